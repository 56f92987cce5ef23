"""The data pipeline's cost on a synthetic corpus; docs/data.md ("Scale") quotes its output.

    python tools/measure_data_scale.py --size-gb 1 --workdir /tmp/moetrain_scale

1. Writes a JSONL corpus of about --size-gb: documents of 3-40 random verses of data/kjv_tiny.
2. Encodes it with tools/preprocess_data.py (a subprocess each) with 1 and with 2 workers:
   wall time, input MB/s, peak RSS of the main process and of the largest worker; checks that
   both runs wrote identical shards.
3. Builds the blend index [w, corpus, 1-w, kjv_tiny_train] for --steps x --global-batch samples of
   --seq-length, with round weights (0.7/0.3: a 10-slot schedule period) and with weights whose
   exact period exceeds the run (0.6180339887/0.3819660113: every slot scheduled in Python).
4. A fresh process plays one training rank of dp=4: opens the blend and its cached index, reads
   --read-steps rank batches; reports its RSS before and after, and the batch time.
The workdir is deleted at the end (unless --keep).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV = os.path.join(REPO, "data", "kjv_tiny")


def write_corpus(path: str, size_bytes: int, seed: int = 0) -> int:
    verses = open(os.path.join(KJV, "kjv_tiny.txt"), encoding="utf-8").read().splitlines()
    rng = np.random.default_rng(seed)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size_bytes:
            lines = []
            for length in rng.integers(3, 41, 1000):
                lines.append(json.dumps({"id": written, "text": " ".join(verses[i] for i in rng.integers(0, len(verses), length))}))
            block = "\n".join(lines) + "\n"
            f.write(block)
            written += len(block.encode("utf-8"))
    return written


def run_preprocess(corpus: str, prefix: str, workers: int) -> dict:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", corpus,
                             "--tokenizer", os.path.join(KJV, "kjv_tiny.model"), "--output-prefix", prefix,
                             "--workers", str(workers), "--no-progress"],
                            capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=REPO))
    wall = time.perf_counter() - start
    rates = re.search(r"\(([\d.]+) MB/s of input.*peak RSS (\d+) MB(?:, largest worker (\d+) MB)?", result.stderr)
    tokens = int(re.search(r"tokens=(\d+)", result.stdout).group(1))
    return dict(workers=workers, wall_s=round(wall, 1), mb_per_s=float(rates.group(1)), tokens=tokens,
                main_peak_rss_mb=int(rates.group(2)), worker_peak_rss_mb=int(rates.group(3) or 0))


RANK_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time
    import psutil
    from moetrain.data.blend import BlendedBatchSampler, build_blended_lm_dataset, parse_blend
    spec, seq, batch, steps, reads, cache = json.loads(sys.argv[1])
    me = psutil.Process()
    before = me.memory_info().rss
    dataset = build_blended_lm_dataset(parse_blend(spec), seq, 2048)
    sampler = BlendedBatchSampler(dataset, batch, steps, 1234, True, cache)
    opened = me.memory_info().rss
    start = time.perf_counter()
    for step in range(reads):
        dataset.batch(sampler.rank_batch(step, 0, 4))
    elapsed = time.perf_counter() - start
    print(json.dumps(dict(rss_after_imports_mb=before / 2**20, rss_after_open_mb=opened / 2**20,
                          rss_after_reads_mb=me.memory_info().rss / 2**20,
                          peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                          ms_per_rank_batch=1000 * elapsed / reads, built_now=sampler.built)))
""")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--workdir", default="/tmp/moetrain_scale")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--read-steps", type=int, default=2000)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from moetrain.data.blend import BlendedBatchSampler, build_blended_lm_dataset, parse_blend

    os.makedirs(args.workdir, exist_ok=True)
    results = {}
    try:
        corpus = os.path.join(args.workdir, "corpus.jsonl")
        start = time.perf_counter()
        results["corpus_bytes"] = write_corpus(corpus, int(args.size_gb * 1e9))
        results["corpus_write_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(results), flush=True)
        runs = [run_preprocess(corpus, os.path.join(args.workdir, f"w{w}"), w) for w in (1, 2)]
        results["preprocess"] = runs
        print(json.dumps(runs), flush=True)
        same = all(open(os.path.join(args.workdir, f"w1{suffix}"), "rb").read() ==
                   open(os.path.join(args.workdir, f"w2{suffix}"), "rb").read() for suffix in (".bin", ".idx.npy"))
        results["identical_shards"] = same
        os.remove(corpus)

        train = os.path.join(KJV, "kjv_tiny_train")
        cache = os.path.join(args.workdir, "cache")
        num_samples = args.steps * args.global_batch
        results["index"] = []
        for w in ("0.7", "0.6180339887"):
            spec = [float(w), os.path.join(args.workdir, "w1"), float(f"{1 - float(w):.10f}"), train]
            dataset = build_blended_lm_dataset(parse_blend(spec), args.seq_length, 2048)
            start = time.perf_counter()
            sampler = BlendedBatchSampler(dataset, args.global_batch, args.steps, 1234, True, cache)
            build = time.perf_counter() - start
            start = time.perf_counter()
            again = BlendedBatchSampler(dataset, args.global_batch, args.steps, 1234, True, cache)
            results["index"].append(dict(weights=spec[::2], source_samples=dataset.sizes, samples=num_samples,
                                         build_s=round(build, 2), built=sampler.built,
                                         reload_s=round(time.perf_counter() - start, 3), rebuilt=again.built,
                                         index_mb=os.path.getsize(sampler.index_path) / 2**20))
            print(json.dumps(results["index"][-1]), flush=True)
        rank = subprocess.run([sys.executable, "-c", RANK_SCRIPT,
                               json.dumps([spec, args.seq_length, args.global_batch, args.steps, args.read_steps, cache])],
                              capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=REPO))
        results["rank"] = json.loads(rank.stdout.strip().splitlines()[-1])
        print(json.dumps(results["rank"]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
