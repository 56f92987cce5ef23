"""Transformer building blocks shared by the model zoo (Llama / Mixtral math).

Conventions every block follows, so checkpoints interchange with Hugging Face and tensor
parallelism can later swap the projections for column/row-parallel versions unchanged:

* Linear weights are stored `[out, in]` (HF layout), fp32 master copies, and applied with
  `ops.MatMul(transpose_b=True)` (faster on CPU than `mint.matmul`, whose backward adds
  explicit transposes). Inputs and weights are cast to `compute_dtype` for the matmul only.
* Norms, softmax and the loss run in fp32; the residual stream is fp32.
* bfloat16 on the CPU (no bf16 MatMul/Softmax in MindSpore's CPU backend): tensors stay fp32 and
  hold bf16-rounded values at the points a bf16 run stores them (`to_compute`, docs/precision.md).
* Head counts are never stored: they are read from the projection outputs (`reshape(..., -1,
  head_dim)`), so a projection holding only this rank's heads just works.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from moetrain import kernels
from moetrain.kernels.ops import (FromBF16, FusedCausalAttention, FusedLMHeadCrossEntropy, FusedRMSNorm, FusedSwiGLU,
                                  FusedSwiGLUBF16, LinearMatmul, LinearMatmulBF16, RoundBF16, ToBF16, shared)
from moetrain.param_init import parameter

COMPUTE_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
_BMM, _BMM_NT = ops.BatchMatMul(), ops.BatchMatMul(transpose_b=True)   # decoding (PyNative) only


def compute_dtype_of(name) -> ms.Type:
    """`"float16"` -> `ms.float16`; an `ms` dtype passes through."""
    if not isinstance(name, str):
        return name
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype {name!r} is not supported; use one of {sorted(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name]


# ---- bfloat16 on the CPU ------------------------------------------------------------------------
# MindSpore 2.10's CPU backend casts, adds and reshapes bf16 tensors but has no bf16 MatMul, Softmax,
# Sigmoid or reductions. There a bf16 compute dtype is emulated: every tensor is fp32, and the values
# a bf16 run would store (matmul operands and outputs, their gradients through the casts' backward)
# are rounded to bf16 (round to nearest even), so the numerics are bf16 storage with fp32
# accumulation, as on Ascend's cube unit, at fp32 GEMM speed (bf16 GEMMs are slower on this CPU).

def emulates_bf16(compute_dtype) -> bool:
    """True when `compute_dtype` is bfloat16 and the device has no bf16 compute (the CPU)."""
    return compute_dtype_of(compute_dtype) == ms.bfloat16 and ms.get_context("device_target") == "CPU"


def tensor_dtype(compute_dtype) -> ms.Type:
    """The dtype of the tensors a compute dtype produces here: fp32 under bf16 emulation."""
    return ms.float32 if emulates_bf16(compute_dtype) else compute_dtype_of(compute_dtype)


def round_bf16(x):
    """fp32 `x` rounded to bf16 values, still fp32; the backward rounds the gradient likewise."""
    return x.astype(ms.bfloat16).astype(ms.float32)


class CastRoundBF16(nn.Cell):
    """`round_bf16` as a Cell: the rounder without the kernels."""

    def construct(self, x):
        return round_bf16(x)


def bf16_rounder(compute_dtype):
    """None, or under bf16 emulation the Cell that rounds to bf16 values (the one-pass kernel where the
    kernels are available, else two casts). Modules hold it as `emulated` and pass it to `to_compute`
    (decided at build time: a graph cannot ask the context)."""
    if not emulates_bf16(compute_dtype):
        return None
    return shared(RoundBF16) if kernels.available() else shared(CastRoundBF16)


def to_compute(x, compute_dtype, emulated):
    """`x` in the compute dtype: a cast, or under bf16 emulation (`emulated`: the module's
    `bf16_rounder(...)`, None otherwise) fp32 holding bf16-rounded values."""
    if emulated is not None:
        return emulated(fp32(x))
    return x if x.dtype == compute_dtype else x.astype(compute_dtype)


def bf16_storage(compute_dtype) -> bool:
    """True where bf16 activations are stored in 2 bytes on the CPU: bf16 emulated and the kernels
    available (their `...BF16` variants read and write bf16 containers, kernels/bf16.h)."""
    return emulates_bf16(compute_dtype) and kernels.available()



def fused_for(compute_dtype) -> bool:
    """True where the fp32 kernels serve this compute dtype (fp32, or bf16 emulated on the CPU)."""
    if not kernels.available():
        if emulates_bf16(compute_dtype):
            _log_bf16_fallback()
        return False
    return compute_dtype_of(compute_dtype) == ms.float32 or emulates_bf16(compute_dtype)


@functools.lru_cache(maxsize=None)
def _log_bf16_fallback():
    logging.getLogger("moetrain").warning(
        "bfloat16 compute without the moetrain CPU kernels: the plain ops compute in float32 on bf16-rounded "
        "values at the same points (docs/precision.md)")


def fp32(x):
    """`x` as fp32, without a cast op when it already is (decoding runs op by op in PyNative)."""
    return x if x.dtype == ms.float32 else x.astype(ms.float32)


def normal_parameter(shape, std: float, name: str) -> Parameter:
    """An fp32 Parameter that starts as N(0, std^2): deferred inside `moetrain.param_init.deferred_parameters`
    (then its values are a function of seed, full name and index: the same slice on any layout),
    else drawn at once (seeded by `ms.set_seed`)."""
    return parameter(shape, name, "normal", std)


class Linear(nn.Cell):
    """`y = x @ weight.T` with `weight [out_features, in_features]`, no bias.

    `x` may have any leading shape; the output has the compute dtype. With `moetrain.kernels` and
    fp32 compute the product is the `LinearMatmul` kernel (row blocks on the kernels' thread pool,
    `dx` and `dweight` in one backward call; measured up to 2x faster than `ops.MatMul` fwd+bwd at the
    bench model's shapes, docs/performance.md)."""

    def __init__(self, in_features: int, out_features: int, init_std: float = 0.02,
                 compute_dtype=ms.float32):
        super().__init__()
        self.weight = normal_parameter((out_features, in_features), init_std, "weight")
        self.compute_dtype = compute_dtype_of(compute_dtype)
        self.emulated = bf16_rounder(self.compute_dtype)
        self.bf16 = bf16_storage(self.compute_dtype)
        if self.bf16:   # fp32 in and out, read as and rounded to bf16 values in the kernel (no containers here)
            self.matmul = shared(LinearMatmulBF16)
        elif fused_for(self.compute_dtype):
            self.matmul = shared(LinearMatmul)
        else:
            self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        return self.apply(x, self.weight)

    def apply(self, x, weight):
        """`x @ weight.T` with this layer's compute dtype and product (`weight` may be this layer's
        weight with others stacked along the output features: one product for several projections)."""
        if self.bf16:   # fp32 in and out, read as and rounded to bf16 values inside the kernel
            x = fp32(x)
            if x.ndim == 2:
                return self.matmul(x, weight)
            return self.matmul(x.reshape(-1, x.shape[-1]), weight).reshape(x.shape[:-1] + (weight.shape[0],))
        if self.compute_dtype != ms.float32:
            x, weight = (to_compute(t, self.compute_dtype, self.emulated) for t in (x, weight))
        if x.ndim == 2:
            y = self.matmul(x, weight)
        else:
            y = self.matmul(x.reshape(-1, x.shape[-1]), weight).reshape(x.shape[:-1] + (weight.shape[0],))
        return y if self.emulated is None else self.emulated(y)   # a bf16 GEMM stores its fp32 sums as bf16

    @property
    def plain(self) -> bool:
        """True where `construct` is exactly `apply(x, weight)` (no communication around it), so
        projections of one input may share one product over their stacked weights (SwiGLUMLP)."""
        return True


class Embedding(nn.Cell):
    """Token embedding `weight [vocab, hidden]`; returns fp32 rows."""

    def __init__(self, vocab_size: int, hidden_size: int, init_std: float = 0.02):
        super().__init__()
        self.weight = normal_parameter((vocab_size, hidden_size), init_std, "weight")
        self.gather = ops.Gather()

    def construct(self, input_ids):
        return self.gather(self.weight, input_ids, 0)


class RMSNorm(nn.Cell):
    """`x / sqrt(mean(x^2) + eps) * weight`, computed and returned in fp32.

    With `moetrain.kernels` available this is one fused kernel each way (measured ~10x less CPU
    time than the ~18 MindSpore ops of forward and backward at [2048, 256])."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = parameter((hidden_size,), "weight", "ones")
        self.eps = eps
        self.fused = None
        if kernels.available():
            self.fused, self.eps_tensor = shared(FusedRMSNorm), Tensor([eps], ms.float32)

    def construct(self, x):
        x = x.astype(ms.float32)
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps_tensor)
        variance = ops.mean(ops.square(x), -1, keep_dims=True)
        return x * ops.rsqrt(variance + self.eps) * self.weight


def rope_tables(head_dim: int, max_positions: int, theta: float, yarn=None):
    """cos/sin tables `[max_positions, head_dim]` in the HF "rotate_half" layout: frequency `i`
    drives dims `i` and `i + head_dim/2`. The sin table carries the sign of rotate_half
    (`[-sin, +sin]`) so applying RoPE is `x * cos + swap_halves(x) * sin`.

    `yarn`: None, or a `YarnScaling` (DeepSeek-V3's context extension): the frequencies are blended
    between the original and the `factor`-interpolated ones, and cos/sin scaled by its attention
    factor, as HF's `_compute_yarn_parameters`."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    # Angles in fp32 as HF computes them (at position 32k fp32 rounding moves an angle by ~1e-3,
    # so a float64 table would not reproduce HF logits); cos/sin of those angles in float64.
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.float32(theta) ** exponents
    scale = 1.0
    if yarn is not None:
        inv_freq, scale = yarn.inv_freq(head_dim, theta), yarn.attention_factor
    angles = np.outer(np.arange(max_positions, dtype=np.float32), inv_freq).astype(np.float32).astype(np.float64)
    cos = np.cos(np.concatenate([angles, angles], axis=-1)) * scale
    sin = np.sin(angles) * scale
    signed_sin = np.concatenate([-sin, sin], axis=-1)
    return cos.astype(np.float32), signed_sin.astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (HF `rope_parameters` with `rope_type: yarn`), hashable for the table cache."""
    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @property
    def attention_factor(self) -> float:
        """Scale of cos/sin (so of q.k on the rotary dims by its square)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, dim: int, theta: float) -> np.ndarray:
        def correction_dim(rotations):
            return dim * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
        extrapolation = np.float32(1.0) / pos_freqs
        interpolation = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)
        keep = (np.float32(1.0) - ramp).astype(np.float32)     # 1: the original frequency
        return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


@functools.lru_cache(maxsize=8)
def _shared_rope_tensors(head_dim: int, max_positions: int, theta: float, yarn=None):
    # One copy for all layers: at 32k positions a table is 16 MB.
    cos, signed_sin = rope_tables(head_dim, max_positions, theta, yarn)
    return Tensor(cos[:, None, :]), Tensor(signed_sin[:, None, :])


class RotaryEmbedding(nn.Cell):
    """Applies RoPE to `[B, S, heads, head_dim]` tensors at positions `0..S-1`, or at int32
    `positions [B, S]` (positions restarting per packed document, `data.reset_position_ids`).

    `interleaved`: the rotary pairs are adjacent dims `(x0, x1), (x2, x3), ...` (DeepSeek's
    checkpoints, HF `rope_interleave`); they are de-interleaved first, so the output is in the
    rotate_half layout exactly as HF's `apply_rotary_pos_emb_interleave` returns it."""

    def __init__(self, head_dim: int, max_positions: int, theta: float = 10000.0, yarn=None,
                 interleaved: bool = False):
        super().__init__()
        # Plain tensors, not Parameters: derived from the config, never trained or saved.
        self.cos, self.signed_sin = _shared_rope_tensors(head_dim, max_positions, float(theta), yarn)
        self.half = head_dim // 2
        self.max_positions = max_positions
        self.interleaved = interleaved
        self.table_key = (head_dim, max_positions, float(theta), yarn)   # decoding: rope_rotations

    def tables(self, seq_len: int):
        """fp32 `(cos, signed_sin)` `[seq_len, head_dim]` for positions `0..seq_len-1`."""
        return self.cos[:seq_len].reshape(seq_len, -1), self.signed_sin[:seq_len].reshape(seq_len, -1)

    def construct(self, x, positions=None):
        seq_len = x.shape[1]
        if self.interleaved:   # [.., (x0 x1) (x2 x3) ..] -> [x0 x2 .. | x1 x3 ..]
            x = x.reshape(x.shape[:-1] + (self.half, 2)).swapaxes(-1, -2).reshape(x.shape)
        if positions is None:                                   # [S, 1, D]: the same for every row
            cos, sin = self.cos[:seq_len], self.signed_sin[:seq_len]
        else:                                                   # [B, S, 1, D]: each token's own position
            cos, sin = ops.gather(self.cos, positions, 0), ops.gather(self.signed_sin, positions, 0)
        first, second = ops.split(x, self.half, axis=-1)
        return x * cos.astype(x.dtype) + ops.cat((second, first), axis=-1) * sin.astype(x.dtype)

    def decode(self, x, step):
        """`construct(x, positions)` for incremental decoding (PyNative, `moetrain.kv_cache`): x `[B, S,
        heads, head_dim]` at the step's positions `[B, S]`. RoPE is linear in x, so for each token it is
        one `[head_dim, head_dim]` matrix (cos on the diagonal, the signed sin where rotate_half takes
        the other half, the de-interleaving folded in): built on the host once per step for every
        layer (`rope_rotations`), applied as one batched matmul instead of the ~10 ops of `construct`."""
        rotations = step.shared(("rope", self.table_key, self.interleaved, x.dtype), lambda: Tensor(
            rope_rotations(self.table_key, self.interleaved, step.positions), x.dtype))
        tokens = x.shape[0] * x.shape[1]
        return _BMM(x.reshape(tokens, -1, x.shape[-1]), rotations).reshape(x.shape)


@functools.lru_cache(maxsize=8)
def _host_rope_tables(head_dim: int, max_positions: int, theta: float, yarn=None):
    return rope_tables(head_dim, max_positions, theta, yarn)


def rope_rotations(table_key, interleaved: bool, positions: np.ndarray) -> np.ndarray:
    """fp32 `[N, d, d]` matrices `R` with `x @ R == RotaryEmbedding(x)` at each of the N = B*S
    `positions` (`table_key`: `(head_dim, max_positions, theta, yarn)`): `R[j, j] = cos_j` and
    `R[(j + d/2) % d, j] = signed_sin_j` (`y_j = x_j cos_j + x_{j+-d/2} sin_j`); for interleaved pairs
    the rows are first permuted by the de-interleaving (`x -> [x0 x2 .. | x1 x3 ..]`)."""
    cos, signed_sin = _host_rope_tables(*table_key)
    flat = np.asarray(positions).reshape(-1)
    dim = cos.shape[-1]
    cols = np.arange(dim)
    out = np.zeros((len(flat), dim, dim), np.float32)
    out[:, cols, cols] = cos[flat]
    out[:, (cols + dim // 2) % dim, cols] = signed_sin[flat]
    if interleaved:   # de-interleaved dim j reads source dim 2j (first half) or 2(j - d/2) + 1
        source = np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])
        permuted = np.empty_like(out)
        permuted[:, source, :] = out
        out = permuted
    return out


class CausalAttentionCore(nn.Cell):
    """`softmax(q k^T + mask) v` for grouped queries, with a hand-written backward.

    q `[B, n_kv, group * S, d]` (pre-scaled; the `group` query heads of one K/V head stacked
    along rows), k, v `[B, n_kv, S, d]`, mask `[S, S]` (packed documents: `[B, 1, 1, S, S]`)
    additive fp32. Returns `(out, probs)`; `probs` is returned only so the backward can reuse it.

    The backward uses the FlashAttention identity `rowsum(dP * P) = rowsum(dO * O)`, a
    reduction over `d` instead of over `S`: on CPU this halves the attention fwd+bwd time
    (measured 226 -> 102 ms at B=8, S=256, 8 heads of 32)."""

    def __init__(self, compute_dtype=ms.float32):
        super().__init__()
        self.compute_dtype = compute_dtype_of(compute_dtype)
        self.matmul = ops.BatchMatMul()
        self.matmul_nt = ops.BatchMatMul(transpose_b=True)
        self.matmul_tn = ops.BatchMatMul(transpose_a=True)

    def construct(self, q, k, v, mask):
        batch, num_kv_heads, rows, _ = q.shape
        seq_len = k.shape[2]
        scores = self.matmul_nt(q, k).astype(ms.float32).reshape(batch, num_kv_heads, rows // seq_len, seq_len, seq_len)
        probs = ops.softmax(scores + mask, axis=-1).astype(self.compute_dtype).reshape(batch, num_kv_heads, rows, seq_len)
        return self.matmul(probs, v), probs

    def bprop(self, q, k, v, mask, out, dout):
        o, probs = out
        do = dout[0]
        dv = self.matmul_tn(probs, do)
        dprobs = self.matmul_nt(do, v).astype(ms.float32)
        delta = (do.astype(ms.float32) * o.astype(ms.float32)).sum(-1, keepdims=True)
        dscores = (probs.astype(ms.float32) * (dprobs - delta)).astype(self.compute_dtype)
        return self.matmul(dscores, k), self.matmul_tn(dscores, q), dv, ops.zeros_like(mask)


class CausalAttention(nn.Cell):
    """The causal softmax(q k^T) v step shared by the attention variants, with its speed choices.

    `attend(q, k, v)`: q `[B, S, n, d]` pre-scaled, k `[B, S, n_kv, d]`, v `[B, S, n_kv, d_v]`
    -> `[B, S, n * d_v]`. Query head `h` uses K/V head `h // (n / n_kv)` (HF `repeat_kv`).

    Packed documents: `context` is None, or `(document_ids, position_ids)`, int32 `[B, S]` each, of
    the whole (never sequence-split) batch (`moetrain.modeling.attention_context`; docs/data.md):
    query t then sees key u only if `u <= t` and both are in the same document, and RoPE rotates
    token t at `position_ids[t]`.

    With `moetrain.kernels` available and fp32 compute, `core` is the fused causal-attention kernel:
    it reads the projection layout `[B, S, heads, head_dim]` (no transposes, no mask tensor), applies
    RoPE and the 1/sqrt(head_dim) scale itself and skips the key blocks above the diagonal (and, with
    documents, before the block's documents; a `d_v < d` value is zero-padded to `d` for it).
    Otherwise GQA runs without repeating K/V: the query heads sharing one K/V head are laid out as
    one `[group * S, d]` block, so one batched matmul per K/V head covers the group; documents add
    a `[B, 1, 1, S, S]` additive mask.

    Context parallelism (`parallel.context_parallel`) sets `context_parallel` to the cell that runs
    `attend` on the local part of a sequence split over ranks (moetrain/parallel/context_parallel.py);
    None: the whole sequence is here."""

    def __init__(self, max_positions: int, compute_dtype=ms.float32):
        super().__init__()
        self.context_parallel = None
        self.fused = fused_for(compute_dtype)
        if self.fused:
            self.core = shared(FusedCausalAttention)
        else:   # bf16 emulated: P stays fp32, as in the fused kernel
            self.core = CausalAttentionCore(tensor_dtype(compute_dtype))
        # Positions for the causal mask, built per call: a stored [S, S] mask is 4 GB at 32k.
        self.positions = Tensor(np.arange(max_positions, dtype=np.int32))

    def attend(self, q, k, v, scale: float, rope=None, context=None):
        """`softmax(scale * rope(q) rope(k)^T + mask) v`: q `[B, S, n, d]`, k `[B, S, n_kv, d]`, v
        `[B, S, n_kv, d_v]` -> `[B, S, n * d_v]`; `rope` (a `RotaryEmbedding` over all d) or None;
        `context` None (causal) or `(document_ids, position_ids)` (see the class).
        The fused kernel applies RoPE and 1/sqrt(d) itself: another scale is folded into q, and
        without RoPE it gets identity tables (cos 1, sin 0). With context parallelism: the local
        tokens, through `context_parallel` (all_gather), or the whole sequence on 1/cp of the heads
        between its all-to-alls (a2a, Ulysses)."""
        cp = self.context_parallel
        if cp is None:
            return self.attend_sequence(q, k, v, scale, rope, context)
        if not cp.splits_heads:
            return cp.attend(q, k, v, scale, rope, context)
        whole = cp.whole_context(context)
        q, k, v = cp.to_heads(q, k, v, None if whole is None else whole[0])
        return cp.from_heads(self.attend_sequence(q, k, v, scale, rope, whole), v.shape[-1])

    def attend_sequence(self, q, k, v, scale: float, rope=None, context=None):
        """`attend` over a whole sequence held here (the fused kernel or the plain path)."""
        batch, seq_len, _, head_dim = q.shape
        value_dim = v.shape[-1]
        if self.fused:
            if rope is not None:   # with positions: every row, the kernel reads the row of each token
                cos, sin = rope.tables(seq_len if context is None else rope.max_positions)
            else:
                cos, sin = ops.ones((seq_len, head_dim), ms.float32), ops.zeros((seq_len, head_dim), ms.float32)
            if scale != head_dim ** -0.5:
                q = q * (scale * head_dim ** 0.5)
            if value_dim != head_dim:
                v = ops.cat((v, ops.zeros(v.shape[:-1] + (head_dim - value_dim,), v.dtype)), axis=-1)
            if context is None:
                out = self.core(q, k, v, cos, sin)                          # [B, S, n, d]
            else:
                document_ids, position_ids = context
                out = self.core(q, k, v, cos, sin, position_ids, document_ids)
            if value_dim != head_dim:
                out = ops.split(out, [value_dim, head_dim - value_dim], axis=-1)[0]
            return out.reshape(batch, seq_len, -1)
        if rope is not None:
            position_ids = None if context is None else context[1]
            q, k = rope(q, position_ids), rope(k, position_ids)
        q = q * scale
        num_kv_heads = k.shape[2]
        group = q.shape[2] // num_kv_heads
        # [B, S, n, d] -> [B, n, S, d]; query heads of one K/V group become one row block.
        q = q.transpose(0, 2, 1, 3).reshape(batch, num_kv_heads, group * seq_len, head_dim)
        k = k.transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        positions = self.positions[:seq_len]
        hidden = positions.reshape(1, -1) > positions.reshape(-1, 1)     # [S, S]: key after query
        if context is not None:                                          # [B, 1, 1, S, S]: or another document
            document_ids = context[0]
            hidden = ops.logical_or(hidden, document_ids.reshape(batch, -1, 1) != document_ids.reshape(batch, 1, -1))
            hidden = hidden.reshape(batch, 1, 1, seq_len, seq_len)
        # Additive mask, -1e9 where hidden: finite, so it can never produce NaN.
        mask = hidden.astype(ms.float32) * -1e9
        out, _ = self.core(q, k, v, mask)                                # [B, n_kv, group * S, d_v]
        out = out.reshape(batch, -1, seq_len, value_dim).transpose(0, 2, 1, 3)
        return out.reshape(batch, seq_len, -1)

    def attend_cached(self, q, k, v, scale: float, step):
        """Incremental decoding (PyNative, `moetrain.kv_cache`): the S new queries against all T keys so
        far. q `[B, S, n, d]` with RoPE applied, k `[B, n_kv, T, d]` (RoPE applied) and v `[B, n_kv, T,
        d_v]` (the cache's head-major layout, so no step transposes it), `step` the `DecodeStep` (its
        mask: causal order and left padding) -> `[B, S, n * d_v]`. The math of `attend`'s plain path:
        `scale` on q in the compute dtype, scores and softmax in fp32, the query heads of one K/V head
        as one row block (GQA, query head h reads K/V head h // (n / n_kv))."""
        batch, seq_len, num_heads, head_dim = q.shape
        num_kv_heads, value_dim = k.shape[1], v.shape[-1]
        group = num_heads // num_kv_heads
        compute_dtype = q.dtype
        if seq_len == 1:     # [B, 1, n, d] is already [B, n_kv, group, d]
            q = q.reshape(batch, num_kv_heads, group, head_dim)
        else:
            q = q.transpose(0, 2, 1, 3).reshape(batch, num_kv_heads, group * seq_len, head_dim)
        scores = _BMM_NT(q * scale, k)                                     # [B, n_kv, group * S, T]
        if scores.dtype != ms.float32:
            scores = scores.astype(ms.float32)
        mask = step.group_mask(group)
        if mask is not None:
            scores = scores + mask
        probs = ops.softmax(scores, axis=-1)
        if probs.dtype != compute_dtype:
            probs = probs.astype(compute_dtype)
        out = _BMM(probs, v)                                               # [B, n_kv, group * S, d_v]
        if seq_len == 1:
            return out.reshape(batch, 1, num_heads * value_dim)
        out = out.reshape(batch, num_heads, seq_len, value_dim).transpose(0, 2, 1, 3)
        return out.reshape(batch, seq_len, -1)


class Attention(CausalAttention):
    """Causal grouped-query self-attention with RoPE (Llama); softmax in fp32.

    `construct(x [B, S, H], context=None)`; `context`: packed documents, see `CausalAttention`.
    `project(x)` gives q, k (before RoPE) and v `[B, S, heads, head_dim]`; a variant (Qwen3's q/k
    norms) overrides it and keeps the rest. RoPE is applied in `attend` (inside the fused kernel)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_positions: int, rope_theta: float = 10000.0, init_std: float = 0.02,
                 output_init_std: float = 0.02, compute_dtype=ms.float32):
        super().__init__(max_positions, compute_dtype)
        self.wq = Linear(hidden_size, num_heads * head_dim, init_std, compute_dtype)
        self.wk = Linear(hidden_size, num_kv_heads * head_dim, init_std, compute_dtype)
        self.wv = Linear(hidden_size, num_kv_heads * head_dim, init_std, compute_dtype)
        self.wo = Linear(num_heads * head_dim, hidden_size, output_init_std, compute_dtype)
        self.rope = RotaryEmbedding(head_dim, max_positions, rope_theta)
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def heads(self, projection, x):
        """`projection(x)` as `[B, S, heads, head_dim]`."""
        return projection(x).reshape(x.shape[0], x.shape[1], -1, self.head_dim)

    def project(self, x):
        # Three products, not one over the stacked weights: measured in one process, alternating
        # steps, the stacked one (its concat and split copies) was 4-6 % slower per step.
        return self.heads(self.wq, x), self.heads(self.wk, x), self.heads(self.wv, x)

    def construct(self, x, context=None):
        q, k, v = self.project(x)
        return self.wo(self.attend(q, k, v, self.scale, self.rope, context))

    def decode(self, x, step, past=None):
        """Incremental decoding (PyNative; `moetrain.kv_cache`): `x [B, S, H]` the new tokens' normed
        hidden states, `step` their `DecodeStep`, `past` None or this layer's `(k, v)` so far ->
        `(out [B, S, H], (k, v))`; the cache is K after RoPE and V, head-major `[B, n_kv, T, head_dim]`."""
        q, k, v = self.project(x)
        q, k = self.rope.decode(q, step), self.rope.decode(k, step)
        k, v = heads_first(k), heads_first(v)
        if past is not None:
            k, v = ops.cat((past[0], k), 2), ops.cat((past[1], v), 2)
        return self.wo(self.attend_cached(q, k, v, self.scale, step)), (k, v)


def heads_first(x):
    """`[B, S, heads, d]` -> `[B, heads, S, d]` (a reshape, no copy, for one token)."""
    if x.shape[1] == 1:
        return x.reshape(x.shape[0], x.shape[2], 1, x.shape[3])
    return x.transpose(0, 2, 1, 3)


class SwiGLUMLP(nn.Cell):
    """`w_down(silu(w_gate(x)) * w_up(x))` (Llama MLP, one Mixtral expert).

    With `moetrain.kernels` and fp32 compute, gate and up are one product over their stacked
    weights and `silu(gate) * up` is the fused SwiGLU kernel (one pass each way)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, init_std: float = 0.02,
                 output_init_std: float = 0.02, compute_dtype=ms.float32):
        super().__init__()
        self.w_gate = Linear(hidden_size, ffn_hidden_size, init_std, compute_dtype)
        self.w_up = Linear(hidden_size, ffn_hidden_size, init_std, compute_dtype)
        self.w_down = Linear(ffn_hidden_size, hidden_size, output_init_std, compute_dtype)
        self.swiglu = None
        self.bf16 = bf16_storage(compute_dtype)
        if self.bf16:
            self.swiglu, self.matmul = shared(FusedSwiGLUBF16), shared(LinearMatmulBF16)
            self.to_bf16, self.from_bf16 = shared(ToBF16), shared(FromBF16)
        elif fused_for(compute_dtype):
            self.swiglu = shared(FusedSwiGLU)

    def construct(self, x):
        if self.bf16 and self.w_gate.plain and self.w_up.plain:
            return self._bf16_storage(x)
        if self.swiglu is not None and self.w_gate.plain and self.w_up.plain:   # [gate | up] in one product
            gate_up = self.w_gate.apply(x, ops.concat((self.w_gate.weight, self.w_up.weight), 0))
            return self.w_down(self.swiglu(gate_up.astype(ms.float32)))
        return self.w_down(ops.silu(self.w_gate(x)) * self.w_up(x))

    def _bf16_storage(self, x):
        """Under `bf16_storage`: the MLP with gate|up and `silu(gate) * up` as 2-byte bf16 containers,
        the input kept for the backward as one too; fp32 out. Every container is made and consumed in
        this method, each by one op (docs/precision.md: a second consumer would add gradients in fp16;
        tests/test_bf16.py checks it)."""
        lead = x.shape[:-1]
        weight = ops.concat((self.w_gate.weight, self.w_up.weight), 0)
        hidden = self.swiglu(self.matmul(self.to_bf16(fp32(x).reshape(-1, x.shape[-1])), weight))
        if self.w_down.plain:
            y = self.from_bf16(self.matmul(hidden, self.w_down.weight))
            return y.reshape(lead + (y.shape[-1],))
        h = self.from_bf16(hidden)   # the down projection communicates (tensor parallel): fp32, its own shape
        return self.w_down(h.reshape(lead + (h.shape[-1],)))


class CrossEntropy(nn.Cell):
    """Mean next-token cross-entropy of fp32 `logits [..., V]` against int `labels [...]`.

    Uses the fused `SparseSoftmaxCrossEntropyWithLogits` kernel (fwd+bwd ~7x faster on CPU than
    `ops.cross_entropy`); every label must lie in `[0, V)`."""

    def __init__(self):
        super().__init__()
        self.loss = ops.SparseSoftmaxCrossEntropyWithLogits()

    def construct(self, logits, labels):
        return self.loss(logits.reshape(-1, logits.shape[-1]).astype(ms.float32),
                         labels.reshape(-1).astype(ms.int32))


class LMHeadCrossEntropy(nn.Cell):
    """Mean cross-entropy of the LM head's logits `h @ weight.T` against `labels`, fused: the
    `[tokens, vocab]` logits are never stored (`moetrain.kernels`, fp32; rows go through the head
    in chunks of a few MB; the backward recomputes them and makes the weight gradient there).

    `construct(h [..., H] fp32, weight [V, H], labels [...] int) -> fp32 scalar`. The head weight is
    an input, so a tied head passes the embedding table. Build it only where `supported(...)`;
    elsewhere a model runs its LM head and `CrossEntropy`, as it does for a vocabulary-parallel head
    (tp > 1; the per-slice partials of `moetrain.kernels.ops.LMHeadLogitStats` are the piece a
    fused vocabulary-parallel loss would reduce over the tp group, docs/performance.md)."""

    def __init__(self, compute_dtype=ms.float32):
        super().__init__()
        self.emulated = bf16_rounder(compute_dtype)
        self.fused = FusedLMHeadCrossEntropy(bf16=self.emulated is not None and kernels.available())

    @staticmethod
    def supported(compute_dtype) -> bool:
        return fused_for(compute_dtype)

    def construct(self, h, weight, labels):
        return self.row_losses(h, weight, labels).mean()

    def row_losses(self, h, weight, labels):
        """`[N]` fp32, the loss of each of the N rows of `h` (flattened): heads that share `weight`
        (DeepSeek's main and MTP heads) concatenate their rows into one call, whose backward makes
        one weight gradient, not one per head and their sum."""
        h = h.reshape(-1, h.shape[-1]).astype(ms.float32)
        if self.emulated is not None and not self.fused.bf16:   # bf16 operands, fp32 logits and loss
            h, weight = self.emulated(h), self.emulated(weight)
        return self.fused.row_losses(h, weight, labels.reshape(-1).astype(ms.int32))
