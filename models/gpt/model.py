"""Dense decoder-only transformer with the Llama architecture ("gpt").

Pre-norm blocks `x + attention(norm(x))`, `x + swiglu(norm(x))`, RoPE, grouped-query
attention, a final RMSNorm and an (optionally tied) LM head. Parameter names:

    embed.weight
    layers.{i}.attention_norm.weight
    layers.{i}.attention.{wq,wk,wv,wo}.weight
    layers.{i}.ffn_norm.weight
    layers.{i}.mlp.{w_gate,w_up,w_down}.weight
    final_norm.weight
    lm_head.weight                      (absent with tie_embeddings)

They map one-to-one onto Hugging Face Llama names (`models/gpt/hf.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mindspore as ms
from mindspore import nn, ops

from moetrain.distributed.sharding import mark_role
from moetrain.layers import (COMPUTE_DTYPES, Attention, CrossEntropy, Embedding, Linear, LMHeadCrossEntropy,
                             RMSNorm, SwiGLUMLP, bf16_rounder, compute_dtype_of, fp32,
                             to_compute)
from moetrain.kv_cache import KVCache
from moetrain.modeling import (MEAN, StatSpec, attention_context, build_layers, builds_embedding, builds_head,
                               merge_stats, reused_block, run_blocks, split_specs)


@dataclass(kw_only=True)
class GPTConfig:
    name: str = "gpt"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: Optional[int] = None   # None: num_heads (plain multi-head attention)
    ffn_hidden_size: int
    seq_length: int                      # maximum number of positions (RoPE table, causal mask)
    head_dim: Optional[int] = None       # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    scale_output_init: bool = True       # init wo / w_down with init_std / sqrt(2 num_layers) (GPT-2)
    compute_dtype: str = "float32"       # matmul dtype; weights, norms, softmax, loss stay fp32

    def __post_init__(self):
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "seq_length"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        _require(self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                 f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None:
            _require(self.hidden_size % self.num_heads == 0, "num_heads",
                     f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}), "
                     f"or set model.head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_heads
        _require(self.head_dim >= 2 and self.head_dim % 2 == 0, "head_dim",
                 f"RoPE needs an even head_dim >= 2, got {self.head_dim}")
        _require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        _require(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        _require(self.init_std > 0, "init_std", f"must be > 0, got {self.init_std}")
        _require(self.compute_dtype in COMPUTE_DTYPES, "compute_dtype",
                 f"{self.compute_dtype!r} is not one of {sorted(COMPUTE_DTYPES)}")

    @property
    def output_init_std(self) -> float:
        return self.init_std / (2 * self.num_layers) ** 0.5 if self.scale_output_init else self.init_std


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ValueError(f"model.{key}: {why}")


def build_attention(cfg: GPTConfig) -> Attention:
    return Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_length,
                     cfg.rope_theta, cfg.init_std, cfg.output_init_std, cfg.compute_dtype)


class TransformerBlock(nn.Cell):
    """Pre-norm attention + SwiGLU block; input and output fp32 `[B, S, H]`; `context`: packed
    documents for the attention (`moetrain.modeling.attention_context`), or None."""

    returns_stats = False

    @reused_block
    def __init__(self, cfg: GPTConfig, attention: Optional[nn.Cell] = None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = attention if attention is not None else build_attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.ffn_hidden_size, cfg.init_std, cfg.output_init_std,
                             cfg.compute_dtype)

    def construct(self, x, context=None):
        h = x + self.attention(self.attention_norm(x), context).astype(ms.float32)
        return h + self.mlp(self.ffn_norm(h)).astype(ms.float32)

    def decode(self, x, step, past=None):
        """Incremental decoding (PyNative, `moetrain.kv_cache`): `(x, present)` for the new tokens
        `x [B, S, H]`; `past` / `present`: this layer's attention cache before / after."""
        attended, present = self.attention.decode(self.attention_norm(x), step, past)
        h = x + fp32(attended)
        return h + fp32(self.mlp(self.ffn_norm(h))), present


class GPT(nn.Cell):
    """`construct(input_ids, labels[, document_ids, position_ids]) -> (loss, {"lm_loss"})`;
    `logits(input_ids[, document_ids, position_ids]) -> fp32 [B, S, V]`. With document and position
    ids (packed documents, docs/data.md) attention stays inside each document and RoPE uses the
    given positions.

    Made of the pieces `moetrain/modeling.py` describes (embed_tokens, run_layers, head_loss), so a
    pipeline stage runs the same code on its part of the model."""

    EMBEDDING_CELLS = ("embed",)
    HEAD_CELLS = ("final_norm", "lm_head")
    head_stat_rows = 0

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.max_positions = cfg.seq_length
        self.tie_embeddings = cfg.tie_embeddings
        # a pipeline chunk builds its own part only (moetrain/modeling.py building_part): the others are None
        self.embed = (Embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_std)
                      if builds_embedding(self.needs_embedding_in_head) else None)
        build_layers(self, self.build_block, cfg.num_layers)   # all layers, or one pipeline chunk's
        head = builds_head()
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if head else None
        if cfg.tie_embeddings:
            self.tied_head_matmul = ops.MatMul(transpose_b=True)
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, cfg.init_std, cfg.compute_dtype) if head else None
            if head:
                mark_role(self.lm_head.weight, lm_head=True)
        self.compute_dtype = compute_dtype_of(cfg.compute_dtype)
        self.emulated = bf16_rounder(cfg.compute_dtype)
        self.cross_entropy = CrossEntropy()
        self.vocab_size = cfg.vocab_size
        # the LM head and loss in one kernel, never storing [tokens, vocab] logits (CPU, fp32)
        self.fused_head_loss = LMHeadCrossEntropy(cfg.compute_dtype) if LMHeadCrossEntropy.supported(cfg.compute_dtype) else None
        self.layer_stat_specs = self.whole_layer_stat_specs()
        self.layer_stats = split_specs(self.layer_stat_specs)   # (summed, stacked) names, graph-safe

    def build_block(self, layer_index: int) -> nn.Cell:
        return TransformerBlock(self.cfg)

    def block_returns_stats(self, layer_index: int) -> bool:
        """Whether block `layer_index` of the whole model returns stats, known without building it (a
        pipeline chunk builds only its own blocks). A family that overrides `build_block` overrides
        this too; otherwise it is answered from the blocks built, and a block not built is refused."""
        if type(self).build_block is GPT.build_block:
            return False
        start, end = self.built_range
        if not start <= layer_index < end:
            raise NotImplementedError(f"{type(self).__name__} overrides build_block but not block_returns_stats, "
                                      f"which a pipeline stage needs for the layers it does not build")
        return bool(self.layers[layer_index - start].returns_stats)

    def whole_layer_stat_specs(self):
        """The stat specs of the whole model's blocks (a chunk may hold none of the blocks that
        produce them); by default those of the blocks built. Override with `build_block`."""
        return {name: spec for block in self.layers if block.returns_stats for name, spec in block.stat_specs.items()}

    @property
    def needs_embedding_in_head(self) -> bool:
        return self.tie_embeddings

    def stat_specs(self):
        return {**self.layer_stat_specs, "lm_loss": StatSpec(MEAN)}

    # ---- the pieces -------------------------------------------------------------------------
    def embed_tokens(self, input_ids):
        if input_ids.shape[-1] > self.max_positions:
            raise ValueError(f"input has {input_ids.shape[-1]} tokens per sequence but the model was built "
                             f"for at most model.seq_length={self.max_positions}")
        return self.embed(input_ids)

    def run_layers(self, h, context=None):
        """The blocks this model holds on `h` (before the final norm): `(h, stats, weighted_aux)`;
        `context`: the attention context (`moetrain.modeling.attention_context`)."""
        return run_blocks(self.layers, h, *self.layer_stats, context)

    def head_loss(self, h, labels, context=None):
        """Final norm, head and next-token loss: `(loss, {"lm_loss"})` (`context`: for a head with
        attention blocks, such as DeepSeek's MTP)."""
        lm_loss = self.lm_loss(h, labels)
        return lm_loss, {"lm_loss": lm_loss}

    def lm_loss(self, h, labels):
        """Final norm, LM head and mean cross-entropy of the last hidden state `[B, S, H]`: fused where
        the kernel exists and the head holds the whole vocabulary; a vocabulary-parallel head (tp > 1)
        takes the plain path, whose loss is reduced over the tp group."""
        weight = self.fused_head_weight()
        if weight is not None:
            return self.fused_head_loss(self.final_norm(h), weight, labels)
        return self.cross_entropy(self.output_logits(h), labels)

    def fused_head_weight(self):
        """The head weight (tied or not) where the fused LM head + loss runs: the kernel exists and
        the head holds the whole vocabulary (a vocabulary-parallel head, tp > 1, does not); else None."""
        weight = self.embed.weight if self.tie_embeddings else self.lm_head.weight
        return weight if self.fused_head_loss is not None and weight.shape[0] == self.vocab_size else None

    def output_logits(self, h):
        """Final norm and LM head: fp32 hidden `[B, S, H]` -> fp32 logits `[B, S, V]`."""
        return self.head_logits(self.final_norm(h))

    def head_logits(self, h):
        """The LM head (tied or not) on normed hidden states: `[B, S, H]` -> fp32 `[B, S, V]`."""
        if self.tie_embeddings:
            batch, seq_len = h.shape[0], h.shape[1]
            weight = self.embed.weight
            if self.compute_dtype != ms.float32:
                h, weight = (to_compute(t, self.compute_dtype, self.emulated) for t in (h, weight))
            logits = self.tied_head_matmul(h.reshape(batch * seq_len, -1), weight).reshape(batch, seq_len, -1)
        else:
            logits = self.lm_head(h)
        return logits.astype(ms.float32)

    # ---- the whole model ------------------------------------------------------------------------
    def logits(self, input_ids, document_ids=None, position_ids=None):
        h, _, _ = self.run_layers(self.embed_tokens(input_ids), attention_context(document_ids, position_ids))
        return self.output_logits(h)

    # ---- incremental decoding (PyNative; moetrain/generate.py) ---------------------------------------
    def new_cache(self, batch: int, pad=None) -> KVCache:
        """An empty decoding cache for `batch` rows; `pad[b]`: left-padding columns of row b."""
        return KVCache(len(self.layers), batch, self.max_positions, pad)

    def decode(self, input_ids, cache: KVCache, last_only: bool = False):
        """The next `S` columns of every row, `input_ids` int `[B, S]`, against what `cache` holds
        (which then holds them too): fp32 logits `[B, S, V]` (`last_only`: `[B, 1, V]`). The blocks'
        `decode` methods, plain Python beside their `construct`: the training graphs are untouched. A
        prefill of the whole prompt then one call per token gives `logits(ids)` (tests/test_generate.py)."""
        step = cache.begin(input_ids.shape[1])
        h = self.embed(input_ids)
        for i, block in enumerate(self.layers):
            h, cache.layers[i] = block.decode(h, step, cache.layers[i])
        cache.commit(input_ids.shape[1])
        if last_only:
            h = h[:, -1:]
        return self.output_logits(h)

    def construct(self, input_ids, labels, document_ids=None, position_ids=None):
        context = attention_context(document_ids, position_ids)
        h, stats, aux = self.run_layers(self.embed_tokens(input_ids), context)
        loss, head_stats = self.head_loss(h, labels, context)
        return loss + aux, merge_stats(stats, head_stats, self.layer_stats[1])
