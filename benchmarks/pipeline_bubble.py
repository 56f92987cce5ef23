"""Measured pipeline bubble of every schedule against its theoretical one.

    python benchmarks/pipeline_bubble.py [--pp 2,4] [--micro 8] [--steps 6] [--layers 8] [--hidden 128]
        [--seq 64] [--schedules 1f1b,interleaved_1f1b,zero_bubble_h1,zero_bubble_v] [--json]

One msrun launch per pipeline size (tests/workers/train_runs_worker.py: the schedules train one
after another in the same processes, so they share the machine's conditions) of a moe_tiny-like
model on the KJV slice. Each step's `pipeline_bubble` (metrics.jsonl) is the fraction of the step
the stages spent in exchanges with their neighbours (waiting, plus the transfer), averaged over the
stages; the table gives the median over the steps after the first (which compiles), the median
step time, and the schedule's idle fraction at equal forward / input-gradient / weight-gradient
pass costs (`moetrain.parallel.schedules.schedule_bubble`). Interleaved 1F1B runs v=2 chunks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble_h1", "zero_bubble_v")


def model_overrides(args) -> list:
    kjv = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
    return [f"data.path={kjv}_train", f"data.eval_path={kjv}_eval", f"data.tokenizer={kjv}.model",
            f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", "model.num_heads=4",
            "model.num_kv_heads=2", f"model.ffn_hidden_size={2 * args.hidden}", f"model.seq_length={args.seq}",
            "model.vocab_size=2048", "model.moe.num_experts=4", "model.moe.top_k=2",
            f"model.moe.ffn_hidden_size={args.hidden}", f"train.steps={args.steps}",
            f"train.global_batch_size={args.micro}", "train.micro_batch_size=1", "train.eval_max_batches=1",
            "train.eval_interval=0", "checkpoint.save_at_end=false", "checkpoint.save_steps=0",
            "logging.tensorboard=false", "logging.progress_bar=false"]


def chunks_of(kind: str) -> int:
    return 2 if kind in ("interleaved_1f1b", "zero_bubble_v") else 1


def measure(pp: int, args) -> list:
    from distributed import run_workers

    from moetrain.parallel.schedules import schedule_bubble

    runs = {kind: [f"parallel.pipeline_stage={pp}", f"parallel.pipeline_schedule={kind}"]
            + (["parallel.pp_interleave_num=2"] if kind == "interleaved_1f1b" else []) for kind in args.schedules}
    specs = [f"{kind}:configs/moe_tiny.yaml:" + ",".join(model_overrides(args) + extra) for kind, extra in runs.items()]
    job = run_workers("tests/workers/train_runs_worker.py", pp, specs, timeout=3000,
                      job_dir=tempfile.mkdtemp(prefix=f"pipeline_bubble_pp{pp}_")).check()
    rows = []
    for kind in runs:
        with open(os.path.join(job.out_dir, kind, "metrics.jsonl")) as fh:
            steps = [r for r in map(json.loads, fh) if "pipeline_bubble" in r][1:]
        rows.append({"pp": pp, "schedule": kind, "micro_batches": args.micro,
                     "theory": schedule_bubble(kind, pp, args.micro, chunks_of(kind)),
                     "measured": float(np.median([r["pipeline_bubble"] for r in steps])),
                     "step_s": float(np.median([r["step_time_s"] for r in steps])),
                     "per_step": [round(r["pipeline_bubble"], 4) for r in steps]})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="2,4")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.schedules = args.schedules.split(",")
    rows = [row for pp in map(int, args.pp.split(",")) for row in measure(pp, args)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| pp | schedule | micro-batches | theoretical bubble | measured bubble (median) | step time (median) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pp']} | {r['schedule']} | {r['micro_batches']} | {r['theory']:.3f} | {r['measured']:.3f} | "
              f"{r['step_s']:.2f} s |")


if __name__ == "__main__":
    main()
