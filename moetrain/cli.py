"""`moetrain` command line: train, plan, convert (hf-import, hf-export, consolidate, upcycle), forward, generate, eval."""
from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import signal
import sys

# light modules only (no MindSpore): `moetrain --help` and refused inputs answer at once
from moetrain.checkpoint.manager import CheckpointError, CheckpointSaveError
from moetrain.checkpoint.run_dir import claim_output_dir, release_claim
from moetrain.compat import unsupported_mindspore
from moetrain.config import ConfigError, check_trainable, load_config, output_dir_of
from moetrain.errors import EXIT_BAD_INPUT, describe, expected_errors
from moetrain.faults import (EXIT_CANNOT_RUN, EXIT_HALTED, EXIT_INVARIANT, EXIT_PREEMPTED, EXIT_SAVE_FAILED,
                             Preempted, PreemptionFlag, TrainingHalted)
from moetrain.moe.accounting import DispatchInvariantError

os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ log: errors only (set GLOG_v=2 for warnings)


def _train(args) -> int:
    preemption = args.preemption      # installed by main() before anything else (docs/faults.md, "Preemption")
    # one process: lock the output folder before the slow set-up (MindSpore's import), docs/faults.md
    claim = claim_output_dir(output_dir_of(args.config, args.set))
    try:
        cfg = load_config(args.config, args.set)
        check_trainable(cfg)        # values `moetrain plan` prices and this trainer does not run: one line, exit 2
        if claim is not None and preemption.signum is not None:     # one process: no rank to agree with
            raise Preempted("stopped by a signal before set-up; nothing was written. Nothing to resume: run the same "
                            "command again (with --resume it starts again from step 0)")
        from moetrain.trainer import Trainer   # MindSpore: imported after the output folder is locked

        trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite, preemption=preemption)
    except Preempted as exc:
        release_claim(claim)      # the folder is left as it was
        print(f"moetrain: {exc} (exit code {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except BaseException:
        release_claim(claim)      # refused before the run took the folder over: leave it as it was
        raise
    args.training = True      # from here an OSError is the run's failure (exit 1, relaunched), not bad input
    result = trainer.fit()
    if result.get("preempted"):
        if trainer.rank == 0 and result.get("before_first_step"):
            again = (f"the checkpoint it resumed from (step {trainer.step}) is the one to continue from: run the "
                     f"same command with --resume" if trainer.step else
                     "nothing was trained and there is nothing to resume: run the same command with --resume (it "
                     "starts again from step 0)")
            print(f"moetrain: stopped on a signal before the first step; {again} (exit code {EXIT_PREEMPTED})",
                  file=sys.stderr, flush=True)
        elif trainer.rank == 0:
            print(f"moetrain: stopped after step {trainer.step} on a signal; the checkpoint is saved. Run the same "
                  f"command with --resume to continue (exit code {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    final = result["eval"]
    if "eval_accuracy" in final:
        print(f"final test accuracy: {final['eval_accuracy']:.4f} (eval_loss {final['eval_loss']:.4f})")
    elif "eval_loss" in final:
        print(f"final eval_loss: {final['eval_loss']:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moetrain", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model from a YAML config")
    train.add_argument("config", help="YAML config, e.g. configs/moe_tiny.yaml")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set optimizer.lr=3e-4 (repeatable)")
    train.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                       help="resume from the latest complete checkpoint of the run's output dir, "
                            "or of DIR (a run folder or one checkpoint folder)")
    train.add_argument("--overwrite", action="store_true",
                       help="start a new run in an output dir that holds one: its checkpoints and metrics are "
                            "first moved into <output_dir>/overwritten-<run id>/")
    train.set_defaults(func=_train)

    forward = sub.add_parser("forward", help="fp32 logits of a batch of token ids from a model directory",
                             add_help=False)
    forward.set_defaults(func=_delegate("moetrain.forward", "main"))
    sub.add_parser("generate", help="text generation with a KV cache from a checkpoint or model directory "
                                    "(--prompt TEXT | --input ids.npy)",
                   add_help=False).set_defaults(func=_delegate("moetrain.generate", "main"))
    sub.add_parser("eval", help="loss and perplexity of a checkpoint or model directory on token shards or a blend",
                   add_help=False).set_defaults(func=_delegate("moetrain.evaluate", "main"))
    sub.add_parser("plan", help="parameters, FLOPs, memory and communication of a config's layout; --search",
                   add_help=False).set_defaults(func=_delegate("moetrain.planner.cli", "main"))
    convert = sub.add_parser("convert", help="checkpoint interchange: hf-import, hf-export, upcycle, reshard, consolidate")
    conv = convert.add_subparsers(dest="conversion", required=True)
    conv.add_parser("hf-import", help="Llama/Mixtral/DeepSeek-V3/Qwen3-MoE HF_DIR -> moetrain model directory",
                    add_help=False).set_defaults(func=_delegate("moetrain.checkpoint.hf", "main_import"))
    conv.add_parser("hf-export", help="moetrain model directory -> Hugging Face format (--layout fused)",
                    add_help=False).set_defaults(func=_delegate("moetrain.checkpoint.hf", "main_export"))
    conv.add_parser("upcycle", help="dense gpt model directory -> MoE model directory with the same forward",
                    add_help=False).set_defaults(func=_delegate("moetrain.checkpoint.upcycle", "main"))
    conv.add_parser("reshard", help="training checkpoint (or model directory) -> checkpoint of another layout",
                    add_help=False).set_defaults(func=_delegate("moetrain.checkpoint.distributed", "main_reshard"))
    conv.add_parser("consolidate", help="training checkpoint of any layout -> one model directory",
                    add_help=False).set_defaults(func=_delegate("moetrain.checkpoint.distributed", "main_consolidate"))
    return ap


def _delegate(module: str, function: str):
    """Sub-commands whose own argument parser lives with their implementation."""
    def run(args) -> int:
        return getattr(importlib.import_module(module), function)(args.rest)
    return run


def main(argv=None) -> int:
    """Every sub-command's errors go one way: the run's own failures to their documented exit codes
    (docs/faults.md), bad input (`moetrain.errors`) to one line and exit 2, anything else (a bug) to
    a traceback. An in-process call (argv given) gets its signal handlers back at the end."""
    preemption = None
    if (sys.argv[1:] if argv is None else list(argv))[:1] == ["train"]:
        # first thing: from here on SIGTERM/SIGINT stop the run cleanly (exit 75), during set-up and
        # compile too, instead of killing it half set up (docs/faults.md, "Preemption")
        preemption = PreemptionFlag().install()
        if argv is None:   # a process of its own: a native crash (SIGSEGV, SIGABRT) prints every thread's stack
            faulthandler.enable(file=sys.stderr, all_threads=True)
    args, rest = build_parser().parse_known_args(argv)
    unsupported = unsupported_mindspore()          # the version gate (moetrain/compat.py), before any work
    if unsupported:
        print(f"moetrain: error: {unsupported}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if rest and args.command == "train":
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest, args.preemption = rest, preemption
    try:
        return _run(args)
    finally:
        if preemption is not None and argv is not None:
            preemption.uninstall()
        elif preemption is not None:
            # the run's outcome is decided (and saved): a SIGTERM during the interpreter's exit (MindSpore's
            # teardown takes a second or more, with Python's handlers already gone) would only turn it into 143
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _run(args) -> int:
    try:
        return args.func(args)
    except DispatchInvariantError as exc:
        print(f"moetrain: {exc}", file=sys.stderr)
        return EXIT_INVARIANT
    except TrainingHalted as exc:
        print(f"moetrain: training halted: {exc}", file=sys.stderr)
        return EXIT_HALTED
    except CheckpointSaveError as exc:
        print(f"moetrain: checkpoint save failed: {exc}", file=sys.stderr)
        return EXIT_SAVE_FAILED
    except (ConfigError, CheckpointError) as exc:
        kind = "config error" if isinstance(exc, ConfigError) else "checkpoint error"
        print(f"moetrain: {kind}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except expected_errors() as exc:
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError) and getattr(args, "training", False):
            raise     # an I/O error while training (a flaky filesystem): a failure --max-restarts relaunches
        print(f"moetrain: error: {describe(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RuntimeError as exc:
        from moetrain.trainer import CompileError   # (MindSpore is loaded by now: the trainer raised)

        if not isinstance(exc, CompileError):
            raise
        print(f"moetrain: compile error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main())
