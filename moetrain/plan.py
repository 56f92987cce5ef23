"""`moetrain plan`: what a training layout costs, before any device is touched, and the layout search.

    result = plan(cfg, world_size=8, device="ascend910b")   # PlanResult: params, FLOPs, memory, comm, time
    print(format_plan(result))
    layout, search = choose_layout(cfg, world_size=8)       # the fastest layout that fits (parallel.mode: auto)

Everything is closed-form arithmetic on the model config (docs/plan.md has every formula and its
source): parameters exactly as the built model holds them; FLOPs = 6 x active matmul params +
attention; memory per device of the most loaded pipeline stage (weights, gradients, optimizer
states with ZeRO, activations after Korthikanti et al. 2022 adapted to SwiGLU/GQA/MoE, a pipeline
stage's from a walk over its schedule's instruction list); bytes each parallel dimension moves per
step; and a cost model (compute at a sustained fraction of peak, communication at the device
profile's bandwidths, the schedule's bubble at the runtime's pass costs) for step time and MFU.

Rank order assumed for link placement: tensor-parallel ranks innermost, then expert-parallel (a
slice of data parallel), then data parallel, pipeline stages outermost.
"""
from __future__ import annotations

import argparse
import copy
import functools
import itertools
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from moetrain.devices import GiB, DeviceProfile, get_device
from moetrain.layout import RECOMPUTE_MODES, Layout, LayoutError, ModelShape, divisors, layout_problems
from moetrain.parallel import schedules

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
FP32 = 4
OPTIMIZER_FP32_STATES = {"adamw": 2, "adam": 2, "lamb": 2, "momentum": 1, "sgd": 0}
MEMORY_SAFETY = 0.90        # usable = 90 % of (device memory - runtime): fragmentation, workspace peaks
THROUGHPUT_TIE = 0.005      # layouts within 0.5 % of the best throughput count as equally fast
CPU_CONFIG = "configs/moe_tiny_8p.yaml"
# Expert rows per routed assignment of a load-proportional dropless dispatcher: the routed rows
# rounded up to its static buckets / blocks (issue 18 bounds expert_rows / routed at 1.3).
DISPATCH_ROW_MARGIN = 1.1


# --------------------------------------------------------------------------------------------
# What is planned: the model's shape, the training job, the layout
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arch:
    """The shape numbers of a `gpt` / `moe_gpt` model config that the formulas use."""
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

    @classmethod
    def of(cls, model_cfg) -> "Arch":
        required = ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "head_dim")
        missing = [key for key in required if not hasattr(model_cfg, key)]
        if missing:
            raise LayoutError(f"the planner models Llama-style transformers (model.name gpt or moe_gpt); "
                              f"model {getattr(model_cfg, 'name', model_cfg)!r} lacks {', '.join(missing)}")
        arch = dict(vocab=model_cfg.vocab_size, hidden=model_cfg.hidden_size, layers=model_cfg.num_layers,
                    heads=model_cfg.num_heads, kv_heads=model_cfg.num_kv_heads or model_cfg.num_heads,
                    head_dim=model_cfg.head_dim, ffn=model_cfg.ffn_hidden_size, tied=model_cfg.tie_embeddings)
        if getattr(model_cfg, "kv_lora_rank", 0):
            arch.update(value_dim=model_cfg.v_head_dim, q_lora_rank=model_cfg.q_lora_rank,
                        kv_lora_rank=model_cfg.kv_lora_rank, rope_dim=model_cfg.qk_rope_head_dim,
                        mtp_depth=model_cfg.mtp_depth)
        arch["qk_norm"] = getattr(model_cfg, "name", "") == "qwen3_moe"
        moe = getattr(model_cfg, "moe", None)
        if moe is not None:
            arch.update(moe_layers=tuple(model_cfg.moe_layers), experts=moe.num_experts, top_k=moe.top_k,
                        expert_ffn=moe.ffn_hidden_size, shared_ffn=moe.shared_hidden_size,
                        capacity_factor=float(moe.capacity_factor))
        return cls(**arch)

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


@dataclass(frozen=True)
class Job:
    """The training settings, besides the layout, that costs depend on."""
    model: object                     # GPTConfig / MoEGPTConfig
    seq_length: int
    global_batch_size: int            # sequences per optimizer step
    compute_dtype: str = "float32"    # matmul / activation dtype
    grad_dtype: str = "float32"       # dtype gradients are accumulated and reduced in
    optimizer: str = "adamw"

    @classmethod
    def of(cls, cfg) -> "Job":
        return cls(model=cfg.model, seq_length=cfg.data.seq_length or getattr(cfg.model, "seq_length", 0),
                   global_batch_size=cfg.train.global_batch_size, compute_dtype=cfg.precision.compute_dtype,
                   grad_dtype=cfg.parallel.grad_reduce_dtype, optimizer=cfg.optimizer.name)

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


# --------------------------------------------------------------------------------------------
# Parameters and FLOPs
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def plan_problems(job: Job, layout: Layout, world_size: Optional[int] = None) -> List[str]:
    """Every reason `layout` cannot run `job` (empty when it can): the layout rules
    (`moetrain.layout`) and what the planner itself needs (an optimizer it can cost)."""
    problems = layout_problems(layout, ModelShape.of(job.model), world=world_size,
                               global_batch_size=job.global_batch_size, seq_length=job.seq_length)
    if job.optimizer not in OPTIMIZER_FP32_STATES:
        problems.append(f"optimizer.name {job.optimizer!r} is not one of {sorted(OPTIMIZER_FP32_STATES)}")
    if layout.cp > 1:
        problems.append(f"parallel.context_parallel={layout.cp}: the planner and the dry run do not model context "
                        f"parallelism yet (docs/context_parallel.md); plan the layout with context_parallel=1")
    return problems


def validate_plan(job: Job, layout: Layout, world_size: Optional[int] = None) -> None:
    problems = plan_problems(job, layout, world_size)
    if problems:
        raise LayoutError(f"layout {layout.describe()} cannot run:\n  - " + "\n  - ".join(problems))


# --------------------------------------------------------------------------------------------
# Per-stage costs
# --------------------------------------------------------------------------------------------
def chunk_layer_lists(arch: Arch, layout: Layout, stage: int) -> List[List[int]]:
    """The layers of each model chunk of `stage`: chunk c runs virtual stage
    `schedules.virtual_stage(stage, c)`; the MTP blocks run after the stack, with the head."""
    virtual = layout.pp * layout.chunks
    sizes = layout.pipeline_layers or [arch.layers // virtual] * virtual
    bounds = list(itertools.accumulate(sizes, initial=0))
    chunks = []
    for c in range(layout.chunks):
        u = schedules.virtual_stage(layout.schedule, layout.pp, stage, c) if layout.pp > 1 else 0
        chunks.append(list(range(bounds[u], bounds[u + 1])) + (list(arch.mtp_layers) if u == virtual - 1 else []))
    return chunks


def last_stage(layout: Layout) -> int:
    """The stage holding the head and loss: the last (ZB-V: the first, the V's end)."""
    return schedules.stage_of(layout.schedule, layout.pp, layout.pp * layout.chunks - 1)[0] if layout.pp > 1 else 0


def pipeline_in_flight(layout: Layout, stage: int) -> int:
    """The most micro-batch inputs `stage` holds (model chunks' inputs; 1 without pipeline)."""
    if layout.pp == 1:
        return 1
    return schedules.peak_in_flight(schedules.build_schedule(layout.schedule, layout.pp, stage,
                                                             layout.num_micro_batches, layout.chunks))


def pipeline_peak(layout: Layout, stage: int, inputs: Sequence[float], working: Sequence[float], hidden: float,
                  grads: float, buffers: float) -> float:
    """The most `stage` holds above the step's start while it runs its schedule's instruction list,
    as moetrain/parallel/pipeline.py's `PipelineExecutor` keeps tensors (found with the dry run's
    pool record, pass by pass): each chunk input from its forward to its backward (or W);
    `hidden` for every hidden state or gradient received and not yet used, handed over and not yet
    sent, an output gradient kept from B to W, the last chunk's input gradient kept from its
    forward to its B; inside a pass, chunk c's working set `working[c]` (its layers' activations,
    recomputed from the input) and, in a pass that takes parameter gradients (unsplit backward, W,
    the last chunk's forward), the per-parameter gradients `grads` and their packed copy `buffers`
    at its end; between passes, the running gradient sum, with the old sum and the micro-batch's
    packed gradients while they are added. Every schedule is counted by this one walk."""
    kind, P = layout.schedule, layout.pp
    V, split = P * layout.chunks, kind in schedules.SPLIT_BACKWARD
    held = peak = 0.0
    summed = False       # the running gradient sum exists (after the first gradient pass)

    def gradient_pass(c: int) -> None:
        nonlocal peak, summed
        total = buffers if summed else 0.0
        peak = max(peak, held + total + max(working[c], grads + buffers))
        if summed:               # old sum + micro-batch + new sum
            peak = max(peak, held + 3 * buffers)
        summed = True

    for op in schedules.build_schedule(kind, P, stage, layout.num_micro_batches, layout.chunks):
        if op.kind == schedules.EXCHANGE:
            held += hidden * ((op.recv is not None) - (op.send is not None))
            continue
        c = op.chunk
        u = schedules.virtual_stage(kind, P, stage, c)
        first, last = u == 0, u == V - 1
        if op.kind == schedules.FORWARD:
            held += inputs[c] - (0.0 if first else hidden)    # the received activation becomes the input
            if last:
                gradient_pass(c)                            # its whole backward runs in its forward
            held += hidden                                  # output handed over, or the last's input gradient
        elif op.kind == schedules.BACKWARD:
            if last:
                held -= 0.0 if split else inputs[c]
            elif split:                                     # B: the output gradient stays for W
                if not first:
                    peak = max(peak, held + (buffers if summed else 0.0) + working[c] + hidden)
                    held += hidden
            else:
                gradient_pass(c)
                held += (0.0 if first else hidden) - inputs[c] - hidden
        else:                                               # W
            if not last:
                gradient_pass(c)
                held -= hidden
            held -= inputs[c]
    return peak


def pipeline_bubble(layout: Layout, pass_costs: Sequence[Sequence[Tuple[float, float, float]]]) -> float:
    """The idle fraction of the busiest stage when every stage runs its schedule's instruction list
    with its own pass costs (`pass_costs[stage][chunk]`: F, B, W seconds) and exchanges take no
    time: 1 - busiest stage's work / makespan. At equal costs on every stage this is
    `schedules.schedule_bubble`; here the costs are this runtime's (the last virtual stage takes its
    gradients in its forward, a split backward recomputes the forward in B and in W)."""
    index = {schedules.FORWARD: 0, schedules.BACKWARD: 1, schedules.WEIGHT: 2}
    makespan, busy = schedules.run_schedule(layout.schedule, layout.pp, layout.num_micro_batches, layout.chunks,
                                            lambda stage, op: pass_costs[stage][op.chunk][index[op.kind]])
    return 1.0 - max(busy) / makespan


def activation_bytes(arch: Arch, moe: bool, tokens: int, seq_length: int, layout: Layout, dtype_bytes: int,
                     fused: bool = False, exact: bool = False) -> Tuple[float, float]:
    """`(stored, attention_probs)`: bytes one layer keeps for backward for `tokens` tokens of one
    micro-batch, without recompute. Korthikanti et al. (2022) term by term, for this model: fp32
    residual and norms, no dropout, GQA, SwiGLU, MoE. Terms outside the tensor-parallel region
    are split by tp only under sequence parallelism. `fused`: the CPU kernels run
    (`moetrain.kernels`, fp32 compute): the attention kernel keeps no probabilities, and the
    grouped experts and the dense SwiGLU MLP keep gate|up and the SwiGLU output (3 F a row, not 4)."""
    h, d, t = arch.hidden, dtype_bytes, layout.tp
    outside = t if layout.sequence_parallel else 1
    # attention: norm input (fp32) + QKV input; Q, K, V and the output O
    attention = ((FP32 + d) * tokens * h / outside           # Q, K, V, O (MLA: + its latents, whole)
                 + d * tokens * (arch.head_dim * (arch.heads + arch.kv_heads) + arch.v_dim * (arch.heads + arch.kv_heads)) / t
                 + d * tokens * (arch.q_lora_rank + arch.kv_lora_rank + arch.rope_dim))
    probs = 0.0 if fused else d * arch.heads * seq_length * tokens / t   # softmax output, a x S x S per sequence
    if not moe:   # norm input + MLP input, then gate, up, silu(gate), silu(gate) * up (fused: gate|up, the product)
        ffn = (FP32 + d) * tokens * h / outside + (3 if fused else 4) * d * tokens * arch.ffn / t
    else:         # the MoE block sees all tokens (gathered under sequence parallelism); its router is
        # whole on every tp rank; folded, a tp rank dispatches 1/token_slices of the tokens to experts
        # split over etp, into buffers sized from its dp rank's counts (moetrain/moe/capacity.py)
        rows = tokens * arch.routed_rows_per_token(exact)
        ffn = (FP32 * tokens * h / outside + FP32 * tokens * h  # norm input, router input (fp32)
               + 2 * FP32 * tokens * arch.experts               # router logits and probabilities
               + (FP32 + d) * rows * h                          # dispatched rows (fp32, the norm's), expert output
               + (3 if fused else 4) * d * rows * arch.expert_ffn / layout.etp)       # expert SwiGLU
        if arch.shared_ffn:
            ffn += d * tokens * h / outside + 4 * d * tokens * arch.shared_ffn / t
    return attention + ffn, probs


def dispatch_bytes(arch: Arch, tokens: int, layout: Layout, dtype_bytes: int, exact: bool = False) -> float:
    """Token-row buffers of one MoE layer for `tokens` tokens (what `moetrain plan --dry-run`
    measures): the rows the experts read (fp32: the norm's output, moetrain/moe/layer.py) and
    write (compute dtype), and with expert parallelism the exchanges that carry them there and
    back (sent and received: twice each)."""
    rows = tokens * arch.routed_rows_per_token(exact)      # folded: the capacities follow the dp rank's counts
    return rows * arch.hidden * (FP32 + dtype_bytes) * (3 if layout.ep > 1 else 1)


@dataclass
class StageCost:
    stage: int
    layers: int
    params: int                 # parameters held by one device of this stage
    memory: Dict[str, float]    # weights, gradients, optimizer, activations, runtime -> bytes
    activations_by_recompute: Dict[str, float]
    comm_bytes: Dict[str, float]         # per step, per device
    comm_seconds: Dict[str, float]
    compute_seconds_per_micro_batch: float
    comm_seconds_per_micro_batch: float  # tp / sp / ep / pp: on the critical path
    dp_seconds: float                    # gradient sync, overlapped with the last backward
    dispatch_bytes: float = 0.0          # token-row buffers of the stage's MoE layers, one micro-batch
    in_flight: int = 1                   # micro-batch (chunk) inputs held by the pipeline schedule
    in_flight_bytes: float = 0.0         # their bytes (part of the activations)
    pass_costs: List[Tuple[float, float, float]] = field(default_factory=list)   # per chunk: F, B, W seconds

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())


def _bandwidth(device: DeviceProfile, span: int) -> float:
    """A group of consecutive-enough ranks stays on the fast links while it fits in one node."""
    return device.intra_node_bandwidth if span <= device.devices_per_node else device.inter_node_bandwidth


def _stage_cost(job: Job, arch: Arch, layout: Layout, device: DeviceProfile, stage: int,
                chunks: List[List[int]]) -> StageCost:
    """The costs of pipeline stage `stage`, whose model chunks hold the layers `chunks`."""
    L, h, s = layout, arch.hidden, job.seq_length
    layer_ids = sorted(layer for chunk in chunks for layer in chunk)
    t, first, last = L.tp, stage == 0, stage == last_stage(L)
    d = DTYPE_BYTES[job.compute_dtype]
    # What the code holds (measured by `moetrain plan --dry-run`): fp32 parameters, cast to the
    # compute dtype per matmul (moetrain/layers.py); fp32 flat gradient buffers (grad_reduce_dtype
    # is the wire dtype only); fp32 moments, and under ZeRO this rank's fp32 master rows.
    weight_bytes = grad_bytes = FP32
    state_bytes = FP32 * OPTIMIZER_FP32_STATES[job.optimizer] + (FP32 if L.zero >= 1 else 0)
    wire_bytes = DTYPE_BYTES[job.grad_dtype]
    # replicas of an expert slice: ep carved out of dp, or folded over tp x dp = etp x ep x edp
    edp = L.dp * L.tp // (L.etp * L.ep) if L.expert_folded else L.dp // L.ep

    # ---- parameters held by one device of this stage
    dense = expert = frozen = 0.0
    for layer in layer_ids:
        dense += arch.attention_split_params / t + arch.attention_replicated_params + arch.attention_norm_params + 2 * h
        if layer >= arch.layers:                 # MTP depth: its norms and eh_proj
            dense += 3 * h + 2 * h * h
        if arch.is_moe(layer):
            dense += arch.experts * h + 3 * h * arch.shared_ffn / t
            expert += 3 * h * arch.expert_ffn * arch.experts / (L.ep * L.etp)   # unsplit by tp unless etp
            frozen += arch.experts
        else:
            dense += 3 * h * arch.ffn / t
    if first:
        dense += arch.vocab * h / t
    if last:
        dense += h + (arch.vocab * h / t if not arch.tied or L.pp > 1 else 0)
    zero_grads = (L.dp, edp) if L.zero >= 2 else (1, 1)
    zero_states = (L.dp, edp) if L.zero >= 1 else (1, 1)
    memory = {
        "weights": (dense + expert) * weight_bytes + frozen * FP32,
        "gradients": (dense / zero_grads[0] + expert / zero_grads[1]) * grad_bytes,
        "optimizer": (dense / zero_states[0] + expert / zero_states[1]) * state_bytes,
    }

    # ---- activations. Without a pipeline, one micro-batch's activations of every layer (gradient
    # accumulation). With one, the pipeline keeps only each in-flight micro-batch's chunk INPUT and
    # recomputes the chunk in its backward (moetrain/parallel/pipeline.py): `pipeline_peak` walks the
    # schedule's instruction list with one chunk's activations live inside a pass.
    tokens = L.micro_batch_size * s
    in_flight = pipeline_in_flight(L, stage)
    fused = device.name == "cpu" and d == FP32       # moetrain.kernels: CPU only, fp32 compute
    exact = device.name == "cpu" and L.ep == 1     # SortDispatcher's one-row layout (the grouped GEMM kernel)
    outside = t if L.sequence_parallel else 1
    layer_input = FP32 * tokens * h / outside
    if fused and t == 1:      # fused LM head + loss: dh and d(head weight) kept from the forward, no logits
        head, head_grad = FP32 * tokens * h + FP32 * arch.vocab * h, 0.0
    else:                     # fp32 logits and their gradient at the loss (+ both in the compute dtype);
        lower = d if d < FP32 else 0      # once a step, the head weight's gradient (measured at moe_1b width)
        head = (2 * FP32 + 2 * lower) * tokens * arch.vocab / t
        head_grad = (FP32 + lower) * arch.vocab * h / t if last else 0.0
    logits = (head + (FP32 + d) * tokens * h / outside) * (1 + arch.mtp_depth)
    # Besides: the compute-dtype copies of the weights (the matmuls' saved inputs; under full
    # recompute only the recomputed layer's). The backward's per-parameter gradients add nothing
    # at the peak without a pipeline (measured): each layer's appear as its saved activations are freed.
    cast_bytes = d * (dense + expert) if d < FP32 else 0.0

    def by_recompute(layers: List[int], extra: float) -> Dict[str, float]:
        """One micro-batch's activations of `layers` per recompute mode, + `extra`."""
        per_layer = [activation_bytes(arch, arch.is_moe(i), tokens, s, L, d, fused, exact) for i in layers]
        working_set = max((stored + probs for stored, probs in per_layer), default=0.0)
        casts = cast_bytes * len(layers) / max(1, len(layer_ids))
        return {"none": sum(stored + probs for stored, probs in per_layer) + casts + extra,
                "selective": sum(stored for stored, _ in per_layer) + casts + extra,
                "full": layer_input * len(layers) + working_set + casts / max(1, len(layers)) + extra}

    if L.pp == 1:
        by_mode, stage_inputs = by_recompute(layer_ids, (logits + head_grad) if last else 0.0), 0.0
    else:
        V = L.pp * L.chunks
        vstages = [schedules.virtual_stage(L.schedule, L.pp, stage, c) for c in range(L.chunks)]
        inputs = [4.0 * tokens if u == 0 else layer_input for u in vstages]     # token ids on the first
        working = [by_recompute(layers, logits if u == V - 1 else 0.0) for layers, u in zip(chunks, vstages)]
        stage_inputs = in_flight * max(inputs)
        by_mode = {mode: pipeline_peak(L, stage, inputs, [w[mode] for w in working], layer_input,
                                       FP32 * (dense + expert), memory["gradients"]) - memory["gradients"]
                   for mode in RECOMPUTE_MODES}
    memory["activations"] = by_mode[L.recompute]
    memory["runtime"] = device.runtime_bytes

    # ---- compute per micro-batch (hardware FLOPs: recompute adds forward work). Routers are whole
    # on every tp rank, and so are the routed experts unless folded (then a tp rank computes
    # 1/token_slices of the rows on 1/etp of the FFN: 1/tp of the work). The pipeline
    # (moetrain/parallel/pipeline.py) recomputes a chunk's forward in its backward, except on the
    # last virtual stage, whose forward takes its gradients at once; a split backward (zero-bubble)
    # is two compiled passes that each recompute the forward: B (input gradient) and W (weight
    # gradient, which also back-propagates through the chunk), so a chunk between the first and
    # the last virtual stage computes one forward and one input gradient more (the first one's B is
    # empty: token ids need no gradient). `pass_costs`: (F, B, W) seconds of each chunk's passes.
    peak = device.peak(job.compute_dtype) / (L.world if device.shared_host else 1)
    per_flop = tokens / (peak * device.compute_efficiency)
    V = L.pp * L.chunks
    split_backward = L.pp > 1 and L.schedule in schedules.SPLIT_BACKWARD
    compute, pass_costs = 0.0, []
    for c, layers in enumerate(chunks):
        u = schedules.virtual_stage(L.schedule, L.pp, stage, c) if L.pp > 1 else 0
        input_gradient_again = split_backward and 0 < u < V - 1
        forward = tp_flops = whole = 0.0
        for layer in layers:
            moe = arch.is_moe(layer)
            matmul = arch.attention_params + (3 * h * arch.shared_ffn if moe else 3 * h * arch.ffn)
            routed = arch.experts * h + 3 * h * arch.expert_ffn * arch.top_k / (L.token_slices * L.etp) if moe else 0
            if layer >= arch.layers:                 # MTP depth: eh_proj and the LM head once more
                matmul += 2 * h * h + arch.vocab * h
            attention = arch.attention_core_flops(s)           # forward QK^T and AV per token
            forwards = 1 + (L.recompute == "full") + (L.pp > 1 and u < V - 1) + input_gradient_again
            again = 2 * input_gradient_again                  # the input gradient once more (matmuls x2, core x2)
            tp_flops += (4 + 2 * forwards + again) * matmul + (2 + forwards + again) * attention
            whole += (4 + 2 * forwards + again) * routed
            forward += 2 * matmul / t + attention / t + 2 * routed
            if L.recompute == "selective":
                tp_flops += attention
        if u == V - 1:
            tp_flops += 6 * arch.vocab * h
            forward += 2 * arch.vocab * h / t
        total = (tp_flops / t + whole) * per_flop
        forward *= per_flop
        compute += total
        if L.pp == 1 or u == V - 1:          # the last virtual stage: all in its forward
            pass_costs.append((total, 0.0, 0.0))
        elif not split_backward:
            pass_costs.append((forward, total - forward, 0.0))
        else:                                # B: a forward and an input gradient (about a forward's FLOPs)
            backward_input = 2 * forward if u > 0 else 0.0
            pass_costs.append((forward, backward_input, total - forward - backward_input))

    # ---- communication (bytes per device)
    # Emulated on CPU by an all-reduce of a buffer with one slot per rank (moetrain/dist/comm.py):
    # all-gather and reduce-scatter move 2x the native bytes, all-to-all 2 x ep x.
    gather_factor = 2 if device.emulated_collectives else 1
    a2a_factor = 2 * L.ep if device.emulated_collectives else 1
    full = L.recompute == "full"
    per_mb = {"tp": 0.0, "sp": 0.0, "ep": 0.0, "pp": 0.0}
    if t > 1:
        collectives = len(layer_ids) * (10 + 4 * full if L.sequence_parallel else 4 + 2 * full) + first + last
        size = tokens * h * d
        if L.sequence_parallel:        # all-gathers / reduce-scatters of the sequence shards
            per_mb["sp"] = collectives * (t - 1) / t * size * gather_factor
        else:                          # all-reduces of the row-parallel outputs and column-parallel input grads
            per_mb["tp"] = collectives * 2 * (t - 1) / t * size
    moe_layers = sum(arch.is_moe(i) for i in layer_ids)
    if L.ep > 1:   # folded: a slice's buffers are sized from its dp rank's counts (moetrain/moe/capacity.py)
        rows = tokens * arch.routed_rows_per_token()
        per_mb["ep"] = moe_layers * (4 + 2 * full) * (L.ep - 1) / L.ep * rows * h * d * a2a_factor
    if L.token_slices > 1:   # folded: the slices' outputs all-gathered over tp_tokens (backward: the gradients)
        n = L.token_slices
        per_mb["tp"] += moe_layers * (2 + full) * (n - 1) / n * tokens * h * d * gather_factor
    if L.etp > 1:            # the experts' partial outputs all-reduced over etp, their input gradients too
        rows = tokens * arch.routed_rows_per_token()
        per_mb["tp"] += moe_layers * (2 + full) * 2 * (L.etp - 1) / L.etp * rows * h * d
    sends = schedules.sends_per_micro_batch(L.schedule, L.pp, stage, L.chunks) if L.pp > 1 else 0
    if L.pp > 1:
        # activations forward, gradients backward, at every chunk boundary that crosses to another stage
        per_mb["pp"] = sends * layer_input
    spans = {"tp": t, "sp": t, "ep": L.etp * L.ep if L.expert_folded else t * L.ep, "pp": L.world}
    comm_bytes = {dim: per_mb[dim] * L.num_micro_batches for dim in per_mb}
    comm_seconds = {dim: comm_bytes[dim] / _bandwidth(device, spans[dim]) for dim in per_mb}
    # each exchange also costs a fixed latency, whatever its size: what more chunks a stage pay
    comm_seconds["pp"] += sends * L.num_micro_batches * device.p2p_latency

    def sync_bytes(params: float, group: int) -> float:
        if group == 1:
            return 0.0
        if L.zero == 0:
            return 2 * (group - 1) / group * params * wire_bytes
        return (group - 1) / group * params * (wire_bytes + weight_bytes) * gather_factor
    dense_sync, expert_sync = sync_bytes(dense, L.dp), sync_bytes(expert, edp)
    comm_bytes["dp"] = dense_sync + expert_sync
    dp_seconds = (dense_sync + expert_sync) / _bandwidth(device, t * L.dp)
    comm_seconds["dp"] = dp_seconds
    return StageCost(stage=stage, layers=len(layer_ids), params=int(dense + expert + frozen), memory=memory,
                     in_flight=in_flight, in_flight_bytes=stage_inputs,
                     dispatch_bytes=sum(arch.is_moe(i) for i in layer_ids) * dispatch_bytes(arch, tokens, L, d, exact),
                     activations_by_recompute=by_mode, comm_bytes=comm_bytes, comm_seconds=comm_seconds,
                     compute_seconds_per_micro_batch=compute, pass_costs=pass_costs,
                     comm_seconds_per_micro_batch=sum(comm_seconds[dim] for dim in per_mb) / L.num_micro_batches,
                     dp_seconds=dp_seconds)


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------
@dataclass
class PlanResult:
    job: Job
    layout: Layout
    device: DeviceProfile
    params: ParamCount
    model_flops_per_token: float
    hardware_flops_per_token: float      # with recompute
    tokens_per_step: int
    stages: List[StageCost]
    peak_stage: int                      # the most loaded stage (memory)
    capacity_bytes: float                # device memory per rank
    usable_bytes: float                  # what the plan may fill: (capacity - runtime) x MEMORY_SAFETY
    step_seconds: float
    compute_seconds: float               # step = compute + bubble + exposed communication
    bubble_seconds: float
    exposed_comm_seconds: float
    tokens_per_second: float
    mfu: float
    source: str = ""
    notes: List[str] = field(default_factory=list)
    bubble_fraction: float = 0.0         # the schedule's idle fraction (moetrain.parallel.schedules)

    @property
    def memory(self) -> Dict[str, float]:
        return self.stages[self.peak_stage].memory

    @property
    def total_memory(self) -> float:
        return self.stages[self.peak_stage].total_memory

    @property
    def fits(self) -> bool:
        return self.total_memory - self.device.runtime_bytes <= self.usable_bytes

    @property
    def comm_bytes(self) -> Dict[str, float]:
        """Per dimension, the most any device moves per step."""
        return {dim: max(stage.comm_bytes[dim] for stage in self.stages) for dim in self.stages[0].comm_bytes}

    @property
    def comm_seconds(self) -> Dict[str, float]:
        return {dim: max(stage.comm_seconds[dim] for stage in self.stages) for dim in self.stages[0].comm_seconds}

    @property
    def total_comm_bytes(self) -> float:
        return sum(self.comm_bytes.values())


def plan_layout(job: Job, layout: Layout, device: Union[str, DeviceProfile] = "cpu", world_size=None,
                source: str = "") -> PlanResult:
    """Plan `job` on `layout`; raises LayoutError if the layout is invalid."""
    validate_plan(job, layout, world_size)
    return _plan_valid_layout(job, layout, get_device(device), source)


def _plan_valid_layout(job: Job, layout: Layout, device: DeviceProfile, source: str = "") -> PlanResult:
    arch = job.arch
    stages = [_stage_cost(job, arch, layout, device, i, chunk_layer_lists(arch, layout, i))
              for i in range(layout.pp)]
    peak_stage = max(range(len(stages)), key=lambda i: stages[i].total_memory)
    capacity = device.memory_bytes / (layout.world if device.shared_host else 1)
    usable = (capacity - device.runtime_bytes) * MEMORY_SAFETY

    # The slowest stage paces the pipeline: m micro-batch slots of work, and the schedule's idle
    # fraction at this runtime's pass costs (`pipeline_bubble`; 1F1B at pp 2: (pp - 1) / (m + pp - 1)).
    pacing = max(stages, key=lambda st: st.compute_seconds_per_micro_batch + st.comm_seconds_per_micro_batch)
    per_micro = pacing.compute_seconds_per_micro_batch
    slot = per_micro + pacing.comm_seconds_per_micro_batch
    bubble_fraction = pipeline_bubble(layout, [st.pass_costs for st in stages]) if layout.pp > 1 else 0.0
    # Gradient sync overlaps the backward (~2/3 of the compute) of the last micro-batch.
    exposed_dp = max(max(0.0, st.dp_seconds - 2 / 3 * st.compute_seconds_per_micro_batch) for st in stages)
    busy = layout.num_micro_batches * slot
    bubble = busy * bubble_fraction / (1 - bubble_fraction)
    step = busy + bubble + exposed_dp
    compute = layout.num_micro_batches * per_micro

    params = job.params
    attention = attention_flops_per_token(arch, job.seq_length)
    model_flops = 6 * params.matmul_active + attention
    extra = {"none": 0.0, "selective": attention / 3,
             "full": 2 * (params.matmul_active - arch.vocab * arch.hidden) + attention / 3}[layout.recompute]
    tokens = job.global_batch_size * job.seq_length
    peak_total = device.peak(job.compute_dtype) * (1 if device.shared_host else layout.world)
    notes = []
    if arch.moe_layers:
        notes.append("MoE costs assume balanced routing (every expert gets top_k x tokens / experts)")
    if device.shared_host:
        notes.append(f"all {layout.world} ranks share one host: memory and FLOP/s per rank are the host's / "
                     f"{layout.world}")
    return PlanResult(job=job, layout=layout, device=device, params=params, model_flops_per_token=model_flops,
                      hardware_flops_per_token=model_flops + extra, tokens_per_step=tokens, stages=stages,
                      peak_stage=peak_stage, capacity_bytes=capacity, usable_bytes=usable, step_seconds=step,
                      compute_seconds=compute, bubble_seconds=bubble, exposed_comm_seconds=step - compute - bubble,
                      bubble_fraction=bubble_fraction,
                      tokens_per_second=tokens / step, mfu=model_flops * tokens / step / peak_total,
                      source=source, notes=notes)


def load_plan_config(path: str, overrides: Sequence[str] = ()):
    """The config to plan (`load_config`; kept as the planner's entry point)."""
    from moetrain.config import load_config

    return load_config(path, overrides)


def _device_of(cfg, device) -> DeviceProfile:
    return get_device(device if device is not None else cfg.train.device)


def plan(cfg, world_size: Optional[int] = None, device=None) -> PlanResult:
    """Plan the layout `cfg` names (or, with `parallel.mode: auto`, the one `choose_layout` picks)
    on `world_size` devices (default: dp x tp x pp of the config) of `device` (default: train.device)."""
    if cfg.parallel.mode == "auto":
        world = world_size or cfg.parallel.data_parallel * cfg.parallel.model_parallel * cfg.parallel.pipeline_stage
        return choose_layout(cfg, world, device)[1].chosen
    return plan_layout(Job.of(cfg), Layout.of(cfg), _device_of(cfg, device), world_size, source=cfg.source)


# --------------------------------------------------------------------------------------------
# Layout search (the counterpart of MindSpore's AUTO_PARALLEL cost-model search)
# --------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    layout: Layout
    status: str                  # chosen | invalid | does not fit | slower
    reason: str
    result: Optional[PlanResult] = None
    problems: List[str] = field(default_factory=list)     # of an invalid candidate


@dataclass
class LayoutSearch:
    world_size: int
    device: DeviceProfile
    chosen: PlanResult
    candidates: List[Candidate]

    def with_status(self, status: str) -> List[Candidate]:
        return [c for c in self.candidates if c.status == status]

    def __str__(self) -> str:
        return format_search(self)


def pipeline_schedules(arch: Arch, pp: int, num_micro_batches: int) -> List[Tuple[str, int]]:
    """`(schedule, pp_interleave_num)` pairs the search tries: 1F1B, and with pipeline stages
    ZB-H1, plus, where the layers split evenly into 2·pp virtual stages, ZB-V (two chunks in a V)
    and interleaved 1F1B of two chunks a stage if the micro-batches come in groups of pp
    (moetrain/layout.py)."""
    if pp == 1:
        return [("1f1b", 1)]
    tried = [("1f1b", 1), ("zero_bubble_h1", 1)]
    if arch.layers % (2 * pp) == 0:
        tried += [("interleaved_1f1b", 2)] if num_micro_batches % pp == 0 else []
        tried += [("zero_bubble_v", 1)]
    return tried


def candidate_layouts(job: Job, world_size: int) -> List[Layout]:
    """Every dp x tp x pp = world, ep, micro-batching, ZeRO level, recompute, sequence-parallel
    and pipeline-schedule combination worth costing (ZeRO levels are all the same layout when
    dp = 1)."""
    arch = job.arch
    layouts = []
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            eps = divisors(world_size) if arch.moe_layers else [1]
            per_rank = job.global_batch_size // dp if job.global_batch_size % dp == 0 else 1
            etps = divisors(tp) if arch.moe_layers else [1]
            for etp, ep, count, zero, recompute, sp in itertools.product(
                    etps, eps, divisors(per_rank), (0, 1, 2) if dp > 1 else (0,),
                    RECOMPUTE_MODES, (False, True) if tp > 1 else (False,)):
                if (dp * tp // etp) % ep:      # ep up to dp x tp / etp (MoE folding, moetrain/layout.py)
                    continue
                for schedule, interleave in pipeline_schedules(arch, pp, count):
                    layouts.append(Layout(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp,
                                          micro_batch_size=max(1, per_rank // count), num_micro_batches=count,
                                          zero=zero, recompute=recompute, sequence_parallel=sp,
                                          schedule=schedule, interleave=interleave))
    return layouts


def _tie_key(result: PlanResult):
    L = result.layout
    return (result.total_comm_bytes, L.zero, RECOMPUTE_MODES.index(L.recompute), L.tp, L.pp,
            L.sequence_parallel, -L.micro_batch_size, L.ep, L.etp, L.chunks, L.schedule in schedules.SPLIT_BACKWARD)


def choose_layout(cfg, world_size: int, device=None) -> Tuple[Dict[str, object], LayoutSearch]:
    """The fastest valid layout of `cfg`'s model and batch on `world_size` devices that fits in
    memory (ties within 0.5 %: less communication, then the simpler layout). Returns its
    `parallel.*` settings (apply them with `apply_layout`, which also sets train.micro_batch_size)
    and the search report, which lists every rejected candidate and why."""
    device = _device_of(cfg, device)
    job = Job.of(cfg)
    candidates, fitting = [], []
    for layout in candidate_layouts(job, world_size):
        problems = plan_problems(job, layout, world_size)
        if problems:
            candidates.append(Candidate(layout, "invalid", " | ".join(problems), problems=problems))
            continue
        result = _plan_valid_layout(job, layout, device, source=cfg.source)
        if not result.fits:
            need = result.total_memory - device.runtime_bytes
            candidates.append(Candidate(layout, "does not fit", f"{need / GiB:.2f} GiB > "
                                        f"{result.usable_bytes / GiB:.2f} GiB usable", result))
            continue
        fitting.append(result)
    if not fitting:
        unfit = [c for c in candidates if c.result is not None]
        if not unfit:
            raise LayoutError(f"no layout of {world_size} devices is valid for this model and batch; e.g. "
                              f"{candidates[0].layout.describe()}: {candidates[0].reason}")
        smallest = min(unfit, key=lambda c: c.result.total_memory)
        raise LayoutError(f"no layout of {world_size} x {device.name} fits in memory; the smallest, "
                          f"{smallest.layout.describe()}, needs {smallest.reason}: use more devices, a smaller "
                          f"micro-batch or sequence, or a smaller model")
    best_speed = max(r.tokens_per_second for r in fitting)
    near = [r for r in fitting if r.tokens_per_second >= best_speed * (1 - THROUGHPUT_TIE)]
    chosen = min(near, key=_tie_key)
    tied = {id(r) for r in near}
    for result in fitting:
        if result is chosen:
            candidates.append(Candidate(result.layout, "chosen", "fastest that fits", result))
        elif id(result) in tied:
            candidates.append(Candidate(result.layout, "slower", f"as fast within {THROUGHPUT_TIE:.1%} "
                                        f"({result.tokens_per_second:,.0f} tokens/s) but more communication or "
                                        f"a more complex layout", result))
        else:
            candidates.append(Candidate(result.layout, "slower", f"{result.tokens_per_second:,.0f} tokens/s < "
                                        f"{chosen.tokens_per_second:,.0f}", result))
    return chosen.layout.parallel_settings(), LayoutSearch(world_size, device, chosen, candidates)


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------
def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def _flops(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}FLOP"
    return f"{n:.0f} FLOP"


def _gib(n: float) -> str:
    """Fixed-width bytes: GiB, or MiB / KiB for the tiny models."""
    for unit, scale in (("GiB", GiB), ("MiB", 1024 ** 2)):
        if n >= 0.1 * scale or unit == "MiB" and n >= 0.1 * 1024:
            return f"{n / scale:8.2f} {unit}"
    return f"{n / 1024:8.2f} KiB"


def format_plan(result: PlanResult) -> str:
    r, L, a, job, dev = result, result.layout, result.job.arch, result.job, result.device
    p = r.params
    d = DTYPE_BYTES[job.compute_dtype]
    by_mode = r.stages[r.peak_stage].activations_by_recompute
    states = {2: "m+v", 1: "momentum", 0: "no states"}[OPTIMIZER_FP32_STATES[job.optimizer]]
    rule = "-" * 92
    lines = [f"moetrain plan{': ' + r.source if r.source else ''} on {L.world} x {dev.name} ({dev.description})",
             rule,
             f" model        {getattr(job.model, 'name', '?')}: {a.layers} layers, hidden {a.hidden}, {a.heads} heads "
             f"({a.kv_heads} kv, head_dim {a.head_dim}), ffn {a.ffn}, vocab {a.vocab}, seq {job.seq_length}"
             f"{', tied embeddings' if a.tied else ''}"]
    if a.kv_lora_rank:
        lines.append(f"              MLA: q_lora {a.q_lora_rank or 'none'}, kv_lora {a.kv_lora_rank}, q/k head "
                     f"{a.head_dim - a.rope_dim} + rope {a.rope_dim}, v head {a.v_dim}"
                     + (f"; MTP depth {a.mtp_depth} (one MoE block each, after the stack)" if a.mtp_depth else ""))
    if a.moe_layers:
        shared = f", shared ffn {a.shared_ffn}" if a.shared_ffn else ""
        capacity = f", capacity factor {a.capacity_factor:g}" if a.capacity_factor else ", dropless"
        lines.append(f"              MoE: {len(a.moe_layers)} of {a.layers} layers, {a.experts} experts top-{a.top_k}, "
                     f"expert ffn {a.expert_ffn}{shared}{capacity}")
    lines += [
        f" layout       dp {L.dp} x tp {L.tp} x pp {L.pp} = {L.world} devices; ep {L.ep}"
        + (f" ({a.experts // L.ep} experts/device)" if a.moe_layers else "")
        + (f", etp {L.etp} (1/{L.etp} of each expert's ffn)" if L.etp > 1 else "")
        + f"; ZeRO-{L.zero}; recompute {L.recompute}; sequence parallel {'on' if L.sequence_parallel else 'off'}"
        + (f"; {L.schedule}" if L.pp > 1 else ""),
        f" batch        {job.global_batch_size} sequences x {job.seq_length} = {r.tokens_per_step:,} tokens/step; "
        f"{L.num_micro_batches} micro-batch(es) of {L.micro_batch_size} per dp rank; {job.compute_dtype} compute",
        rule,
        f" parameters   total {_count(p.total)} ({p.total:,}; trainable {p.trainable:,}); active per token "
        f"{_count(p.active)} ({p.active / p.total:.1%}); per device {_count(r.stages[r.peak_stage].params)}",
        f" FLOPs/token  {_flops(r.model_flops_per_token)} = 6 x {_count(p.matmul_active)} active matmul params "
        f"+ 6 (L{' + MTP' if a.mtp_depth else ''}) a (d_qk + d_v) S = {_flops(attention_flops_per_token(a, job.seq_length))}; "
        f"with recompute "
        f"{_flops(r.hardware_flops_per_token)}",
        rule,
        f" memory per device, stage {r.peak_stage} of {L.pp} (the most loaded)",
        f"   weights (fp32{', cast to ' + job.compute_dtype + ' per matmul' if d < FP32 else ''})".ljust(56)
        + _gib(r.memory["weights"]),
        f"   gradients (fp32 buffers{', ZeRO-2' if L.zero >= 2 else ''}; {job.grad_dtype} on the wire)".ljust(56)
        + _gib(r.memory["gradients"]),
        f"   optimizer ({job.optimizer}: fp32 {states}{' + master' if L.zero >= 1 else ''}, ZeRO-{L.zero})".ljust(56)
        + _gib(r.memory["optimizer"]),
        f"   activations (recompute {L.recompute})".ljust(56) + _gib(r.memory["activations"])
        + "    [" + ", ".join(f"{mode} {_gib(by_mode[mode]).strip()}" for mode in RECOMPUTE_MODES) + "]",
        *([f"     of which {r.stages[r.peak_stage].in_flight} pipeline input(s) in flight".ljust(56)
           + _gib(r.stages[r.peak_stage].in_flight_bytes)] if L.pp > 1 else []),
        f"   runtime (framework, workspace)".ljust(56) + _gib(r.memory["runtime"]),
        f"   total".ljust(56) + _gib(r.total_memory)
        + f"    of {r.capacity_bytes / GiB:.2f} GiB: {'FITS' if r.fits else 'DOES NOT FIT'} (usable "
        f"{r.usable_bytes / GiB:.2f} GiB = {MEMORY_SAFETY:.0%} of what the runtime leaves)",
        rule,
        f" communication per step per device".ljust(56) + "  volume        time   link",
    ]
    names = {"dp": f"dp gradients ({'all-reduce' if L.zero == 0 else 'ZeRO reduce-scatter + all-gather'})",
             "tp": "tp all-reduces", "sp": "sp all-gather / reduce-scatter", "pp": "pp activations p2p",
             "ep": "ep all-to-all (dispatch + combine)"}
    spans = {"dp": L.tp * L.dp, "tp": L.tp, "sp": L.tp, "pp": L.world,
             "ep": L.etp * L.ep if L.expert_folded else L.tp * L.ep}
    for dim in ("dp", "tp", "sp", "pp", "ep"):
        volume = r.comm_bytes[dim]
        link = "intra-node" if spans[dim] <= dev.devices_per_node else "inter-node"
        lines.append(f"   {names[dim]}".ljust(56) + (f"{_gib(volume)} {r.comm_seconds[dim]:9.3f} s   {link}"
                                                         if volume else "       -"))
    lines += [
        rule,
        f" step time    {r.step_seconds:.3f} s = compute {r.compute_seconds:.3f} s + pipeline "
        f"bubble {r.bubble_seconds:.3f} s + exposed communication {r.exposed_comm_seconds:.3f} s",
        *([f" pipeline     {L.schedule}" + (f", {L.chunks} model chunks per stage" if L.chunks > 1 else "")
           + f": bubble {r.bubble_fraction:.1%} of the busiest stage's time at this runtime's pass costs; inputs in "
           f"flight per stage {[st.in_flight for st in r.stages]}"] if L.pp > 1 else []),
        f" throughput   {r.tokens_per_second:,.0f} tokens/s ({r.tokens_per_second / L.world:,.0f} per device); "
        f"MFU {r.mfu:.1%} (cost model: {dev.compute_efficiency:.0%} of {dev.peak(job.compute_dtype) / 1e12:g} "
        f"TFLOP/s sustained)",
    ]
    lines += [f" note         {note}" for note in r.notes]
    return "\n".join(lines)


def format_search(search: LayoutSearch, show: int = 8) -> str:
    chosen = search.chosen
    lines = [f"layout search: {len(search.candidates)} candidates on {search.world_size} x {search.device.name}",
             f"  chosen       {chosen.layout.describe()}: {chosen.tokens_per_second:,.0f} tokens/s, "
             f"MFU {chosen.mfu:.1%}, {chosen.total_memory / GiB:.2f} GiB of {chosen.capacity_bytes / GiB:.2f}"]
    for status in ("slower", "does not fit", "invalid"):
        group = search.with_status(status)
        if status == "slower":
            group.sort(key=lambda c: -c.result.tokens_per_second)
        elif status == "does not fit":
            group.sort(key=lambda c: c.result.total_memory)
        lines.append(f"  {status}: {len(group)}")
        if status == "invalid":       # one line per kind of reason (numbers aside), with an example
            by_kind: Dict[str, List[str]] = {}
            for c in group:
                for reason in c.problems:
                    by_kind.setdefault(re.sub(r"\d+", "#", reason), []).append(reason)
            for reasons in sorted(by_kind.values(), key=len, reverse=True)[:show]:
                text = reasons[0] if len(reasons[0]) <= 120 else reasons[0][:117] + "..."
                lines.append(f"    {len(reasons):5d} x {text}")
            continue
        for c in group[:show]:
            lines.append(f"    {c.layout.describe():<58} {c.reason}")
        if len(group) > show:
            lines.append(f"    ... {len(group) - show} more")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Entry points for the launcher and the CLI
# --------------------------------------------------------------------------------------------
def device_available(backend: str) -> bool:
    """Whether this machine has the `train.device` backend (without importing MindSpore)."""
    if backend == "cpu":
        return True
    if backend == "ascend":
        return bool(os.environ.get("ASCEND_HOME_PATH")) or shutil.which("npu-smi") is not None
    if backend == "gpu":
        return shutil.which("nvidia-smi") is not None
    return False


def explain_cannot_run_here(cfg) -> Optional[str]:
    """None when this machine has `cfg`'s device; otherwise the plan of the config and why it
    cannot start here (the launcher prints it instead of starting workers)."""
    backend = cfg.train.device
    if device_available(backend):
        return None
    try:
        table = format_plan(plan(cfg))
    except (LayoutError, ValueError) as exc:
        table = f"(no plan: {exc})"
    probe = {"ascend": "no ASCEND_HOME_PATH and no npu-smi", "gpu": "no nvidia-smi"}.get(backend, "unknown device")
    return (f"{table}\n\n{cfg.source or 'this config'} is laid out for train.device: {backend}, which this "
            f"machine does not have ({probe}); the plan above is what it would cost there. To train on this "
            f"CPU machine use {CPU_CONFIG}.")


def main(argv=None) -> int:
    """`moetrain plan CONFIG [--world N] [--device NAME] [--search] [--set K=V ...]`.
    Exit status: 0 fits, 1 does not fit, 2 bad config or layout."""
    from moetrain.config import ConfigError

    ap = argparse.ArgumentParser(prog="moetrain plan", description="parameters, FLOPs, memory, communication "
                                 "and step time of a config's layout; --search picks the best layout")
    ap.add_argument("config")
    ap.add_argument("--world", type=int, default=None, help="number of devices (default: dp x tp x pp of the config)")
    ap.add_argument("--device", default=None, help="device profile: ascend910b, gpu_a100, gpu_h100, cpu "
                    "(default: from train.device)")
    ap.add_argument("--search", action="store_true", help="search the layouts of --world devices")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    dry = ap.add_argument_group("dry run (moetrain/dryrun.py): one rank built and run on this CPU, measured")
    dry.add_argument("--dry-run", action="store_true", help="build rank --rank of the layout at full width, run "
                     "one step, print planned against measured bytes per category")
    dry.add_argument("--rank", type=int, default=0, help="the rank to build (default 0)")
    dry.add_argument("--json", action="store_true", help="with --dry-run: one JSON object (planned, measured)")
    dry.add_argument("--seq", type=int, default=None, help="with --dry-run: run this many tokens per sequence "
                     "(default: the config's, shortened to fit this machine)")
    dry.add_argument("--layers", type=int, default=None, help="with --dry-run: build the first N layers at full "
                     "width (default: all, fewer where the plan is over 2 GiB); planned is for the same model")
    args = ap.parse_args(argv)
    try:
        cfg = load_plan_config(args.config, args.set)
        if args.world and cfg.parallel.data_parallel_inferred:   # as a launch of --world processes would
            from moetrain.config import infer_data_parallel

            infer_data_parallel(cfg, cfg.source, args.world)
        if args.dry_run:
            from moetrain.dryrun import dry_run, format_dry_run

            result = dry_run(cfg, args.rank, args.seq, layers=args.layers)
            print(result.to_json() if args.json else format_dry_run(result))
            return 0
        if args.search:
            world = args.world or cfg.parallel.data_parallel * cfg.parallel.model_parallel * cfg.parallel.pipeline_stage
            _, search = choose_layout(cfg, world, args.device)
            print(format_search(search))
            print()
            result = search.chosen
        else:
            result = plan(cfg, args.world, args.device)
        print(format_plan(result))
    except (ConfigError, LayoutError, ValueError) as exc:
        print(f"moetrain plan: {exc}", file=sys.stderr)
        return 2
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
