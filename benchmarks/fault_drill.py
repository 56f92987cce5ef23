r"""Fault drill: kill -9 (or stop: `--fault stop`, SIGSTOP, a hang) a random rank at a random step
of a training job that runs under `run_scripts/run_distributed.sh --max-restarts`, and check that
the job still trains every step with exactly the losses of a clean run (docs/faults.md).

    PYTHONPATH=$PWD python benchmarks/fault_drill.py                       # 3 trials, moe_tiny on 4 ranks
    PYTHONPATH=$PWD python benchmarks/fault_drill.py --trials 1 --nproc 2 --config configs/mnist_mlp.yaml \
        --set data.path=../shared/data/mnist --set model.hidden_size=32 --set train.global_batch_size=32

The default job is configs/moe_tiny.yaml shrunk to 2 layers of hidden size 64, 8 steps of 8
sequences of 32 tokens, on 4 ranks with data_parallel 4 and expert_parallel 2 (two expert-parallel
groups of 2 ranks, each expert held by 2 replicas: expert data parallel 2 x ep 2), a checkpoint
every step, PyNative. First a clean run; then each trial launches the same job with
`--max-restarts 3`, waits until the chosen rank reports the chosen step (its heartbeat in
<output_dir>/logs/.status/), kills that rank with SIGKILL, and lets the launcher relaunch every
rank from the last complete checkpoint. A trial passes when the job exits 0 after at least one
restart and its metrics.jsonl holds one loss per step, equal (bitwise) to the clean run's.
`--fault stop` sends SIGSTOP instead (the rank hangs, alive): the launcher must then name that rank
as the one the job hangs on and end the attempt with 124 (whichever timeout fires first: the
collective's, MindSpore's heartbeat or --hang-timeout), before relaunching; `--collective-timeout`
and `--hang-timeout` are passed to the launcher.
Exit status: 0 when every trial passes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "run_scripts", "run_distributed.sh")
TINY_MOE = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.seq_length=32",
            "model.moe.ffn_hidden_size=64", "parallel.data_parallel=4", "parallel.expert_parallel=2",
            "train.global_batch_size=8", "train.eval_interval=0", "train.eval_max_batches=2",
            "lr_schedule.warmup_steps=0"]
COMMON = ["checkpoint.save_steps=1", "checkpoint.keep_max=2", "logging.tensorboard=false",
          "logging.progress_bar=false", "train.jit=false"]


def losses(run_dir: str) -> List[float]:
    from moetrain.logger import read_metrics

    return [r["loss"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]


def job_command(args, out_dir: str, restarts: int) -> List[str]:
    sets = (TINY_MOE if args.config.endswith("moe_tiny.yaml") else []) + COMMON + \
        [f"train.steps={args.steps}", "train.epochs=0", f"train.output_dir={out_dir}"] + args.set
    cmd = [SCRIPT, "--nproc", str(args.nproc)] + (["--max-restarts", str(restarts)] if restarts else [])
    if restarts and args.fault == "stop":
        cmd += ["--collective-timeout", str(args.collective_timeout), "--hang-timeout", str(args.hang_timeout)]
    return cmd + [args.config] + [a for s in sets for a in ("--set", s)]


def job_env(out_dir: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MOETRAIN_RESTART")}
    env.update(MOETRAIN_OUTPUT_DIR=out_dir, MOETRAIN_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")])))
    return env


def heartbeat(out_dir: str, rank: int) -> Optional[dict]:
    try:
        with open(os.path.join(out_dir, "logs", ".status", f"progress_{rank}.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def clean_run(args) -> List[float]:
    out = os.path.join(args.workdir, "clean")
    shutil.rmtree(out, ignore_errors=True)
    started = time.time()
    proc = subprocess.run(job_command(args, out, 0), cwd=REPO, env=job_env(out), capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"fault_drill: the clean run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    reference = losses(out)
    print(f"clean run: {len(reference)} steps in {time.time() - started:.0f} s, final loss {reference[-1]:.6f}",
          flush=True)
    return reference


def trial(args, number: int, rng: random.Random, reference: List[float]) -> bool:
    out = os.path.join(args.workdir, f"trial_{number}")
    shutil.rmtree(out, ignore_errors=True)
    rank, step = rng.randrange(args.nproc), rng.randint(1, args.steps - 2)
    started = time.time()
    proc = subprocess.Popen(job_command(args, out, args.max_restarts), cwd=REPO, env=job_env(out),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    killed_at = None
    try:
        while proc.poll() is None and killed_at is None and time.time() - started < args.timeout:
            beat = heartbeat(out, rank)
            if beat and beat["step"] >= step:
                os.kill(int(beat["pid"]), signal.SIGSTOP if args.fault == "stop" else signal.SIGKILL)
                killed_at = beat["step"]
            time.sleep(0.05)
        output, _ = proc.communicate(timeout=max(1, args.timeout - (time.time() - started)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        print(f"trial {number}: timed out after {args.timeout} s", flush=True)
        return False
    restarts = sum(1 for line in output.splitlines() if "[moetrain.launch] restart " in line)
    got = losses(out) if os.path.exists(os.path.join(out, "metrics.jsonl")) else []
    ok = proc.returncode == 0 and killed_at is not None and restarts >= 1 and got == reference
    if args.fault == "stop":     # the hang is named: that rank, and the attempt ended with 124
        named = f"[moetrain.launch] the job hangs on rank {rank} (" in output
        ok = ok and named and "attempt 0 ended with code 124" in output
        if not named:
            print(f"trial {number}: the launcher did not name rank {rank} as the one the job hangs on", flush=True)
    what = "SIGSTOP" if args.fault == "stop" else "kill -9"
    print(f"trial {number}: {what} of rank {rank} at step {killed_at} (aimed at {step}); exit {proc.returncode}, "
          f"{restarts} restart(s), {len(got)} steps, losses {'equal to' if got == reference else 'DIFFER from'} the "
          f"clean run; {time.time() - started:.0f} s: {'PASS' if ok else 'FAIL'}", flush=True)
    if not ok:
        print("\n".join(output.splitlines()[-40:]), flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "moe_tiny.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None, help="seed of the rank and step choices (default: random)")
    ap.add_argument("--workdir", default=os.path.join(REPO, "runs", "fault_drill"))
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--fault", choices=("kill", "stop"), default="kill",
                    help="kill: SIGKILL the rank (it dies); stop: SIGSTOP it (it hangs; the launcher must name it)")
    ap.add_argument("--collective-timeout", type=int, default=30, help="with --fault stop: the launcher's")
    ap.add_argument("--hang-timeout", type=int, default=60, help="with --fault stop: the launcher's")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error("--steps must be >= 3 (a kill needs a step after a checkpoint and before the end)")
    args.workdir = os.path.abspath(args.workdir)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"fault drill ({args.fault}): {args.trials} trial(s) of {args.config} on {args.nproc} ranks, {args.steps} steps, "
          f"--max-restarts {args.max_restarts}, seed {seed}; runs in {args.workdir}", flush=True)
    reference = clean_run(args)
    rng = random.Random(seed)
    results = [trial(args, n, rng, reference) for n in range(1, args.trials + 1)]
    print(f"fault drill: {sum(results)}/{len(results)} trials passed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
