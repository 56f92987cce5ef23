"""Worker of tests/test_launch_faults.py: a few world all_reduces, then
optionally fail on one rank.

    python tests/workers/allreduce_worker.py OUT_DIR [--fail-rank R --fail-mode kill|raise] [--steps N]
                                             [--fail-attempt K] [--late-rank R --late-s S]

Each rank writes OUT_DIR/rank_<r>.json ({rank, world, sums, first_wait}). With --late-rank, rank R
sleeps S seconds after a first all_reduce that every rank leaves together; first_wait is [wall, CPU]
seconds this process spent in the next one (the others wait there for R: on the CPU the wait must
block, not spin; see topology.init_parallel). A failing rank first writes OUT_DIR/failure.json with the time it
fails, in the middle of the collective loop; with --fail-attempt K only on the launcher's K-th
relaunch (MOETRAIN_RESTART=K). Extra arguments (such as the --resume a relaunch adds) are ignored.
"""
import argparse
import json
import os
import signal
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-mode", choices=["kill", "raise"], default="kill")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fail-attempt", type=int, default=-1)
    ap.add_argument("--late-rank", type=int, default=-1)
    ap.add_argument("--late-s", type=float, default=0.0)
    args, _ = ap.parse_known_args()
    if args.fail_attempt >= 0 and int(os.environ.get("MOETRAIN_RESTART", "0")) != args.fail_attempt:
        args.fail_rank = -1

    import mindspore as ms

    ms.set_device("CPU")
    from moetrain.distributed import comm
    from moetrain.distributed.topology import init_parallel

    ctx = init_parallel()
    world = ctx.group("world")
    zeros = ms.Tensor(np.zeros((4,), np.float32))
    comm.all_reduce(zeros, world).asnumpy()        # every rank leaves this one together
    if ctx.rank == args.late_rank:
        time.sleep(args.late_s)
    wall, cpu = time.perf_counter(), time.process_time()
    comm.all_reduce(zeros, world).asnumpy()
    first_wait = [time.perf_counter() - wall, time.process_time() - cpu]
    sums = []
    for step in range(args.steps):
        if ctx.rank == args.fail_rank and step == 1:
            with open(os.path.join(args.out_dir, "failure.json"), "w") as f:
                json.dump({"rank": ctx.rank, "time": time.time()}, f)
            if args.fail_mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"rank {ctx.rank} fails on purpose at step {step}")
        value = comm.all_reduce(ms.Tensor(np.full((4,), ctx.rank + step, np.float32)), world)
        sums.append(float(value.asnumpy()[0]))
    with open(os.path.join(args.out_dir, f"rank_{ctx.rank}.json"), "w") as f:
        json.dump({"rank": ctx.rank, "world": ctx.world_size, "sums": sums, "first_wait": first_wait,
                   "host_blocking_run": os.environ.get("MS_DEV_HOST_BLOCKING_RUN")}, f)


if __name__ == "__main__":
    main()
