"""Worker of tests/test_comm.py (4 ranks, dp=2 x tp=2): every op of moetrain.dist.comm, its
output and its gradient, in PyNative and under ms.jit, plus byte ledgers. Writes
<out>/rank_<r>.npz (arrays) and <out>/rank_<r>.json (ledgers, timings).

    python tests/workers/comm_worker.py OUT_DIR [--modes pynative,jit] [--bench]
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comm_cases import CASES, WORLD, a2av_counts, case_input, loss_weight  # noqa: E402
from moetrain.dist import comm  # noqa: E402


def apply(op, x, group, kw):
    if op == "all_reduce":
        return comm.all_reduce(x, group)
    if op == "all_gather":
        return comm.all_gather(x, group, kw["axis"])
    if op == "reduce_scatter":
        return comm.reduce_scatter(x, group, kw["axis"])
    if op == "all_to_all":
        return comm.all_to_all(x, group, kw["split_axis"], kw["concat_axis"])
    if op == "all_to_all_v":
        return comm.all_to_all_v(x, kw["send_counts"], kw["recv_counts"], group)
    if op == "broadcast":
        return comm.broadcast(x, kw["src"], group)
    if op == "copy_to_region":
        return comm.copy_to_region(x, group)
    if op == "reduce_from_region":
        return comm.reduce_from_region(x, group)
    if op == "scatter_to_region":
        return comm.scatter_to_region(x, group, kw["axis"])
    if op == "gather_from_region":
        return comm.gather_from_region(x, group, kw["axis"])
    if op == "reduce_scatter_to_sequence":
        return comm.reduce_scatter_to_sequence(x, group, kw["axis"])
    return comm.gather_from_sequence(x, group, kw["axis"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--modes", default="pynative,jit")
    ap.add_argument("--bench", action="store_true", help="also time 1 MB all_reduce / all_to_all")
    args = ap.parse_args()

    import mindspore as ms
    from mindspore import Tensor

    ms.set_device("CPU")
    from moetrain.dist.topology import init_parallel

    ctx = init_parallel(dp=2, tp=2)
    rank = ctx.rank
    specs, xs = [], []
    for name, op, kind, shape_of, kw in CASES:
        kw = dict(kw)
        if op == "all_to_all_v":
            kw["send_counts"] = [a2av_counts(rank, j) for j in range(WORLD)]
            kw["recv_counts"] = [a2av_counts(i, rank) for i in range(WORLD)]
        specs.append((op, ctx.group(kind), kw))
        xs.append(Tensor(case_input(name, rank, shape_of(rank))))
    specs, xs = tuple(specs), tuple(xs)
    ws = tuple(Tensor(loss_weight(name, rank, apply(op, x, g, kw).shape))
               for (name, *_), (op, g, kw), x in zip(CASES, specs, xs))

    count = len(specs)

    def loss_fn(*tensors):   # inputs then loss weights (tuple arguments break grads under jit)
        outs = ()
        loss = 0.0
        for spec, x, w in zip(specs, tensors[:count], tensors[count:]):
            y = apply(spec[0], x, spec[1], spec[2])
            loss = loss + (y * w).sum()
            outs = outs + (y,)
        return loss, outs

    arrays, report = {}, {"rank": rank, "backend": comm.backend_name()}
    grad_fn = ms.value_and_grad(loss_fn, grad_position=tuple(range(count)), has_aux=True)
    for mode in args.modes.split(","):
        fn = ms.jit(grad_fn) if mode == "jit" else grad_fn
        start = time.perf_counter()
        fn(*xs, *ws)                     # first call: compiles under jit
        report[f"{mode}_first_call_s"] = time.perf_counter() - start
        with comm.CommLedger() as ledger:
            (loss, outs), grads = fn(*xs, *ws)
        report[f"{mode}_ledger"] = {"native": ledger.bytes_by_group(backward=True),
                                    "emulated": ledger.bytes_by_group(backward=True, emulated=True),
                                    "native_forward": ledger.bytes_by_group(backward=False)}
        for (name, *_), y, dx in zip(CASES, outs, grads):
            arrays[f"{mode}/{name}/y"] = y.asnumpy()
            arrays[f"{mode}/{name}/dx"] = dx.asnumpy()

    # A loop of collectives: every executed call is booked in PyNative; a jitted graph books nothing.
    tp = ctx.group("tp")

    def chained(x):
        for _ in range(3):
            x = comm.all_reduce(x, tp) * 0.5
        return x

    probe = Tensor(np.full((5, 7), rank + 1.0, np.float32))
    for mode, fn in (("pynative", chained), ("jit", ms.jit(chained))):
        fn(probe)
        with comm.CommLedger() as ledger:
            arrays[f"loop_{mode}/y"] = fn(probe).asnumpy()
        report[f"loop_{mode}_ledger"] = ledger.bytes_by_group(backward=False)

    # inf on rank 1 must stay in rank 1's slot (no 0 * inf = nan leaking into other slots).
    special = np.zeros((2, 2), np.float32) + rank
    if rank == 1:
        special[0, 0] = np.inf
    arrays["inf/y"] = comm.all_gather(Tensor(special), ctx.group("world")).asnumpy()

    if args.bench:
        world = ctx.group("world")
        big = Tensor(np.ones((256, 1024), np.float32))   # 1 MiB
        for label, run in (("all_reduce_1MiB_ms", lambda: comm.all_reduce(big, world)),
                           ("all_to_all_1MiB_ms", lambda: comm.all_to_all(big, world))):
            run().asnumpy()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                run().asnumpy()
                times.append((time.perf_counter() - start) * 1000)
            report[label] = float(np.median(times))

    os.makedirs(args.out_dir, exist_ok=True)
    np.savez(os.path.join(args.out_dir, f"rank_{rank}.npz"), **arrays)
    with open(os.path.join(args.out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
