"""A run's output directory: its identity, who may write into it, which checkpoint a resume picks,
and (multi-node) that every rank sees the same folder. docs/checkpoints.md, "Run identity".

`<output_dir>/run.json` holds the run's `run_id` (a uuid); every checkpoint records it too. A new
run (no `--resume`) into a directory that holds checkpoints or metrics is refused before any work
unless `--overwrite`, which first moves them into `<output_dir>/overwritten-<old run_id>/`.
`--resume` without a path continues the run recorded in run.json from its newest sound
checkpoint; `--resume` of a checkpoint outside the directory starts a new run (a new id) from it.

On an automatic relaunch (`MOETRAIN_RESTART` > 0, set by the launcher, which adds `--resume`)
the newest checkpoint of this run wins; if the failed attempt saved none, the run starts over.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from moetrain.checkpoint.manager import (CheckpointError, checkpoint_run_id, latest_of_run, list_checkpoints,
                                         newest_usable, resolve_resume_path, run_id_in)

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
# what belongs to a run and is moved aside by --overwrite (logs/ belongs to the launch, not the run)
RUN_CONTENTS = (CHECKPOINTS, METRICS_FILE, RUN_FILE, "tensorboard", "resolved_config.yaml", "layout_search.txt",
                "profile")
SHARED_FS_TIMEOUT_ENV = "MOETRAIN_SHARED_FS_TIMEOUT"
SHARED_FS_TIMEOUT_S = 30.0
_CHECK_PREFIX = ".shared-fs-check-"


class OutputDirError(ValueError):
    """The output directory cannot be used as asked; the message says why and what to do."""


@dataclass
class RunStart:
    run_id: str
    resume_path: Optional[str]      # checkpoint (or model directory) to load; None: from scratch
    moved_aside: Optional[str] = None


def read_run_id(out: str) -> Optional[str]:
    return run_id_in(os.path.join(out, RUN_FILE))


def write_run_file(out: str, run_id: str, **extra) -> None:
    path = os.path.join(out, RUN_FILE)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), **extra}, fh, indent=1)
    os.replace(tmp, path)


def metrics_records(out: str) -> int:
    try:
        with open(os.path.join(out, METRICS_FILE), errors="replace") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def describe_contents(out: str) -> Optional[str]:
    """What of a run `out` holds (checkpoints, metrics), or None when nothing would be lost."""
    root = os.path.join(out, CHECKPOINTS)
    folders = sorted(n for n in os.listdir(root) if n.startswith(("step_", ".tmp-step_"))) if os.path.isdir(root) else []
    records = metrics_records(out)
    if not folders and not records:
        return None
    parts = []
    if folders:
        complete = list_checkpoints(root)
        parts.append(f"{len(folders)} checkpoint folder(s)" + (f", the newest {complete[-1][1]}" if complete else ""))
    if records:
        parts.append(f"{records} records in {os.path.join(out, METRICS_FILE)}")
    run_id = read_run_id(out)
    return f"run {run_id or '(no run.json)'}: " + "; ".join(parts)


def move_aside(out: str, old_id: Optional[str]) -> str:
    """Move the previous run's files into <out>/overwritten-<id>/ (same filesystem: renames)."""
    dest = os.path.join(out, f"overwritten-{old_id or time.strftime('%Y%m%d-%H%M%S')}")
    while os.path.exists(dest):
        dest += "+"
    os.makedirs(dest)
    for name in RUN_CONTENTS:
        if os.path.exists(os.path.join(out, name)):
            os.rename(os.path.join(out, name), os.path.join(dest, name))
    return dest


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


# ------------------------------------------------------------------------------------------------
# What to do (every rank computes it from the shared directory; no writes)
# ------------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    resume_path: Optional[str]
    run_id: Optional[str]           # None: a new one
    move_aside: bool
    note: str = ""


def _used_message(out: str, contents: str, how: str) -> str:
    return (f"train.output_dir {out} already holds a run ({contents}); {how} would overwrite its checkpoints and "
            f"metrics. Continue that run with --resume, choose another directory (--set train.output_dir=...), or "
            f"pass --overwrite to move its files into {out}/overwritten-<run id>/ first")


def plan_run(out: str, resume: Optional[str], overwrite: bool, restart: int = 0) -> _Plan:
    """Decide from the directory's contents; raises OutputDirError / CheckpointError."""
    current = read_run_id(out)
    root = os.path.join(out, CHECKPOINTS)
    contents = describe_contents(out)
    if resume is None:
        if contents and not overwrite:
            raise OutputDirError(_used_message(out, contents, "a new run (no --resume)"))
        return _Plan(None, None, bool(contents))
    if restart > 0:     # an automatic relaunch: this run's newest checkpoint, whatever --resume named
        latest = newest_usable(root, current)
        if latest is not None:
            return _Plan(latest, current or checkpoint_run_id(latest), False, f"relaunch {restart}: resuming from {latest}")
        path = resolve_resume_path(resume, out) if resume else None
        return _Plan(path, current, False, f"relaunch {restart}: no checkpoint of this run yet, starting again from "
                                           + (path or "scratch"))
    inside = not resume or _inside(resume, out)
    if overwrite and inside:
        raise OutputDirError(f"--overwrite starts a new run in {out} and --resume {resume or ''} continues the one "
                             f"there: pass only one")
    path = resolve_resume_path(resume, out, run_id=current if not resume else None)
    if inside:
        return _Plan(path, current or checkpoint_run_id(path), False)
    # a checkpoint from elsewhere: a new run here that starts from it
    if contents and not overwrite:
        raise OutputDirError(_used_message(out, contents, f"starting from {path}"))
    return _Plan(path, None, bool(contents), f"a new run in {out}, started from {path}")


# ------------------------------------------------------------------------------------------------
# Collective parts
# ------------------------------------------------------------------------------------------------
def _agree(pctx, error: Optional[BaseException], what: str) -> None:
    """Raise on every rank if any rank failed (the failing rank its own error)."""
    from moetrain.faults import failed_ranks

    failed = failed_ranks(error is not None, pctx) if pctx.world_size > 1 else ([0] if error else [])
    if error is not None:
        raise error
    if failed:
        raise OutputDirError(f"rank(s) {failed} refused {what}: their logs say why")


def _make_dir(out: str) -> None:
    probe = out
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if probe and not os.path.isdir(probe):
        raise OutputDirError(f"train.output_dir {out!r} cannot be created: {probe!r} is a file; "
                             f"set train.output_dir to a directory path")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise OutputDirError(f"train.output_dir {out!r} cannot be created: {exc}") from None


def check_shared_filesystem(out: str, pctx, timeout: Optional[float] = None) -> None:
    """Every rank writes a marker file into `out`; rank 0 must see every rank's marker and every
    rank rank 0's, within `timeout` seconds. Multi-node checkpoints need this: rank 0 assembles
    each checkpoint from every rank's files, and every rank reads them back on resume."""
    from moetrain.faults import broadcast_bytes, world_sum

    if pctx.world_size == 1:
        return
    timeout = float(os.environ.get(SHARED_FS_TIMEOUT_ENV, SHARED_FS_TIMEOUT_S) if timeout is None else timeout)
    token = broadcast_bytes(uuid.uuid4().bytes if pctx.rank == 0 else None, 16, pctx).hex()
    folder = os.path.join(out, _CHECK_PREFIX + token)
    host = socket.gethostname()

    def marker(rank: int) -> str:
        return os.path.join(folder, f"rank_{rank:05d}")

    error = None
    try:
        os.makedirs(folder, exist_ok=True)
        with open(marker(pctx.rank), "w") as fh:
            fh.write(host)
    except OSError as exc:
        error = OutputDirError(f"rank {pctx.rank} ({host}) cannot write into train.output_dir {out}: {exc}")
    _agree(pctx, error, "to write into train.output_dir")            # also: every marker is written
    wanted = range(1, pctx.world_size) if pctx.rank == 0 else [0]
    deadline = time.monotonic() + timeout
    missing = [r for r in wanted if not os.path.exists(marker(r))]
    while missing and time.monotonic() < deadline:
        time.sleep(0.2)
        missing = [r for r in missing if not os.path.exists(marker(r))]
    flags = [0.0] * pctx.world_size
    for r in missing:
        flags[r if pctx.rank == 0 else pctx.rank] = 1.0
    unseen = [r for r, v in enumerate(world_sum(flags, pctx)) if v > 0]
    if pctx.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        for name in os.listdir(out):     # leftovers of checks that were interrupted
            if name.startswith(_CHECK_PREFIX):
                shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    if unseen:
        raise OutputDirError(
            f"train.output_dir {out} is not one folder shared by every rank: rank 0 and rank(s) {unseen} cannot "
            f"see each other's marker files in {folder} within {timeout:.0f} s (this is rank {pctx.rank} on "
            f"{host}). A multi-node run needs train.output_dir on a filesystem every node mounts at the same path "
            f"(NFS, Lustre, ...): rank 0 assembles each checkpoint from every rank's files and every rank reads "
            f"them back on resume. Raise ${SHARED_FS_TIMEOUT_ENV} if the filesystem is only slow to show new files")


def start_run(out: str, resume: Optional[str], overwrite: bool, pctx, restart: Optional[int] = None) -> RunStart:
    """Every rank, before any work: check the output directory, the shared filesystem and the
    checkpoint to resume from, agree, then (rank 0) move an overwritten run aside and write run.json."""
    from moetrain.faults import broadcast_bytes, world_sum
    from moetrain.dist.launch import RESTART_ENV

    restart = int(os.environ.get(RESTART_ENV, "0") or 0) if restart is None else restart
    error = None
    try:
        _make_dir(out)
    except OutputDirError as exc:
        error = exc
    _agree(pctx, error, "train.output_dir")
    check_shared_filesystem(out, pctx)
    plan = error = None
    try:
        plan = plan_run(out, resume, overwrite, restart)
    except (OutputDirError, CheckpointError) as exc:
        error = exc
    _agree(pctx, error, "to start")
    fresh = uuid.uuid4().hex if pctx.rank == 0 else None
    run_id = plan.run_id or broadcast_bytes(bytes.fromhex(fresh) if fresh else None, 16, pctx).hex()
    moved = None
    if pctx.rank == 0:
        if plan.move_aside:
            moved = move_aside(out, read_run_id(out))
            print(f"moetrain: --overwrite: moved the previous run's checkpoints and metrics to {moved}", flush=True)
        extra = {"resumed_from": plan.resume_path} if plan.resume_path else {}
        write_run_file(out, run_id, **extra)
        if plan.note:
            print(f"moetrain: {plan.note}", flush=True)
    world_sum([0.0], pctx)           # nobody writes into the directory before rank 0 has moved the old run
    return RunStart(run_id, plan.resume_path, moved)


def last_good_checkpoint(out: str, run_id: str) -> Optional[str]:
    return latest_of_run(os.path.join(out, CHECKPOINTS), run_id)
