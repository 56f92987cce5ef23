"""Training-step benchmark: the trainer's own step on random tokens, one process, one JSON line.

    python benchmarks/bench.py --hidden 256 --layers 4 --heads 8 --kv-heads 8 --ffn 512 --experts 8 \\
        --topk 2 --vocab 8192 --seq 256 --batch 8 --steps 10 --warmup 3 [--capacity-factor 1.25]

It builds `moe_gpt` (`gpt` with `--dense`) through the registry, writes a shard of uniformly
random tokens to a temporary folder and runs `Trainer.train_step()` (the jitted grad step and the
`OptimizerStep` with fused AdamW, fp32 master weights) `warmup + steps` times. Warm-up steps (the
graph compiles in the first) are not timed. Printed fields:

  tokens_per_s      batch * seq / median step time
  step_ms_median    median wall time of the timed steps (plus min and max)
  compile_s         the first step's wall time minus the median step: graph compilation (the
                    grad step, the optimizer's prepare and apply) and the first run's allocations
  first_step_s      the first step's wall time
  mfu               model FLOPs (moetrain.planner.flops_per_token: 6 x active matmul params + the
                    attention matmuls) per second / peak_gflops
  peak_gflops       back-to-back fp32 matmul throughput of this machine, measured at start: the
                    best of a jitted MindSpore 2048^2 matmul chain, numpy, and numpy's rate per
                    CPU-second times the usable cores (robust to other processes on the host)
  cpu_ms_median     median CPU time of the process per timed step, all threads (less sensitive
                    to other processes than the wall time; ~2x the wall time on an idle 2-core host)
  peak_rss_steps_mb peak resident memory from the end of the first step (graph compilation) to the
                    end (Linux; None elsewhere): the training step's own peak, without the compiler's
  peak_rss_mb       peak resident memory of the process (the matmul calibration runs in a child
                    process: MindSpore's memory pool keeps its buffers, ~45 MB at 2048^2, which
                    would count as the training step's otherwise)
  fused_kernels     whether moetrain.kernels (grouped GEMM, fused SwiGLU) ran; with them the
                    dropless MoE layout is exact (no padding), without them padded blocks
  loadavg           1-minute load average before and after the timed steps (other processes
                    share the cores: compare figures taken at similar load)
  step_ms_all       every timed step's wall time
Everything else goes to stderr, so stdout is exactly the JSON line. Under `benchmarks/turns.Referee`
(`MOETRAIN_BENCH_TURNS` set; benchmarks/bench_vs_peer.py) each step waits for its turn first.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.turns import NoTurns, Turns  # noqa: E402

PEAK_MATMUL_SIZE = 2048


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--ffn", type=int, default=512, help="FFN width (per expert for MoE)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    ap.add_argument("--dense", action="store_true", help="dense `gpt` instead of `moe_gpt`")
    ap.add_argument("--capacity-factor", type=float, default=0.0, help="0: dropless routing")
    ap.add_argument("--compute-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="bfloat16: emulated on the CPU's fp32 kernels (docs/precision.md)")
    ap.add_argument("--no-jit", action="store_true", help="PyNative step (debugging; much slower)")
    ap.add_argument("--profile", metavar="DIR", default="",
                    help="after the timed steps, run --profile-steps more under mindspore.Profiler into DIR and "
                         "print the time per op type to stderr (and `profile` in the JSON)")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--peak-matmul-size", type=int, default=PEAK_MATMUL_SIZE,
                    help="square fp32 matmul size for the peak measurement")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    return args


def model_section(args) -> dict:
    model = {"name": "gpt" if args.dense else "moe_gpt", "vocab_size": args.vocab, "hidden_size": args.hidden,
             "num_layers": args.layers, "num_heads": args.heads, "num_kv_heads": args.kv_heads or args.heads,
             "ffn_hidden_size": args.ffn, "seq_length": args.seq}
    if not args.dense:
        model["moe"] = {"num_experts": args.experts, "top_k": args.topk, "ffn_hidden_size": args.ffn,
                        "capacity_factor": args.capacity_factor}
    return model


def write_random_shard(prefix: str, vocab: int, num_tokens: int, seed: int = 0) -> None:
    from moetrain.data.lm import TokenShardWriter

    writer = TokenShardWriter(prefix, vocab)
    writer.add_documents([np.random.default_rng(seed).integers(0, vocab, num_tokens)])
    writer.close()


def measure_matmul_peak(size: int = PEAK_MATMUL_SIZE, repeats: int = 5) -> dict:
    """Back-to-back fp32 `size`^2 matmul throughput in GFLOP/s: the best wall-clock rate of a jitted
    MindSpore matmul chain and of numpy, and numpy's best rate per CPU-second times the cores this
    process may use (`per_core_x_cores`), which other processes on a shared host hardly disturb."""
    import mindspore as ms
    from mindspore import ops

    ms.set_device("CPU")   # run() calls this in a fresh child process
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32) / np.sqrt(size)
    b = rng.standard_normal((size, size), dtype=np.float32) / np.sqrt(size)
    flops_per_matmul = 2.0 * size ** 3
    chain = 4
    matmul = ops.MatMul()

    @ms.jit
    def matmul_chain(x, y):
        for _ in range(chain):
            x = matmul(x, y)
        return x

    xa, xb = ms.Tensor(a), ms.Tensor(b)
    matmul_chain(xa, xb).asnumpy()  # compile
    best_ms = best_np = best_np_cpu = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul_chain(xa, xb).asnumpy()
        best_ms = min(best_ms, (time.perf_counter() - start) / chain)
        start, cpu_start = time.perf_counter(), time.process_time()
        np.matmul(a, b)
        best_np = min(best_np, time.perf_counter() - start)
        best_np_cpu = min(best_np_cpu, time.process_time() - cpu_start)
    cores = len(os.sched_getaffinity(0))
    return {"mindspore": flops_per_matmul / best_ms / 1e9, "numpy": flops_per_matmul / best_np / 1e9,
            "per_core_x_cores": flops_per_matmul / max(best_np_cpu, 1e-9) / 1e9 * cores}


def profile_op_types(trainer, steps: int, out_dir: str, top: int = 25) -> list:
    """Runs `steps` train steps under the CPU profiler; returns `[op_type, ms_per_step, share]` rows,
    largest first (kernel time as the profiler records it: wall time, so contention inflates it)."""
    import glob

    import mindspore as ms
    from mindspore.profiler import ProfilerActivity

    profiler = ms.Profiler(output_path=out_dir, activities=[ProfilerActivity.CPU])
    for _ in range(steps):
        trainer.train_step()
    profiler.stop()
    profiler.analyse()
    tables = sorted(glob.glob(os.path.join(out_dir, "*", "FRAMEWORK", "cpu_op_type_info_*.csv")), key=os.path.getmtime)
    if not tables:
        raise RuntimeError(f"mindspore.Profiler wrote no cpu_op_type_info_*.csv under {out_dir}")
    totals = {}
    with open(tables[-1]) as fh:
        next(fh)
        for line in fh:
            fields = line.strip().split(",")
            totals[fields[0]] = totals.get(fields[0], 0.0) + float(fields[3])
    whole = sum(totals.values())
    rows = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [[name, round(ms_total / steps, 2), round(ms_total / whole, 4)] for name, ms_total in rows]


def loadavg() -> float:
    with open("/proc/loadavg") as fh:
        return float(fh.read().split()[0])


def run(args) -> dict:
    import mindspore as ms

    from moetrain import kernels
    from moetrain.config import config_from_dict
    from moetrain.planner import flops_per_token
    from moetrain.trainer import Trainer

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    with multiprocessing.get_context("spawn").Pool(1) as pool:   # its buffers stay out of this process's RSS
        peak = pool.apply(measure_matmul_peak, (args.peak_matmul_size,))
    peak_gflops = max(peak.values())
    total_steps = args.warmup + args.steps + (args.profile_steps if args.profile else 0)
    with tempfile.TemporaryDirectory(prefix="moetrain-bench-") as workdir:
        prefix = os.path.join(workdir, "random")
        write_random_shard(prefix, args.vocab, (total_steps + 1) * args.batch * args.seq + 1)
        cfg = config_from_dict({
            "model": model_section(args),
            "data": {"type": "lm", "path": prefix},
            "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "clip_grad_norm": 1.0},
            "precision": {"compute_dtype": args.compute_dtype},
            "train": {"steps": total_steps, "global_batch_size": args.batch, "output_dir": workdir,
                      "jit": not args.no_jit},
            "checkpoint": {"save_at_end": False},
            "logging": {"tensorboard": False, "progress_bar": False},
        }, source="benchmarks/bench.py")
        with contextlib.redirect_stdout(sys.stderr):
            trainer = Trainer(cfg)
            load_before = loadavg()
            times, cpu_times, records = [], [], []
            first_step_s = None
            turns = Turns.from_env() or NoTurns()   # in turns with another benchmark (benchmarks/bench_vs_peer.py)
            for step in range(args.warmup + args.steps):
                turns.wait()
                start, cpu_start = time.perf_counter(), time.process_time()
                records.append(trainer.train_step())
                end, cpu_end = time.perf_counter(), time.process_time()
                turns.done()
                if step == 0:
                    first_step_s = end - start
                    steps_rss_reset = reset_peak_rss()   # the steps' peak, without the compilation's
                if step >= args.warmup:
                    times.append(end - start)
                    cpu_times.append(cpu_end - cpu_start)
            turns.wait()
            load_after = loadavg()
            profile = profile_op_types(trainer, args.profile_steps, args.profile) if args.profile else None
            trainer.logger.close()

    step_s = statistics.median(times)
    tokens_per_step = args.batch * args.seq
    model_flops = flops_per_token(cfg.model, args.seq) * tokens_per_step / step_s
    last = records[-1]
    result = {
        "tokens_per_s": round(tokens_per_step / step_s, 1),
        "step_ms_median": round(step_s * 1e3, 1),
        "step_ms_min": round(min(times) * 1e3, 1),
        "step_ms_max": round(max(times) * 1e3, 1),
        "step_ms_all": [round(t * 1e3, 1) for t in times],
        "cpu_ms_median": round(statistics.median(cpu_times) * 1e3, 1),
        "compile_s": round(first_step_s - step_s, 2),
        "first_step_s": round(first_step_s, 2),
        "mfu": round(model_flops / (peak_gflops * 1e9), 4),
        "model_gflops_per_s": round(model_flops / 1e9, 2),
        "peak_gflops": round(peak_gflops, 1),
        "peak_gflops_mindspore": round(peak["mindspore"], 1),
        "peak_gflops_numpy": round(peak["numpy"], 1),
        "peak_gflops_per_core_x_cores": round(peak["per_core_x_cores"], 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_rss_steps_mb": peak_rss_mb() if steps_rss_reset else None,
        "loss_first": round(records[0]["loss"], 4),
        "loss_last": round(last["loss"], 4),
        "drop_rate": round(last.get("drop_rate", 0.0), 4),
        "fused_kernels": kernels.available(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "config": {"model": cfg.model.name, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                   "kv_heads": args.kv_heads or args.heads, "ffn": args.ffn, "vocab": args.vocab, "seq": args.seq,
                   "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                   "compute_dtype": args.compute_dtype, "jit": not args.no_jit,
                   **({} if args.dense else {"experts": args.experts, "topk": args.topk,
                                             "capacity_factor": args.capacity_factor})},
    }
    if profile is not None:
        result["profile"] = {"steps": args.profile_steps, "op_types_ms_per_step": profile}
        print("op type                      ms/step   share", file=sys.stderr)
        for name, ms_per_step, share in profile:
            print(f"{name:28s} {ms_per_step:8.1f}  {share:6.1%}", file=sys.stderr)
    return result


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux: `5` to /proc/self/clear_refs); False where that fails."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb():
    """VmHWM of this process in MB (since start or the last `reset_peak_rss`), or None."""
    try:
        with open("/proc/self/status") as fh:
            kb = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
        return round(kb / 1024, 1)
    except (OSError, StopIteration, ValueError):
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
