"""Worker: `moetrain train CONFIG [--set k=v ...] [--resume [DIR]]`, exactly as the CLI runs it.

    python ckpt_train.py OUT_DIR [--dump-state] [--fail-save RANK:STEP] CONFIG [--set k=v ...] [--resume [DIR]]

Each rank writes OUT_DIR/pid_rank<r> at start (so a test can `kill -9` one rank) and, after
training, OUT_DIR/rank_<r>.json (its final step); with --dump-state also rank_<r>.npz holding
every model Parameter as it is in memory at the end. --fail-save RANK:STEP makes that rank's write
of checkpoint STEP fail with ENOSPC (a full disk); the worker then exits with the CLI's code.
"""
import json
import os
import sys

os.environ.setdefault("GLOG_v", "3")


def main():
    out_dir, argv = sys.argv[1], sys.argv[2:]
    dump_state = "--dump-state" in argv
    argv = [a for a in argv if a != "--dump-state"]
    rank = int(os.environ.get("RANK_ID", "0"))
    if "--fail-save" in argv:
        at = argv.index("--fail-save")
        fail_rank, fail_step = map(int, argv[at + 1].split(":"))
        del argv[at:at + 2]
        if rank == fail_rank:
            import errno

            from moetrain.checkpoint.manager import CheckpointWriter

            real = CheckpointWriter.tensors

            def tensors(self, filename, arrays):
                if self.name == f"step_{fail_step:08d}":
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real(self, filename, arrays)

            CheckpointWriter.tensors = tensors
    with open(os.path.join(out_dir, f"pid_rank{rank}"), "w") as fh:
        fh.write(str(os.getpid()))

    from moetrain.checkpoint.model_dir import model_state
    from moetrain.cli import build_parser
    from moetrain.config import load_config
    from moetrain.trainer import Trainer

    from moetrain.checkpoint.manager import CheckpointSaveError
    from moetrain.faults import EXIT_SAVE_FAILED

    args = build_parser().parse_args(["train", *argv])
    trainer = Trainer(load_config(args.config, args.set), resume=args.resume)
    try:
        trainer.fit()
    except CheckpointSaveError as exc:
        print(f"checkpoint save failed: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_SAVE_FAILED)
    trainer.wait_for_checkpoint()
    if dump_state:
        import numpy as np

        np.savez(os.path.join(out_dir, f"rank_{trainer.rank}.npz"), **model_state(trainer.model))
    with open(os.path.join(out_dir, f"rank_{trainer.rank}.json"), "w") as fh:
        json.dump({"rank": trainer.rank, "step": trainer.step}, fh)


if __name__ == "__main__":
    main()
