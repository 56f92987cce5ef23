"""The data pipeline's cost on a synthetic corpus; docs/data.md ("Scale") quotes its output.

    python benchmarks/measure_data_scale.py --size-gb 1 --workdir /tmp/moetrain_scale

1. Writes a JSONL corpus of about --size-gb: documents of 3-40 random verses of data/kjv_tiny.
2. Encodes it with tools/preprocess_data.py (a subprocess each) with 1 and with 2 workers:
   wall time, input MB/s, peak RSS of the main process and of the largest worker; checks that
   both runs wrote identical shards.
3. Builds the blend index [w, corpus, 1-w, kjv_tiny_train] for --steps x --global-batch samples of
   --seq-length, with round weights (0.7/0.3: a 10-slot schedule period) and with weights whose
   exact period exceeds the run (0.6180339887/0.3819660113: every slot scheduled in Python).
   Each build runs in a fresh process: build time, peak RSS (VmHWM), time to open the cached index.
4. A fresh process plays one training rank of dp=4: opens the blend and its cached index, reads
   --read-steps rank batches; reports its memory (/proc: VmRSS, RssAnon = private, RssFile = mapped
   shard and index pages, shared with the other ranks and reclaimable) and the batch time.
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
    """One tools/preprocess_data.py run; its process tree's RSS sampled every 0.2 s with psutil."""
    import psutil

    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", corpus,
                                "--tokenizer", os.path.join(KJV, "kjv_tiny.model"), "--output-prefix", prefix,
                                "--workers", str(workers), "--no-progress"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=REPO))
    main_peak = worker_peak = total_peak = 0
    watched = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            main = watched.memory_info().rss
            children = [c.memory_info().rss for c in watched.children(recursive=True)]
        except psutil.Error:
            continue
        main_peak, worker_peak = max(main_peak, main), max([worker_peak] + children)
        total_peak = max(total_peak, main + sum(children))
        time.sleep(0.2)
    out, err = process.communicate()
    if process.returncode:
        raise RuntimeError(err)
    wall = time.perf_counter() - start
    reported = re.search(r"\(([\d.]+) MB/s of input.*peak RSS (\d+) MB", err)
    return dict(workers=workers, wall_s=round(wall, 1), mb_per_s=float(reported.group(1)),
                tokens=int(re.search(r"tokens=(\d+)", out).group(1)), reported_main_peak_rss_mb=int(reported.group(2)),
                sampled_main_peak_rss_mb=round(main_peak / 2**20), sampled_worker_peak_rss_mb=round(worker_peak / 2**20),
                sampled_tree_peak_rss_mb=round(total_peak / 2**20))


MEMORY = textwrap.dedent("""
    def memory():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {k: int(fields[k].split()[0]) // 1024 for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}
""")

INDEX_SCRIPT = MEMORY + textwrap.dedent("""
    import json, sys, time
    from moetrain.data.blend import BlendedBatchSampler, build_blended_lm_dataset, parse_blend
    spec, seq, batch, steps, cache = json.loads(sys.argv[1])
    dataset = build_blended_lm_dataset(parse_blend(spec), seq, 2048)
    before = memory()
    start = time.perf_counter()
    sampler = BlendedBatchSampler(dataset, batch, steps, 1234, True, cache)
    build = time.perf_counter() - start
    start = time.perf_counter()
    again = BlendedBatchSampler(dataset, batch, steps, 1234, True, cache)
    print(json.dumps(dict(weights=spec[::2], source_samples=dataset.sizes, samples=steps * batch, build_s=round(build, 2),
                          built=sampler.built, reload_s=round(time.perf_counter() - start, 4), rebuilt=again.built,
                          index_mb=round(os.path.getsize(sampler.index_path) / 2**20, 1),
                          rss_before_mb=before["VmRSS"], peak_rss_mb=memory()["VmHWM"])))
""").replace("import json, sys, time", "import json, os, sys, time")

RANK_SCRIPT = MEMORY + textwrap.dedent("""
    import json, sys, time
    from moetrain.data.blend import BlendedBatchSampler, build_blended_lm_dataset, parse_blend
    spec, seq, batch, steps, reads, cache = json.loads(sys.argv[1])
    start_memory = memory()
    dataset = build_blended_lm_dataset(parse_blend(spec), seq, 2048)
    sampler = BlendedBatchSampler(dataset, batch, steps, 1234, True, cache)
    opened = memory()
    start = time.perf_counter()
    for step in range(reads):
        dataset.batch(sampler.rank_batch(step, 0, 4))
    elapsed = time.perf_counter() - start
    print(json.dumps(dict(after_imports=start_memory, after_open=opened, after_reads=memory(),
                          ms_per_rank_batch=round(1000 * elapsed / reads, 3), built_now=sampler.built)))
""")


def run_script(script: str, *args) -> dict:
    result = subprocess.run([sys.executable, "-c", script, json.dumps(list(args))], capture_output=True, text=True,
                            check=True, env=dict(os.environ, PYTHONPATH=REPO))
    return json.loads(result.stdout.strip().splitlines()[-1])


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
        results["index"] = []
        for w in ("0.7", "0.6180339887"):
            spec = [float(w), os.path.join(args.workdir, "w1"), float(f"{1 - float(w):.10f}"), train]
            results["index"].append(run_script(INDEX_SCRIPT, spec, args.seq_length, args.global_batch, args.steps, cache))
            print(json.dumps(results["index"][-1]), flush=True)
        results["rank"] = run_script(RANK_SCRIPT, spec, args.seq_length, args.global_batch, args.steps,
                                     args.read_steps, cache)
        print(json.dumps(results["rank"]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
