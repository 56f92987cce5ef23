"""What the planner plans: the model's shape (`Arch`), the training job (`Job`), and the closed-form
parameter and FLOP counts (docs/plan.md, "Parameters", "FLOPs"). `flops_per_token` is also the
trainer's `mfu` numerator."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import List, Optional, Tuple

from moetrain.family import family_of
from moetrain.layout import Layout, LayoutError, ModelShape, layout_problems

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
FP32 = 4
OPTIMIZER_FP32_STATES = {"adamw": 2, "adam": 2, "lamb": 2, "momentum": 1, "sgd": 0}
# Expert rows per routed assignment of a load-proportional dropless dispatcher: the routed rows
# rounded up to its static buckets / blocks (issue 18 bounds expert_rows / routed at 1.3).
DISPATCH_ROW_MARGIN = 1.1


@dataclass(frozen=True)
class Arch:
    """The shape numbers of a transformer model config that the formulas use (its family's `arch`)."""
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    moe_layers: Tuple[int, ...] = ()
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    capacity_factor: float = 0.0
    value_dim: int = 0                # per-head value width (MLA's v_head_dim); 0: head_dim
    q_lora_rank: int = 0              # MLA (deepseek_v3): query bottleneck, 0: a plain query projection
    kv_lora_rank: int = 0             # MLA key/value latent; 0: not MLA
    rope_dim: int = 0                 # MLA: rotary part of head_dim (the decoupled key shared by the heads)
    qk_norm: bool = False             # per-head q/k RMSNorm (qwen3_moe)
    mtp_depth: int = 0                # multi-token-prediction modules after the stack (each an MoE block)
    groups: int = 1                   # group-limited routing (moe.num_groups): node-limited when groups map to nodes
    topk_groups: int = 1              # groups a token may reach (moe.topk_groups)
    # the family's `selective` recompute plan recomputes the routed experts (a `moe.experts` cell):
    # their SwiGLU intermediates are not kept (moetrain/parallel/plans.py)
    selective_experts: bool = False

    @classmethod
    def of(cls, model_cfg) -> "Arch":
        """The shape numbers the model's family declares (`moetrain.family.Family.arch`)."""
        family = family_of(model_cfg)
        if family is None or family.arch is None:
            raise LayoutError(f"the planner models the families that declare their shape numbers (Family.arch, "
                              f"moetrain/family.py); model {getattr(model_cfg, 'name', model_cfg)!r} declares none")
        selective = tuple((family.recompute or {}).get("selective", ()))
        return cls(**family.arch(model_cfg), selective_experts=any(p.endswith("moe.experts") for p in selective))

    @property
    def v_dim(self) -> int:
        return self.value_dim or self.head_dim

    @functools.cached_property
    def attention_split_params(self) -> int:
        """Attention matmul weights split over tensor parallelism (by heads)."""
        h, n, d = self.hidden, self.heads, self.head_dim
        if not self.kv_lora_rank:                 # wq, wk, wv, wo
            return h * (n + 2 * self.kv_heads) * d + n * d * h
        query = (self.q_lora_rank or h) * n * d   # wq_b (or wq)
        return query + self.kv_lora_rank * n * (d - self.rope_dim + self.v_dim) + n * self.v_dim * h  # + wkv_b, wo

    @functools.cached_property
    def attention_replicated_params(self) -> int:
        """MLA's latent projections wq_a and wkv_a: whole on every tensor-parallel rank."""
        if not self.kv_lora_rank:
            return 0
        return self.hidden * (self.q_lora_rank + self.kv_lora_rank + self.rope_dim)

    @functools.cached_property
    def largest_attention_param(self) -> int:
        """The largest attention weight before tensor parallelism's split (a bucket of its own in
        ZeRO-2's packing): MLA's wq_b, wkv_b or wo; else wo or a fused q/k/v projection."""
        h, n, d = self.hidden, self.heads, self.head_dim
        if not self.kv_lora_rank:
            return max(h * (n + 2 * self.kv_heads) * d, n * d * h)
        return max((self.q_lora_rank or h) * n * d, self.kv_lora_rank * n * (d - self.rope_dim + self.v_dim),
                   n * self.v_dim * h, self.hidden * (self.q_lora_rank + self.kv_lora_rank + self.rope_dim))

    @property
    def attention_params(self) -> int:            # every attention matmul weight
        return self.attention_split_params + self.attention_replicated_params

    @property
    def attention_norm_params(self) -> int:       # norms inside attention: MLA latent norms, Qwen3 q/k norms
        return self.q_lora_rank + self.kv_lora_rank + (2 * self.head_dim if self.qk_norm else 0)

    def attention_core_flops(self, seq_length: int) -> float:
        """Forward FLOPs of QK^T and AV per token in one layer: 2 S a (d_qk + d_v)."""
        return 2 * seq_length * self.heads * (self.head_dim + self.v_dim)

    @property
    def mtp_layers(self) -> Tuple[int, ...]:
        """Pseudo layer indices `layers .. layers + mtp_depth - 1` of the MTP blocks (MoE blocks)."""
        return tuple(range(self.layers, self.layers + self.mtp_depth))

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layer_set or layer >= self.layers

    @functools.cached_property
    def moe_layer_set(self) -> frozenset:
        return frozenset(self.moe_layers)

    def routed_rows_per_token(self, exact: bool = False) -> float:
        """Expert-buffer rows per token: top_k assignments, padded to capacity when there is one,
        else load-proportional (`DISPATCH_ROW_MARGIN`; none for the exact one-row layout that
        one process runs with the CPU kernels)."""
        margin = 1.0 if exact else DISPATCH_ROW_MARGIN
        return self.top_k * (self.capacity_factor if self.capacity_factor > 0 else margin)

    def max_nodes_per_token(self, nodes: int) -> int:
        """Node-limited routing (DeepSeek-V3's M): the most nodes of an expert-parallel group spread
        over `nodes` nodes that one token's experts can be on. Group-limited routing is node-limited
        when the groups tile the nodes (experts placed in order, each node holding whole groups or
        each group whole nodes): a token reaches topk_groups groups, i.e. that many groups' nodes."""
        if self.groups > 1 and self.topk_groups < self.groups:
            if self.groups % nodes == 0:
                return min(nodes, self.topk_groups, self.top_k)
            if nodes % self.groups == 0:
                return min(nodes, self.topk_groups * nodes // self.groups, self.top_k)
        return min(nodes, self.top_k)

    def nodes_per_token(self, nodes: int) -> float:
        """Expected distinct nodes one token's top_k experts are on (balanced routing): k uniform
        picks over `nodes` nodes reach n (1 - (1 - 1/n)^k) of them, at most `max_nodes_per_token`."""
        if nodes <= 1:
            return 1.0
        spread = nodes * (1 - (1 - 1 / nodes) ** self.top_k)
        return min(spread, float(self.max_nodes_per_token(nodes)))


@dataclass(frozen=True)
class Job:
    """The training settings, besides the layout, that costs depend on."""
    model: object                     # GPTConfig / MoEGPTConfig
    seq_length: int
    global_batch_size: int            # sequences per optimizer step
    compute_dtype: str = "float32"    # matmul / activation dtype
    grad_dtype: str = "float32"       # dtype gradients are accumulated and reduced in
    optimizer: str = "adamw"
    # the priced system beyond the layout (moetrain/config.py; docs/plan.md, "Published runs")
    fp8_recipe: str = "none"          # precision.fp8_recipe: GEMMs at the device's fp8 peak
    moe_overlap: str = "none"         # parallel.moe_overlap: none | a2a_overlap | dualpipe
    pipeline_backward: str = "recompute"   # parallel.pipeline_backward: recompute (this trainer) | stash
    recompute_modules: Optional[Tuple[str, ...]] = None   # parallel.recompute_modules (None: attention core)
    param_dtype: str = "float32"      # precision.param_dtype: bfloat16 = Megatron-Core's memory recipe
    moment_dtype: str = "float32"     # precision.moment_dtype: Adam's m and v
    # how this trainer sizes its dropless dispatch buffers on the CPU (moetrain/moe/capacity.py)
    moe_capacity: str = "adaptive"    # parallel.moe_capacity: adaptive | bound
    moe_capacity_prior: float = 2.0   # parallel.moe_capacity_prior: the first capacities / the even share
    moe_token_dispatcher: str = "alltoall"   # parallel.moe_token_dispatcher
    grad_bucket_mb: float = 25.0      # parallel.grad_bucket_mb: ZeRO-2 packs and reduce-scatters buckets of it

    @property
    def megatron_memory(self) -> bool:
        """Memory as Megatron-Core / DeepSeek hold it (16-bit parameters, fp32 main gradients and
        masters, activations as their kernels save them) instead of as this trainer does."""
        return self.param_dtype != "float32"

    @classmethod
    def of(cls, cfg) -> "Job":
        p = cfg.parallel
        modules = getattr(p, "recompute_modules", None)
        return cls(model=cfg.model, seq_length=cfg.data.seq_length or getattr(cfg.model, "seq_length", 0),
                   global_batch_size=cfg.train.global_batch_size, compute_dtype=cfg.precision.compute_dtype,
                   grad_dtype=p.grad_reduce_dtype, optimizer=cfg.optimizer.name,
                   fp8_recipe=getattr(cfg.precision, "fp8_recipe", "none"),
                   moe_overlap=getattr(p, "moe_overlap", "none"),
                   pipeline_backward=getattr(p, "pipeline_backward", "recompute"),
                   recompute_modules=tuple(modules) if modules is not None else None,
                   param_dtype=getattr(cfg.precision, "param_dtype", "float32"),
                   moment_dtype=getattr(cfg.precision, "moment_dtype", "float32"),
                   moe_capacity=getattr(p, "moe_capacity", "adaptive"),
                   moe_capacity_prior=float(getattr(p, "moe_capacity_prior", 2.0)),
                   moe_token_dispatcher=getattr(p, "moe_token_dispatcher", "alltoall"),
                   grad_bucket_mb=float(getattr(p, "grad_bucket_mb", 25.0)))

    # Derived once per job: the layout search costs thousands of layouts of the same model.
    @functools.cached_property
    def arch(self) -> "Arch":
        return Arch.of(self.model)

    @functools.cached_property
    def params(self) -> "ParamCount":
        return parameter_counts(self.model)


def apply_layout(cfg, layout: Layout):
    """A copy of `cfg` set to run `layout` (its parallel.* keys and train.micro_batch_size)."""
    new = copy.deepcopy(cfg)
    for key, value in layout.parallel_settings().items():
        setattr(new.parallel, key, value)
    new.train.micro_batch_size = layout.micro_batch_size
    return new


@dataclass(frozen=True)
class ParamCount:
    total: int          # every Parameter of the built model, the non-trainable expert_bias included
    trainable: int
    active: int         # used by one token: dense parts, router, shared experts, top_k routed experts
    matmul_active: int  # active params that enter a matmul (FLOPs): no embedding lookup, norms, bias
    embedding: int
    expert: int         # routed-expert weights (all experts)


def parameter_counts(model_cfg) -> ParamCount:
    a = Arch.of(model_cfg)
    h = a.hidden
    embedding = a.vocab * h
    head = 0 if a.tied else a.vocab * h
    total = embedding + head + h                                   # + final norm
    matmul = a.vocab * h                                           # the LM head (tied or not)
    expert = frozen = inactive = 0
    for layer in list(range(a.layers)) + list(a.mtp_layers):
        if layer >= a.layers:   # an MTP depth: enorm, hnorm, final_norm, eh_proj [H, 2H], then its block
            total += 3 * h + 2 * h * h
            matmul += 2 * h * h + a.vocab * h                      # eh_proj and the shared LM head again
        total += a.attention_params + a.attention_norm_params + 2 * h   # + attention_norm, ffn_norm
        matmul += a.attention_params
        if a.is_moe(layer):
            routed = 3 * h * a.expert_ffn * a.experts
            total += a.experts * h + routed + 3 * h * a.shared_ffn + a.experts     # router ... expert_bias
            matmul += a.experts * h + 3 * h * a.expert_ffn * a.top_k + 3 * h * a.shared_ffn
            expert += routed
            frozen += a.experts
            inactive += 3 * h * a.expert_ffn * (a.experts - a.top_k)
        else:
            total += 3 * h * a.ffn
            matmul += 3 * h * a.ffn
    return ParamCount(total=total, trainable=total - frozen, active=total - inactive, matmul_active=matmul,
                      embedding=embedding, expert=expert)


def count_parameters(model_cfg) -> Tuple[int, int]:
    """`(total, active)`; total == `sum(p.size for p in model.get_parameters())` of the built model
    (expert_bias included: it is saved and held in memory, though not trained)."""
    counts = parameter_counts(model_cfg)
    return counts.total, counts.active


def attention_flops_per_token(arch: Arch, seq_length: int) -> float:
    """Training FLOPs of QK^T and AV per token over all layers and MTP blocks: 3 x 2 S a (d_qk + d_v),
    i.e. 12 L a d_head S when d_qk = d_v (the full S x S matrix, as in PaLM's MFU; a causal kernel
    skips half)."""
    return 3 * (arch.layers + arch.mtp_depth) * arch.attention_core_flops(seq_length)


def flops_per_token(model_cfg, seq_length: int) -> float:
    """Model training FLOPs per token: 6 x active matmul params + 12 L (a d_head) S."""
    return 6 * parameter_counts(model_cfg).matmul_active + attention_flops_per_token(Arch.of(model_cfg), seq_length)


def plan_problems(job: Job, layout: Layout, world_size: Optional[int] = None) -> List[str]:
    """Every reason `layout` cannot run `job` (empty when it can): the layout rules
    (`moetrain.layout`) and what the planner itself needs (an optimizer it can cost)."""
    problems = layout_problems(layout, ModelShape.of(job.model), world=world_size,
                               global_batch_size=job.global_batch_size, seq_length=job.seq_length)
    if job.optimizer not in OPTIMIZER_FP32_STATES:
        problems.append(f"optimizer.name {job.optimizer!r} is not one of {sorted(OPTIMIZER_FP32_STATES)}")
    return problems


def validate_plan(job: Job, layout: Layout, world_size: Optional[int] = None) -> None:
    problems = plan_problems(job, layout, world_size)
    if problems:
        raise LayoutError(f"layout {layout.describe()} cannot run:\n  - " + "\n  - ".join(problems))
