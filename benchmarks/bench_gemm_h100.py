"""GEMM throughput of one GPU at the published MoE runs' shapes, bf16 and fp8 (torch._scaled_mm,
tensor-wise scales): what `moetrain/planner/constants.py`'s GEMM efficiency is measured from
(docs/plan.md, "Published runs"). PyTorch only (no MindSpore on the GPU machine).

    python benchmarks/bench_gemm_h100.py --out DIR      # writes DIR/gemm.json and DIR/gemm.md
    python benchmarks/bench_gemm_h100.py --smoke        # tiny shapes on the CPU: checks the script runs

Each shape is a forward GEMM [M, K] x [K, N] and its two backward GEMMs (input gradient
[M, N] x [N, K], weight gradient [K, M] x [M, N]); TFLOP/s = 2 M K N / seconds, efficiency = that /
the data-sheet dense peak (H100 SXM: 989.4 bf16, 1,978.9 fp8 TFLOP/s). Expert GEMMs are also timed as
the rank runs them: its E_local experts one after the other (per-expert M rows each)."""
import argparse
import json
import os
import time

import torch

PEAK = {"bfloat16": 989.4e12, "float8": 1978.9e12}      # H100 SXM5 data sheet, dense

# (name, M, K, N, experts on the rank): per-rank GEMMs of the four published runs (docs/plan.md)
SHAPES = [
    # expert GEMMs: M = rows per expert per micro-batch (balanced), fc1 = gate|up, fc2 = down
    ("qwen3 expert fc1 (16 local)", 1024, 4096, 3072, 16),
    ("qwen3 expert fc2 (16 local)", 1024, 1536, 4096, 16),
    ("dsv3-h100 expert fc1 (4 local)", 4096, 7168, 4096, 4),
    ("dsv3-h100 expert fc2 (4 local)", 4096, 2048, 7168, 4),
    ("dsv3-h800 expert fc1 (4 local)", 8192, 7168, 4096, 4),
    ("dsv3-h800 expert fc2 (4 local)", 8192, 2048, 7168, 4),
    ("mixtral expert fc1 (1 local)", 4096, 6144, 32768, 1),
    ("mixtral expert fc2 (1 local)", 4096, 16384, 6144, 1),
    # attention projections, 4096 tokens a micro-batch (tp splits N of qkv, K of o)
    ("qwen3 qkv tp2", 4096, 4096, 4608, 1),
    ("qwen3 o tp2", 4096, 4096, 4096, 1),
    ("dsv3 wq_b tp2", 4096, 1536, 12288, 1),
    ("dsv3 wkv_b tp2", 4096, 512, 16384, 1),
    ("dsv3 wo tp2", 4096, 8192, 7168, 1),
    ("dsv3 wq_a", 4096, 7168, 1536, 1),
    ("mixtral qkv tp2", 4096, 6144, 4096, 1),
    ("mixtral o tp2", 4096, 3072, 6144, 1),
]
# the efficiency-vs-size curve: M swept at three (K, N)
SWEEP_M = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SWEEP_KN = [(4096, 4096), (7168, 4096), (2048, 7168)]


def timed(fn, device, min_seconds=0.05):
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if n % 5 == 0:
            sync()
            if time.perf_counter() - start >= min_seconds:
                break
    sync()
    return (time.perf_counter() - start) / n


def gemm_fn(M, K, N, dtype, device, experts=1):
    """A callable running `experts` GEMMs [M, K] x [K, N] in `dtype` (bfloat16 or float8)."""
    a = [torch.randn(M, K, device=device).to(torch.bfloat16) for _ in range(experts)]
    w = [torch.randn(N, K, device=device).to(torch.bfloat16) for _ in range(experts)]
    if dtype == "bfloat16" or device != "cuda":
        bt = [x.t() for x in w]
        return lambda: [torch.mm(x, y) for x, y in zip(a, bt)]
    f8 = torch.float8_e4m3fn
    a8 = [x.to(f8) for x in a]
    b8 = [x.to(f8).t() for x in w]          # column-major [K, N], as _scaled_mm wants
    one = torch.tensor(1.0, device=device)
    return lambda: [torch._scaled_mm(x, y, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                    for x, y in zip(a8, b8)]


def measure(M, K, N, dtype, device, experts=1):
    """Seconds and efficiency of the forward, input-gradient and weight-gradient GEMMs together."""
    total = 0.0
    for m, k, n in ((M, K, N), (M, N, K), (K, M, N)):
        total += timed(gemm_fn(m, k, n, dtype, device, experts), device)
    flops = 3 * 2 * M * K * N * experts
    return total, flops / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    scale = 64 if args.smoke else 1
    dtypes = ["bfloat16"] if args.smoke else ["bfloat16", "float8"]
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke)"
    rows, sweep = [], []
    t0 = time.time()
    for label, M, K, N, E in SHAPES:
        M, K, N = max(16, M // scale), max(16, K // scale), max(16, N // scale)
        for dtype in dtypes:
            try:
                one_s, one_rate = measure(M, K, N, dtype, device)
            except Exception as exc:     # noqa: BLE001 - recorded, the other shapes still run
                rows.append({"shape": label, "dtype": dtype, "error": str(exc)[:200]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            row = {"shape": label, "M": M, "K": K, "N": N, "experts": E, "dtype": dtype,
                   "tflops": one_rate / 1e12, "efficiency": one_rate / PEAK[dtype]}
            if E > 1:
                _, loop_rate = measure(M, K, N, dtype, device, E)
                row.update(loop_tflops=loop_rate / 1e12, loop_efficiency=loop_rate / PEAK[dtype])
            rows.append(row)
            print(json.dumps(row), flush=True)
    for K, N in SWEEP_KN:
        for M in SWEEP_M:
            m, k, n = max(16, M // scale), max(16, K // scale), max(16, N // scale)
            for dtype in dtypes:
                try:
                    _, rate = measure(m, k, n, dtype, device)
                except Exception as exc:     # noqa: BLE001
                    print(json.dumps({"M": m, "dtype": dtype, "error": str(exc)[:200]}), flush=True)
                    continue
                sweep.append({"M": m, "K": k, "N": n, "dtype": dtype, "tflops": rate / 1e12,
                              "efficiency": rate / PEAK[dtype]})
                print(json.dumps(sweep[-1]), flush=True)
    result = {"device": name, "torch": torch.__version__, "peak": PEAK, "seconds": time.time() - t0,
              "shapes": rows, "sweep": sweep}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"device: {name}, torch {torch.__version__}; efficiency = TFLOP/s / data-sheet dense peak "
             f"(bf16 989.4, fp8 1978.9); forward + both backward GEMMs", "",
             "| shape | M x K x N | dtype | TFLOP/s | efficiency | E_local one after another |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | | {r['dtype']} | error: {r['error'][:80]} | | |")
            continue
        loop = f"{r['loop_efficiency']:.2f}" if "loop_efficiency" in r else ""
        lines.append(f"| {r['shape']} | {r['M']} x {r['K']} x {r['N']} | {r['dtype']} | {r['tflops']:.0f} | "
                     f"{r['efficiency']:.2f} | {loop} |")
    lines += ["", "| K x N | dtype | " + " | ".join(f"M {m}" for m in SWEEP_M) + " |",
              "|---|---|" + "---|" * len(SWEEP_M)]
    for K, N in SWEEP_KN:
        for dtype in dtypes:
            effs = [s["efficiency"] for s in sweep if s["dtype"] == dtype and s["K"] == max(16, K // scale)
                    and s["N"] == max(16, N // scale)]
            lines.append(f"| {K} x {N} | {dtype} | " + " | ".join(f"{e:.2f}" for e in effs) + " |")
    with open(os.path.join(args.out, "gemm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
