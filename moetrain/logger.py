"""Rank-0 metrics: `metrics.jsonl` (one JSON object per optimizer step), tensorboard scalars,
a progress line with ETA. Other ranks write only their own log file (set up by the launcher).

metrics.jsonl survives crashes: each record is one write of one line, flushed and fsynced, so a
crash can only leave a torn *last* line; on resume that line is dropped (with a warning) and the
records after the checkpoint's step are removed, by writing the kept lines to a temporary file
that replaces the old one atomically."""
from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

import numpy as np

from moetrain.fileio import temp_path


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value


def _scalars(record: Dict[str, Any]):
    """Flatten a record into tensorboard scalars (expert_load -> per-layer imbalance and loads)."""
    for key, value in record.items():
        if key == "step":
            continue
        if key == "expert_load":
            for layer, loads in enumerate(value):
                loads = np.asarray(loads, dtype=np.float64)
                if loads.sum() > 0:
                    yield f"moe/layer{layer}/max_over_mean", loads.max() / loads.mean()
                    for e, load in enumerate(loads / loads.sum()):
                        yield f"moe/layer{layer}/expert{e}", load
        elif isinstance(value, (int, float)) and math.isfinite(value):
            group = "eval" if key.startswith("eval_") else "train"
            yield f"{group}/{key}", value


class MetricsLogger:
    def __init__(self, output_dir: str, total_steps: int, enabled: bool, tensorboard: bool,
                 progress_bar: bool, log_interval: int, resume_step: int = 0):
        self.enabled = enabled
        self.total_steps = total_steps
        self.progress_bar = progress_bar and enabled
        self.log_interval = log_interval
        self.start_time = time.time()
        self.start_step = resume_step
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.tb = None
        if not enabled:
            return
        self._truncate_after(resume_step)
        self.file = open(self.path, "a")
        if tensorboard:
            from tensorboardX import SummaryWriter   # 1.4 s to import: only when logging.tensorboard asks

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def _truncate_after(self, step: int, keep_events: bool = False) -> None:
        """On resume, forget records of steps after the checkpoint: they will be redone."""
        if os.path.exists(self.path):
            truncate_metrics(self.path, step, keep_events)

    def rewind(self, step: int) -> None:
        """After a rollback to `step`: drop the later step records (kept: the fault events)."""
        if not self.enabled:
            return
        self.file.close()
        self._truncate_after(step, keep_events=True)
        self.file = open(self.path, "a")

    def log(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: _jsonable(v) for k, v in record.items()}
        self.file.write(json.dumps(record) + "\n")     # one line, one write: a crash tears only the last
        self.file.flush()
        os.fsync(self.file.fileno())
        step = record["step"]
        if "event" in record:       # a fault event (moetrain.faults): said on stderr where it happens
            return
        if self.tb is not None:
            for tag, value in _scalars(record):
                self.tb.add_scalar(tag, value, step)
        if "loss" in record and (step % self.log_interval == 0 or step == self.total_steps or step == 1):
            self._print_line(record)
        elif "eval_loss" in record:
            extra = f" eval_accuracy {record['eval_accuracy']:.4f}" if "eval_accuracy" in record else ""
            per_source = [f"{k.split('/', 1)[1]} {v:.4f}" for k, v in record.items() if k.startswith("eval_loss/")]
            extra += f" ({', '.join(per_source)})" if per_source else ""
            print(f"[eval] step {step}: eval_loss {record['eval_loss']:.4f}{extra}", flush=True)

    def _print_line(self, r: Dict[str, Any]) -> None:
        step = r["step"]
        elapsed = time.time() - self.start_time
        done = step - self.start_step
        eta = elapsed / max(1, done) * (self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}", f"loss {r['loss']:.4f}"]
        for key in ("lm_loss", "mtp_loss", "aux_loss", "z_loss", "drop_rate"):
            if key in r:
                parts.append(f"{key} {r[key]:.4g}")
        if "expert_load" in r:
            ratios = [max(l) / (sum(l) / len(l)) for l in r["expert_load"] if sum(l) > 0]
            if ratios:
                parts.append(f"load_max/mean {max(ratios):.2f}")
        parts += [f"lr {r['lr']:.3g}", f"gnorm {r['grad_norm']:.3g}"]
        if "loss_scale" in r:
            parts.append(f"scale {r['loss_scale']:.0f}")
        rate = r.get("tokens_per_s") or r.get("samples_per_s")
        unit = "tok/s" if "tokens_per_s" in r else "samples/s"
        parts.append(f"{rate:.0f} {unit}")
        if self.progress_bar:
            width = 20
            filled = int(width * step / max(1, self.total_steps))
            parts.insert(0, "[" + "#" * filled + "." * (width - filled) + "]")
            parts.append(f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")
        print(" | ".join(parts), flush=True)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


def read_metrics(path: str) -> List[Dict[str, Any]]:
    """The records of a metrics.jsonl; a torn or unreadable line is skipped with a warning."""
    records = []
    with open(path, errors="replace") as fh:
        lines = fh.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            torn = number == len(lines) and not line.endswith("\n")
            warnings.warn(f"{path}: line {number} " + ("is a torn last line (the run was killed while writing it): "
                          "dropped" if torn else "is not JSON: dropped"))
    return records


def truncate_metrics(path: str, step: int, keep_events: bool = False) -> None:
    """Keep the records of steps <= `step` (and, with `keep_events`, every `event` record), atomically."""
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step or (keep_events and "event" in r)]
    tmp = temp_path(path)
    with open(tmp, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in kept)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def print_rank0(rank: int, *args) -> None:
    if rank == 0:
        print(*args, flush=True)
        sys.stdout.flush()
