"""Decoding benchmark: tokens/s of `moetrain generate` with the KV cache against a full forward per new token.

    python benchmarks/bench_decode.py [--config configs/moe_tiny.yaml] [--prompt 16] [--new 96] [--batch 1] [--rounds 3]

Builds the config's model (random init: speed does not depend on the weights; every MoE layer routes
as trained), makes `--batch` random prompts of `--prompt` tokens and generates `--new` tokens greedily
(`moetrain.generate.generate`) two ways, alternating within each round so both see the same stretch of
the machine's speed:

  cache     prefill the prompt once, then one token per forward against the cache (what `generate` runs)
  no_cache  the whole sequence (prompt + tokens so far) through `model.logits` for every new token

Both run op by op in PyNative on the calling thread, as `moetrain generate` does, and must produce the
same tokens (checked). Printed, one JSON line per way to stdout (everything else to stderr):

  decode_tokens_per_s   new tokens after the first / time from the first to the last new token, all
                        rows (the steady decode rate; median over rounds, and every round)
  total_tokens_per_s    all new tokens / wall time including the prefill (median over rounds)
  first_token_ms        prefill + first token (median)
  ms_per_token_at       decode step time (ms, median over rounds) around new token 1, N/2 and N: the
                        no-cache step grows with the sequence, the cached one barely
  loadavg               1-minute load average before and after (other processes share the cores)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "moe_tiny.yaml"))
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=96, help="new tokens per row")
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def one_run(model, prompts, new: int, use_cache: bool):
    """(tokens, seconds to the first new token, time of every new token after the start)."""
    from moetrain.generate import generate

    stamps = []
    start = time.perf_counter()
    rows = generate(model, prompts, new, temperature=0.0, use_cache=use_cache,
                    on_token=lambda tokens, live: stamps.append(time.perf_counter() - start))
    return np.stack(rows), stamps


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms

    from moetrain.config import load_config
    from moetrain.distributed.topology import cpu_ops_on_calling_thread
    from moetrain.registry import get_model

    ms.set_device("CPU")
    cpu_ops_on_calling_thread()
    ms.set_seed(args.seed)
    cfg = load_config(args.config).model
    model = get_model(cfg.name).cls(cfg)
    model.set_train(False)
    params = sum(int(np.prod(p.shape)) for p in model.get_parameters())
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.prompt)).tolist()
    print(f"{cfg.name} from {os.path.relpath(args.config, ROOT)}: {params / 1e6:.2f} M parameters, {cfg.num_layers} "
          f"layers; batch {args.batch}, prompt {args.prompt}, {args.new} new tokens", file=sys.stderr)
    one_run(model, prompts, 4, True)                     # warm-up: first calls of every op shape family
    one_run(model, prompts, 4, False)
    load_before = os.getloadavg()[0]
    results = {"cache": [], "no_cache": []}
    for round_ in range(args.rounds):
        tokens = {}
        for way in ("cache", "no_cache") if round_ % 2 == 0 else ("no_cache", "cache"):
            tokens[way], stamps = one_run(model, prompts, args.new, way == "cache")
            results[way].append(stamps)
            steps = np.diff(stamps)
            print(f"round {round_ + 1} {way:>8}: first token {stamps[0] * 1e3:.0f} ms, decode "
                  f"{(len(stamps) - 1) * args.batch / (stamps[-1] - stamps[0]):.1f} tokens/s, step "
                  f"{steps[0] * 1e3:.1f} -> {steps[-1] * 1e3:.1f} ms", file=sys.stderr)
        if not np.array_equal(tokens["cache"], tokens["no_cache"]):
            raise SystemExit("the cached and uncached runs produced different tokens")
    load_after = os.getloadavg()[0]
    for way, runs in results.items():
        decode = [(len(s) - 1) * args.batch / (s[-1] - s[0]) for s in runs]
        total = [len(s) * args.batch / s[-1] for s in runs]
        marks = sorted({1, args.new // 2, args.new - 1})
        at = {str(m): round(statistics.median(float(np.diff(s)[m - 1]) for s in runs) * 1e3, 2) for m in marks}
        print(json.dumps({"way": way, "model": cfg.name, "config": os.path.relpath(args.config, ROOT),
                          "params_m": round(params / 1e6, 2), "batch": args.batch, "prompt": args.prompt,
                          "new": args.new, "decode_tokens_per_s": round(statistics.median(decode), 1),
                          "decode_tokens_per_s_rounds": [round(x, 1) for x in decode],
                          "total_tokens_per_s": round(statistics.median(total), 1),
                          "first_token_ms": round(statistics.median(s[0] for s in runs) * 1e3, 1),
                          "ms_per_token_at": at, "loadavg": [round(load_before, 2), round(load_after, 2)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
