"""First-step time against depth, per layout: does compilation stay (at most) linear in the layers?

    python benchmarks/compile_depth.py [--depths 4 8 16 32] [--layouts one tp2 pp2 dp2ep2] [--model moe|gpt]
                                  [--json OUT.json]

For each layout one process tree (one process, or an msrun job of 2 ranks) trains, depth after
depth, a `moe_tiny`-width model (hidden 128, 4 heads / 2 kv-heads, 8 experts top-2 on every layer;
`--model gpt`: the dense `gpt_tiny` width) for 2 steps on the shipped KJV slice, and reports per
depth: `first_step_s` (the first optimizer step: compilation of the grad step and the optimizer,
plus one step of work), `step_s` (the second step) and `compile_s` = first - second. Rank 0's
figures are printed as a table and, with --json, written out. Timings need an idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
KJV = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
LAYOUTS = {"one": (1, []), "tp2": (2, ["parallel.model_parallel=2"]), "pp2": (2, ["parallel.pipeline_stage=2"]),
           "dp2ep2": (2, ["parallel.data_parallel=2", "parallel.expert_parallel=2"])}


def overrides(depth: int, out_dir: str) -> list:
    return [f"data.path={KJV}_train", f"data.eval_path={KJV}_eval", f"data.tokenizer={KJV}.model",
            f"model.num_layers={depth}", "train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2",
            "train.eval_interval=0", "checkpoint.save_at_end=false", "checkpoint.save_steps=0",
            "logging.tensorboard=false", "logging.progress_bar=false", f"train.output_dir={out_dir}"]


def worker(out_json: str, config: str, layout: list, depths: list) -> None:
    """Train each depth in this process (under msrun: every rank) and write rank 0's times."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
    from moetrain import trainer as trainer_module
    from moetrain.config import load_config
    from train_runs_worker import reuse_parallel_context

    reuse_parallel_context(trainer_module)
    results = []
    for depth in depths:
        out = os.path.join(os.path.dirname(out_json), f"depth{depth}")   # one folder shared by the ranks
        cfg = load_config(config, overrides(depth, out) + layout)
        start = time.perf_counter()
        trainer = trainer_module.Trainer(cfg)
        built = time.perf_counter() - start
        first = trainer._first_step()
        second = trainer.train_step()
        trainer.logger.close()
        results.append({"depth": depth, "build_s": round(built, 2), "first_step_s": round(first["step_time_s"], 2),
                        "step_s": round(second["step_time_s"], 3),
                        "compile_s": round(first["step_time_s"] - second["step_time_s"], 2),
                        "loss": [first["loss"], second["loss"]], "grad_norm": [first["grad_norm"],
                                                                             second["grad_norm"]]})
        if trainer.rank == 0:
            print(json.dumps(results[-1]), flush=True)
    if trainer.rank == 0:
        with open(out_json, "w") as fh:
            json.dump(results, fh)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--model", choices=("moe", "gpt"), default="moe")
    ap.add_argument("--json", default="")
    ap.add_argument("--job-result", nargs=3, metavar=("OUT_JSON", "CONFIG", "LAYOUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    config = os.path.join(ROOT, "configs", "moe_tiny.yaml" if args.model == "moe" else "gpt_tiny.yaml")
    if args.job_result:
        out_json, config, layout = args.job_result
        worker(out_json, config, [o for o in layout.split(",") if o], args.depths)
        return 0
    table = {}
    for name in args.layouts:
        nproc, layout = LAYOUTS[name]
        with tempfile.TemporaryDirectory(prefix=f"compile-depth-{name}-") as job:
            out_json = os.path.join(job, "result.json")
            command = [sys.executable, os.path.abspath(__file__), "--depths", *map(str, args.depths),
                       "--model", args.model, "--job-result", out_json, config, ",".join(layout)]
            if nproc > 1:
                command = [sys.executable, "-m", "moetrain.distributed.launch", "--nproc", str(nproc), "--log-dir",
                           os.path.join(job, "logs"), "--tail", "none", "--"] + command
            print(f"[{name}] {' '.join(command[:6])} ...", file=sys.stderr, flush=True)
            subprocess.run(command, cwd=job, check=True)
            with open(out_json) as fh:
                table[name] = json.load(fh)
    print(f"{'layout':8s} {'depth':>5s} {'first step s':>13s} {'compile s':>10s} {'step s':>8s}  first / first@{args.depths[0]}")
    for name, rows in table.items():
        base = rows[0]["first_step_s"]
        for row in rows:
            print(f"{name:8s} {row['depth']:5d} {row['first_step_s']:13.1f} {row['compile_s']:10.1f} {row['step_s']:8.2f}"
                  f"  {row['first_step_s'] / base:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "layouts": table}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
