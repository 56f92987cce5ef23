"""Every expert-parallel layout of a config against one process, at the config's real settings.

    python benchmarks/layout_matrix.py [CONFIG] [--steps 20] [--layouts dp4_ep4,pp2_dp2_ep2]
        [--capacity adaptive,bound] [--optimizer adamw,sgd] [--out runs/layout_matrix]
        [--table docs/layout_matrix.md] [--set key=value ...]

For each optimizer it trains CONFIG (default configs/moe_tiny.yaml, with
`parallel.moe_aux_loss_scope=global` so that every layout balances the same whole batch) on one
process, then on each layout with each capacity policy (`adaptive`, the default: dispatch buffers
sized from the routing counts; `bound`: the static bound, `parallel.moe_capacity=bound`), through
the user's commands (`moetrain train`, `run_scripts/run_distributed.sh`). Every step must reproduce
one process:
  - loss within 1e-5 relative, grad_norm within 1e-4 relative, eval_loss within 1e-5;
  - expert_rows == routed (dropless: every routed row computed once);
  - expert loads exact for the first EXACT_LOAD_STEPS steps; after that at most LOAD_SLACK
    assignments apart per layer (sum of |difference| over its experts): another summation order can
    flip a near-tied routing decision, which moves one assignment (2 counts of 1).
With `--resume-at N` each run also saves at step N; its checkpoints past N are then deleted and the
run resumed from step N (`--resume`, the documented recovery): steps N+1.. must again reproduce one
process (the dispatch capacities and their sizing window come back from the checkpoint).
Writes OUT/results.json and, with --table, a markdown table of the results.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the pipeline needs micro-batches (>= its stages): then every layout and the reference run the same
# micro-batches of 4 samples, with the config's own per-micro-batch aux loss (the 'global' scope would
# balance over dp ranks' micro-batches, which one process does not group alike)
MICRO_BATCHES = ["train.micro_batch_size=4", "parallel.moe_aux_loss_scope=micro_batch"]
# issue 30's tp2.dp2.ep2.etp2 command ran micro-batches of 2: 4 per dp rank, with the same pairs of
# samples as one process's micro-batches of 2 (dp ranks take contiguous halves of the global batch)
MICRO_BATCHES_OF_2 = ["train.micro_batch_size=2", "parallel.moe_aux_loss_scope=micro_batch"]
# issue 34's context-parallel rows: sequences of 1,024 tokens (8 a step) split over 2 or 4 ranks
LONG_SEQUENCES = ["model.seq_length=1024", "train.global_batch_size=8"]
REFERENCE_OF = {"pp2_dp2_ep2": MICRO_BATCHES,   # layout -> the overrides it shares with its reference
                "dp2_ep2_mb4": MICRO_BATCHES,
                "tp2_dp2_ep2_etp2_mb2": MICRO_BATCHES_OF_2,
                **{f"cp{cp}_{kind}_seq1024": LONG_SEQUENCES for cp in (2, 4) for kind in ("p2p", "a2a")}}
LAYOUTS = {   # name -> (ranks, overrides)
    "dp4_ep4": (4, ["parallel.data_parallel=4", "parallel.expert_parallel=4"]),
    "dp4_ep2": (4, ["parallel.data_parallel=4", "parallel.expert_parallel=2"]),
    "dp2_ep2_zero2": (2, ["parallel.data_parallel=2", "parallel.expert_parallel=2", "parallel.optimizer_shard=2"]),
    "tp2_dp2_ep2_etp2": (4, ["parallel.model_parallel=2", "parallel.data_parallel=2", "parallel.expert_parallel=2",
                             "parallel.expert_tensor_parallel=2"]),
    "tp2_dp2_ep2_etp2_mb2": (4, ["parallel.model_parallel=2", "parallel.data_parallel=2", "parallel.expert_parallel=2",
                                 "parallel.expert_tensor_parallel=2"] + MICRO_BATCHES_OF_2),
    "tp2_dp2_ep4_sp": (4, ["parallel.model_parallel=2", "parallel.data_parallel=2", "parallel.expert_parallel=4",
                           "parallel.use_seq_parallel=true"]),
    "pp2_dp2_ep2": (4, ["parallel.pipeline_stage=2", "parallel.data_parallel=2", "parallel.expert_parallel=2",
                        "parallel.pipeline_schedule=1f1b"] + MICRO_BATCHES),
    # the pipeline's control: the same dp ranks and micro-batches of 4 without the pipeline
    "dp2_ep2_mb4": (2, ["parallel.data_parallel=2", "parallel.expert_parallel=2"] + MICRO_BATCHES),
    # context parallelism (no expert parallelism: the capacity policy has nothing to size)
    **{f"cp{cp}_{kind}_seq1024": (cp, [f"parallel.context_parallel={cp}", f"parallel.cp_comm_type={kind}"]
                                  + LONG_SEQUENCES) for cp in (2, 4) for kind in ("p2p", "a2a")},
}
OPTIMIZERS = {
    "adamw": [],
    # no per-element normalisation and no clipping: a wrong gradient scale shows in the loss
    "sgd": ["optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.clip_grad_norm=0", "optimizer.weight_decay=0"],
}
COMMON = ["parallel.moe_aux_loss_scope=global", "logging.tensorboard=false", "logging.progress_bar=false",
          "logging.log_interval=1"]
LOSS_RTOL, GRAD_NORM_RTOL, EVAL_RTOL = 1e-5, 1e-4, 1e-5
EXACT_LOAD_STEPS, LOAD_SLACK = 5, 8


def records(run_dir: str):
    """(train step records, eval records) of a run's metrics.jsonl."""
    steps, evals = [], []
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        for line in fh:
            record = json.loads(line)
            if "grad_norm" in record:
                steps.append(record)
            elif "eval_loss" in record:
                evals.append(record)
    return steps, evals


def compare(reference, run) -> Dict:
    """The worst deviations of `run` from `reference` ((steps, evals) each) and the failures."""
    (ref_steps, ref_evals), (steps, evals) = reference, run
    failures: List[str] = []
    if len(steps) != len(ref_steps):
        failures.append(f"{len(steps)} steps logged, the reference {len(ref_steps)}")
    loss = grad = 0.0
    load_late = 0
    for want, got in zip(ref_steps, steps):
        step = got["step"]
        loss_err = abs(got["loss"] - want["loss"]) / abs(want["loss"])
        grad_err = abs(got["grad_norm"] - want["grad_norm"]) / max(abs(want["grad_norm"]), 1e-12)
        loss, grad = max(loss, loss_err), max(grad, grad_err)
        if loss_err > LOSS_RTOL:
            failures.append(f"step {step}: loss {got['loss']} vs {want['loss']} ({loss_err:.1e} relative)")
        if grad_err > GRAD_NORM_RTOL:
            failures.append(f"step {step}: grad_norm {got['grad_norm']} vs {want['grad_norm']} ({grad_err:.1e})")
        if got.get("expert_rows") != got.get("routed") or got.get("routed") != want.get("routed"):
            failures.append(f"step {step}: expert_rows {got.get('expert_rows')} routed {got.get('routed')} "
                            f"(one process routed {want.get('routed')})")
        apart = np.abs(np.asarray(got["expert_load"]) - np.asarray(want["expert_load"])).sum(-1)
        if step <= EXACT_LOAD_STEPS and apart.any():
            failures.append(f"step {step}: expert loads differ by {apart.tolist()} assignments per layer")
        elif step > EXACT_LOAD_STEPS:
            load_late = max(load_late, int(apart.max()))
            if apart.max() > LOAD_SLACK:
                failures.append(f"step {step}: expert loads {apart.tolist()} apart per layer (> {LOAD_SLACK})")
    eval_err = 0.0
    for want, got in zip(ref_evals, evals):
        err = abs(got["eval_loss"] - want["eval_loss"]) / abs(want["eval_loss"])
        eval_err = max(eval_err, err)
        if err > EVAL_RTOL:
            failures.append(f"eval at step {got['step']}: {got['eval_loss']} vs {want['eval_loss']}")
    if len(evals) != len(ref_evals):
        failures.append(f"{len(evals)} evaluations, the reference {len(ref_evals)}")
    return {"steps": len(steps), "loss_rel": loss, "grad_norm_rel": grad, "eval_rel": eval_err,
            "load_apart_after_exact": load_late, "failures": failures}


def train(config: str, out: str, overrides: List[str], nproc: int, env: Dict[str, str], log: str,
          resume: bool = False) -> float:
    sets = [a for o in overrides for a in ("--set", o)] + ["--resume" if resume else "--overwrite"]
    if nproc == 1:
        cmd = [sys.executable, "-m", "moetrain.cli", "train", config, *sets]
    else:
        cmd = ["bash", os.path.join(ROOT, "run_scripts", "run_distributed.sh"), "--nproc", str(nproc), config, *sets]
    start = time.perf_counter()
    with open(log, "w") as fh:
        code = subprocess.call(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env})
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {code}; see {log}")
    return time.perf_counter() - start


def resume_from(run_dir: str, step: int, rerun) -> None:
    """Deletes the run's checkpoints past `step`, then `rerun()` (the same command with --resume)."""
    root = os.path.join(run_dir, "checkpoints")
    later = [name for name in os.listdir(root) if name.startswith("step_") and int(name[5:]) > step]
    if not os.path.isdir(os.path.join(root, f"step_{step:08d}")):
        raise RuntimeError(f"{root} holds no checkpoint of step {step} to resume from")
    for name in later:
        shutil.rmtree(os.path.join(root, name))
    rerun()


def capacity_events(log: str) -> Dict[str, int]:
    """How often the run resized its dispatch buffers (rank 0's log lines)."""
    counts = {"overflow": 0, "shrink": 0, "sized": 0, "reruns": 0}
    with open(log, errors="replace") as fh:
        for line in fh:
            if "MoE dispatch capacities" in line:
                for why in ("overflow", "shrink", "sized"):
                    counts[why] += line.count(f"({why})")
                counts["reruns"] += "re-running" in line
    return counts


def table(results: List[Dict], steps: int) -> str:
    rows = ["| layout | ranks | capacities | optimizer | steps | loss (max rel.) | grad_norm (max rel.) | eval_loss "
            "| loads apart after step 5 | resizes (grow/shrink, re-runs) | result |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = list(LAYOUTS)
    for r in sorted(results, key=lambda r: (order.index(r["layout"]), r["optimizer"], r["capacity"])):
        c = r.get("capacity_events", {})
        resizes = f"{c.get('overflow', 0)}/{c.get('shrink', 0)}, {c.get('reruns', 0)}" if c else "-"
        ok = "pass" if not r["failures"] else "FAIL: " + "; ".join(r["failures"][:2])
        rows.append(f"| {r['layout']}{' (resumed at step %d)' % r['resumed'] if r.get('resumed') else ''} | {r['ranks']} | {r['capacity']} | {r['optimizer']} | {r['steps']} | "
                    f"{r['loss_rel']:.1e} | {r['grad_norm_rel']:.1e} | {r['eval_rel']:.1e} | "
                    f"{r['load_apart_after_exact']} | {resizes} | {ok} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", default="configs/moe_tiny.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--capacity", default="adaptive,bound")
    ap.add_argument("--optimizer", default="adamw,sgd")
    ap.add_argument("--out", default="runs/layout_matrix")
    ap.add_argument("--table", default="")
    ap.add_argument("--resume-at", type=int, default=0, metavar="N",
                    help="also save at step N, then resume each run from it and check the steps after N")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; choose from {list(LAYOUTS)}")
    config = os.path.abspath(args.config)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    results_path = os.path.join(out, "results.json")
    results = json.load(open(results_path)) if os.path.exists(results_path) else []   # earlier runs kept
    for optimizer in args.optimizer.split(","):
        base = COMMON + [f"train.steps={args.steps}"] + OPTIMIZERS[optimizer] + args.sets
        if args.resume_at:
            base.append(f"checkpoint.save_steps={args.resume_at}")
        references = {}
        for layout in layouts:
            shared = REFERENCE_OF.get(layout, [])
            key = ",".join(shared)
            if key not in references:
                ref_dir = os.path.join(out, f"one_process_{optimizer}" + "".join(f"_{o.split('.')[-1]}" for o in shared))
                seconds = train(config, ref_dir, base + shared + [f"train.output_dir={ref_dir}"], 1, {},
                                ref_dir + ".log")
                print(f"one process, {optimizer} {key}: {seconds:.0f} s", flush=True)
                references[key] = records(ref_dir)
            reference = references[key]
            nproc, overrides = LAYOUTS[layout]
            for capacity in args.capacity.split(","):
                name = f"{layout}_{capacity}_{optimizer}"
                run_dir = os.path.join(out, name)
                run_overrides = base + overrides + [f"train.output_dir={run_dir}", f"parallel.moe_capacity={capacity}"]
                env = {}
                try:
                    seconds = train(config, run_dir, run_overrides, nproc, env, run_dir + ".log")
                    result = compare(reference, records(run_dir))
                    if args.resume_at:
                        resume_from(run_dir, args.resume_at, lambda: train(
                            config, run_dir, run_overrides, nproc, env, run_dir + ".resume.log", resume=True))
                        resumed = compare(reference, records(run_dir))
                        result["failures"] += [f"after resuming at step {args.resume_at}: {f}"
                                               for f in resumed["failures"]]
                        result["resumed"] = args.resume_at
                except (RuntimeError, OSError) as exc:
                    seconds, result = 0.0, {"steps": 0, "loss_rel": float("nan"), "grad_norm_rel": float("nan"),
                                            "eval_rel": float("nan"), "load_apart_after_exact": -1,
                                            "failures": [str(exc)]}
                result.update(layout=layout, ranks=nproc, capacity=capacity, optimizer=optimizer,
                              seconds=round(seconds, 1), capacity_events=capacity_events(run_dir + ".log"))
                results = [r for r in results if (r["layout"], r["capacity"], r["optimizer"]) !=
                           (layout, capacity, optimizer)] + [result]
                print(f"{name}: {'pass' if not result['failures'] else 'FAIL'} (loss {result['loss_rel']:.1e}, "
                      f"grad_norm {result['grad_norm_rel']:.1e}, {seconds:.0f} s)"
                      + "".join(f"\n    {f}" for f in result["failures"][:5]), flush=True)
                with open(results_path, "w") as fh:
                    json.dump(results, fh, indent=1)
    print(table(results, args.steps))
    if args.table:
        with open(args.table, "w") as fh:
            fh.write(table(results, args.steps) + "\n")
    return 0 if all(not r["failures"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
