"""What a layout costs, per pipeline stage and for the whole step: memory per device (weights,
gradients, optimizer states with ZeRO, activations after Korthikanti et al. 2022 adapted to
SwiGLU/GQA/MoE), bytes each parallel dimension moves, and the step time and MFU of the cost model
(docs/plan.md has every formula and its source).

Rank order assumed for link placement: tensor-parallel ranks innermost, then expert-parallel (a
slice of data parallel), then data parallel, pipeline stages outermost."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Tuple, Union

from moetrain.devices import DeviceProfile, get_device
from moetrain.layout import RECOMPUTE_MODES, Layout
from moetrain.moe.sizing import sized
from moetrain.parallel import schedules
from moetrain.planner import context
from moetrain.planner.arch import (DTYPE_BYTES, FP32, OPTIMIZER_FP32_STATES, Arch, Job, ParamCount,
                                   attention_flops_per_token, validate_plan)
from moetrain.planner.constants import constant
from moetrain.planner.schedule import last_stage, pipeline_bubble, pipeline_in_flight, pipeline_peak, chunk_layer_lists

MEMORY_SAFETY = 0.90        # usable = 90 % of (device memory - runtime): fragmentation, workspace peaks


def activation_bytes(arch: Arch, moe: bool, tokens: int, seq_length: int, layout: Layout, dtype_bytes: int,
                     fused: bool = False, exact: bool = False, rows: float = None,
                     container_bytes: int = None) -> Tuple[float, float, float]:
    """`(stored, attention_probs, expert_inner)`: bytes one layer keeps for backward for `tokens`
    tokens of one micro-batch, without recompute; `expert_inner` is the part of `stored` inside the
    routed experts (their SwiGLU intermediates), which the trainer's selective recompute drops when
    the family's plan recomputes `moe.experts` (its input rows and output stay: the cell's boundary). Korthikanti et al. (2022) term by term, for this model: fp32
    residual and norms, no dropout, GQA, SwiGLU, MoE. Terms outside the tensor-parallel region
    are split by tp only under sequence parallelism. `fused`: the CPU kernels run
    (`moetrain.kernels`, fp32 compute): the attention kernel keeps no probabilities, and the
    grouped experts and the dense SwiGLU MLP keep gate|up and the SwiGLU output (3 F a row, not 4).
    `rows`: the rows of the experts' buffers when known (`dispatch_rows`), else routed x margin.
    `container_bytes` (bf16 on the CPU kernels, docs/precision.md; `dtype_bytes` is then fp32's, the
    bf16 values the kernels hold in fp32 tensors): the bytes of what they store as 2-byte bf16
    containers instead, the SwiGLU activations: the routed experts' token rows, gate|up and product,
    and the dense (or shared) MLP's input, gate|up and product where its projections are whole (tp 1)."""
    h, d, t = arch.hidden, dtype_bytes, layout.tp
    c = mlp = d       # the routed experts' SwiGLU activations; a dense (or shared) MLP's input and SwiGLU's
    rows_in = FP32    # the dispatched rows: the norm's output
    if container_bytes is not None:
        rows_in = c = container_bytes
        mlp = container_bytes if t == 1 else d
    outside = t if layout.sequence_parallel else 1
    # attention: norm input (fp32) + QKV input; Q, K, V and the output O
    attention = ((FP32 + d) * tokens * h / outside           # Q, K, V, O (MLA: + its latents, whole)
                 + d * tokens * (arch.head_dim * (arch.heads + arch.kv_heads) + arch.v_dim * (arch.heads + arch.kv_heads)) / t
                 + d * tokens * (arch.q_lora_rank + arch.kv_lora_rank + arch.rope_dim))
    # softmax output, a x S x S per sequence; none with the fused kernel or context parallelism's blockwise
    # attention (each block recomputes its probabilities: planner/context.py)
    blockwise = layout.cp > 1 and layout.cp_comm != "a2a"
    probs = 0.0 if fused or blockwise else d * arch.heads * seq_length * tokens / t
    if not moe:   # norm input + MLP input, then gate, up, silu(gate), silu(gate) * up (fused: gate|up, the product)
        ffn = (FP32 + mlp) * tokens * h / outside + (3 if fused else 4) * mlp * tokens * arch.ffn / t
    else:         # the MoE block sees all tokens (gathered under sequence parallelism); its router is
        # whole on every tp rank; folded, a tp rank dispatches 1/token_slices of the tokens to experts
        # split over etp, into buffers sized from its dp rank's counts (moetrain/moe/capacity.py)
        rows = tokens * arch.routed_rows_per_token(exact) if rows is None else rows
        expert_inner = (3 if fused else 4) * c * rows * arch.expert_ffn / layout.etp         # expert SwiGLU
        ffn = (FP32 * tokens * h / outside + FP32 * tokens * h  # norm input, router input (fp32)
               + 2 * FP32 * tokens * arch.experts               # router logits and probabilities
               + rows_in * rows * h                             # dispatched rows
               + d * rows * h                                   # expert output
               + expert_inner)
        if arch.shared_ffn:
            ffn += mlp * tokens * h / outside + (3 if mlp < d else 4) * mlp * tokens * arch.shared_ffn / t
        return attention + ffn, probs, expert_inner
    return attention + ffn, probs, 0.0


def recipe_activation_bytes(arch: Arch, moe: bool, tokens: int, layout: Layout, job: Job,
                            recomputed: frozenset) -> float:
    """Bytes one layer keeps for backward for `tokens` tokens of one micro-batch under Megatron-Core's
    (and DeepSeek's) recipe (`Job.megatron_memory`), with the modules `recomputed` (Megatron-Core's
    --recompute-modules names) dropped. Korthikanti et al. 2022's terms (their 34 s b h per layer with
    sequence parallelism; docs/plan.md) as these runs save them: 16-bit activations, no dropout,
    flash attention (no probabilities: Q, K, V, O and the log-sum-exp), SwiGLU, a GEMM's saved input
    in fp8 (1 byte) under an FP8 recipe (Transformer Engine keeps the quantised copy; DeepSeek-V3
    report 3.3.3 caches the MoE inputs in FP8), MoE rows load-exact (dropless, k a token), the
    probabilities applied inside the experts' activation (Megatron-Core 0.13+: the expert output is
    not kept). `layernorm`: the norms' outputs (the next GEMM's input) recomputed; `mla_up_proj`:
    MLA's up-projected q, k, v freed after the attention core and recomputed from the latents;
    `moe_act` / `mlp` / `moe` / `shared_experts`: the SwiGLU output / the dense MLP / the routed /
    the shared experts recomputed from their inputs; `core_attn`: nothing more with flash attention."""
    h, t, d = arch.hidden, layout.tp, DTYPE_BYTES[job.compute_dtype]
    g = 1 if job.fp8_recipe != "none" else d            # a GEMM input kept for the weight gradient
    outside = t if layout.sequence_parallel else 1
    norm_out = 0.0 if "layernorm" in recomputed else g * tokens * h / outside
    stored = 2 * d * tokens * h / outside + 2 * norm_out  # the two norms' inputs (residual stream) and outputs
    # attention
    if arch.kv_lora_rank:           # MLA: the latents (normed, up-projection inputs), then q, k, v
        stored += d * tokens * (arch.q_lora_rank + arch.kv_lora_rank + arch.rope_dim)
        if "mla_up_proj" not in recomputed:
            stored += d * tokens * arch.heads * (2 * arch.head_dim + arch.v_dim) / t
    else:
        stored += d * tokens * arch.head_dim * (arch.heads + 2 * arch.kv_heads) / t
    stored += d * tokens * arch.heads * arch.v_dim / t + FP32 * tokens * arch.heads / t   # O, log-sum-exp

    def swiglu(rows: float, width: float) -> float:      # input shared with the norm; gate|up, product
        return d * rows * 2 * width + (0.0 if "moe_act" in recomputed else g * rows * width)
    if not moe:
        if "mlp" not in recomputed:
            stored += swiglu(tokens, arch.ffn / t)
        return stored
    stored += 2 * FP32 * tokens * arch.experts                     # fp32 router logits and probabilities
    if "moe" not in recomputed:
        rows = tokens * arch.top_k * (arch.capacity_factor if arch.capacity_factor > 0 else 1.0) / layout.token_slices
        stored += g * rows * h + swiglu(rows, arch.expert_ffn / layout.etp)   # dispatched rows, experts
    if arch.shared_ffn and "shared_experts" not in recomputed:
        stored += swiglu(tokens, arch.shared_ffn / t)
    return stored


def dispatch_bytes(arch: Arch, tokens: int, layout: Layout, dtype_bytes: int, exact: bool = False,
                   rows: float = None) -> float:
    """Token-row buffers of one MoE layer for `tokens` tokens (what `moetrain plan --dry-run`
    measures): the rows the experts read (fp32: the norm's output, moetrain/moe/layer.py) and
    write (compute dtype), and with expert parallelism the exchanges that carry them there and
    back (sent and received: twice each). `rows`: as `dispatch_rows` gives them, else routed x margin."""
    if rows is None:
        rows = tokens * arch.routed_rows_per_token(exact)      # folded: the capacities follow the dp rank's counts
    return rows * arch.hidden * (FP32 + dtype_bytes) * (3 if layout.ep > 1 else 1)


def dispatch_rows(arch: Arch, tokens: float, layout: Layout, job: Job, device: str) -> float:
    """Rows of one MoE layer's expert buffers (and, with expert parallelism, of each exchange's send
    and receive buffer) for `tokens` tokens of one micro-batch, as this trainer sizes them on the
    CPU (`moetrain/moe/capacity.py`, `moetrain/moe/ep_dispatcher.py`):

      ep 1                  exactly the routed rows T k (the one-row layout, the grouped GEMM kernel)
      ep n, all-to-all      n C rows received, sum_j C_j = n C sent, C per destination rank:
        adaptive            the first micro-batch's capacities, the largest a run holds under
                            balanced routing (later ones are sized from the counts and only shrink
                            below them): sized(prior x T k / n), at most the bound; the pipeline
                            sizes them the same way, per step (`moetrain.moe.capacity.StepCapacities`)
        bound               the bound T min(k, L) (L = E / n)

    Other devices (the priced GPU / Ascend systems) and the all-gather dispatcher keep the
    load-proportional estimate T k x DISPATCH_ROW_MARGIN; a capacity factor fixes T k x factor."""
    k, n = arch.top_k, layout.ep
    if arch.capacity_factor > 0 or device != "cpu" or (n > 1 and job.moe_token_dispatcher != "alltoall"):
        return tokens * arch.routed_rows_per_token(exact=device == "cpu" and n == 1)
    if n == 1:
        return tokens * k
    bound = tokens * min(k, arch.experts // n)
    if job.moe_capacity == "bound":
        return n * bound
    return n * min(bound, sized(math.ceil(job.moe_capacity_prior * tokens * k / n)))



def _selective_recompute(arch: Arch, modules, layer: int, attention: float, routed: float) -> Tuple[float, float, float]:
    """FLOPs per token of one more forward of what `recompute selective` recomputes in `layer`:
    (tp-split matmuls, attention core, routed experts). `modules` None: the attention core (this
    trainer); else Megatron-Core's --recompute-modules: layernorm and moe_act are elementwise (no
    matmul FLOPs), mla_up_proj the MLA up-projections wq_b and wkv_b, mlp a dense layer's MLP, moe
    the routed experts, shared_experts the shared ones."""
    if modules is None:
        return 0.0, attention, 0.0
    h, moe = arch.hidden, arch.is_moe(layer)
    extra_tp = extra_attention = extra_whole = 0.0
    if "core_attn" in modules:
        extra_attention += attention
    if "mla_up_proj" in modules and arch.kv_lora_rank:
        d_nope = arch.head_dim - arch.rope_dim
        extra_tp += 2 * (arch.q_lora_rank * arch.heads * arch.head_dim
                         + arch.kv_lora_rank * arch.heads * (d_nope + arch.v_dim))
    if "mlp" in modules and not moe:
        extra_tp += 2 * 3 * h * arch.ffn
    if "shared_experts" in modules and moe:
        extra_tp += 2 * 3 * h * arch.shared_ffn
    if "moe" in modules and moe:
        extra_whole += 2 * routed
    return extra_tp, extra_attention, extra_whole


def _calibrated_seconds(device: DeviceProfile, job: Job, flops: float, attention: float, bf16: float) -> float:
    """Seconds per token of `flops` per device on a calibrated profile: the attention core at
    `attention_efficiency` of the 16-bit peak, the head and router (`bf16`) at the 16-bit GEMM
    efficiency, the other matmuls at the fp8 one under an FP8 recipe, plus the non-GEMM work; with
    DualPipe the SMs left after the all-to-all kernels' share (constants.COST_MODEL)."""
    dtype = job.compute_dtype
    gemm16 = device.peak(dtype) * constant("gemm_efficiency.bfloat16")     # fp16 the same
    fp8 = job.fp8_recipe != "none" and "float8" in device.peak_flops
    gemm = device.peak("float8") * constant("gemm_efficiency.float8") if fp8 else gemm16
    seconds = (attention / (device.peak(dtype) * constant("attention_efficiency")) + bf16 / gemm16
               + max(0.0, flops - attention - bf16) / gemm)
    if job.moe_overlap == "dualpipe":
        seconds /= 1 - constant("dualpipe_sm_share")
    return seconds


def _elementwise_seconds(device: DeviceProfile, job: Job, elements: float, d: int) -> float:
    """Seconds per token of the non-GEMM kernels: `elements` activation elements touched per token
    (summed over passes), each `elementwise_passes` times in the compute dtype, at the HBM bandwidth."""
    if not device.memory_bandwidth:
        return 0.0
    seconds = elements * d * constant("elementwise_passes") / device.memory_bandwidth
    if job.moe_overlap == "dualpipe":
        seconds /= 1 - constant("dualpipe_sm_share")
    return seconds


def _expert_all_to_all(arch: Arch, job: Job, L: Layout, device: DeviceProfile, tokens: float, exchanges: float,
                       d: int) -> Tuple[float, float, Dict[str, float]]:
    """`(bytes sent, seconds, detail)` per micro-batch of the expert all-to-all on a calibrated
    profile: `tokens` dispatched by this rank, `exchanges` dispatch + combine pairs (forward,
    backward, recompute). Inside a node every routed row goes over NVLink / HCCS; across nodes the
    dispatcher sends a token ONCE to each remote node its experts are on (deduplicated, then
    forwarded inside the node: DeepSeek-V3 report 3.2.2, DeepEP), and node-limited routing caps
    those nodes (`Arch.max_nodes_per_token`). Both links run at once: the slower one sets the time.
    FP8 dispatch (blockwise recipe, DeepSeek-V3 report 3.3.4) halves the forward dispatch bytes."""
    ranks = L.etp * L.ep if L.expert_folded else L.tp * L.ep
    per_node = max(1, device.devices_per_node // (L.etp if L.expert_folded else L.tp))   # ep ranks per node
    nodes = max(1, -(-ranks // device.devices_per_node))
    k = arch.top_k * (arch.capacity_factor if arch.capacity_factor > 0 else 1.0)
    dispatch_bytes = 1.0 if job.fp8_recipe == "blockwise" else d     # + scales, negligible at 1x128 blocks
    # bytes of one token's row in the four passes of a dispatch + combine pair (forward: dispatch,
    # combine; backward: the combine's gradient out, the dispatch's gradient back), per element
    pair = dispatch_bytes + 3 * d
    row = arch.hidden * pair * exchanges         # bytes of one routed row over all the exchanges
    if nodes == 1:
        remote = 0.0
        nvlink_bytes = tokens * k * (L.ep - 1) / L.ep * row
        network_bytes = 0.0
    else:
        local_ranks = min(per_node, L.ep)
        remote = arch.nodes_per_token(nodes) * (1 - 1 / nodes)      # remote nodes a token is sent to
        # inside the node: the rows for this node's other ranks, and the rows the network copies
        # that arrive here fan out to (each remote copy forwards to its experts' ranks)
        rows_local = k * (local_ranks - 1) / L.ep
        rows_forwarded = k * (1 - local_ranks / L.ep)
        nvlink_bytes = tokens * (rows_local + rows_forwarded) * row
        network_bytes = tokens * remote * row
    nvlink = nvlink_bytes / (device.intra_node_link * constant("a2a_efficiency.intra_node"))
    network = network_bytes / (device.inter_node_link * constant("a2a_efficiency.inter_node")) if nodes > 1 else 0.0
    return nvlink_bytes + network_bytes, max(nvlink, network), {
        "nodes": nodes, "max_nodes_per_token": arch.max_nodes_per_token(nodes) if nodes > 1 else 1,
        "remote_nodes_per_token": remote, "nvlink_bytes": nvlink_bytes, "network_bytes": network_bytes,
        "nvlink_seconds": nvlink, "network_seconds": network}


@dataclass
class StageCost:
    stage: int
    layers: int
    params: int                 # parameters held by one device of this stage
    memory: Dict[str, float]    # weights, gradients, optimizer, activations, runtime -> bytes
    activations_by_recompute: Dict[str, float]    # the saved activations' peak per recompute mode
    comm_bytes: Dict[str, float]         # per step, per device
    comm_seconds: Dict[str, float]
    compute_seconds_per_micro_batch: float
    comm_seconds_per_micro_batch: float  # tp / sp / ep / pp: on the critical path
    dp_seconds: float                    # gradient sync, overlapped with the last backward
    dispatch_bytes: float = 0.0          # token-row buffers of the stage's MoE layers, one micro-batch
    in_flight: int = 1                   # micro-batch (chunk) inputs held by the pipeline schedule
    in_flight_bytes: float = 0.0         # their bytes (part of the activations)
    pass_costs: List[Tuple[float, float, float]] = field(default_factory=list)   # per chunk: F, B, W seconds
    ep_hidden_seconds: float = 0.0       # of the expert all-to-all, per step, hidden under compute (moe_overlap)
    ep_detail: Dict[str, float] = field(default_factory=dict)   # how the all-to-all was priced (docs/plan.md)
    unpacked_gradients: float = 0.0      # of memory["activations"]: per-parameter gradients at a backward-end peak

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())


def _bandwidth(device: DeviceProfile, span: int) -> float:
    """A group of consecutive-enough ranks stays on the fast links while it fits in one node."""
    return device.intra_node_bandwidth if span <= device.devices_per_node else device.inter_node_bandwidth


def stage_cost(job: Job, arch: Arch, layout: Layout, device: DeviceProfile, stage: int,
                chunks: List[List[int]]) -> StageCost:
    """The costs of pipeline stage `stage`, whose model chunks hold the layers `chunks`."""
    L, h, s = layout, arch.hidden, job.seq_length
    layer_ids = sorted(layer for chunk in chunks for layer in chunk)
    t, first, last = L.tp, stage == 0, stage == last_stage(L)
    d = DTYPE_BYTES[job.compute_dtype]
    # bf16 on the CPU (docs/precision.md, "bfloat16 on the CPU"): the kernels compute in fp32 and hold
    # a bf16 value in an fp32 tensor (attention, the residual stream, what layers exchange, the
    # gradients' collectives), read the fp32 weights as bf16 (no rounded copies), and store only the
    # SwiGLU activations as 2-byte bf16 containers (`container_bytes`, activation_bytes)
    cpu_bf16 = device.name == "cpu" and not job.megatron_memory
    container_bytes = DTYPE_BYTES["bfloat16"] if cpu_bf16 and job.compute_dtype == "bfloat16" else None
    if container_bytes is not None:
        d = FP32
    # What the code holds (measured by `moetrain plan --dry-run`): fp32 parameters, cast to the
    # compute dtype per matmul (moetrain/layers.py); fp32 flat gradient buffers (grad_reduce_dtype
    # is the wire dtype only); fp32 moments, and under ZeRO this rank's fp32 master rows.
    weight_bytes = grad_bytes = FP32
    state_bytes = FP32 * OPTIMIZER_FP32_STATES[job.optimizer] + (FP32 if L.zero >= 1 else 0)
    wire_bytes = FP32 if cpu_bf16 and job.grad_dtype == "bfloat16" else DTYPE_BYTES[job.grad_dtype]
    if job.megatron_memory:
        # Megatron-Core's recipe (its README, "Distributed optimizer": bf16 parameters with fp32
        # gradients hold 6 + 12/d bytes a parameter): 16-bit parameters, fp32 main gradients (the
        # grad_reduce_dtype: --grad-reduce-in-bf16 keeps them 16-bit), and the fp32 master weights and
        # moments (moment_dtype) in the distributed optimizer, over dp (experts: edp) when ZeRO >= 1
        weight_bytes, grad_bytes = DTYPE_BYTES[job.param_dtype], wire_bytes
        state_bytes = DTYPE_BYTES[job.moment_dtype] * OPTIMIZER_FP32_STATES[job.optimizer] + FP32
    # replicas of an expert slice: ep carved out of dp, or folded over tp x dp = etp x ep x edp
    dp = context.replicas(L)              # dense replicas: dp x cp (context parallel)
    edp = dp * L.tp // (L.etp * L.ep) if L.expert_folded else dp // L.ep

    # ---- parameters held by one device of this stage
    dense = expert = frozen = 0.0
    units, largest = [], 0.0          # trainable parameters of each layer, the embedding, the head; the largest one
    for layer in layer_ids:
        before = dense + expert
        dense += arch.attention_split_params / t + arch.attention_replicated_params + arch.attention_norm_params + 2 * h
        largest = max(largest, arch.largest_attention_param / t)
        if layer >= arch.layers:                 # MTP depth: its norms and eh_proj
            dense += 3 * h + 2 * h * h
            largest = max(largest, 2 * h * h)
        if arch.is_moe(layer):
            dense += arch.experts * h + 3 * h * arch.shared_ffn / t
            expert += 3 * h * arch.expert_ffn * arch.experts / (L.ep * L.etp)   # unsplit by tp unless etp
            frozen += arch.experts
            largest = max(largest, h * arch.shared_ffn / t, h * arch.expert_ffn * arch.experts / (L.ep * L.etp))
        else:
            dense += 3 * h * arch.ffn / t
            largest = max(largest, h * arch.ffn / t)
        units.append(dense + expert - before)
    if first:
        dense += arch.vocab * h / t
        units.append(arch.vocab * h / t)
    if last:
        head = h + (arch.vocab * h / t if not arch.tied or L.pp > 1 else 0)
        dense += head
        units.append(head)
    # the embedding (the first stage's last bucket) and the LM head (the last stage's first bucket,
    # `ParamRole.lm_head`) are reduce-scattered a few columns at a time: no collective output of their size
    zero_grads = (dp, edp) if L.zero >= 2 else (1, 1)
    zero_states = (dp, edp) if L.zero >= 1 else (1, 1)
    memory = {
        "weights": (dense + expert) * weight_bytes + frozen * FP32,
        "gradients": (dense / zero_grads[0] + expert / zero_grads[1]) * grad_bytes,
        "optimizer": (dense / zero_states[0] + expert / zero_states[1]) * state_bytes,
    }
    # Packing a micro-batch's gradients (DataParallel.flatten). Below ZeRO-2, or for a buffer whose
    # group is one rank, each flat buffer is concatenated whole at the pass's end, beside every
    # per-parameter gradient. At ZeRO-2 a buffer over G > 1 ranks is packed and reduce-scattered
    # bucket by bucket as the backward produces its gradients (`OptimizerStep._bucketed_rows`), and
    # each bucket's gradients are freed at once: what a gradient pass holds beside its activations is
    # one unit's per-parameter gradients (a layer, the embedding or the head: they appear together
    # in its backward) and one bucket's packed copy and collective output (`grad_bucket_mb`, or the
    # largest parameter, a bucket of its own, except the first stage's embedding: the last bucket,
    # reduce-scattered a piece at a time), plus the rows so far (`gradients`). Measured on the
    # 671B full-depth dry runs (docs/plan.md, "Full depth and DeepSeek-V3-671B ranks").
    packing = memory["gradients"]
    bucketed = L.zero >= 2 and not job.megatron_memory and max(zero_grads) > 1
    if bucketed:
        whole = (dense if zero_grads[0] == 1 else 0.0) + (expert if zero_grads[1] == 1 else 0.0)
        # a bucket of several parameters: its packed copy and the collective's output; one parameter
        # (over the bucket size, unpadded): the collective's output only
        bucket = max(2 * min(job.grad_bucket_mb * 2 ** 20 / FP32, dense + expert - whole), largest)
        alongside = grad_bytes * (whole + max(units, default=0.0) + bucket)
    else:
        alongside = 0.0

    # ---- activations. Without a pipeline, one micro-batch's activations of every layer (gradient
    # accumulation). With one, the pipeline keeps only each in-flight micro-batch's chunk INPUT and
    # recomputes the chunk in its backward (moetrain/parallel/pipeline.py): `pipeline_peak` walks the
    # schedule's instruction list with one chunk's activations live inside a pass.
    tokens = context.local_tokens(L, L.micro_batch_size * s)
    in_flight = pipeline_in_flight(L, stage)
    fused = device.name == "cpu" and d == FP32       # moetrain.kernels: CPU only, fp32 compute (bf16 on fp32 GEMMs)
    exact = device.name == "cpu" and L.ep == 1     # SortDispatcher's one-row layout (the grouped GEMM kernel)
    buffer_rows = dispatch_rows(arch, tokens, L, job, device.name)     # the expert buffers as the dispatcher sizes them
    outside = t if L.sequence_parallel else 1
    layer_input = FP32 * tokens * h / outside
    def casts_of(layers: List[int]) -> float:
        return cast_bytes * len(layers) / max(1, len(layer_ids))

    if job.megatron_memory:   # the residual stream is 16-bit; fused cross-entropy: 16-bit logits, fp32 row stats
        layer_input = d * tokens * h / outside
    if fused and t == 1:      # fused LM head + loss: 3 numbers a row kept, dh and the rows concatenated (every
        # head's in one call); no logits, and d(head weight) is made in the backward, once for every head
        # (DeepSeek's MTP heads share the weight): the gradient itself, booked with the parameters' gradients
        head, head_grad = 2 * FP32 * tokens * h + 3 * FP32 * tokens, 0.0
    else:                     # fp32 logits and their gradient at the loss (+ both in the compute dtype);
        lower = d if d < FP32 else 0      # once a step, the head weight's gradient (measured at moe_1b width)
        head = (2 * FP32 + 2 * lower) * tokens * arch.vocab / t
        head_grad = (FP32 + lower) * arch.vocab * h / t if last else 0.0
    if job.megatron_memory:
        head, head_grad = d * tokens * arch.vocab / t + 2 * FP32 * tokens, 0.0
    logits = (head + (FP32 + d) * tokens * h / outside) * (1 + arch.mtp_depth)
    # Besides: the compute-dtype copies of the weights (the matmuls' saved inputs; under full
    # recompute only the recomputed layer's). The backward's per-parameter gradients add nothing
    # at the peak without a pipeline (measured): each layer's appear as its saved activations are freed.
    cast_bytes = d * (dense + expert) if d < FP32 else 0.0
    if job.megatron_memory:   # 16-bit weights are used as they are (an FP8 recipe's 1-byte copies: weights)
        cast_bytes = 0.0

    def by_recompute(layers: List[int], extra: float) -> Dict[str, float]:
        """One micro-batch's activations of `layers` per recompute mode, + `extra`."""
        if job.megatron_memory:   # selective: the listed modules (None: the attention core)
            selected = frozenset(job.recompute_modules or ("core_attn",))
            none = [recipe_activation_bytes(arch, arch.is_moe(i), tokens, L, job, frozenset()) for i in layers]
            return {"none": sum(none) + casts_of(layers) + extra,
                    "selective": sum(recipe_activation_bytes(arch, arch.is_moe(i), tokens, L, job, selected)
                                     for i in layers) + casts_of(layers) + extra,
                    "full": layer_input * len(layers) + max(none, default=0.0) + extra}
        per_layer = [activation_bytes(arch, arch.is_moe(i), tokens, s, L, d, fused, exact, buffer_rows, container_bytes)
                     for i in layers]
        working_set = max((stored + probs for stored, probs, _ in per_layer), default=0.0)
        casts = cast_bytes * len(layers) / max(1, len(layer_ids))
        # selective as the trainer applies it: the attention core, and the routed experts' insides
        # where the family's plan names them (moe_gpt, deepseek_v3, qwen3_moe)
        inner = 1.0 if arch.selective_experts else 0.0
        return {"none": sum(stored + probs for stored, probs, _ in per_layer) + casts + extra,
                "selective": sum(stored - inner * experts for stored, _, experts in per_layer) + casts + extra,
                "full": layer_input * len(layers) + working_set + casts / max(1, len(layers)) + extra}

    if L.pp == 1:
        by_mode, stage_inputs = by_recompute(layer_ids, (logits + head_grad) if last else 0.0), 0.0
    else:
        V = L.pp * L.chunks
        vstages = [schedules.virtual_stage(L.schedule, L.pp, stage, c) for c in range(L.chunks)]
        inputs = [4.0 * tokens if u == 0 else layer_input for u in vstages]     # token ids on the first
        working = [by_recompute(layers, logits if u == V - 1 else 0.0) for layers, u in zip(chunks, vstages)]
        if job.megatron_memory and job.pipeline_backward == "stash":
            # Megatron-Core / DeepSeek: each micro-batch (chunk) in flight holds its activations from its
            # forward to its backward; inside a pass about one layer's more is live; the gradients go
            # straight into the persistent fp32 main-gradient buffer (no transient copies)
            by_mode = {}
            for mode in RECOMPUTE_MODES:
                held = [x + w[mode] for x, w in zip(inputs, working)]
                live = [w[mode] / max(1, len(layers)) for w, layers in zip(working, chunks)]
                by_mode[mode] = pipeline_peak(L, stage, held, live, layer_input, 0.0, 0.0)
            stage_inputs = in_flight * max(x + w[L.recompute] for x, w in zip(inputs, working))
        else:
            if job.pipeline_backward == "stash":   # Megatron / DeepSeek: a micro-batch in flight keeps its activations
                inputs = [x + w[L.recompute] for x, w in zip(inputs, working)]
            stage_inputs = in_flight * max(inputs)
            # the pass's end: per-parameter gradients + the pack's largest transient (`packing` >= the
            # rows); bucketed (ZeRO-2): a unit's gradients and a bucket beside the chunk's activations
            grads_at_end = alongside if bucketed else FP32 * (dense + expert) + packing - memory["gradients"]
            by_mode = {mode: pipeline_peak(L, stage, inputs, [w[mode] for w in working], layer_input,
                                           grads_at_end, memory["gradients"], alongside) - memory["gradients"]
                       for mode in RECOMPUTE_MODES}
    by_mode = context.add_held_kv(by_mode, arch, L, tokens, d, len(layer_ids))
    memory["activations"] = by_mode[L.recompute]
    # The end of a micro-batch's backward (one process or gradient accumulation, this code's step:
    # moetrain/parallel/runner.py packs inside the compiled step): every trainable parameter's fp32
    # gradient is live while its packed copy (the flat buffers, `gradients`) is filled. Without
    # recompute the saved activations are larger; with `full` (or small activations) this is the
    # step's peak (measured, docs/parallel_engine.md "Recompute under jit"). The pipeline books the
    # same inside `pipeline_peak`. `unpacked_gradients`: how much the per-parameter gradients raise
    # the activation peak (part of it, shown apart).
    unpacked = 0.0
    if L.pp == 1 and not job.megatron_memory:
        per_parameter, packed = (alongside, packing) if bucketed else (FP32 * (dense + expert), packing)
        if per_parameter + packed > memory["activations"]:
            unpacked = per_parameter + packed - max(memory["activations"], packed)
            memory["activations"] = per_parameter + packed
    memory["runtime"] = device.runtime_bytes
    if job.moe_overlap == "dualpipe" and L.pp > 1:   # DualPipe keeps two copies of the parameters (report 3.2.1)
        memory["weights"] *= 2
    if job.megatron_memory and job.fp8_recipe != "none":   # the FP8 GEMMs' 1-byte copy of the weights they read
        memory["weights"] += dense + expert

    # ---- compute per micro-batch (hardware FLOPs: recompute adds forward work). Routers are whole
    # on every tp rank, and so are the routed experts unless folded (then a tp rank computes
    # 1/token_slices of the rows on 1/etp of the FFN: 1/tp of the work). The pipeline
    # (moetrain/parallel/pipeline.py) recomputes a chunk's forward in its backward, except on the
    # last virtual stage, whose forward takes its gradients at once; a split backward (zero-bubble)
    # is two compiled passes that each recompute the forward: B (input gradient) and W (weight
    # gradient, which also back-propagates through the chunk), so a chunk between the first and
    # the last virtual stage computes one forward and one input gradient more (the first one's B is
    # empty: token ids need no gradient). `pass_costs`: (F, B, W) seconds of each chunk's passes.
    sustained = device.sustained(job.compute_dtype) / (L.world if device.shared_host else 1)
    per_flop = tokens / sustained
    V = L.pp * L.chunks
    stash = job.pipeline_backward == "stash"        # no forward recomputed by the pipeline's backward
    split_backward = L.pp > 1 and L.schedule in schedules.SPLIT_BACKWARD
    modules = job.recompute_modules
    # COST_MODEL is fitted for 16-bit training: fp32 compute on a calibrated part keeps compute_efficiency
    calibrated = device.calibrated and job.compute_dtype in ("bfloat16", "float16")
    compute, pass_costs = 0.0, []
    for c, layers in enumerate(chunks):
        u = schedules.virtual_stage(L.schedule, L.pp, stage, c) if L.pp > 1 else 0
        input_gradient_again = split_backward and 0 < u < V - 1 and not stash
        forward = tp_flops = whole = 0.0
        attention_part = bf16_part = 0.0                # of tp_flops: attention core; of both: head and router
        elementwise = 0.0                               # activation elements a device's kernels touch per token
        for layer in layers:
            moe = arch.is_moe(layer)
            matmul = arch.attention_params + (3 * h * arch.shared_ffn if moe else 3 * h * arch.ffn)
            router = arch.experts * h if moe else 0
            routed = router + 3 * h * arch.expert_ffn * arch.top_k / (L.token_slices * L.etp) if moe else 0
            if layer >= arch.layers:                 # MTP depth: eh_proj and the LM head once more
                matmul += 2 * h * h + arch.vocab * h
            attention = arch.attention_core_flops(s)           # forward QK^T and AV per token
            forwards = (1 + (L.recompute == "full") + (L.pp > 1 and u < V - 1 and not stash)
                        + input_gradient_again)
            again = 2 * input_gradient_again                  # the input gradient once more (matmuls x2, core x2)
            tp_flops += (4 + 2 * forwards + again) * matmul + (2 + forwards + again) * attention
            attention_part += (2 + forwards + again) * attention
            whole += (4 + 2 * forwards + again) * routed
            bf16_part += (4 + 2 * forwards + again) * router
            rows = arch.routed_rows_per_token() / L.token_slices if moe else 0.0
            width = (h + arch.expert_ffn / L.etp) * rows + (3 * h * arch.shared_ffn / t / h if moe else arch.ffn / t)
            elementwise += (2 + forwards) * (h / t + width)
            forward += 2 * matmul / t + attention / t + 2 * routed
            if L.recompute == "selective":           # one more forward of what it recomputes
                extra_tp, extra_attention, extra_whole = _selective_recompute(arch, modules, layer, attention, routed)
                tp_flops += extra_tp + extra_attention
                attention_part += extra_attention
                whole += extra_whole
        if u == V - 1:
            tp_flops += 6 * arch.vocab * h
            bf16_part += 6 * arch.vocab * h / t
            forward += 2 * arch.vocab * h / t
        flops = tp_flops / t + whole
        if calibrated:            # GEMMs, attention and the rest priced apart (moetrain/planner/constants.py)
            chunk_seconds = tokens * (_calibrated_seconds(device, job, flops, attention_part / t, bf16_part)
                                      + _elementwise_seconds(device, job, elementwise, d))
            total, forward = chunk_seconds, chunk_seconds * forward / flops if flops else 0.0
        else:
            total = flops * per_flop
            forward *= per_flop
        compute += total
        if L.pp == 1 or u == V - 1:          # the last virtual stage: all in its forward
            pass_costs.append((total, 0.0, 0.0))
        elif not split_backward:
            pass_costs.append((forward, total - forward, 0.0))
        else:                                # B: a forward and an input gradient (about a forward's FLOPs)
            backward_input = (forward if stash else 2 * forward) if u > 0 else 0.0
            pass_costs.append((forward, backward_input, total - forward - backward_input))

    # ---- communication (bytes per device)
    # Emulated on CPU by an all-reduce of a buffer with one slot per rank (moetrain/distributed/comm.py):
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
    ep_seconds_per_mb, ep_detail = None, {}
    if L.ep > 1:   # folded: a slice's buffers are sized from its dp rank's counts (moetrain/moe/capacity.py)
        rows = tokens * arch.routed_rows_per_token()
        per_mb["ep"] = moe_layers * (4 + 2 * full) * (L.ep - 1) / L.ep * rows * h * d * a2a_factor
        if device.calibrated:
            ep_bytes, ep_seconds_per_mb, ep_detail = _expert_all_to_all(
                arch, job, L, device, tokens / L.token_slices, moe_layers * (1 + full / 2), d)
            per_mb["ep"] = ep_bytes
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
    per_mb["cp"] = context.traffic_per_micro_batch(arch, L, tokens, d, len(layer_ids), device.emulated_collectives)
    spans = {"tp": t, "sp": t, "ep": L.etp * L.ep if L.expert_folded else t * L.ep, "pp": L.world,
             "cp": context.span(L)}
    comm_bytes = {dim: per_mb[dim] * L.num_micro_batches for dim in per_mb}
    comm_seconds = {dim: comm_bytes[dim] / _bandwidth(device, spans[dim]) for dim in per_mb}
    if ep_seconds_per_mb is not None:      # NVLink and the network priced apart, node-limited, deduplicated
        comm_seconds["ep"] = ep_seconds_per_mb * L.num_micro_batches
    # the part of the expert all-to-all that runs under another micro-batch's (or chunk's) compute
    overlap = constant(f"overlap.{job.moe_overlap}")
    ep_hidden = min(overlap * comm_seconds["ep"], compute * L.num_micro_batches)
    # each exchange also costs a fixed latency, whatever its size: what more chunks a stage pay
    comm_seconds["pp"] += sends * L.num_micro_batches * device.p2p_latency
    critical = sum(comm_seconds[dim] for dim in per_mb) - ep_hidden

    def sync_bytes(params: float, group: int) -> float:
        if group == 1:
            return 0.0
        if L.zero == 0:
            return 2 * (group - 1) / group * params * wire_bytes
        return (group - 1) / group * params * (wire_bytes + weight_bytes) * gather_factor
    dense_sync, expert_sync = sync_bytes(dense, dp), sync_bytes(expert, edp)
    comm_bytes["dp"] = dense_sync + expert_sync
    dp_seconds = (dense_sync + expert_sync) / _bandwidth(device, t * dp)
    comm_seconds["dp"] = dp_seconds
    return StageCost(stage=stage, layers=len(layer_ids), params=int(dense + expert + frozen), memory=memory,
                     in_flight=in_flight, in_flight_bytes=stage_inputs,
                     dispatch_bytes=sum(arch.is_moe(i) for i in layer_ids) * dispatch_bytes(arch, tokens, L, d, exact, buffer_rows),
                     activations_by_recompute=by_mode, unpacked_gradients=unpacked,
                     comm_bytes=comm_bytes, comm_seconds=comm_seconds,
                     compute_seconds_per_micro_batch=compute, pass_costs=pass_costs,
                     comm_seconds_per_micro_batch=critical / L.num_micro_batches,
                     dp_seconds=dp_seconds, ep_hidden_seconds=ep_hidden, ep_detail=ep_detail)




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
    return plan_valid_layout(job, layout, get_device(device), source)


def plan_valid_layout(job: Job, layout: Layout, device: DeviceProfile, source: str = "") -> PlanResult:
    arch = job.arch
    stages = [stage_cost(job, arch, layout, device, i, chunk_layer_lists(arch, layout, i))
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
    if job.moe_overlap == "dualpipe" and layout.pp > 1:
        # DualPipe's bubble (DeepSeek-V3 report, table 2): (PP/2 - 1)(F&B + B - 3W), with F&B = F + B + W
        # of one micro-batch and B = W = half its backward: (PP/2 - 1) F
        forward = sum(f for f, _, _ in pacing.pass_costs)
        bubble = (layout.pp / 2 - 1) * forward
        bubble_fraction = bubble / (busy + bubble)
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
