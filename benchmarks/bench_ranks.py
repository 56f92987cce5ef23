"""One host, several ranks: `msrun` data parallelism with one thread per rank against one process
with every thread, interleaved rounds, the same config (issue 19, item 5; docs/performance.md).

    python benchmarks/bench_ranks.py [--config configs/moe_tiny.yaml] [--nproc 2] [--steps 30] [--rounds 3] [--set k=v]

Per round: one process (`moetrain train`, the kernels on all hardware threads), then `--nproc` ranks
(`run_scripts/run_distributed.sh`, `MOETRAIN_KERNEL_THREADS=1 OMP_NUM_THREADS=1` each), the same
global batch and steps. Each run's figure is the median `tokens_per_s` of its metrics.jsonl over the
steps after `--skip` (compile and warm-up excluded); the last line gives the medians over rounds and
the ratio ranks / one process. `--json FILE` writes every round.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def median_tokens_per_s(output_dir: str, skip: int) -> float:
    from moetrain.logger import read_metrics

    path = os.path.join(output_dir, "metrics.jsonl")
    rates = [r["tokens_per_s"] for r in read_metrics(path) if r.get("step", 0) > skip and "tokens_per_s" in r]
    if not rates:
        raise SystemExit(f"bench_ranks: no tokens_per_s after step {skip} in {path}")
    return statistics.median(rates)


def run(command: list[str], env: dict, log: str) -> None:
    with open(log, "w") as fh:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"bench_ranks: {' '.join(command)} failed (rc {done.returncode}); see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/moe_tiny.yaml")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the median (compile, warm-up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for both runs (repeatable), e.g. model.hidden_size=256")
    parser.add_argument("--json", help="write every round here")
    args = parser.parse_args()
    if args.steps <= args.skip:
        parser.error(f"--steps ({args.steps}) must exceed --skip ({args.skip})")

    work = tempfile.mkdtemp(prefix="moetrain-bench-ranks-")
    sets = ["--set", f"train.steps={args.steps}", "--set", f"train.global_batch_size={args.global_batch}",
            "--set", f"train.eval_interval={args.steps + 1}", "--set", f"checkpoint.save_steps={args.steps + 1}"]
    for override in args.set:
        sets += ["--set", override]
    env = dict(os.environ)
    ranks_env = dict(env, MOETRAIN_KERNEL_THREADS="1", OMP_NUM_THREADS="1")
    rounds = []
    for r in range(1, args.rounds + 1):
        one_dir, ranks_dir = os.path.join(work, f"one_{r}"), os.path.join(work, f"ranks_{r}")
        run([sys.executable, "-m", "moetrain.cli", "train", args.config, *sets,
             "--set", f"train.output_dir={one_dir}"], env, one_dir + ".log")
        run(["bash", "run_scripts/run_distributed.sh", "--nproc", str(args.nproc), args.config, *sets,
             "--set", f"train.output_dir={ranks_dir}", "--set", f"parallel.data_parallel={args.nproc}"],
            ranks_env, ranks_dir + ".log")
        one, ranks = median_tokens_per_s(one_dir, args.skip), median_tokens_per_s(ranks_dir, args.skip)
        rounds.append({"one_process_tokens_per_s": one, "ranks_tokens_per_s": ranks, "ratio": ranks / one})
        print(f"round {r}: one process {one:,.0f} tok/s, {args.nproc} ranks x 1 thread {ranks:,.0f} tok/s, "
              f"ratio {ranks / one:.2f}", flush=True)
    one = statistics.median(x["one_process_tokens_per_s"] for x in rounds)
    ranks = statistics.median(x["ranks_tokens_per_s"] for x in rounds)
    ratio = statistics.median(x["ratio"] for x in rounds)
    print(f"median over {args.rounds} rounds: one process {one:,.0f} tok/s, {args.nproc} ranks {ranks:,.0f} tok/s, "
          f"ratio {ratio:.2f} (outputs in {work})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": args.config, "set": args.set, "nproc": args.nproc, "steps": args.steps, "skip": args.skip,
                       "global_batch": args.global_batch, "rounds": rounds}, fh, indent=1)


if __name__ == "__main__":
    main()
