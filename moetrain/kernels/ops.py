"""The kernels as differentiable MindSpore ops (Cells; PyNative and `ms.jit`): fp32, and the `...BF16`
ones on bf16 storage (bf16 containers: float16-typed tensors holding bf16 bits, `kernels/bf16.h`).

Build them only when `moetrain.kernels.available()` is True. Shapes and dtypes are inferred by the
C++ functions in the library (`out_shape=None`), which MindSpore needs where it compiles a graph
without the Python primitive (e.g. a jitted step that returns a dict of stats)."""
from __future__ import annotations

import functools

import numpy as np

from mindspore import Tensor, nn, ops
from mindspore.ops import CustomRegOp, DataType
from mindspore.ops import signature as sig

from moetrain.kernels import library_path


F32, I32, I64 = DataType.F32_Default, DataType.I32_Default, DataType.I64_Default
BF16 = DataType.F16_Default   # a bf16 container (kernels/bf16.h): MindSpore's CPU has no bf16 Reshape/Gather/AddN


def _custom(name: str, input_dtypes, bprop=None, output_dtypes=(F32,), more_formats=()):
    """The kernel `name` of the library: inputs of `input_dtypes`, outputs of `output_dtypes` (a
    tuple of tensors when there are several; their C++ shape inference returns one shape each).
    `more_formats`: further `(input_dtypes, output_dtypes)` the kernel also takes."""
    reg = CustomRegOp()
    for i in range(len(input_dtypes)):
        reg = reg.input(i, f"x{i}")
    for i in range(len(output_dtypes)):
        reg = reg.output(i, f"y{i}")
    for inputs, outputs in ((input_dtypes, output_dtypes), *more_formats):
        reg = reg.dtype_format(*inputs, *outputs)
    reg = reg.target("CPU").get_op_info()
    return ops.Custom(f"{library_path()}:{name}", out_shape=None, out_dtype=None, func_type="aot", bprop=bprop,
                      reg_info=reg)


class GroupedMatmul(nn.Cell):
    """`construct(x [N, K], w [E, K, F], row_expert [N] int32) -> [N, F]`: `y[n] = x[n] @ w[row_expert[n]]`.

    Runs of rows with the same expert are one GEMM each, so rows sorted by expert (the exact
    dropless MoE layout) cost one GEMM per expert. Gradients flow to `x` and `w` (an expert that
    owns no rows gets a zero weight gradient). Id `E` marks a padding row: no work, a zero output
    row and a zero input gradient; an id outside `[0, E]` fails the op."""

    def __init__(self):
        super().__init__()
        matmul_nt = _custom("GroupedMatmulNT", (F32, F32, I32))
        matmul_tn = _custom("GroupedMatmulTN", (F32, F32, I32, F32))

        def bprop(x, w, row_expert, out, dout):
            return matmul_nt(dout, w, row_expert), matmul_tn(x, dout, row_expert, w), ops.zeros_like(row_expert)

        self.matmul_nn = _custom("GroupedMatmulNN", (F32, F32, I32), bprop)

    def construct(self, x, w, row_expert):
        return self.matmul_nn(x, w, row_expert)


class GroupedMatmulPair(nn.Cell):
    """`construct(x [N, K], w_a [E, K, Fa], w_b [E, K, Fb], row_expert [N] int32) -> [N, Fa + Fb]`:
    `GroupedMatmul` of `x` with `w_a` and `w_b` concatenated along the last axis (the experts' gate
    and up projections), without making that concatenation (a copy of both weights each call and a
    split of their gradient). Gradients flow to `x`, `w_a` and `w_b`."""

    def __init__(self):
        super().__init__()
        matmul_nt = _custom("GroupedMatmulPairNT", (F32, F32, F32, I32))
        matmul_tn = _custom("GroupedMatmulPairTN", (F32, F32, I32, F32, F32), output_dtypes=(F32, F32))

        def bprop(x, w_a, w_b, row_expert, out, dout):
            dw_a, dw_b = matmul_tn(x, dout, row_expert, w_a, w_b)
            return matmul_nt(dout, w_a, w_b, row_expert), dw_a, dw_b, ops.zeros_like(row_expert)

        self.matmul_nn = _custom("GroupedMatmulPairNN", (F32, F32, F32, I32), bprop)

    def construct(self, x, w_a, w_b, row_expert):
        return self.matmul_nn(x, w_a, w_b, row_expert)


class LinearMatmul(nn.Cell):
    """`construct(x [N, K], weight [F, K]) -> x @ weight^T` `[N, F]`, fp32 (a linear layer in the HF
    weight layout): row blocks on the kernels' thread pool; the backward computes `dx` and `dweight`
    in one call, their blocks as tasks of one pool run."""

    def __init__(self):
        super().__init__()
        backward = _custom("LinearBackward", (F32, F32, F32), output_dtypes=(F32, F32))

        def bprop(x, weight, out, dout):
            return backward(x, weight, dout)

        self.forward = _custom("LinearForward", (F32, F32), bprop)

    def construct(self, x, weight):
        return self.forward(x, weight)


class RoundBF16(nn.Cell):
    """`construct(x fp32) -> x` rounded to bfloat16 values (nearest even), still fp32, in one pass; the
    backward rounds the gradient likewise (bf16 compute emulated on the CPU, docs/precision.md)."""

    def __init__(self):
        super().__init__()
        kernel = _custom("RoundBF16", (F32,))

        def bprop(x, out, dout):
            return (kernel(dout),)

        self.forward = _custom("RoundBF16", (F32,), bprop)

    def construct(self, x):
        return self.forward(x)


class _Conversion(nn.Cell):
    """`construct(x) -> x` converted by the kernel `name` (`source` -> `target` dtype); the backward
    converts the gradient back with the kernel `inverse`."""

    def __init__(self, name: str, inverse: str, source, target):
        super().__init__()
        back = _custom(inverse, (target,), output_dtypes=(source,))

        def bprop(x, out, dout):
            return (back(dout),)

        self.forward = _custom(name, (source,), bprop, output_dtypes=(target,))

    def construct(self, x):
        return self.forward(x)


class ToBF16(_Conversion):
    """`construct(x fp32) -> bf16 container` (nearest even), one pass; the backward decodes the
    gradient (a bf16 container from the kernel that read it) to fp32."""

    def __init__(self):
        super().__init__("ToBF16", "FromBF16", F32, BF16)


class FromBF16(_Conversion):
    """`construct(x bf16 container) -> fp32` (exact); the backward rounds the gradient to a bf16
    container, as a bf16 tensor's gradient is stored."""

    def __init__(self):
        super().__init__("FromBF16", "ToBF16", BF16, F32)


class LinearMatmulBF16(nn.Cell):
    """`LinearMatmul` on bf16 values: `construct(x [N, K], weight [F, K] fp32) -> [N, F]`, `x` and the
    output bf16 containers, or both fp32 tensors (read as / rounded to bf16 values). The product reads
    the weight's bf16 values (fp32 accumulation); the backward returns `dx` like `x` and `dweight`
    fp32 holding bf16 values. No rounded copy of the weight is kept between forward and backward."""

    def __init__(self):
        super().__init__()
        backward = _custom("LinearBackwardBF16", (BF16, F32, BF16), output_dtypes=(BF16, F32),
                           more_formats=(((F32, F32, F32), (F32, F32)),))

        def bprop(x, weight, out, dout):
            return backward(x, weight, dout)

        self.forward = _custom("LinearForwardBF16", (BF16, F32), bprop, output_dtypes=(BF16,),
                               more_formats=(((F32, F32), (F32,)),))

    def construct(self, x, weight):
        return self.forward(x, weight)


class GroupedMatmulBF16(nn.Cell):
    """`GroupedMatmul` on bf16 storage: `x` and the output bf16 containers, `w` the fp32 master read
    as bf16 values, its gradient fp32 holding bf16 values."""

    def __init__(self):
        super().__init__()
        matmul_nt = _custom("GroupedMatmulNTBF16", (BF16, F32, I32), output_dtypes=(BF16,))
        matmul_tn = _custom("GroupedMatmulTNBF16", (BF16, BF16, I32, F32))

        def bprop(x, w, row_expert, out, dout):
            return matmul_nt(dout, w, row_expert), matmul_tn(x, dout, row_expert, w), ops.zeros_like(row_expert)

        self.matmul_nn = _custom("GroupedMatmulNNBF16", (BF16, F32, I32), bprop, output_dtypes=(BF16,))

    def construct(self, x, w, row_expert):
        return self.matmul_nn(x, w, row_expert)


class GroupedMatmulPairBF16(nn.Cell):
    """`GroupedMatmulPair` on bf16 storage (as `GroupedMatmulBF16`)."""

    def __init__(self):
        super().__init__()
        matmul_nt = _custom("GroupedMatmulPairNTBF16", (BF16, F32, F32, I32), output_dtypes=(BF16,))
        matmul_tn = _custom("GroupedMatmulPairTNBF16", (BF16, BF16, I32, F32, F32), output_dtypes=(F32, F32))

        def bprop(x, w_a, w_b, row_expert, out, dout):
            dw_a, dw_b = matmul_tn(x, dout, row_expert, w_a, w_b)
            return matmul_nt(dout, w_a, w_b, row_expert), dw_a, dw_b, ops.zeros_like(row_expert)

        self.matmul_nn = _custom("GroupedMatmulPairNNBF16", (BF16, F32, F32, I32), bprop, output_dtypes=(BF16,))

    def construct(self, x, w_a, w_b, row_expert):
        return self.matmul_nn(x, w_a, w_b, row_expert)


class FusedSwiGLUBF16(nn.Cell):
    """`FusedSwiGLU` on bf16 containers (fp32 math in between)."""

    def __init__(self):
        super().__init__()
        backward = _custom("SwiGLUBackwardBF16", (BF16, BF16), output_dtypes=(BF16,))

        def bprop(gate_up, out, dout):
            return (backward(gate_up, dout),)

        self.forward = _custom("SwiGLUForwardBF16", (BF16,), bprop, output_dtypes=(BF16,))

    def construct(self, gate_up):
        return self.forward(gate_up)


class FusedSwiGLU(nn.Cell):
    """`construct(gate_up [..., 2F]) -> silu(gate_up[..., :F]) * gate_up[..., F:]`, one pass each way."""

    def __init__(self):
        super().__init__()
        backward = _custom("SwiGLUBackward", (F32, F32))

        def bprop(gate_up, out, dout):
            return (backward(gate_up, dout),)

        self.forward = _custom("SwiGLUForward", (F32,), bprop)

    def construct(self, gate_up):
        return self.forward(gate_up)


class PermuteRows(nn.Cell):
    """`construct(x [T, H], slot [T k] int32) -> [T k, H]`, row `slot[t k + j]` = `x[t]`: the token
    rows sorted by expert (`moetrain.moe.permutation.permute_by_id`'s gather), one copy pass; the
    backward sums each token's k rows. `slot` must be a permutation of `[0, T k)` (else the op fails)."""

    def __init__(self):
        super().__init__()
        backward = _custom("PermuteRowsBackward", (F32, F32, I32))

        def bprop(x, slot, out, dout):
            return backward(x, dout, slot), ops.zeros_like(slot)

        self.forward = _custom("PermuteRows", (F32, I32), bprop)

    def construct(self, x, slot):
        return self.forward(x, slot)


class UnpermuteRows(nn.Cell):
    """`construct(rows [T k, H], slot [T k] int32, weight [T, k]) -> [T, H]`,
    `y[t] = sum_j weight[t, j] * rows[slot[t k + j]]`: the weighted combine of the experts' rows
    (`moetrain.moe.permutation.unpermute` with every assignment kept), one pass each way; gradients
    for `rows` and `weight`. `slot` must be a permutation of `[0, T k)` (else the op fails)."""

    def __init__(self):
        super().__init__()
        backward = _custom("UnpermuteRowsBackward", (F32, I32, F32, F32), output_dtypes=(F32, F32))

        def bprop(rows, slot, weight, out, dout):
            drows, dweight = backward(rows, slot, weight, dout)
            return drows, ops.zeros_like(slot), dweight

        self.forward = _custom("UnpermuteRows", (F32, I32, F32), bprop)

    def construct(self, rows, slot, weight):
        return self.forward(rows, slot, weight)


class FusedRMSNorm(nn.Cell):
    """`construct(x [..., H], weight [H], eps [1]) -> x / sqrt(mean(x^2, -1) + eps) * weight`, fp32;
    gradients for `x` and `weight` (`eps` is a constant)."""

    def __init__(self):
        super().__init__()
        backward_input = _custom("RMSNormBackwardInput", (F32, F32, F32, F32))
        backward_weight = _custom("RMSNormBackwardWeight", (F32, F32, F32))

        def bprop(x, weight, eps, out, dout):
            return backward_input(x, weight, eps, dout), backward_weight(x, eps, dout), ops.zeros_like(eps)

        self.forward = _custom("RMSNormForward", (F32, F32, F32), bprop)

    def construct(self, x, weight, eps):
        return self.forward(x, weight, eps)


class FusedCausalAttention(nn.Cell):
    """`construct(q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, D], cos [S, D], sin [S, D])` ->
    `softmax(rope(q) rope(k)^T / sqrt(D) + causal) v` as `[B, S, Hq, D]`, fp32; query head h uses
    key/value head `h // (Hq / Hkv)`.

    Packed documents: `construct(q, k, v, cos [P, D], sin [P, D], positions, document_ids)` with
    int32 `[B, S]` ids: query t sees key u only if `u <= t` and `document_ids[t] == document_ids[u]`,
    and token t is rotated at position `positions[t]` (row of the tables; one outside `[0, P)` fails
    the op). Where the ids never decrease along a row (moetrain.data's layout) the keys before a row
    block's earliest document start are skipped, not only those above the diagonal.

    q and k come before RoPE: the kernel rotates them (HF rotate_half with the signed `sin` table of
    `moetrain.layers.rope_tables`) and scales q, and its backward applies the transposed rotation,
    so no RoPE op, transpose or mask tensor runs outside. It skips the key blocks above the diagonal
    and recomputes the probabilities in the backward instead of storing them."""

    def __init__(self):
        super().__init__()
        backward = _custom("CausalAttentionBackward", (F32,) * 7, output_dtypes=(F32,) * 3)

        def bprop(q, k, v, cos, sin, out, dout):
            dq, dk, dv = backward(q, k, v, cos, sin, out, dout)
            return dq, dk, dv, ops.zeros_like(cos), ops.zeros_like(sin)

        self.forward = _custom("CausalAttentionForward", (F32,) * 5, bprop)
        documents_backward = _custom("DocumentAttentionBackward", (F32,) * 5 + (I32, I32, F32, F32),
                                     output_dtypes=(F32,) * 3)

        def documents_bprop(q, k, v, cos, sin, positions, document_ids, out, dout):
            dq, dk, dv = documents_backward(q, k, v, cos, sin, positions, document_ids, out, dout)
            return (dq, dk, dv, ops.zeros_like(cos), ops.zeros_like(sin), ops.zeros_like(positions),
                    ops.zeros_like(document_ids))

        self.documents_forward = _custom("DocumentAttentionForward", (F32,) * 5 + (I32, I32), documents_bprop)

    def construct(self, q, k, v, cos, sin, positions=None, document_ids=None):
        if positions is None:
            return self.forward(q, k, v, cos, sin)
        return self.documents_forward(q, k, v, cos, sin, positions, document_ids)


def block_meta(r0: int, k0: int, keys: int, causal: bool, offset: int, documents: bool, prior: bool) -> Tensor:
    """The int32 `[7]` step description `BlockAttention`'s kernels read (`kernels/block_attention.cc`):
    query rows `[r0, r0 + T)` against keys `[k0, k0 + keys)`; `causal`: row i sees range key j only if
    `j <= offset + i`; `documents`: only keys of its document; `prior`: merge with the running result."""
    return Tensor(np.array([r0, k0, keys, int(causal), offset, int(documents), int(prior)], np.int32))


class BlockAttention(nn.Cell):
    """One step of blockwise attention and its backward, fp32, as the kernels of
    `kernels/block_attention.cc` (no bprop of their own: `TiledAttention` / `RingAttention` call both
    from their hand-written forward and backward, moetrain/parallel/context_parallel.py).

    `forward(q [B, H, G, R, D] pre-scaled, k [B, H, K, D], v [B, H, K, Dv], query_docs [B, R],
    key_docs [B, K], prev_out [B, H, G, T, Dv], prev_lse [B, H, G, T, 1], meta)` -> `(out, lse)`: the
    softmax attention of query rows `[r0, r0 + T)` against keys `[k0, k0 + keys)` (`block_meta`; the G
    query heads of K/V head h side by side), merged by log-sum-exp with `(prev_out, prev_lse)` when the
    meta says `prior` (else those are not read); fp32 document ids (placeholders without documents). A
    row that sees no key gets lse -1e30 and output 0 from the step.

    `backward(q, k, v, query_docs, key_docs, out, lse, dout, dlse, dq_acc [B, H, G, T, D], dk_acc
    [B, H, keys, D], dv_acc [B, H, keys, Dv], meta)` -> the accumulators plus this step's dq, dk, dv,
    from the merged `out`, `lse` `[B, H, G, R, ·]` of all the steps and their gradients (FlashAttention's:
    the probabilities recomputed as exp(S − lse))."""

    def __init__(self):
        super().__init__()
        self.forward = _custom("BlockAttentionForward", (F32,) * 7 + (I32,), output_dtypes=(F32, F32))
        self.backward = _custom("BlockAttentionBackward", (F32,) * 12 + (I32,), output_dtypes=(F32,) * 3)

    def construct(self, q, k, v, query_docs, key_docs, prev_out, prev_lse, meta):
        return self.forward(q, k, v, query_docs, key_docs, prev_out, prev_lse, meta)


class FusedLMHeadCrossEntropy(nn.Cell):
    """`construct(h [N, H], weight [V, H], labels [N] int32) -> mean_n CE(h_n weight^T, labels_n)`, fp32,
    without ever storing the `[N, V]` logits (rows go through in chunks of a few MB).

    The forward keeps only three fp32 numbers a row (`LMHeadLogitStats`, one GEMM); the backward
    recomputes the logits and makes `dh` and `d weight` (three GEMMs), so the head weight's gradient
    exists only as the gradient itself, never as a `[V, H]` tensor kept from the forward (a step pays
    one GEMM more than a kernel returning both gradients from its forward, docs/performance.md).
    `row_losses` gives the per-row losses, so several heads sharing one weight (DeepSeek's main
    and MTP heads) make one call, one weight gradient. Every label must lie in `[0, V)`: one outside
    fails the op. `bf16=True`: h and weight are used as their bf16 values (rounded inside the kernels,
    no rounded copies kept), logits and loss fp32, the gradients rounded to bf16 values (as the
    rounding casts' backward rounds them)."""

    def __init__(self, bf16: bool = False):
        super().__init__()
        self.bf16 = bf16
        self.stats = LMHeadLogitStats(strict=True, bf16=bf16)

    def row_losses(self, h, weight, labels):
        """`[N]` fp32: the cross-entropy of each row (the row max is a shift the loss does not depend on)."""
        row_max, sum_exp, target = self.stats(h, weight, labels)
        return ops.log(sum_exp) + ops.stop_gradient(row_max) - target

    def construct(self, h, weight, labels):
        return self.row_losses(h, weight, labels).mean()


class LMHeadLogitStats(nn.Cell):
    """`construct(h [N, H], weight [Vs, H], labels [N] int32) -> (m, s, t)`, each `[N]` fp32: over the
    logits `z = h weight^T` of this vocabulary slice, `m = max z`, `s = sum exp(z - m)` and
    `t = z[label]` (0 for a label outside `[0, Vs)`; with `strict=True` such a label fails the op).

    The partials of a vocabulary-parallel cross-entropy: with `M = max_r m_r` over the slices,
    `loss_n = log(sum_r s_r exp(m_r - M)) + M - sum_r t_r`, where `m` is a shift the loss does not
    depend on (use it under `stop_gradient`). Gradients flow from `s` and `t` to `h` and `weight`
    (the backward recomputes the logits chunk by chunk). `bf16=True`: h and weight read as their
    bf16 values, their gradients rounded to bf16 values."""

    def __init__(self, strict: bool = False, bf16: bool = False):
        super().__init__()
        suffix = "BF16" if bf16 else ""
        backward = _custom("LMHeadLogitStatsBackward" + suffix, (F32, F32, I32, F32, F32, F32), output_dtypes=(F32, F32))

        def bprop(h, weight, labels, out, dout):
            dh, dweight = backward(h, weight, labels, out[0], dout[1], dout[2])
            return dh, dweight, ops.zeros_like(labels)

        name = ("LMHeadLogitStatsStrict" if strict else "LMHeadLogitStats") + suffix
        self.forward = _custom(name, (F32, F32, I32), bprop, (F32,) * 3)

    def construct(self, h, weight, labels):
        return self.forward(h, weight, labels)


class FusedRouter(nn.Cell):
    """`construct(logits [T, E] fp32, bias [E]) -> (topk_idx [T, k] int32, topk_weight [T, k],
    probs [T, E], tokens_per_expert [E])`: MoE top-k routing in one kernel each way.

    scores = softmax(logits) or sigmoid(logits); the k largest `scores + bias` are chosen (the bias
    steers the choice only and gets no gradient; ties go to the lower expert id, as `ops.topk`);
    `topk_weight` = the chosen scores, over their sum (+1e-20) with `norm_topk_prob`, times
    `route_scale`; `probs` = the softmax scores, or the sigmoid scores over their sum (+1e-20);
    `tokens_per_expert` counts the assignments (no gradient). Gradients reach `logits` from
    `topk_weight` and `probs`."""

    def __init__(self, top_k: int, score_func: str = "softmax", norm_topk_prob: bool = True,
                 route_scale: float = 1.0):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"FusedRouter: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        # k rows of (score function, norm_topk_prob, route_scale): the shape inference reads k from the shape
        row = [1.0 if score_func == "sigmoid" else 0.0, 1.0 if norm_topk_prob else 0.0, float(route_scale)]
        self.config = Tensor(np.tile(np.array(row, np.float32), (top_k, 1)))
        backward = _custom("RouterBackward", (F32, I32, F32, F32, F32))

        def bprop(logits, bias, config, out, dout):
            d_logits = backward(logits, out[0], config, dout[1], dout[2])
            return d_logits, ops.zeros_like(bias), ops.zeros_like(config)

        self.forward = _custom("RouterForward", (F32, F32, F32), bprop, (I32, F32, F32, F32))

    def construct(self, logits, bias):
        return self.forward(logits, bias, self.config)


class SumOfSquares(nn.Cell):
    """`construct(x fp32 [...]) -> [2]`: the sum of squares of all elements, accumulated in double
    and returned as `(hi, lo)` (`hi` the float32 sum, `lo` the rest: `hi + lo` in float64 keeps ~48
    bits), multi-threaded: the squared gradient norm of a flat buffer for clipping, the same however
    a model's gradients are cut into buffers and ranks. No gradient."""

    def __init__(self):
        super().__init__()
        self.kernel = _custom("SumOfSquares", (F32,))

    def construct(self, x):
        return self.kernel(x)


def decay_segments(sizes, weight_decays):
    """`(segment_ends int64 [K], segment_decay fp32 [K])` for FusedAdamW from the sizes and weight
    decays of the tensors laid end to end in a flat buffer, adjacent runs of equal decay merged
    (a ZeRO shard: pass the sizes of the pieces inside the shard)."""
    if len(sizes) != len(weight_decays) or not len(sizes):
        raise ValueError(f"decay_segments: need one weight decay per tensor, got {len(sizes)} sizes and "
                         f"{len(weight_decays)} decays")
    ends, decays, offset = [], [], 0
    for size, decay in zip(sizes, weight_decays):
        offset += int(size)
        if decays and decays[-1] == float(decay):
            ends[-1] = offset
        else:
            ends.append(offset)
            decays.append(float(decay))
    return Tensor(np.array(ends, np.int64)), Tensor(np.array(decays, np.float32))


def _adamw_update_primitive(tensors: int):
    """The AdamWUpdate kernel for `tensors` (param, exp_avg, exp_avg_sq) triples, each marked as written
    in place: MindSpore then orders the op against every read of those Parameters in a jitted graph
    and keeps it even though nothing uses its output (measured: without the marks a read placed after
    the op saw the new value before it ran)."""
    written = [sig.make_sig(f"{kind}{t}", sig.sig_rw.RW_WRITE) for kind in ("param", "exp_avg", "exp_avg_sq")
               for t in range(tensors)]
    read = [sig.make_sig(name) for name in ("grad", "hyper", "lr", "step", "grad_scale", "segment_ends",
                                            "segment_decay")]
    primitive = type("AdamWUpdatePrimitive", (ops.Custom,), {"__mindspore_signature__": tuple(written + read)})
    reg = CustomRegOp(f"AdamWUpdate{tensors}")   # MindSpore keys the reg info by this name: one per arity
    for i in range(3 * tensors + 7):
        reg = reg.input(i, f"x{i}")
    dtypes = (F32,) * (3 * tensors + 5) + (I64, F32, F32)
    reg = reg.output(0, "status").dtype_format(*dtypes).target("CPU").get_op_info()
    update = primitive(f"{library_path()}:AdamWUpdate", out_shape=None, out_dtype=None, func_type="aot", reg_info=reg)
    update.add_prim_attr("side_effect_mem", True)
    return update


class FusedAdamW(nn.Cell):
    """AdamW (or Adam with L2, `decoupled=False`) in place, one pass over a flat fp32 gradient.

    `construct(params, exp_avgs, exp_avg_sqs, grad, lr, step, grad_scale, segment_ends, segment_decay)`:
    `params`, `exp_avgs`, `exp_avg_sqs` are tuples of `tensors` fp32 Parameters each (param t and its
    two moments of one size), updated in place; laid end to end they are the N elements of the fp32
    `grad` (one flat buffer: `tensors=1`, or the separate parameters whose gradients a flat buffer
    holds); `lr`, `step` (1-based), `grad_scale` (the gradient multiplier: loss scale unscale x clip
    factor) fp32 `[1]` tensors; elements `[segment_ends[k-1], segment_ends[k])` use weight decay
    `segment_decay[k]` (`segment_ends` int64 ascending, last = N). Returns a `[1]` status tensor (0).
    Matches torch.optim.AdamW / Adam step for step (tests/test_kernels.py)."""

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, decoupled: bool = True,
                 tensors: int = 1):
        super().__init__()
        if tensors < 1:
            raise ValueError(f"FusedAdamW: tensors must be at least 1, got {tensors}")
        self.hyper = Tensor(np.array([beta1, beta2, eps, 1.0 if decoupled else 0.0], np.float32))
        self.update = _adamw_update_primitive(tensors)

    def construct(self, params, exp_avgs, exp_avg_sqs, grad, lr, step, grad_scale, segment_ends, segment_decay):
        return self.update(*params, *exp_avgs, *exp_avg_sqs, grad, self.hyper, lr, step, grad_scale, segment_ends,
                           segment_decay)


@functools.lru_cache(maxsize=None)
def shared(kernel_class):
    """One instance of a (parameter-free) kernel Cell for every layer that uses it: MindSpore then
    parses and type-infers its backward once instead of once per layer (compile time: about 18 %
    less per MoE layer, measured in CPU seconds). Marking it for recompute marks it in every layer,
    as the recompute policies (`layers.*...`) do anyway."""
    return kernel_class()
