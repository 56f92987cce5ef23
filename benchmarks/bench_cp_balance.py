"""Per-rank attention time of context parallelism, load-balanced split against a contiguous one.

    python benchmarks/bench_cp_balance.py [--cp 4] [--seq 2048] [--repeats 5] [--splits balanced] [--jit]

Each rank's share of one causal attention layer (batch 1, 8 query / 4 K/V heads of 64), forward +
backward and the forward alone (their difference is printed as the backward), timed in this process
one rank after another (the K/V of the whole sequence given, as the all-gather leaves it): the
load-balanced split of moetrain (rank i holds chunks i and 2·cp−1−i,
`moetrain.parallel.context_parallel.blockwise_attention`: one `TiledAttention` cell) and a
contiguous split (rank i holds chunk i of cp: it attends to i earlier chunks and its own diagonal;
the same cell, chunks and tiles).
Prints the median time per rank (the ranks timed in turn within each repeat) and the slowest /
fastest ratio of each.

Clock: `--clock thread` (default) is the calling thread's CPU time (`time.thread_time`), with
MindSpore's ops run on that thread (MS_DEV_HOST_BLOCKING_RUN=1) and its CPU kernels on one thread
(`runtime_num_threads=1`), so what other jobs on a loaded machine do moves it little (wall time
would count their share of the cores); `--clock process` is the whole process's CPU time. With the
thread clock set MOETRAIN_KERNEL_THREADS=1 where the fused kernels run (their pool's other threads
are not the calling thread); MOETRAIN_DISABLE_KERNELS=1 times the plain ops. `--jit`: forward and
forward + backward each compiled (`ms.jit`, as the training step runs them), the compilation not timed.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=("thread", "process"), default="thread")
    parser.add_argument("--splits", default="balanced,contiguous", help="splits to time, comma-separated")
    parser.add_argument("--jit", action="store_true", help="time the compiled forward and forward + backward")
    args = parser.parse_args()
    os.environ["MS_DEV_HOST_BLOCKING_RUN"] = "1"             # ops on the calling thread (read at the first op)
    import mindspore as ms
    from mindspore import Tensor

    from moetrain.parallel.context_parallel import (_NO_DOCS, balanced_plan, blockwise_attention, chunk_order,
                                                    chunk_plan, tiled_attention, tiled_cell)

    ms.set_device("CPU")
    if args.clock == "thread":
        ms.set_context(runtime_num_threads=1)                 # the kernels on one thread too
    clock = time.thread_time if args.clock == "thread" else time.process_time
    cp, seq, heads, kv_heads, dim = args.cp, args.seq, 8, 4, 64
    rng = np.random.default_rng(0)
    q = rng.normal(0, 0.1, (1, kv_heads, heads // kv_heads, seq, dim)).astype(np.float32)
    k, v = (rng.normal(0, 0.1, (1, kv_heads, seq, dim)).astype(np.float32) for _ in range(2))
    local = seq // cp

    def balanced(r):
        order = chunk_order(seq, cp, r)
        k_all = np.concatenate([k[:, :, chunk_order(seq, cp, j)] for j in range(cp)], 2)
        v_all = np.concatenate([v[:, :, chunk_order(seq, cp, j)] for j in range(cp)], 2)
        return (Tensor(q[:, :, :, order]), Tensor(k_all), Tensor(v_all)), \
            lambda q_, k_, v_: blockwise_attention(q_, k_, v_, r, cp)

    def contiguous(r):
        rows = slice(r * local, (r + 1) * local)
        chunk = local // 2                                  # the same chunks and steps, not balanced
        plan = chunk_plan((2 * r, 2 * r + 1), lambda j: j * chunk, chunk)
        return (Tensor(q[:, :, :, rows]), Tensor(k), Tensor(v)), \
            lambda q_, k_, v_: tiled_attention(plan, q_, k_, v_)[0]

    def make_plan(name, r):
        """The rank's `TiledAttention` plan of split `name`."""
        if name == "balanced":
            return balanced_plan(local, r, cp)
        chunk = local // 2
        return chunk_plan((2 * r, 2 * r + 1), lambda j: j * chunk, chunk)

    def summed(attend, cell=False):
        """`(q, k, v) -> attend(q, k, v).sum()`; `cell`: `attend` is a TiledAttention cell."""
        def total(q_, k_, v_):
            if cell:
                return attend(q_, k_, v_, _NO_DOCS, _NO_DOCS)[0].sum()
            return attend(q_, k_, v_).sum()
        return total

    def medians(runs):
        """Median time of each of `runs`, the repeats interleaved (run 0, 1, ..., then again), so that
        the other jobs' load drifting over the minutes falls on every rank alike."""
        first = []
        for run in runs:                                    # warm-up (with --jit: the compilation)
            start = clock()
            run()
            first.append(clock() - start)
        warmups.append(first)
        samples = [[] for _ in runs]
        for _ in range(args.repeats):
            for run, times in zip(runs, samples):
                start = clock()
                run()
                times.append(clock() - start)
        return [float(np.median(times)) for times in samples]

    def ratio(times):
        return ("per rank " + " / ".join(f"{t * 1e3:.0f}" for t in times)
                + f" ms, slowest / fastest {max(times) / min(times):.2f}")

    warmups = []
    for name, make in (("balanced", balanced), ("contiguous", contiguous)):
        if name not in args.splits.split(","):
            continue
        forward_runs, both_runs = [], []
        for r in range(cp):
            inputs, attend = make(r)
            total = summed(attend)
            if args.jit:   # the rank's cell itself (ms.jit cannot run the Python look-up of the cell)
                total = summed(tiled_cell(make_plan(name, r), False, q.shape[1] * q.shape[2]), cell=True)
            step = ms.value_and_grad(total, grad_position=(0, 1, 2))
            forward = total
            if args.jit:
                step, forward = ms.jit(step), ms.jit(total)
            forward_runs.append(lambda f=forward, x=inputs: float(f(*x).asnumpy()))
            both_runs.append(lambda s=step, x=inputs: float(s(*x)[0].asnumpy()))
        forward, both = medians(forward_runs), medians(both_runs)
        mode = ", ms.jit" if args.jit else ""
        print(f"{name:>10} cp {cp} seq {seq} ({args.clock} CPU time, median of {args.repeats}{mode})", flush=True)
        print(f"   forward + backward: {ratio(both)}", flush=True)
        print(f"   forward:            {ratio(forward)}", flush=True)
        backward = [b - f for b, f in zip(both, forward)]
        print(f"   backward (difference): {ratio(backward)}", flush=True)
        if args.jit:
            print("   first call (compilation + one run), per rank: forward "
                  + " / ".join(f"{t:.1f}" for t in warmups[-2]) + " s, forward + backward "
                  + " / ".join(f"{t:.1f}" for t in warmups[-1]) + " s", flush=True)


if __name__ == "__main__":
    main()
