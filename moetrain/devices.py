"""Device profiles for the planner (`moetrain/planner/`): memory, peak FLOP/s, link bandwidths.

Figures are public data-sheet numbers (sources in docs/plan.md) or, for `cpu`, measured on this
project's 2-core machines (/work/shared/notes/mindspore-cpu.md); the `cpu` peak is measured on the
host that asks (`host_fp32_peak`), so the trainer's `mfu` is against what this machine's cores can
do. Bandwidths are *effective collective bus bandwidths* (bytes/s a ring all-reduce moves per
device), assumed at about half (intra-node) or 80 % (inter-node) of the link rate;
`compute_efficiency` is the fraction of peak the training kernels sustain (for `cpu`, a measured
whole-step rate instead: `sustained_flops`). Both are cost-model assumptions, stated so they can be
argued with.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Dict, Union

import numpy as np

GiB = 1024 ** 3
PEAK_GEMM_SIZE = 1024        # square fp32 GEMM of the host peak measurement (2.1 GFLOP)
PEAK_GEMM_REPEATS = 7        # the best of these (a shared host disturbs single runs)


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
    # `peak_flops` are fractions of the fp32 GEMM rate measured on this host (`host_fp32_peak`)
    measured_peak: bool = False
    # FLOP/s a whole training step sustains per dtype, measured: the cost model's compute rate
    # instead of peak x compute_efficiency (empty: that product)
    sustained_flops: Dict[str, float] = field(default_factory=dict)
    # raw per-device link rates, one direction, bytes/s (NVLink / HCCS inside a node, the NIC between
    # nodes); a calibrated profile is priced with moetrain/planner/constants.py's efficiencies of them
    intra_node_link: float = 0.0
    inter_node_link: float = 0.0
    calibrated: bool = False
    memory_bandwidth: float = 0.0        # HBM bytes/s (data sheet): what elementwise kernels are bound by

    def peak(self, dtype: str) -> float:
        """Dense matmul peak FLOP/s in `dtype` (the whole host for a shared host)."""
        if dtype not in self.peak_flops:
            raise ValueError(f"device profile {self.name!r} has no {dtype} compute figure (it lists "
                             f"{', '.join(self.peak_flops)}): set precision.compute_dtype to one of those")
        return self.peak_flops[dtype] * (host_fp32_peak() if self.measured_peak else 1.0)

    def sustained(self, dtype: str) -> float:
        """FLOP/s the cost model computes at in a training step."""
        if self.sustained_flops:
            self.peak(dtype)                     # the same refusal for an unknown dtype
            return self.sustained_flops[dtype]
        return self.peak(dtype) * self.compute_efficiency


PROFILES: Dict[str, DeviceProfile] = {p.name: p for p in (
    DeviceProfile(
        name="ascend910b",
        description="Huawei Ascend 910B (Atlas 800T A2 node: 8 NPUs, HCCS full mesh, 200GE RoCE per NPU)",
        memory_bytes=64 * GiB,                     # 64 GB HBM2e (Gitee AI cluster docs, 910B)
        peak_flops={"bfloat16": 313e12, "float16": 313e12},   # 910B3 dense fp16/bf16; SKUs 280-376; no fp8
        compute_efficiency=0.5,
        intra_node_bandwidth=196e9,      # half of 7 HCCS links x 56 GB/s
        inter_node_bandwidth=20e9,       # 80 % of 200 Gb/s RoCE
        devices_per_node=8,
        runtime_bytes=2 * GiB,
        intra_node_link=392e9,           # HCCS: 7 links x 56 GB/s per NPU (Atlas 800T A2 full mesh)
        inter_node_link=25e9,            # one 200GE RoCE port per NPU = 25 GB/s
        memory_bandwidth=1.6e12,         # HBM2e ~1.6 TB/s (public 910B figures)
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
        memory_bytes=80 * GiB,                     # 80 GB HBM3 (H100 SXM5 data sheet)
        # dense (without sparsity) Tensor Core peaks, H100 SXM5 data sheet: bf16/fp16 989.4, fp8 1,978.9,
        # tf32 494.7 TFLOP/s; fp32 (non-tensor) 66.9
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 67e12},
        compute_efficiency=0.5,          # unused: calibrated (moetrain/planner/constants.py)
        intra_node_bandwidth=360e9,      # 80 % of NVLink's 450 GB/s a direction (collective_efficiency)
        inter_node_bandwidth=40e9,       # 80 % of 400 Gb/s NDR = 50 GB/s a direction
        devices_per_node=8,
        runtime_bytes=2 * GiB,
        intra_node_link=450e9,           # NVLink 4: 18 links, 900 GB/s bidirectional per GPU (data sheet)
        inter_node_link=50e9,            # one ConnectX-7 400 Gb/s NDR InfiniBand NIC per GPU (DGX H100)
        memory_bandwidth=3.35e12,        # HBM3 3.35 TB/s (H100 SXM5 data sheet)
        calibrated=True,
        sources="NVIDIA H100 data sheet (SXM5, dense; NVLink 900 GB/s; NDR 400 Gb/s per GPU)"),
    DeviceProfile(
        name="gpu_h800",
        description="NVIDIA H800 SXM 80GB (8 GPUs per node, NVLink 400 GB/s, 400 Gb/s CX7 InfiniBand per GPU)",
        memory_bytes=80 * GiB,                     # 80 GB HBM3, as H100 SXM
        # the H100 SXM's compute (same GH100 die and clocks), export variant with reduced NVLink
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 67e12},
        compute_efficiency=0.5,          # unused: calibrated
        intra_node_bandwidth=160e9,      # 80 % of 200 GB/s
        inter_node_bandwidth=40e9,
        devices_per_node=8,
        runtime_bytes=2 * GiB,
        # NVLink 400 GB/s bidirectional (H800 SXM data sheet); the DeepSeek-V3 report (section 3.2.2)
        # quotes 160 GB/s achieved NVLink and 50 GB/s IB per GPU on its H800 cluster
        intra_node_link=200e9,
        inter_node_link=50e9,            # CX7 400 Gb/s InfiniBand per GPU (DeepSeek-V3 report, section 3.1)
        memory_bandwidth=3.35e12,        # HBM3 3.35 TB/s, as H100 SXM
        calibrated=True,
        sources="H800 SXM: H100 SXM compute, NVLink 400 GB/s; DeepSeek-V3 report (arXiv 2412.19437) 3.1-3.2"),
    DeviceProfile(
        name="cpu",
        description="this project's CPU machine (2 cores, AVX-512, MindSpore 2.10 CPU backend); "
                    "every rank shares the host",
        memory_bytes=24 * GiB,
        # x the measured fp32 GEMM rate: no fp16 BLAS on CPU; bfloat16 is emulated on fp32 GEMMs (docs/precision.md)
        peak_flops={"float32": 1.0, "float16": 0.5, "bfloat16": 1.0},
        measured_peak=True,
        compute_efficiency=0.0,          # unused: sustained_flops
        sustained_flops={"float32": 0.042e12, "float16": 0.021e12, "bfloat16": 0.042e12},   # a whole jitted Mixtral-like step: ~42 GFLOP/s
        intra_node_bandwidth=14e6,       # all-reduce of 1 MB among 4 workers took ~110 ms
        inter_node_bandwidth=14e6,
        devices_per_node=1024,
        runtime_bytes=0.41 * GiB,        # RSS of a process after `import mindspore`
        p2p_latency=5e-3,                # an exchange is a 2-rank all-reduce: 5.3 ms for 4 floats (measured)
        shared_host=True,
        emulated_collectives=True,
        sources="measured: /work/shared/notes/mindspore-cpu.md; the peak on the host that plans or trains"),
)}

# `train.device` names a backend; the planner needs a concrete part.
DEFAULT_FOR_BACKEND = {"ascend": "ascend910b", "gpu": "gpu_a100", "cpu": "cpu"}


def get_device(device: Union[str, DeviceProfile]) -> DeviceProfile:
    """A profile by name (`ascend910b`, `gpu_a100`, `gpu_h100`, `gpu_h800`, `cpu`) or backend (`ascend`, `gpu`)."""
    if isinstance(device, DeviceProfile):
        return device
    name = DEFAULT_FOR_BACKEND.get(device, device)
    if name not in PROFILES:
        near = difflib.get_close_matches(str(device), list(PROFILES) + list(DEFAULT_FOR_BACKEND), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"unknown device {device!r}{hint} Known profiles: {', '.join(PROFILES)} "
                         f"(or a train.device backend: {', '.join(DEFAULT_FOR_BACKEND)})")
    return PROFILES[name]


# ---------------------------------------------------------------------------------------------
# The host's peak, measured
# ---------------------------------------------------------------------------------------------
def measure_fp32_gemm_peak(size: int = PEAK_GEMM_SIZE, repeats: int = PEAK_GEMM_REPEATS) -> float:
    """FLOP/s of a square fp32 GEMM (numpy's BLAS, all the cores it uses) on this host: the best of
    `repeats` by wall clock, or by process CPU time times the cores this process may use (what the
    host could do undisturbed: other processes on a shared host hardly change CPU time), whichever
    is higher."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    np.matmul(a, b)                      # threads started, pages touched
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        np.matmul(a, b)
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    flops = 2.0 * size ** 3
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(flops / max(best_wall, 1e-9), flops / max(best_cpu, 1e-9) * cores)


def _host_key() -> str:
    """What the measured peak depends on: the CPU model, the usable cores, numpy (its BLAS)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return f"{model} | {cores} cores | numpy {np.__version__}"


def peak_cache_file() -> str:
    base = os.environ.get("MOETRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moetrain")
    return os.path.join(base, "host_peak.json")


@functools.lru_cache(maxsize=None)
def host_fp32_peak() -> float:
    """This host's fp32 GEMM peak (FLOP/s), measured once per host (CPU model, cores, numpy) and
    kept in `peak_cache_file()`, so every plan and run on a machine uses the same figure; an
    unreadable or unwritable cache only means measuring again (~0.1 s)."""
    path, key = peak_cache_file(), _host_key()
    try:
        with open(path) as fh:
            cached = json.load(fh)
        if isinstance(cached.get(key), (int, float)) and cached[key] > 0:
            return float(cached[key])
    except (OSError, ValueError, AttributeError):
        cached = {}
    peak = measure_fp32_gemm_peak()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump({**(cached if isinstance(cached, dict) else {}), key: peak}, fh, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
    return peak
