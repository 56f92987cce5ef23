"""Every constant of the accelerator cost model in ONE table, each with its source or what it was
fitted to (docs/plan.md, "Published runs", lists the fits and the run kept out of them).

The device profiles (moetrain/devices.py) hold data-sheet figures: peak FLOP/s per dtype, link
rates. What a training step reaches of them (GEMM efficiency, the non-GEMM work, how well the
all-to-all uses a link, how much of it overlap hides) lives here. Profiles with
`calibrated=True` (gpu_h100, gpu_h800) are priced with this table; the others keep their single
`compute_efficiency` (and the `cpu` profile its measured whole-step rate).

A term for a new parallel dimension (context parallelism's ring or all-gather) adds its rows here
and its bytes in `costs.stage_cost`'s communication section: nothing else needs to change."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class Constant:
    value: float
    source: str          # a public figure, or "fitted to <run>" (docs/plan.md names the runs)


COST_MODEL: Dict[str, Constant] = {
    # ---- compute
    "gemm_efficiency.bfloat16": Constant(
        0.80, "estimate, not fitted: cuBLAS / TE bf16 GEMMs of training shapes (4k-16k rows, hidden 4k-7k) "
              "reach ~750-800 of the H100 SXM's 989 TFLOP/s; grouped expert GEMMs priced the same"),
    "gemm_efficiency.float8": Constant(
        0.65, "fitted to DeepSeek-V3 on 2,048 H800 (DeepSeek's run, 1,543 tokens/s/GPU): the fraction of "
              "the fp8 dense peak that FP8 GEMMs sustain, quantisation and scaling kernels included"),
    "attention_efficiency": Constant(
        0.45, "FlashAttention-2 forward+backward on H100 reaches ~35-50 % of the bf16 peak at head dim 128, "
              "sequence 4k (Shah et al. 2024, FlashAttention-3, fig. 5-6); Megatron-Core runs cuDNN / TE "
              "fused attention of that class"),
    "elementwise_passes": Constant(
        12.0, "fitted to Mixtral 8x22B on 128 H100 (49.3 % MFU; 12, 24, 40 tried, 12 closest): the non-GEMM "
              "kernels (norms, residual adds, RoPE, SwiGLU, router, token permutation and un-permutation, "
              "combine weighting) priced as this many 16-bit reads or writes of every activation row a "
              "layer holds per token (h, and per routed row h + F_e) at the HBM bandwidth, forward; "
              "backward twice that. What makes fine-grained top-8 MoE slower per FLOP than top-2"),
    "dualpipe_sm_share": Constant(
        20 / 132, "DeepSeek-V3 report, section 3.2.2: 20 of the H800's 132 SMs run the all-to-all kernels "
                  "while DualPipe overlaps them with compute; the rest compute"),
    # ---- links (fractions of the profile's per-device link rate that the expert all-to-all reaches)
    "a2a_efficiency.intra_node": Constant(
        0.75, "NCCL all-to-all inside a DGX H100 node: ~340 of the 450 GB/s NVLink rate per direction "
              "(nccl-tests alltoall_perf bus bandwidth, 8 GPUs, large messages); DeepEP's kernels reach "
              "153-158 of H800's 160 GB/s (DeepEP README, intranode)"),
    "a2a_efficiency.inter_node": Constant(
        0.85, "DeepEP README, internode normal kernels on H800 + CX7 IB 400 Gb/s (50 GB/s): 43-46 GB/s "
              "RDMA bottleneck bandwidth at EP16-64"),
    "collective_efficiency.intra_node": Constant(
        0.80, "NCCL all-reduce / all-gather / reduce-scatter bus bandwidth inside a DGX H100 node, ~360 of "
              "450 GB/s (nccl-tests, large messages)"),
    "collective_efficiency.inter_node": Constant(
        0.80, "NCCL ring collectives over 400 Gb/s NDR/CX7 IB per GPU: ~40 of 50 GB/s bus bandwidth "
              "(nccl-tests, large messages; the 80 % of moetrain's earlier profiles)"),
    # ---- overlap: the fraction of the expert all-to-all that runs under other work
    "overlap.dualpipe": Constant(
        1.0, "DeepSeek-V3 report, section 3.2.1: DualPipe 'achieves full overlap of forward and backward "
             "computation-communication phases' (bounded here by the compute it hides under)"),
    "overlap.a2a_overlap": Constant(
        0.70, "Megatron-Core --overlap-moe-expert-parallel-comm (1F1B A2A overlap of one micro-batch's "
              "dispatch/combine with another's compute); fitted to Megatron-MoE-ModelZoo best_practice/"
              "Qwen3: 19.7 s -> 17.6 s a step with '+1f1b overlap' at EP32 across nodes (not one of the "
              "four runs of the table)"),
    "overlap.none": Constant(0.0, "no overlap: the all-to-all is on the critical path"),
    "overlap.dp_backward": Constant(
        2 / 3, "the gradient reduce overlaps the backward (about 2/3 of a micro-batch's compute) of the "
               "last micro-batch (moetrain's bucketed reduce; Megatron --overlap-grad-reduce)"),
    # ---- pipeline
    "p2p_latency": Constant(20e-6, "one pipeline send/receive beyond its bytes: NCCL p2p latency over NVLink/IB"),
}


def constant(name: str) -> float:
    """The value of cost-model constant `name` (a KeyError names the table)."""
    try:
        return COST_MODEL[name].value
    except KeyError:
        raise KeyError(f"no cost-model constant {name!r} in moetrain/planner/constants.py COST_MODEL") from None
