"""Device profiles for the planner (`moetrain/planner/`): memory, peak FLOP/s, link bandwidths.

Figures are public data-sheet numbers (sources in docs/plan.md) or, for `cpu`, measured on this
project's 2-core machines (/work/shared/notes/mindspore-cpu.md). Bandwidths are *effective
collective bus bandwidths* (bytes/s a ring all-reduce moves per device), assumed at about half
(intra-node) or 80 % (inter-node) of the link rate; `compute_efficiency` is the fraction of peak
the training kernels sustain. Both are cost-model assumptions, stated so they can be argued with.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Dict, Union

GiB = 1024 ** 3


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    memory_bytes: float                  # per device (for a shared host: the whole host)
    peak_flops: Dict[str, float]         # dense matmul peak per compute dtype
    compute_efficiency: float            # sustained fraction of peak in a training step
    intra_node_bandwidth: float          # effective collective bandwidth inside a node, bytes/s
    inter_node_bandwidth: float          # ... between nodes, per device
    devices_per_node: int
    runtime_bytes: float                 # per process: framework, kernels workspace, comm buffers
    p2p_latency: float = 20e-6           # seconds one pipeline exchange costs beyond its bytes
    shared_host: bool = False            # all ranks share one host's memory and cores (CPU)
    emulated_collectives: bool = False   # reduce-scatter / all-to-all built from all-reduce (CPU)
    sources: str = field(default="", compare=False)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"device profile {self.name!r} has no {dtype} compute figure (it lists "
                             f"{', '.join(self.peak_flops)}): set precision.compute_dtype to one of those")
        return self.peak_flops[dtype]


PROFILES: Dict[str, DeviceProfile] = {p.name: p for p in (
    DeviceProfile(
        name="ascend910b",
        description="Huawei Ascend 910B (Atlas 800T A2 node: 8 NPUs, HCCS full mesh, 200GE RoCE per NPU)",
        memory_bytes=64 * GiB,
        peak_flops={"bfloat16": 313e12, "float16": 313e12},
        compute_efficiency=0.5,
        intra_node_bandwidth=196e9,      # half of 7 HCCS links x 56 GB/s
        inter_node_bandwidth=20e9,       # 80 % of 200 Gb/s RoCE
        devices_per_node=8,
        runtime_bytes=2 * GiB,
        sources="313 TFLOP/s fp16/bf16 dense and 64 GB HBM2e: public 910B (910B3) figures; SKUs range "
                "280-376 TFLOP/s; HCCS 392 GB/s per NPU"),
    DeviceProfile(
        name="gpu_a100",
        description="NVIDIA A100 SXM 80GB (DGX A100: 8 GPUs, NVLink 3, 200 Gb/s HDR per GPU)",
        memory_bytes=80 * GiB,
        peak_flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
        compute_efficiency=0.5,
        intra_node_bandwidth=240e9,      # NVLink 600 GB/s bidirectional
        inter_node_bandwidth=20e9,
        devices_per_node=8,
        runtime_bytes=2 * GiB,
        sources="NVIDIA A100 data sheet"),
    DeviceProfile(
        name="gpu_h100",
        description="NVIDIA H100 SXM 80GB (DGX H100: 8 GPUs, NVLink 4, 400 Gb/s NDR per GPU)",
        memory_bytes=80 * GiB,
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
        compute_efficiency=0.5,
        intra_node_bandwidth=360e9,      # NVLink 900 GB/s bidirectional
        inter_node_bandwidth=40e9,
        devices_per_node=8,
        runtime_bytes=2 * GiB,
        sources="NVIDIA H100 data sheet (SXM5, dense, without sparsity)"),
    DeviceProfile(
        name="cpu",
        description="this project's CPU machine (2 cores, AVX-512, MindSpore 2.10 CPU backend); "
                    "every rank shares the host",
        memory_bytes=24 * GiB,
        peak_flops={"float32": 0.14e12, "float16": 0.07e12},
        compute_efficiency=0.3,          # a whole jitted Mixtral-like step ran at ~42 GFLOP/s
        intra_node_bandwidth=14e6,       # all-reduce of 1 MB among 4 workers took ~110 ms
        inter_node_bandwidth=14e6,
        devices_per_node=1024,
        runtime_bytes=0.41 * GiB,        # RSS of a process after `import mindspore`
        p2p_latency=5e-3,                # an exchange is a 2-rank all-reduce: 5.3 ms for 4 floats (measured)
        shared_host=True,
        emulated_collectives=True,
        sources="measured: /work/shared/notes/mindspore-cpu.md"),
)}

# `train.device` names a backend; the planner needs a concrete part.
DEFAULT_FOR_BACKEND = {"ascend": "ascend910b", "gpu": "gpu_a100", "cpu": "cpu"}


def get_device(device: Union[str, DeviceProfile]) -> DeviceProfile:
    """A profile by name (`ascend910b`, `gpu_a100`, `gpu_h100`, `cpu`) or backend (`ascend`, `gpu`)."""
    if isinstance(device, DeviceProfile):
        return device
    name = DEFAULT_FOR_BACKEND.get(device, device)
    if name not in PROFILES:
        near = difflib.get_close_matches(str(device), list(PROFILES) + list(DEFAULT_FOR_BACKEND), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"unknown device {device!r}{hint} Known profiles: {', '.join(PROFILES)} "
                         f"(or a train.device backend: {', '.join(DEFAULT_FOR_BACKEND)})")
    return PROFILES[name]
