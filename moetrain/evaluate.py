"""`moetrain eval MODEL_OR_CHECKPOINT --data PREFIX_OR_BLEND`: loss and perplexity of a saved model.

MODEL_OR_CHECKPOINT is a model directory (hf-import, upcycle, consolidate) or a training checkpoint
saved on any layout. `--data` is a token-shard prefix or a blend in the config's syntax, given as
YAML (`"[0.7, data/a, 0.3, data/b]"` or `"{kjv: [0.7, data/a], web: [0.3, data/b]}"`); a blend is
reported per source plus the weighted total, as training's `eval_loss/<source>`.

It runs the training code's evaluation (`Trainer.evaluate`: the same batching, loss and blend
handling) on a run whose weights come from `checkpoint.load_path`, so a checkpoint of any layout
and a model saved with another `seq_length` load as they would for a fine-tune. Nothing is written
beside the model: the run's folder is temporary.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Sequence

import yaml

from moetrain.checkpoint.distributed import CheckpointReader
from moetrain.checkpoint.model_files import CONFIG_FILE
from moetrain.config import config_with_overrides
from moetrain.fileio import read_yaml


def saved_config(path: str) -> Dict[str, Any]:
    """The config saved with a model directory or training checkpoint (`config.yaml`, else the
    checkpoint's `metadata.json`)."""
    if os.path.isfile(os.path.join(path, CONFIG_FILE)):
        config = read_yaml(os.path.join(path, CONFIG_FILE)) or {}
    elif os.path.isfile(os.path.join(path, "metadata.json")):
        config = CheckpointReader(path).metadata.get("config") or {}
    else:
        raise FileNotFoundError(f"{path!r} is neither a model directory nor a training checkpoint (no "
                                f"{CONFIG_FILE} or metadata.json)")
    if not isinstance(config.get("model"), dict) or "name" not in config["model"]:
        raise ValueError(f"{path}: its config has no `model:` section")
    return config


def parse_data(text: str):
    """A shard prefix, or a blend written as YAML (a list or a mapping, as in `data.path`)."""
    stripped = text.strip()
    if stripped[:1] in "[{":
        try:
            return yaml.safe_load(stripped)
        except yaml.YAMLError as exc:
            raise ValueError(f"--data {text!r}: not a valid YAML blend ({exc.problem})") from None
    return text


def eval_config(path: str, data, seq_length: int, batch_size: int, max_batches: int, out_dir: str,
                overrides: Sequence[str] = ()):
    """The `Config` of an evaluation-only run of the model at `path` on `data`."""
    saved = saved_config(path)
    saved_data = saved.get("data") if isinstance(saved.get("data"), dict) else {}
    model = dict(saved["model"])
    seq_length = seq_length or saved_data.get("seq_length") or model["seq_length"]
    model["seq_length"] = max(model["seq_length"], seq_length)   # positions: no weight depends on them
    raw = {
        "model": model,
        "data": {"type": "lm", "path": data, "eval_path": data, "seq_length": seq_length, "shuffle": False,
                 "tokenizer": saved_data.get("tokenizer", "")},
        "train": {"steps": 1, "global_batch_size": batch_size, "eval_batch_size": batch_size,
                  "eval_max_batches": max_batches, "eval_interval": 0, "output_dir": out_dir},
        "checkpoint": {"load_path": path, "save_steps": 0, "save_at_end": False},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    return config_with_overrides(raw, overrides, source=f"moetrain eval {path}")


def evaluate(path: str, data, seq_length: int = 0, batch_size: int = 8, max_batches: int = 0,
             overrides: Sequence[str] = ()) -> Dict[str, float]:
    """`{"eval_loss": ..., "eval_loss/<source>": ...}` of the saved model on `data` (one process)."""
    from moetrain.trainer import Trainer   # MindSpore: kept off `moetrain eval --help` and argument errors

    out_dir = tempfile.mkdtemp(prefix="moetrain-eval-")
    try:
        trainer = Trainer(eval_config(path, data, seq_length, batch_size, max_batches, out_dir, overrides))
        try:
            record = trainer.evaluate()
        finally:
            trainer.logger.close()
            trainer.faults.close()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {k: v for k, v in record.items() if k.startswith("eval_loss")}


def report(record: Dict[str, float]) -> List[str]:
    """One line per source (a blend) and the total: loss and perplexity."""
    def line(label, loss):
        return f"{label}: loss {loss:.4f}  perplexity {math.exp(loss):.3f}"

    sources = sorted(k for k in record if k.startswith("eval_loss/"))
    lines = [line(key.split("/", 1)[1], record[key]) for key in sources]
    return lines + [line("total (weighted by the blend)" if sources else "all", record["eval_loss"])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model directory or training checkpoint")
    ap.add_argument("--data", required=True, help="token-shard prefix, or a YAML blend: '[0.7, a, 0.3, b]' or '{name: [w, prefix]}'")
    ap.add_argument("--seq-length", type=int, default=0,
                    help="sample length (default: the checkpoint's data.seq_length, else model.seq_length)")
    ap.add_argument("--batch-size", type=int, default=8, help="samples per forward")
    ap.add_argument("--max-batches", type=int, default=0, help="evaluate at most this many batches per source (0: all)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for the evaluation run (e.g. model.compute_dtype=bfloat16)")
    args = ap.parse_args(argv)
    record = evaluate(args.model, parse_data(args.data), args.seq_length, args.batch_size, args.max_batches, args.set)
    print("\n".join(report(record)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
