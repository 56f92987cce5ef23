"""DeepSeek-V3 ("deepseek_v3"): the MoE GPT with multi-head latent attention and multi-token prediction.

Against `moe_gpt` it changes two things and adds one:

* attention is MLA (`MultiHeadLatentAttention`): queries through a low-rank bottleneck with its own
  norm (`q_lora_rank`; 0 = one plain projection, as DeepSeek-V2-Lite), keys and values from one
  compressed latent with its norm (`kv_lora_rank`), each head's query/key split into a part without
  position (`qk_nope_head_dim`) and a rotary part (`qk_rope_head_dim`) whose key is one head shared
  by all heads, values of `v_head_dim`. RoPE pairs are interleaved as in DeepSeek's checkpoints
  (`rope_interleave`), optionally YaRN-scaled (`yarn_*`, which also scales the softmax);
* routing is whatever `moe:` says; DeepSeek-V3 itself is sigmoid scores, group-limited top-k
  (`num_groups`, `topk_groups`, `group_score_topk: 2`), the aux-loss-free `expert_bias` (HF
  `e_score_correction_bias`), `norm_topk_prob`, `route_scale` (`routed_scaling_factor`), shared
  experts and `first_k_dense` dense layers (`first_k_dense_replace`);
* `mtp_depth` multi-token-prediction modules after the stack (DeepSeek-V3 paper, section 2.2).
  Depth k (1..D) at position i combines the previous depth's hidden state (the main stack's output
  before the final norm for k = 1) with the embedding of token i+k, `eh_proj([enorm(emb); hnorm(h)])`,
  runs one MoE block and its own final norm, and predicts token i+k+1 through the shared LM head.
  Its inputs are the tokens `labels` already holds, so it needs only `(h, labels)` and the shared
  embedding and head: `mtp_loss` is the mean cross-entropy over depths, and the model's loss adds
  `mtp_loss_weight * mtp_loss`. A depth works on the first S-k positions (causal attention makes
  that equal to masking the last k); RoPE is relative, so the positions may start at 0. With packed
  documents its attention uses the main stack's document and position ids of those positions (as
  Megatron's MTP reuses the main attention mask and rotary positions). Under context parallelism
  (`hold_positions`) a depth runs on every local position, its labels handed over k+1 ahead by the
  runner, and counts only the positions one process computes (docs/context_parallel.md).

Parameter names beyond `moe_gpt`'s:

    layers.{i}.attention.{wq_a,wq_b | wq}.weight, q_norm.weight       query path
    layers.{i}.attention.{wkv_a,wkv_b}.weight, kv_norm.weight          key/value latent
    layers.{i}.attention.wo.weight
    mtp.{k}.{enorm,hnorm,final_norm}.weight, mtp.{k}.eh_proj.weight    MTP depth k+1
    mtp.{k}.block.*                                                    its MoE block (MLA + MoE)

Stats: those of `moe_gpt` (the MTP blocks' MoE layers are rows after the main ones in
`expert_load`, and their aux terms are summed in) plus `mtp_loss`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import numpy as np

import mindspore as ms
from mindspore import nn, ops

from moetrain.models.gpt.model import TransformerBlock
from moetrain.models.moe_gpt.model import MoEBlock, MoEGPT, MoEGPTConfig
from moetrain.layers import CausalAttention, Linear, RMSNorm, RotaryEmbedding, YarnScaling, yarn_mscale
from moetrain.modeling import MEAN, StatSpec, builds_head, merge_stats

LATENT_NORM_EPS = 1e-6   # HF builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps


@dataclass(kw_only=True)
class DeepSeekV3Config(MoEGPTConfig):
    name: str = "deepseek_v3"
    q_lora_rank: int = 0                 # 0: one plain query projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True         # rotary pairs are adjacent dims (DeepSeek checkpoints)
    yarn_factor: float = 1.0             # YaRN context extension; 1: off
    yarn_original_max_positions: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    mtp_depth: int = 0                   # multi-token prediction modules (num_nextn_predict_layers)
    mtp_loss_weight: float = 0.1         # lambda (DeepSeek-V3: 0.3, then 0.1)

    def __post_init__(self):
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"model.{key}: must be an integer >= 1, got {getattr(self, key)!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim: RoPE needs an even size, got {self.qk_rope_head_dim}")
        if self.q_lora_rank < 0:
            raise ValueError(f"model.q_lora_rank: must be >= 0 (0: no query compression), got {self.q_lora_rank}")
        # MLA: every head has its own key and value; head_dim is the query/key head size.
        if self.num_kv_heads not in (None, self.num_heads):
            raise ValueError(f"model.num_kv_heads: MLA gives every head its own key and value; leave it unset or "
                             f"equal to num_heads ({self.num_heads}), got {self.num_kv_heads}")
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim not in (None, qk_head_dim):
            raise ValueError(f"model.head_dim: for MLA it is qk_nope_head_dim + qk_rope_head_dim = {qk_head_dim}; "
                             f"leave it unset, got {self.head_dim}")
        self.num_kv_heads, self.head_dim = self.num_heads, qk_head_dim
        super().__post_init__()
        if self.yarn_factor < 1:
            raise ValueError(f"model.yarn_factor: must be >= 1 (1: no YaRN), got {self.yarn_factor}")
        if self.yarn_factor > 1 and self.yarn_original_max_positions < 1:
            raise ValueError("model.yarn_original_max_positions: YaRN needs the pre-training context length "
                             "(HF rope_parameters.original_max_position_embeddings)")
        if self.mtp_depth < 0 or self.mtp_depth >= self.seq_length:
            raise ValueError(f"model.mtp_depth: must be in [0, seq_length={self.seq_length}), got {self.mtp_depth}")
        if self.mtp_loss_weight < 0:
            raise ValueError(f"model.mtp_loss_weight: must be >= 0, got {self.mtp_loss_weight}")

    @property
    def yarn(self):
        if self.yarn_factor <= 1:
            return None
        return YarnScaling(self.yarn_factor, self.yarn_original_max_positions, self.yarn_beta_fast,
                           self.yarn_beta_slow, self.yarn_mscale, self.yarn_mscale_all_dim)

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim^-0.5`, times YaRN's `mscale(factor, mscale_all_dim)^2` (HF `yarn_apply_mscale`)."""
        scale = self.head_dim ** -0.5
        if self.yarn is not None and self.yarn_mscale_all_dim:
            scale *= yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim) ** 2
        return scale


class MultiHeadLatentAttention(CausalAttention):
    """MLA (DeepSeek-V2/V3); `construct(x [B, S, H], context=None) -> [B, S, H]` in the compute dtype;
    `context`: packed documents (`CausalAttention`): RoPE, applied here to the decoupled part only,
    rotates at its position ids, and `attend` masks across documents. Under context parallelism with
    `cp_comm_type: all_gather` or `p2p` the normed latent and the rotated shared key (kv_lora_rank +
    qk_rope_head_dim values a token) cross the split (all-gathered or round the ring) and every rank
    expands all of them through `wkv_b`, rather than sending the per-head keys and values
    (docs/context_parallel.md).

    Head counts are read from the `wq_b`/`wq` and `wkv_b` outputs, so a tensor-parallel plan may
    split those column-wise (and `wo` row-wise) while the latent projections and norms stay whole."""

    def __init__(self, cfg: DeepSeekV3Config):
        super().__init__(cfg.seq_length, cfg.compute_dtype)
        hidden, heads, dtype = cfg.hidden_size, cfg.num_heads, cfg.compute_dtype
        self.nope_dim, self.rope_dim, self.value_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent_dim = cfg.kv_lora_rank
        self.q_lora = cfg.q_lora_rank > 0
        if self.q_lora:
            self.wq_a = Linear(hidden, cfg.q_lora_rank, cfg.init_std, dtype)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = Linear(cfg.q_lora_rank, heads * cfg.head_dim, cfg.init_std, dtype)
        else:
            self.wq = Linear(hidden, heads * cfg.head_dim, cfg.init_std, dtype)
        self.wkv_a = Linear(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.init_std, dtype)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.init_std, dtype)
        self.wo = Linear(heads * cfg.v_head_dim, hidden, cfg.output_init_std, dtype)
        self.rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.seq_length, cfg.rope_theta, cfg.yarn,
                                    interleaved=cfg.rope_interleave)
        self.head_dim = cfg.head_dim
        self.scale = cfg.softmax_scale

    def construct(self, x, context=None):
        batch, seq_len = x.shape[0], x.shape[1]
        position_ids = None if context is None else context[1]
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora else self.wq(x)
        q_nope, q_rot = ops.split(q.reshape(batch, seq_len, -1, self.head_dim), [self.nope_dim, self.rope_dim], -1)
        latent, k_rot = ops.split(self.wkv_a(x), [self.latent_dim, self.rope_dim], -1)
        latent = self.kv_norm(latent)
        k_rot = self.rope(k_rot.reshape(batch, seq_len, 1, self.rope_dim), position_ids)
        q = ops.cat((q_nope, self.rope(q_rot, position_ids).astype(q_nope.dtype)), -1)
        cp = self.context_parallel
        gathered = cp is not None and cp.gathers_keys
        key_docs = None
        if gathered:   # all_gather / p2p under cp: the compressed K/V crosses the split, expanded after
            compressed = ops.cat((latent.astype(ms.float32),
                                  k_rot.reshape(batch, seq_len, self.rope_dim).astype(ms.float32)), -1)
            compressed, key_docs = cp.gather_keys(compressed, context)     # [B, cp * L, latent + rope]
            latent, k_rot = ops.split(compressed, [self.latent_dim, self.rope_dim], -1)
            seq_len = compressed.shape[1]
            k_rot = k_rot.reshape(batch, seq_len, 1, self.rope_dim)
        kv = self.wkv_b(latent).reshape(batch, seq_len, -1, self.nope_dim + self.value_dim)
        k_nope, v = ops.split(kv, [self.nope_dim, self.value_dim], -1)
        k_rot = k_rot.astype(k_nope.dtype)
        k = ops.cat((k_nope, ops.broadcast_to(k_rot, k_nope.shape[:-1] + (self.rope_dim,))), -1)
        if gathered:
            return self.wo(cp.attend_gathered(q, k, v, self.scale, context, key_docs))
        return self.wo(self.attend(q, k, v, self.scale, context=context))   # RoPE already on the decoupled part

    def decode(self, x, step, past=None):
        """Incremental decoding (PyNative, `moetrain.kv_cache`): `(out [B, S, H], (latent, k_rot))`.

        The cache is what DeepSeek-V3 caches: per token the normed compressed latent `[B, T,
        kv_lora_rank]` (fp32, as `kv_norm` returns it) and the rotary key, RoPE (interleaved, YaRN)
        applied at its position, `[B, T, qk_rope_head_dim]`, one head shared by all heads; at attention
        time the latents are expanded through `wkv_b` into every head's key part and value, as
        `construct` does for the whole sequence."""
        batch, seq_len = x.shape[0], x.shape[1]
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora else self.wq(x)
        q_nope, q_rot = ops.split(q.reshape(batch, seq_len, -1, self.head_dim), [self.nope_dim, self.rope_dim], -1)
        latent, k_rot = ops.split(self.wkv_a(x), [self.latent_dim, self.rope_dim], -1)
        latent = self.kv_norm(latent)
        k_rot = self.rope.decode(k_rot.reshape(batch, seq_len, 1, self.rope_dim), step).reshape(
            batch, seq_len, self.rope_dim)
        if past is not None:
            latent, k_rot = ops.cat((past[0], latent), 1), ops.cat((past[1], k_rot), 1)
        total = latent.shape[1]
        kv = self.wkv_b(latent).reshape(batch, total, -1, self.nope_dim + self.value_dim)
        k_nope, v = ops.split(kv, [self.nope_dim, self.value_dim], -1)
        k_rot_heads = k_rot.reshape(batch, total, 1, self.rope_dim)
        if k_rot_heads.dtype != k_nope.dtype:
            k_rot_heads = k_rot_heads.astype(k_nope.dtype)
        k = ops.cat((k_nope, ops.broadcast_to(k_rot_heads, k_nope.shape[:-1] + (self.rope_dim,))), -1)
        q = ops.cat((q_nope, self.rope.decode(q_rot, step)), -1)
        out = self.attend_cached(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), self.scale, step)
        return self.wo(out), (latent, k_rot)


class MTPLayer(nn.Cell):
    """One multi-token-prediction depth: `construct(h [B, n, H], emb [B, n, H], context=None, valid=0) -> (normed
    h, moe_stats)`; `context`: the attention context of those n positions, or None."""

    def __init__(self, cfg: DeepSeekV3Config):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, cfg.init_std, cfg.compute_dtype)
        self.block = MoEBlock(cfg, MultiHeadLatentAttention(cfg))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def construct(self, h, emb, context=None, valid: int = 0):
        """`valid` > 0: only the first `valid` positions count in the MoE stats (context parallelism)."""
        x = self.eh_proj(ops.cat((self.enorm(emb), self.hnorm(h)), -1)).astype(ms.float32)
        if valid:
            x, stats = self.block.counting(x, context, valid)
        else:
            x, stats = self.block(x, context)
        return self.final_norm(x), stats


class DeepSeekV3(MoEGPT):
    """`construct(input_ids, labels) -> (loss, stats)`; see the module docstring. The MTP modules are
    part of the head (`head_loss`): they need only the final hidden state, the labels and the
    embedding, so the last pipeline stage runs them."""

    HEAD_CELLS = MoEGPT.HEAD_CELLS + ("mtp",)

    def __init__(self, cfg: DeepSeekV3Config):
        super().__init__(cfg)
        self.mtp_depth = cfg.mtp_depth
        self.mtp_loss_weight = float(cfg.mtp_loss_weight)
        self.mtp = nn.CellList([MTPLayer(cfg) for _ in range(cfg.mtp_depth)]) if builds_head() else None
        self.head_stat_rows = cfg.mtp_depth      # each MTP block is an MoE block: one expert_load row
        self.held = None                         # context parallelism: per depth (counted positions, loss weight)

    @property
    def label_lookahead(self) -> int:
        """How far past a position the head reads the labels (depth k: k ahead for its input, k+1 for its
        target): context parallelism hands each rank the labels that far ahead of its own positions
        (`moetrain.parallel.context_parallel.local_batch`)."""
        return self.mtp_depth

    def hold_positions(self, positions, seq_length: int) -> None:
        """Context parallelism: this rank holds the global positions `positions` (increasing) of each
        sequence of `seq_length`, and its labels come as `[B, 1 + mtp_depth, len(positions)]`, row j the
        labels j ahead. Depth k (one process: positions 0..S-k-2) then runs on every local position,
        counting only those below S-k-1 (a prefix of the local ones, since the rest of the sequence's
        end is a suffix of every rank's chunks), and weights its per-token means by
        counted x cp / (S-k-1), so that the mean over the cp ranks is one process's mean."""
        positions = np.asarray(positions)
        cp = seq_length // len(positions)
        held = []
        for k in range(self.mtp_depth):
            n = seq_length - k - 1
            valid = int((positions < n).sum())
            if valid == 0 or (positions[:valid] >= n).any():
                raise ValueError(f"model.mtp_depth={self.mtp_depth}: depth {k + 1} counts no prefix of the local "
                                 f"positions {positions[:4].tolist()}... of a {seq_length}-token sequence")
            held.append((valid, valid * cp / n))
        self.held = tuple(held)

    @property
    def needs_embedding_in_head(self) -> bool:
        return self.tie_embeddings or self.cfg.mtp_depth > 0     # asked before the MTP layers are built

    def stat_specs(self):
        specs = super().stat_specs()
        if self.mtp_depth:
            specs["mtp_loss"] = StatSpec(MEAN)
        return specs

    def build_block(self, layer_index: int) -> nn.Cell:
        attention = MultiHeadLatentAttention(self.cfg)
        if self.cfg.is_moe_layer(layer_index):
            return MoEBlock(self.cfg, attention)
        return TransformerBlock(self.cfg, attention)

    def mtp_depth_step(self, k: int, h, labels, context=None):
        """MTP depth k+1: `(normed h [B, S-k-1, H], logits [B, S-k-1, V], moe_stats)`; row i predicts
        token i+k+2 (`labels[:, i+k+1]`). `h`: the previous depth's output, or for k = 0 the main
        stack's output before the final norm `[B, S, H]`; `labels [B, S]`; `context`: the main
        stack's attention context `[B, S]` (None: causal), cut to the first S-k-1 positions. Under context
        parallelism (`hold_positions`): h stays `[B, L, H]`, the logits are those of the counted positions."""
        h, counted, stats = self.mtp_depth_hidden(k, h, labels, context)
        return h, self.head_logits(counted), stats

    def mtp_depth_hidden(self, k: int, h, labels, context=None):
        """`mtp_depth_step` without the head: `(normed h, its counted positions (the head's input), moe_stats)`."""
        if self.held is not None:   # context parallelism: every local position, `labels` [B, 1 + D, L]
            valid = self.held[k][0]
            h, stats = self.mtp[k](h, self.embed(labels[:, k]), context, valid)
            return h, h[:, :valid], stats
        n = labels.shape[1] - k - 1
        if context is not None:
            context = (context[0][:, :n], context[1][:, :n])
        h, stats = self.mtp[k](h[:, :n], self.embed(labels[:, k:k + n]), context)
        return h, h, stats

    def head_loss(self, h, labels, context=None):
        """lm_loss, and with MTP: `mtp_loss` (mean over depths) weighted into the loss, the MTP
        blocks' MoE stats (their aux terms weighted in too) and their rows of every per-layer stat
        (`expert_load`, and `dispatch_rows` / `dispatch_load`: the dispatch invariant and the adaptive
        capacities cover the MTP blocks as they do the stack's layers). With the fused head, the main
        head's rows and every depth's go through one `row_losses` call (they share the head weight):
        one weight gradient in the backward, not one per head and their sum."""
        if (labels.ndim == 3) != (self.held is not None):
            raise ValueError(f"DeepSeekV3: labels of shape {labels.shape}: [B, S] on one process, [B, 1 + mtp_depth, "
                             f"S/cp] under context parallelism (ContextParallelRunner)")
        main_labels = labels if self.held is None else labels[:, 0]
        if not self.mtp_depth:
            return super().head_loss(h, main_labels, context)
        weight = self.fused_head_weight()
        joint = weight is not None
        summed, stacked = self.layer_stats
        zero = ops.zeros((), ms.float32)
        totals = {name: zero for name in summed}
        rows, mtp_loss, aux = {name: [] for name in stacked}, zero, zero
        head_rows, head_labels, depth_weights = [self.final_norm(h)], [main_labels], []
        depth_h = h
        for k in range(self.mtp_depth):
            depth_h, counted, mtp_stats = self.mtp_depth_hidden(k, depth_h, labels, context)
            if self.held is None:
                target, weight_k = labels[:, k + 1:], 1.0
            else:   # this rank's share of the mean over all S-k-1 positions (hold_positions)
                valid, weight_k = self.held[k]
                target = labels[:, k + 1, :valid]
                mtp_stats["z_loss"] = mtp_stats["z_loss"] * weight_k
            if joint:
                head_rows.append(counted)
                head_labels.append(target)
                depth_weights.append(weight_k)
            else:
                mtp_loss = mtp_loss + self.cross_entropy(self.head_logits(counted), target) * weight_k
            for name in summed:
                totals[name] = totals[name] + mtp_stats[name].astype(ms.float32)
            for name in stacked:   # expert_load, and the dispatch rows / loads the trainer checks and sizes by
                rows[name].append(mtp_stats[name].astype(ms.float32))
            aux = aux + self.mtp[k].block.moe.weighted_aux(mtp_stats)
        if joint:   # one call over every head's rows, split back into the per-head means
            hidden = ops.cat([x.reshape(-1, x.shape[-1]) for x in head_rows])
            row_loss = self.fused_head_loss.row_losses(hidden, weight, ops.cat([t.reshape(-1) for t in head_labels]))
            sizes = [t.shape[0] * t.shape[1] for t in head_labels]
            start = sizes[0]
            lm_loss = row_loss[:start].mean()
            for k in range(self.mtp_depth):
                mtp_loss = mtp_loss + row_loss[start:start + sizes[k + 1]].mean() * depth_weights[k]
                start += sizes[k + 1]
            loss, stats = lm_loss, {"lm_loss": lm_loss}
        else:
            loss, stats = super().head_loss(h, main_labels, context)
        loss = loss + aux
        for name in stacked:
            totals[name] = ops.stack(rows[name])
        totals["mtp_loss"] = mtp_loss / self.mtp_depth
        loss = loss + self.mtp_loss_weight * totals["mtp_loss"]
        stats = merge_stats(stats, totals, stacked)
        return loss, stats

    def moe_modules(self) -> List:
        """The MoE layers this model holds in layer order, then the MTP blocks' (the rows of
        `expert_load`); a pipeline stage without the head has no MTP blocks."""
        return super().moe_modules() + ([layer.block.moe for layer in self.mtp] if self.mtp is not None else [])
