"""A run's output directory: its identity, who may write into it, which checkpoint a resume picks,
and (multi-node) that every rank sees the same folder. docs/checkpoints.md, "Run identity".

`<output_dir>/run.json` holds the run's `run_id` (a uuid); every checkpoint records it too. A new
run (no `--resume`) into a directory that holds checkpoints or metrics is refused before any work
unless `--overwrite`, which first moves them into `<output_dir>/overwritten-<old run_id>/`.
`--resume` without a path continues the run recorded in run.json from its newest sound
checkpoint; `--resume` of a checkpoint outside the directory starts a new run (a new id) from it.

On an automatic relaunch (`MOETRAIN_RESTART` > 0, set by the launcher, which adds `--resume`)
the newest checkpoint of this run wins; if the failed attempt saved none, the run starts over.

A run owns its folder: before anything else is written, rank 0 creates `<output_dir>/.moetrain.lock`
(O_CREAT | O_EXCL: exactly one process can; it records pid, host, start time and command) and
removes it when the run ends. A second run into a folder whose lock is held by a live process is
refused naming the holder; a lock left by a dead process on this host (a crash, kill -9) is taken
over with a warning; one held by a process on another host cannot be checked from here and is
refused (delete the file if that host is gone). The other ranks check that they see rank 0's lock
(a shared filesystem). `start_run` only decides (and locks); `RunStart.commit` moves an
overwritten run aside and writes run.json once the trainer has validated everything else, so a
refused run leaves the folder as it was.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, Optional

from moetrain.checkpoint.manager import (METADATA, CheckpointError, checkpoint_run_id, holds_checkpoint_folders,
                                         list_checkpoints, newest_usable, resolve_resume_path, run_id_in, same_run)
from moetrain.distributed.launch import RESTART_ENV
from moetrain.faults import broadcast_bytes, failed_ranks, world_sum
from moetrain.fileio import file_in_the_way, temp_path
from moetrain.layout import launched_world_size

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
# what belongs to a run and is moved aside by --overwrite (logs/ belongs to the launch, not the run)
RUN_CONTENTS = (CHECKPOINTS, METRICS_FILE, RUN_FILE, "tensorboard", "resolved_config.yaml", "layout_search.txt",
                "profile")
SHARED_FS_TIMEOUT_ENV = "MOETRAIN_SHARED_FS_TIMEOUT"
SHARED_FS_TIMEOUT_S = 30.0
_CHECK_PREFIX = ".shared-fs-check-"
LOCK_FILE = ".moetrain.lock"
RELAUNCH_LOCK_WAIT_S = 30.0     # a relaunch waits this long for the killed attempt's rank 0 to be gone


class OutputDirError(ValueError):
    """The output directory cannot be used as asked; the message says why and what to do."""


# ------------------------------------------------------------------------------------------------
# The run lock: one run per output directory
# ------------------------------------------------------------------------------------------------
def _proc_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid it
    names one process, not a later one that reuses the pid. None where /proc is not readable."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _process_state(pid: int, start: Optional[str]) -> bool:
    """Whether process `pid` (started at `start`, if known) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                        # another user's process: it exists
    except (OverflowError, ValueError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):                     # killed, not yet reaped
            return False
        if start is not None and fields[19] != start:    # the pid was reused by another process
            return False
    except (OSError, IndexError):
        pass
    return True


def read_lock(path: str) -> Optional[Dict]:
    """The holder recorded in a lock file (None: no file, or not (yet) readable)."""
    try:
        with open(path) as fh:
            holder = json.load(fh)
        return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def describe_holder(holder: Dict) -> str:
    return (f"process {holder.get('pid')} on host {holder.get('host')} (rank 0 of its run, started "
            f"{holder.get('since', '?')}" + (f", command: {holder['command']}" if holder.get("command") else "") + ")")


class RunLockError(OutputDirError):
    """Another live run holds the output directory."""


@dataclass
class RunLock:
    """This process's hold on `<output_dir>/.moetrain.lock`; `release()` removes the file if it is still ours."""
    path: str
    token: str
    holder: Dict = field(default_factory=dict)

    def release(self) -> None:
        current = read_lock(self.path)
        if current is not None and current.get("token") == self.token:
            try:
                os.remove(self.path)
            except OSError:
                pass
        _HELD.pop(self.path, None)


_HELD: Dict[str, RunLock] = {}


@atexit.register
def _release_all() -> None:          # a run that ends by an exception or sys.exit lets go of its folders
    for lock in list(_HELD.values()):
        lock.release()
    for folder in _CREATED:          # and removes those it created and left empty (refused before any work)
        try:
            os.rmdir(folder)
        except OSError:
            pass


def _holder_record(token: str) -> Dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "proc_start": _proc_start(os.getpid()), "token": token,
            "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:400]}


def _stale(holder: Dict) -> Optional[bool]:
    """True: the holder is a dead process of this host; False: alive here; None: another host's."""
    if holder.get("host") != socket.gethostname():
        return None
    return not _process_state(int(holder["pid"]), holder.get("proc_start"))


def _lock_in_use_message(out: str, path: str, holder: Dict, other_host: bool) -> str:
    return (f"train.output_dir {out} is in use by another run: {describe_holder(holder)} holds its lock {path}. "
            f"Two runs in one folder would overwrite each other's checkpoints and metrics: wait for it to end, or "
            f"choose another directory (--set train.output_dir=...)"
            + (f". That process runs on another host, so it cannot be checked from here: if its run is gone (the "
               f"host crashed), delete {path} and start again" if other_host else ""))


def _take_over(path: str, still_stale) -> None:
    """Remove a stale lock (one process at a time: through `<lock>.takeover`, created with O_EXCL),
    if `still_stale(holder now recorded)` says it was not replaced meanwhile."""
    guard = path + ".takeover"
    try:
        fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            if time.time() - os.path.getmtime(guard) > 30:    # left by a process that died while taking over
                os.remove(guard)
        except OSError:
            pass
        time.sleep(0.05)
        return
    try:
        os.write(fd, str(os.getpid()).encode())
        if os.path.exists(path) and still_stale(read_lock(path)):
            os.remove(path)
    finally:
        os.close(fd)
        try:
            os.remove(guard)
        except OSError:
            pass


def acquire_run_lock(out: str, token: Optional[str] = None, wait_for_holder: float = 0.0) -> RunLock:
    """Take `<out>/.moetrain.lock` for this process (rank 0). Raises RunLockError naming the holder
    when a live process holds it. `wait_for_holder`: seconds to wait for a holder on this host to
    end (an automatic relaunch, whose killed predecessor may not be reaped yet)."""
    path = os.path.join(out, LOCK_FILE)
    token = token or uuid.uuid4().hex
    record = _holder_record(token)
    deadline = time.monotonic() + wait_for_holder
    unreadable_since = None
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_lock(path)
            if holder is None:        # being written this instant, just removed, or damaged
                unreadable_since = unreadable_since or time.monotonic()
                try:
                    age = time.time() - os.path.getmtime(path)
                except OSError:
                    continue
                if time.monotonic() - unreadable_since > 2 and age > 10:
                    print(f"moetrain: warning: taking over the lock {path}: it is empty or damaged and {age:.0f} s "
                          f"old (a run died while taking it)", file=sys.stderr, flush=True)
                    _take_over(path, lambda now: now is None)
                    unreadable_since = None
                else:
                    time.sleep(0.05)
                continue
            unreadable_since = None
            if holder.get("host") == record["host"] and holder.get("pid") == os.getpid():
                # this process took it before (`claim_output_dir`, an earlier Trainer of the same script):
                # take it anew, held since then
                record["since"] = holder.get("since", record["since"])
                tmp = temp_path(path)
                with open(tmp, "w") as fh:
                    json.dump(record, fh, indent=1)
                os.replace(tmp, path)
                break
            stale = _stale(holder)
            if stale is False and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            if not stale:
                raise RunLockError(_lock_in_use_message(out, path, holder, stale is None))
            print(f"moetrain: warning: taking over the stale lock {path} of {describe_holder(holder)}: that process "
                  f"no longer runs (a crashed or killed run)", file=sys.stderr, flush=True)
            _take_over(path, lambda now: now is not None and now.get("token") == holder.get("token"))
            continue
        except OSError as exc:
            raise RunLockError(f"train.output_dir {out}: cannot create its lock file {path}: {exc}") from None
        try:
            os.write(fd, json.dumps(record, indent=1).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        break
    lock = RunLock(path, token, record)
    _HELD[path] = lock
    return lock


_CREATED = set()           # output folders this process created (claim_output_dir)


def claim_output_dir(out: Optional[str]) -> Optional[RunLock]:
    """`moetrain train` in one process (not launched as a job): lock the output directory right after
    the config is read, before the slow set-up (importing MindSpore, building the model), so a run
    started into a folder another run holds is refused in a second and the holder is named at once.
    The trainer's `start_run` takes the lock again (this process already holds it). None in a job:
    there rank 0 locks in `start_run`, once the ranks know who rank 0 is."""
    if not out or (launched_world_size() or 1) > 1:
        return None
    if _make_dir(out):
        _CREATED.add(os.path.abspath(out))
    try:
        return acquire_run_lock(out)
    except RunLockError:
        if os.path.abspath(out) in _CREATED:
            _CREATED.discard(os.path.abspath(out))
            try:
                os.rmdir(out)
            except OSError:
                pass
        raise


def release_claim(lock: Optional[RunLock]) -> None:
    """Undo `claim_output_dir` when the run is refused before the trainer takes the folder over: the
    lock goes (unless the trainer took it anew), and so does the folder if the claim created it and
    it is still empty."""
    if lock is None:
        return
    lock.release()
    folder = os.path.dirname(lock.path)
    if os.path.abspath(folder) in _CREATED:
        try:
            os.rmdir(folder)
            _CREATED.discard(os.path.abspath(folder))
        except OSError:
            pass


def check_lock_visible(out: str, token: str, rank: int, timeout: float) -> None:
    """Another rank than 0: rank 0's lock (its token) must be visible in `out` within `timeout` s."""
    path = os.path.join(out, LOCK_FILE)
    deadline = time.monotonic() + timeout
    while True:
        holder = read_lock(path)
        if holder is not None and holder.get("token") == token:
            return
        if time.monotonic() > deadline:
            seen = f"it holds {describe_holder(holder)}" if holder else "it is missing"
            raise OutputDirError(f"rank {rank} on {socket.gethostname()} does not see rank 0's lock {path} ({seen}): "
                                 f"train.output_dir must be one folder every rank shares")
        time.sleep(0.2)


@dataclass
class RunStart:
    run_id: str
    resume_path: Optional[str]      # checkpoint (or model directory) to load; None: from scratch
    moved_aside: Optional[str] = None
    out: str = ""
    lock: Optional[RunLock] = None  # rank 0's hold on the folder
    move_old_run: bool = False      # --overwrite: move the previous run aside at commit
    note: str = ""
    created_dir: bool = False       # the output folder did not exist before this run
    committed: bool = False

    def commit(self, pctx) -> None:
        """Once everything is validated: (rank 0) move an overwritten run aside, write run.json,
        create checkpoints/ and logs/; then every rank waits for it."""
        if pctx.rank == 0:
            if self.move_old_run:
                self.moved_aside = move_aside(self.out, read_run_id(self.out))
                print(f"moetrain: --overwrite: moved the previous run's checkpoints and metrics to {self.moved_aside}",
                      flush=True)
            extra = {"resumed_from": self.resume_path} if self.resume_path else {}
            write_run_file(self.out, self.run_id, **extra)
            if self.note:
                print(f"moetrain: {self.note}", flush=True)
            os.makedirs(os.path.join(self.out, CHECKPOINTS), exist_ok=True)
            os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        world_sum([0.0], pctx)       # nobody writes into the directory before rank 0 has moved the old run
        self.committed = True

    def release(self) -> None:
        """The run is over (or refused): let go of the folder; a refused run removes the folder it created
        if nothing else was put there."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
            if self.created_dir and not self.committed:
                try:
                    os.rmdir(self.out)
                except OSError:
                    pass


def read_run_id(out: str) -> Optional[str]:
    return run_id_in(os.path.join(out, RUN_FILE))


def write_run_file(out: str, run_id: str, **extra) -> None:
    path = os.path.join(out, RUN_FILE)
    tmp = temp_path(path)
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
    if not resume and not overwrite and not holds_checkpoint_folders(root) and not holds_checkpoint_folders(out):
        # nothing to resume (a run stopped, or killed, before its first checkpoint): start again, as
        # the same command with --resume is the documented recovery of every stop (docs/faults.md)
        return _Plan(None, current, False, f"nothing to resume in {out} (no checkpoint yet): starting again from "
                                           f"step 0" + (f" (run {current})" if current else ""))
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
    failed = failed_ranks(error is not None, pctx) if pctx.world_size > 1 else ([0] if error else [])
    if error is not None:
        raise error
    if failed:
        raise OutputDirError(f"rank(s) {failed} refused {what}: their logs say why")


def _make_dir(out: str) -> bool:
    """Create the output directory; returns whether it did not exist before."""
    probe = file_in_the_way(out)
    if probe:
        raise OutputDirError(f"train.output_dir {out!r} cannot be created: {probe!r} is a file; "
                             f"set train.output_dir to a directory path")
    existed = os.path.isdir(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise OutputDirError(f"train.output_dir {out!r} cannot be created: {exc}") from None
    return not existed


def check_shared_filesystem(out: str, pctx, timeout: Optional[float] = None) -> None:
    """Every rank writes a marker file into `out`; rank 0 must see every rank's marker and every
    rank rank 0's, within `timeout` seconds. Multi-node checkpoints need this: rank 0 assembles
    each checkpoint from every rank's files, and every rank reads them back on resume."""
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
    """Every rank, before any work: rank 0 locks the output directory (before anything else is
    written into it; the other ranks check they see the lock), then every rank checks the shared
    filesystem and the checkpoint to resume from, and they agree. Nothing else is written: the
    trainer calls `RunStart.commit` once it has validated the rest (or `release` when it refuses)."""
    restart = int(os.environ.get(RESTART_ENV, "0") or 0) if restart is None else restart
    error, created, lock = None, False, None
    token = uuid.uuid4().hex if pctx.rank == 0 else None
    if pctx.world_size > 1:
        token = broadcast_bytes(bytes.fromhex(token) if token else None, 16, pctx).hex()
    try:
        created = _make_dir(out) or os.path.abspath(out) in _CREATED
        if pctx.rank == 0:
            lock = acquire_run_lock(out, token, RELAUNCH_LOCK_WAIT_S if restart > 0 else 0.0)
    except OutputDirError as exc:
        error = exc
    start = RunStart("", None, out=out, lock=lock, created_dir=created)
    try:
        _agree(pctx, error, "train.output_dir")
        check_shared_filesystem(out, pctx)
        error = None
        if pctx.rank != 0:      # (rank 0's markers were seen: its lock file is there to see too)
            try:
                check_lock_visible(out, token, pctx.rank, float(os.environ.get(SHARED_FS_TIMEOUT_ENV, SHARED_FS_TIMEOUT_S)))
            except OutputDirError as exc:
                error = exc
        _agree(pctx, error, "to see rank 0's lock of train.output_dir")
        plan = error = None
        try:
            plan = plan_run(out, resume, overwrite, restart)
        except (OutputDirError, CheckpointError) as exc:
            error = exc
        _agree(pctx, error, "to start")
        fresh = uuid.uuid4().hex if pctx.rank == 0 else None
        run_id = plan.run_id or broadcast_bytes(bytes.fromhex(fresh) if fresh else None, 16, pctx).hex()
    except BaseException:
        start.release()
        raise
    start.run_id, start.resume_path, start.move_old_run, start.note = run_id, plan.resume_path, plan.move_aside, plan.note
    return start


def last_good_checkpoint(out: str, run_id: str) -> Optional[str]:
    """The newest complete checkpoint of run `run_id` whose own step was finite: a checkpoint saved
    right after a step the numerical-fault guard rejected (`trainer_state.step_finite` false) is
    passed over, so a rollback or the halt message never points at the state that faulted."""
    for _, path in reversed(list_checkpoints(os.path.join(out, CHECKPOINTS))):
        if not same_run(path, run_id):
            continue
        try:
            with open(os.path.join(path, METADATA)) as fh:
                state = json.load(fh).get("trainer_state", {})
        except (OSError, ValueError, AttributeError):
            continue
        if state.get("step_finite", True) is not False:
            return path
    return None
