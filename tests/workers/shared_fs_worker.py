"""Worker of tests/test_launch_faults.py: the multi-node shared-filesystem check of the output dir.

    python shared_fs_worker.py OUT_DIR [--private-rank R]

Every rank checks OUT_DIR/run, except rank R, which uses OUT_DIR/private_R (as a node without the
shared filesystem would see its own local folder); each writes OUT_DIR/rank_<r>.json with the
error message it got (null when the check passed).
"""
import argparse
import json
import os

os.environ.setdefault("GLOG_v", "3")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--private-rank", type=int, default=-1)
    args = ap.parse_args()

    import mindspore as ms

    ms.set_device("CPU")
    from moetrain.checkpoint.run_dir import OutputDirError, check_shared_filesystem
    from moetrain.distributed.topology import init_parallel

    ctx = init_parallel()
    folder = os.path.join(args.out_dir, f"private_{ctx.rank}" if ctx.rank == args.private_rank else "run")
    os.makedirs(folder, exist_ok=True)
    error = None
    try:
        check_shared_filesystem(folder, ctx)
    except OutputDirError as exc:
        error = str(exc)
    with open(os.path.join(args.out_dir, f"rank_{ctx.rank}.json"), "w") as fh:
        json.dump({"rank": ctx.rank, "error": error}, fh)


if __name__ == "__main__":
    main()
