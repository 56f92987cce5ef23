"""moetrain against the PyTorch reference, interleaved in one session (issue figures are ratios).

    python tools/bench_vs_peer.py [--rounds 3] [--peer-python /tmp/peerenv/bin/python]
                                  [--peer-script ../shared/peer-bench/hf_moe_bench.py] [--json OUT]

Each round runs, one after the other: moetrain MoE, peer MoE (transformers Mixtral), moetrain dense,
peer dense (transformers Llama), every run a fresh process on the same dimensions (tools/bench.py's
defaults; the peer with 2 intra-op threads, this machine's cores). Prints per round the tokens/s and
peak RSS of both and their ratios, then the median ratio over rounds. The peer's environment:
`bash ../shared/peer-bench/setup.sh` (PyTorch is not a dependency of this project). Needs an idle
machine: anything else running distorts both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIMENSIONS = ["--hidden", "256", "--layers", "4", "--heads", "8", "--ffn", "512", "--experts", "8", "--topk", "2",
              "--vocab", "8192", "--seq", "256", "--batch", "8", "--steps", "10", "--warmup", "3"]


def run_json(command):
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stderr[-3000:]}")
    out = done.stdout
    return json.loads(out[out.index("{"):])   # one JSON object (the peer prints it indented)


def rss_mb(result):
    return float(result["peak_rss_mb"])     # both sides: ru_maxrss of the process


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peer-python", default="/tmp/peerenv/bin/python")
    ap.add_argument("--peer-script", default=os.path.join(ROOT, "..", "shared", "peer-bench", "hf_moe_bench.py"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    ours = [sys.executable, os.path.join(ROOT, "tools", "bench.py"), *DIMENSIONS]
    peer = [args.peer_python, args.peer_script, *DIMENSIONS, "--threads", str(args.threads)]
    rounds = []
    for r in range(args.rounds):
        row = {}
        for kind, flag in (("moe", []), ("dense", ["--dense"])):
            mine, theirs = run_json(ours + flag), run_json(peer + flag)
            row[kind] = {"moetrain_tokens_per_s": mine["tokens_per_s"], "peer_tokens_per_s": theirs["tokens_per_s"],
                         "speed_ratio": mine["tokens_per_s"] / theirs["tokens_per_s"],
                         "moetrain_rss_mb": rss_mb(mine), "peer_rss_mb": rss_mb(theirs),
                         "rss_ratio": rss_mb(mine) / rss_mb(theirs), "moetrain_mfu": mine.get("mfu")}
            print(f"round {r + 1} {kind:5s} moetrain {mine['tokens_per_s']:8.0f} tok/s  peer "
                  f"{theirs['tokens_per_s']:8.0f} tok/s  ratio {row[kind]['speed_ratio']:.2f}   RSS "
                  f"{rss_mb(mine):6.0f} vs {rss_mb(theirs):6.0f} MB ({row[kind]['rss_ratio']:.2f}x)", flush=True)
        rounds.append(row)
    summary = {kind: {key: statistics.median(r[kind][key] for r in rounds) for key in ("speed_ratio", "rss_ratio")}
               for kind in ("moe", "dense")}
    for kind, s in summary.items():
        print(f"median over {args.rounds} rounds, {kind}: speed {s['speed_ratio']:.2f}x the peer, "
              f"peak RSS {s['rss_ratio']:.2f}x the peer's")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rounds": rounds, "median": summary}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
