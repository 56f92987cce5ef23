"""Worker of tests/test_red_team.py: the output-directory lock in a job (`start_run`, `RunStart.commit`).

    python run_lock_worker.py OUT_DIR HELD_DIR

Every rank starts a run in HELD_DIR (whose lock a live process outside the job holds: refused on
every rank), then in OUT_DIR/run (rank 0 locks it, the other ranks see the lock; commit writes
run.json; release removes the lock). Each rank writes OUT_DIR/rank_<r>.json with what it saw.
"""
import json
import os
import sys

os.environ.setdefault("GLOG_v", "3")


def main():
    out_dir, held = sys.argv[1], sys.argv[2]

    import mindspore as ms

    ms.set_device("CPU")
    from moetrain.checkpoint.run_dir import LOCK_FILE, OutputDirError, read_lock, start_run
    from moetrain.distributed.topology import init_parallel

    ctx = init_parallel()
    result = {"rank": ctx.rank}
    try:
        start_run(held, None, False, ctx)
        result["held_error"] = None
    except OutputDirError as exc:
        result["held_error"] = str(exc)
    folder = os.path.join(out_dir, "run")
    start = start_run(folder, None, False, ctx)
    result["lock_seen"] = read_lock(os.path.join(folder, LOCK_FILE))
    result["run_json_before_commit"] = os.path.exists(os.path.join(folder, "run.json"))
    from moetrain.faults import world_sum

    world_sum([0.0], ctx)            # every rank has looked before rank 0 commits
    start.commit(ctx)
    result["run_id"] = start.run_id
    result["run_json"] = json.load(open(os.path.join(folder, "run.json")))["run_id"]
    world_sum([0.0], ctx)            # every rank has read the lock and run.json before rank 0 lets go
    start.release()
    world_sum([0.0], ctx)
    result["lock_after_release"] = os.path.exists(os.path.join(folder, LOCK_FILE))
    result["pid"] = os.getpid()
    with open(os.path.join(out_dir, f"rank_{ctx.rank}.json"), "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
