"""moetrain against the PyTorch reference, interleaved in one session (issue figures are ratios).

    python benchmarks/bench_vs_peer.py [--rounds 3] [--peer-python /tmp/peerenv/bin/python]
                                  [--peer-script ../shared/peer-bench/hf_moe_bench.py] [--json OUT]
                                  [--interleave steps|processes] [--precision fp32|bf16]

Each round measures the MoE pair (moetrain, transformers Mixtral) and then the dense pair (moetrain
`--dense`, transformers Llama), every side a fresh process on the same dimensions (benchmarks/bench.py's
defaults; the peer with 2 intra-op threads, this machine's cores).

With `--interleave steps` (the default) the two processes of a pair take their steps in turns of
four (benchmarks/turns.py): this host's speed drifts by 10-40 % within seconds, and turns of ~2 s put both
sides in every stretch of it. The first step of each turn follows a pause and runs at another speed
than steps back to back (the peer's slower, this project's faster), so it is not compared: each side's
figure is the median of the other three steps of its four timed turns (12 steps; one warm-up turn
before them). The side that goes first alternates by round. `--interleave processes` runs the four
processes one after the other instead, 3 warm-up and 10 timed steps each (the method of the figures
before 2026-11-26). Prints per round the tokens/s (2048 tokens over the median compared step) and
peak RSS of both and their ratios, then the median ratio over rounds. `--precision bf16`: this
project with `precision.compute_dtype: bfloat16` (docs/precision.md), the peer under
`torch.autocast("cpu", dtype=torch.bfloat16)` (its `--bf16`); fp32, the default, is unchanged. The peer's environment:
`bash ../shared/peer-bench/setup.sh` (PyTorch is not a dependency of this project). Needs an idle machine: anything else running distorts both sides.
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
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.turns import Referee  # noqa: E402

BATCH, SEQ = 8, 256
DIMENSIONS = ["--hidden", "256", "--layers", "4", "--heads", "8", "--ffn", "512", "--experts", "8", "--topk", "2",
              "--vocab", "8192", "--seq", str(SEQ), "--batch", str(BATCH)]
PROCESS_STEPS = ["--steps", "10", "--warmup", "3"]        # --interleave processes: each run alone
TURN = 4                                                   # --interleave steps: steps a turn, the first re-warms
TURNS_WARMUP, TURNS_STEPS = TURN, 4 * TURN                 # one warm-up turn, then four timed turns


def parse_json(command, returncode, out, err):
    if returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{err[-3000:]}")
    return json.loads(out[out.index("{"):])   # one JSON object (the peer prints it indented)


def run_json(command):
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    return parse_json(command, done.returncode, done.stdout, done.stderr)


def run_in_turns(commands, steps, block=1):
    """Runs the commands side by side, their `steps` steps taken in turns of `block` steps
    (benchmarks/turns.py); their JSON."""
    referee, procs = Referee(), []
    with tempfile.TemporaryDirectory(prefix="bench-vs-peer-") as tmp:
        files = [(open(os.path.join(tmp, f"{i}.out"), "w+"), open(os.path.join(tmp, f"{i}.err"), "w+"))
                 for i in range(len(commands))]
        try:
            for command, (out, err) in zip(commands, files):
                procs.append(referee.start(command, stdout=out, stderr=err, cwd=ROOT))
            waiting_cpu = referee.alternate(steps, block)
            for proc in procs:
                proc.wait(timeout=600)
        except BaseException:
            for proc in procs:
                proc.kill()
            for command, (_, err) in zip(commands, files):
                err.seek(0)
                print(f"--- {' '.join(command)}\n{err.read()[-3000:]}", file=sys.stderr)
            raise
        results = []
        for command, proc, (out, err), cpu in zip(commands, procs, files, waiting_cpu):
            out.seek(0)
            err.seek(0)
            results.append(dict(parse_json(command, proc.returncode, out.read(), err.read()),
                                cpu_s_while_waiting=round(cpu, 2)))
            out.close()
            err.close()
        return results


def warm_steps_ms(result, warmup):
    """A side's timed steps (ms) without the first step of each turn: a step after a pause of a few
    seconds runs at another speed than steps back to back (measured: the peer's 6-12 % slower, this
    project's 4-7 % faster), so only the steps that follow a step of the same side are compared."""
    return [ms for i, ms in enumerate(result["step_ms_all"]) if (warmup + i) % TURN != 0]


def paired_ratio(mine_ms, theirs_ms):
    """Median over step pairs (the i-th compared step of each side: in turns, the same turn pair) of
    peer ms / moetrain ms."""
    return statistics.median(p / m for m, p in zip(mine_ms, theirs_ms))


def rss_mb(result):
    return float(result["peak_rss_mb"])     # both sides: ru_maxrss of the process


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peer-python", default="/tmp/peerenv/bin/python")
    ap.add_argument("--peer-script", default=os.path.join(ROOT, "..", "shared", "peer-bench", "hf_moe_bench.py"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--interleave", choices=("steps", "processes"), default="steps",
                    help="steps: each pair's processes take their steps in turns; processes: one after the other")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: this project in bfloat16, the peer under torch.autocast bfloat16")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    precision = {"fp32": ([], []), "bf16": (["--compute-dtype", "bfloat16"], ["--bf16"])}[args.precision]
    if args.interleave == "steps":
        steps = ["--steps", str(TURNS_STEPS), "--warmup", str(TURNS_WARMUP)]
        peer = [args.peer_python, os.path.join(ROOT, "benchmarks", "peer_turns.py"), args.peer_script]
    else:
        steps, peer = PROCESS_STEPS, [args.peer_python, args.peer_script]
    ours = [sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), *DIMENSIONS, *steps, *precision[0]]
    peer += [*DIMENSIONS, *steps, "--threads", str(args.threads), *precision[1]]
    rounds = []
    for r in range(args.rounds):
        row = {}
        for kind, flag in (("moe", []), ("dense", ["--dense"])):
            if args.interleave == "steps":
                peer_first = r % 2 == 1
                pair = [peer + flag, ours + flag] if peer_first else [ours + flag, peer + flag]
                results = run_in_turns(pair, TURNS_WARMUP + TURNS_STEPS, block=TURN)
                theirs, mine = results if peer_first else results[::-1]
                mine_ms, theirs_ms = warm_steps_ms(mine, TURNS_WARMUP), warm_steps_ms(theirs, TURNS_WARMUP)
            else:
                peer_first = False
                mine, theirs = run_json(ours + flag), run_json(peer + flag)
                mine_ms, theirs_ms = mine["step_ms_all"], theirs["step_ms_all"]
            for result, ms in ((mine, mine_ms), (theirs, theirs_ms)):   # both sides: the same statistic
                result["tokens_per_s"] = BATCH * SEQ / (statistics.median(ms) / 1e3)
            row[kind] = {"moetrain_tokens_per_s": mine["tokens_per_s"], "peer_tokens_per_s": theirs["tokens_per_s"],
                         "speed_ratio": mine["tokens_per_s"] / theirs["tokens_per_s"],
                         "paired_step_ratio": paired_ratio(mine_ms, theirs_ms), "peer_first": peer_first,
                         "moetrain_step_ms": mine["step_ms_all"], "peer_step_ms": theirs["step_ms_all"],
                         "compared_steps": len(mine_ms),
                         "cpu_s_while_waiting": [mine.get("cpu_s_while_waiting"), theirs.get("cpu_s_while_waiting")],
                         "moetrain_rss_mb": rss_mb(mine), "peer_rss_mb": rss_mb(theirs),
                         "rss_ratio": rss_mb(mine) / rss_mb(theirs), "moetrain_mfu": mine.get("mfu")}
            print(f"round {r + 1} {kind:5s} moetrain {mine['tokens_per_s']:8.0f} tok/s  peer "
                  f"{theirs['tokens_per_s']:8.0f} tok/s  ratio {row[kind]['speed_ratio']:.2f} "
                  f"(step pairs {row[kind]['paired_step_ratio']:.2f})   RSS "
                  f"{rss_mb(mine):6.0f} vs {rss_mb(theirs):6.0f} MB ({row[kind]['rss_ratio']:.2f}x)", flush=True)
        rounds.append(row)
    summary = {kind: {key: statistics.median(r[kind][key] for r in rounds) for key in ("speed_ratio", "rss_ratio")}
               for kind in ("moe", "dense")}
    for kind, s in summary.items():
        print(f"median over {args.rounds} rounds, {kind}: speed {s['speed_ratio']:.2f}x the peer, "
              f"peak RSS {s['rss_ratio']:.2f}x the peer's")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"precision": args.precision, "rounds": rounds, "median": summary}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
