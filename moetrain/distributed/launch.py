"""Launch an SPMD job with msrun and stop all of it, loudly, when one rank fails.

    python -m moetrain.distributed.launch --nproc 4 [--log-dir DIR] [--timeout S] -- python train.py ...
    python -m moetrain.distributed.launch --nnodes 2 --node-rank 1 --nproc 2 \\
        --master-addr 10.0.0.1 --master-port 8118 -- python train.py ...

What msrun 2.10 does by itself (measured on CPU workers): when a worker exits non-zero it
SIGKILLs the other local workers within ~1 s, then waits for its scheduler, which only gives up on
the dead node after its ~30 s heartbeat timeout; it then exits 1 naming a *pid*, not a rank. Ranks
on other nodes blocked in a collective fail after the collective timeout. Nothing hangs, but the
failing rank is hard to find. This launcher wraps every worker command so that it writes its rank
and exit status to ``<log_dir>/.status/``; the watchdog polls those files and, on the first
failure, names the rank, prints the end of its log and every local rank's last step, and kills
workers, scheduler and msrun at once (~1 s instead of ~40 s).

Faults it handles (docs/faults.md):
- a dead rank: named, the job stopped at once; a hung one: collectives time out
  (``--collective-timeout``, exported as the backend's variables unless already set), and once the
  ranks report steps (trainer heartbeats), a rank silent for ``--hang-timeout`` seconds stops the
  job, named with its last step;
- SIGTERM / SIGINT to the launcher: forwarded to every rank, which saves a checkpoint at the next
  step boundary and exits with EXIT_PREEMPTED (75); a second signal kills the job;
- ``--max-restarts N``: after a failure (not after bad input, a preemption or a numerical halt)
  every rank is relaunched with ``--resume``, up to N times; each restart is logged to stderr and
  ``<log_dir>/restarts.log``, and the previous attempt's logs are kept in ``<log_dir>/attempt_<k>/``;
- a rank dies with its wrapper (PR_SET_PDEATHSIG), the wrapper with msrun.

It also pins the scheduler to node rank 0: msrun starts one on every node whose addresses include
``--master-addr``, so two "nodes" on one machine (the multi-node test) would both start one, and
all but the first would fail.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from moetrain.distributed.progress import (ALIVE_INTERVAL_S, STATUS_DIR_ENV, write_alive,  # noqa: F401  (the ranks' side)
                                    write_progress)
from moetrain.distributed.progress import write_json as _write_json
from moetrain.faults import EXIT_PREEMPTED, NO_RESTART_CODES

STATUS_DIR = ".status"
RESTART_ENV = "MOETRAIN_RESTART"         # 0 on the first launch, k on the k-th automatic relaunch
SCHEDULER = -1  # status "rank" of msrun's scheduler process
SCHEDULER_PROGRAM = "from mindspore.communication import init; init()"  # serves the cluster, then exits
NOISE_PREFIXES = ("[INFO]", "[WARNING]", "[DEBUG]")
DEFAULT_COLLECTIVE_TIMEOUT_S = 300
DEFAULT_HANG_TIMEOUT_S = 1800
DEFAULT_PREEMPT_GRACE_S = 600
ALIVE_STALE_BEATS = 4          # a rank silent for this many liveness beats while another beats: stuck
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_timeout_env(env: Dict[str, str], seconds: int) -> Dict[str, str]:
    """The backends' collective timeouts, `seconds` unless the user set them (returns what was set).

    CPU: MS_CPU_COMM_OP_TIMEOUT (MindSpore's own default is 30 s; pipeline stages compiling their
    first step need more). Ascend: HCCL_EXEC_TIMEOUT (CANN range [68, 17340], applied in multiples
    of 68 s) and HCCL_CONNECT_TIMEOUT (range [120, 7200]). GPU: MindSpore 2.10 reads no NCCL
    timeout variable, so there the bound is the launcher's --hang-timeout."""
    wanted = {"MS_CPU_COMM_OP_TIMEOUT": seconds,
              "HCCL_EXEC_TIMEOUT": min(17340, max(68, seconds)),
              "HCCL_CONNECT_TIMEOUT": min(7200, max(120, seconds))}
    added = {k: str(v) for k, v in wanted.items() if not env.get(k)}
    env.update(added)
    return added


# ------------------------------------------------------------------------------------------------
# What the ranks leave in <log_dir>/.status/
# ------------------------------------------------------------------------------------------------
@dataclass
class RankStatus:
    rank: int
    returncode: int
    finished_at: float

    @property
    def who(self) -> str:
        return "the scheduler" if self.rank == SCHEDULER else f"rank {self.rank}"

    @property
    def failed(self) -> bool:
        return self.returncode not in (0, EXIT_PREEMPTED)

    def describe(self) -> str:
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"was killed by {name}"
        return f"exited with code {self.returncode}"


def _read_json_files(status_dir: str, prefix: str) -> List[dict]:
    out = []
    if not os.path.isdir(status_dir):
        return out
    for name in os.listdir(status_dir):
        if not (name.startswith(prefix) and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(status_dir, name)) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue  # being written; read again at the next poll
    return out


def read_statuses(status_dir: str) -> Dict[int, RankStatus]:
    return {int(d["rank"]): RankStatus(int(d["rank"]), int(d["returncode"]), float(d["finished_at"]))
            for d in _read_json_files(status_dir, "rank_")}


def read_progress(status_dir: str) -> Dict[int, dict]:
    return {int(d["rank"]): d for d in _read_json_files(status_dir, "progress_")}


def read_alive(status_dir: str) -> Dict[int, float]:
    return {int(d["rank"]): float(d["time"]) for d in _read_json_files(status_dir, "alive_")}


def read_wrapper_pids(status_dir: str) -> Dict[int, int]:
    return {int(d["rank"]): int(d["pid"]) for d in _read_json_files(status_dir, "wrapper_")}


def log_tail(path: str, lines: int = 20) -> str:
    """Last lines of a worker log without MindSpore's INFO/WARNING chatter."""
    try:
        with open(path, errors="replace") as f:
            kept = [line.rstrip("\n") for line in f if not line.startswith(NOISE_PREFIXES)]
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(kept[-lines:])


def pin_scheduler_to_node_zero(node_rank: int) -> bool:
    """Make msrun start its scheduler on node rank 0 only. msrun's own test is "is --master_addr
    an address of this machine", true on every node when several share one machine. Returns
    False (plain msrun behaviour) if msrun's internals have moved."""
    try:
        from mindspore.parallel.cluster.process_entity import _api   # msrun's internals: MindSpore, ~3 s
    except ImportError:
        return False
    if not hasattr(_api, "_is_local_ip"):
        return False
    _api._is_local_ip = lambda _addr: node_rank == 0
    return True


def _msrun(node_rank: int, msrun_args: Sequence[str]) -> int:
    """msrun in this process, with the scheduler pinned to node rank 0."""
    if not pin_scheduler_to_node_zero(node_rank):
        _say("warning: could not pin the scheduler to node 0 (msrun internals changed); using plain msrun")
    from mindspore.parallel.cluster.run import main as msrun_main   # (as above)

    sys.argv = ["msrun", *msrun_args]
    msrun_main()
    return 0


def role_and_command(cmd: Sequence[str], env: Dict[str, str]):
    """(status rank, command) of a process msrun started: the scheduler runs SCHEDULER_PROGRAM."""
    if env.get("MS_ROLE") == "MS_SCHED":
        return SCHEDULER, [sys.executable, "-c", SCHEDULER_PROGRAM]
    return int(env.get("RANK_ID", "-1")), list(cmd)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: have the kernel send `sig` to this process when its parent exits (PR_SET_PDEATHSIG).
    Elsewhere, or without libc, a no-op."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:      # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def _worker_wrapper(status_dir: str, cmd: Sequence[str]) -> int:
    """Run one rank's command and record how it ended (msrun starts this in place of the command).

    msrun also starts the command as its scheduler (MS_ROLE=MS_SCHED), where everything before
    `init()` would run a second time on node 0; the scheduler only needs `init()`, so it runs
    `SCHEDULER_PROGRAM` instead. Its status is recorded as rank -1.

    The rank dies with this wrapper and this wrapper with msrun (parent-death signals). SIGTERM and
    SIGINT are passed on to the rank. A rank that exits with EXIT_PREEMPTED (checkpoint saved after
    a signal) is reported to msrun as a success, so that msrun does not kill the ranks still saving;
    its real code is in the status file.
    """
    die_with_parent()
    rank, cmd = role_and_command(cmd, os.environ)
    child, pending = None, []

    def pass_on(signum, _frame):        # a signal before the rank exists is passed on once it does
        if child is None:
            pending.append(signum)
        else:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):     # before the launcher can know (and signal) this pid
        signal.signal(sig, pass_on)
    os.makedirs(status_dir, exist_ok=True)
    _write_json(os.path.join(status_dir, f"wrapper_{rank}.json"), {"rank": rank, "pid": os.getpid()})
    child = subprocess.Popen(cmd, env={**os.environ, STATUS_DIR_ENV: status_dir}, preexec_fn=die_with_parent)
    for signum in pending:
        child.send_signal(signum)
    returncode = child.wait()
    _write_json(os.path.join(status_dir, f"rank_{rank}.json"),
                {"rank": rank, "returncode": returncode, "finished_at": time.time()})
    if returncode == EXIT_PREEMPTED:
        return 0
    return returncode if returncode >= 0 else 128 - returncode


# ------------------------------------------------------------------------------------------------
# One attempt: msrun and the watchdog
# ------------------------------------------------------------------------------------------------
class Job:
    """One node's share of the job: msrun, its scheduler (node 0) and the local workers."""

    def __init__(self, cmd: Sequence[str], nproc: int, *, nnodes: int = 1, node_rank: int = 0,
                 master_addr: str = "127.0.0.1", master_port: Optional[int] = None, log_dir: str = "runs/logs",
                 tail: Optional[int] = None, bind_core: bool = False, cluster_timeout: int = 300,
                 env: Optional[Dict[str, str]] = None, hang_timeout: Optional[float] = None,
                 preempt_grace: float = DEFAULT_PREEMPT_GRACE_S):
        if not cmd:
            raise ValueError("no command to launch: put it after '--'")
        if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
            raise ValueError(f"need nproc >= 1, nnodes >= 1 and 0 <= node_rank < nnodes; got nproc={nproc} "
                             f"nnodes={nnodes} node_rank={node_rank}")
        if master_port is None:
            if nnodes > 1:
                raise ValueError("a multi-node job needs the same --master-port on every node")
            master_port = int(os.environ.get("MASTER_PORT") or free_port())
        self.cmd, self.nproc, self.nnodes, self.node_rank = list(cmd), nproc, nnodes, node_rank
        self.master_addr, self.master_port = master_addr, master_port
        self.log_dir = os.path.abspath(log_dir)
        self.status_dir = os.path.join(self.log_dir, STATUS_DIR)
        self.local_ranks = list(range(node_rank * nproc, (node_rank + 1) * nproc))
        self.tail, self.bind_core, self.cluster_timeout = tail, bind_core, cluster_timeout
        self.env = dict(os.environ if env is None else env)
        self.hang_timeout, self.preempt_grace = hang_timeout, preempt_grace
        self.proc: Optional[subprocess.Popen] = None
        self.preempt_deadline: Optional[float] = None
        self.forwarded: Optional[int] = None     # the signal passed on to the ranks (also to ranks that start later)
        self._signalled_pids: set = set()
        self.timed_out = False
        self.started_at = time.time()

    def msrun_command(self) -> List[str]:
        # msrun echoes the log of the rank given to --tail_worker_log; a rank that does not exist: none
        tail = str(self.tail) if self.tail is not None else str(self.nproc * self.nnodes)
        cmd = [sys.executable, "-m", "moetrain.distributed.launch", "_msrun", str(self.node_rank),
               f"--worker_num={self.nproc * self.nnodes}", f"--local_worker_num={self.nproc}",
               f"--master_addr={self.master_addr}", f"--master_port={self.master_port}",
               f"--node_rank={self.node_rank}", f"--log_dir={self.log_dir}", "--join=True",
               f"--cluster_time_out={self.cluster_timeout}", f"--tail_worker_log={tail}"]
        if self.bind_core:
            cmd.append("--bind_core=True")
        return cmd + ["python", "-m", "moetrain.distributed.launch", "_worker", self.status_dir] + self.cmd

    def start(self) -> None:
        try:
            os.makedirs(self.status_dir, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create the log folder {self.status_dir}: {exc}; the logs go to "
                             f"<train.output_dir>/logs: is train.output_dir (or a folder above it) a file?") from None
        for name in os.listdir(self.status_dir):
            os.remove(os.path.join(self.status_dir, name))
        self.started_at = time.time()
        # Own session: killing its process group takes msrun, the scheduler and the tail processes.
        self.proc = subprocess.Popen(self.msrun_command(), env=self.env, start_new_session=True,
                                     stdout=None, stderr=None)

    def forward(self, signum: int) -> List[int]:
        """Pass `signum` to every local rank (through its wrapper); returns the ranks signalled.
        Their trainers save at the next step boundary and exit with EXIT_PREEMPTED."""
        self.forwarded = signum
        self.preempt_deadline = time.time() + self.preempt_grace
        return self._forward_to_new_wrappers()

    def _forward_to_new_wrappers(self) -> List[int]:
        """Pass the forwarded signal to every wrapper not signalled yet: a signal that came while msrun
        was still starting the ranks reaches them as they appear (the watchdog calls this each poll)."""
        signalled = []
        for rank, pid in sorted(read_wrapper_pids(self.status_dir).items()):
            if rank == SCHEDULER or pid in self._signalled_pids:
                continue
            try:
                os.kill(pid, self.forwarded)
                signalled.append(rank)
            except ProcessLookupError:
                pass
            self._signalled_pids.add(pid)
        return signalled

    def kill(self) -> None:
        """SIGKILL everything this job started on this node (workers run in their own sessions)."""
        if self.proc is None:
            return
        import psutil   # only to kill a job's processes (the pre-launch checks do without)

        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        for p in descendants:
            try:
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in descendants:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()

    def wait(self, timeout: Optional[float] = None, poll_interval: float = 0.5) -> int:
        """Watch until the job ends; return 0 on success, EXIT_PREEMPTED after a forwarded signal,
        non-zero (and a report on stderr) otherwise."""
        assert self.proc is not None, "start() first"
        while True:
            statuses = read_statuses(self.status_dir)
            failed = sorted((s for s in statuses.values() if s.failed), key=lambda s: s.finished_at)
            if failed:
                running = [r for r in self.local_ranks if r not in statuses]
                stuck = self._hang_behind(failed[0], statuses)
                if stuck:       # a timeout fired first (a collective's, MindSpore's heartbeat): still a hang
                    return self._report_hang(stuck, statuses, failed[0])
                self.kill()
                return self._report_failure(failed[0], running)
            returncode = self.proc.poll()
            if returncode is not None:
                statuses = read_statuses(self.status_dir)
                if returncode != 0 and not any(s.failed for s in statuses.values()):
                    stuck = self.stuck_ranks(statuses, time.time())
                    if stuck:   # msrun gave up on a silent rank (MindSpore's heartbeat) before anyone reported
                        return self._report_hang(stuck, statuses, None, returncode)
                return self._finish(returncode, statuses)
            now = time.time()
            if timeout is not None and now - self.started_at > timeout:
                running = [r for r in self.local_ranks if r not in statuses]
                self.kill()
                self.timed_out = True
                _say(f"timed out after {timeout:.0f} s; ranks still running were killed: {running}; "
                     f"logs in {self.log_dir}")
                self._print_progress(statuses)
                return 124
            if self.forwarded is not None:
                self._forward_to_new_wrappers()
            if self.preempt_deadline is not None and now > self.preempt_deadline:
                running = [r for r in self.local_ranks if r not in statuses]
                self.kill()
                _say(f"ranks {running} did not save and exit within {self.preempt_grace:.0f} s of the signal; "
                     f"killed them (the last complete checkpoint is the one to resume from)")
                return 128 + signal.SIGTERM
            stalled = self.stalled_ranks(statuses, now)
            if stalled:
                stuck = [r for r in self.stuck_ranks(statuses, now) if r in stalled] or stalled
                return self._report_hang(stuck, statuses)
            time.sleep(poll_interval)

    def _hang_behind(self, first: RankStatus, statuses: Dict[int, RankStatus]) -> List[int]:
        """When the first failure is a rank (or the scheduler) giving up on one that does not arrive --
        a collective timeout, MindSpore's heartbeat timeout -- the ranks the job waits for (else [])."""
        log = os.path.join(self.log_dir, "scheduler.log" if first.rank == SCHEDULER else f"worker_{first.rank}.log")
        gave_up = first.rank == SCHEDULER or gave_up_waiting(log_tail(log, 60))
        waiting = [s.rank for s in statuses.values() if s.failed and s.rank != SCHEDULER] if gave_up else []
        return self.stuck_ranks(statuses, time.time(), gave_up=waiting, liveness=gave_up)

    def stuck_ranks(self, statuses: Dict[int, RankStatus], now: float, gave_up: Sequence[int] = (),
                    liveness: bool = True) -> List[int]:
        """The local ranks still running that the others wait for, judged from the ranks' own reports
        (docs/faults.md, "No hangs"), not from which process exits first:
        1. (`liveness`: the job ends on a timeout, not on a rank's own error) a rank whose process is
           stopped (SIGSTOP, a debugger) or whose liveness beat (a
           thread of the trainer, every ALIVE_INTERVAL_S, on while it computes or waits in a collective:
           measured, the GIL is free there) has been silent for ALIVE_STALE_BEATS beats while another
           rank's went on: stopped, frozen or wedged;
        2. else, when some ranks gave up waiting (`gave_up`: a collective timed out on them), the ranks
           that did not, furthest behind in their step reports.
        Empty when nothing tells them apart."""
        running = [r for r in self.local_ranks if r not in statuses and r not in gave_up]
        if not running:
            return []
        alive, progress = read_alive(self.status_dir), read_progress(self.status_dir)
        stopped = [r for r in running if liveness and _process_stopped(progress.get(r, {}).get("pid"))]
        if stopped:
            return stopped
        if alive and liveness:
            freshest = max(alive.values())
            silent = [r for r in running if r in alive and freshest - alive[r] > ALIVE_STALE_BEATS * ALIVE_INTERVAL_S]
            if silent and len(silent) < len(alive):
                return silent
        if gave_up:
            lowest = min((progress.get(r, {}).get("step", -1) for r in running), default=-1)
            return [r for r in running if progress.get(r, {}).get("step", -1) == lowest]
        return []

    def stalled_ranks(self, statuses: Dict[int, RankStatus], now: float) -> List[int]:
        """Local ranks still running whose last heartbeat (or the launch) is older than hang_timeout.
        Only once some local rank has reported a step: a command that writes no heartbeats (a custom
        entry script) is not judged by it."""
        if not self.hang_timeout or self.preempt_deadline is not None:
            return []
        progress = read_progress(self.status_dir)
        if not progress:
            return []
        return [r for r in self.local_ranks if r not in statuses
                and now - progress.get(r, {}).get("time", self.started_at) > self.hang_timeout]

    def _finish(self, returncode: int, statuses: Dict[int, RankStatus]) -> int:
        failed = sorted((s for s in statuses.values() if s.failed), key=lambda s: s.finished_at)
        if failed:
            return self._report_failure(failed[0], [])
        missing = [r for r in self.local_ranks if r not in statuses]
        if returncode == 0 and not missing:
            preempted = [r for r in self.local_ranks if statuses[r].returncode == EXIT_PREEMPTED]
            if preempted:
                _say(f"ranks {preempted} saved a checkpoint and stopped (exit code {EXIT_PREEMPTED}); "
                     f"run the same command with --resume to continue")
                return EXIT_PREEMPTED
            return 0
        self.kill()  # e.g. msrun or the scheduler failed; leave nothing behind
        _say(f"msrun exited with code {returncode} (ranks without an exit status: {missing}); "
             f"see {os.path.join(self.log_dir, 'scheduler.log')}")
        tail = log_tail(os.path.join(self.log_dir, "scheduler.log"), 10)
        if tail:
            print(tail, file=sys.stderr, flush=True)
        return returncode or 1

    def _print_progress(self, statuses: Dict[int, RankStatus]) -> None:
        """Every local rank's state and last step: a rank far behind the others is the stuck one."""
        progress, now = read_progress(self.status_dir), time.time()
        lines = []
        for rank in self.local_ranks:
            beat = progress.get(rank)
            where = (f"last at step {beat['step']} ({beat['phase']}) {now - beat['time']:.0f} s ago" if beat
                     else "no step reported")
            state = statuses[rank].describe() if rank in statuses else "was still running"
            lines.append(f"  rank {rank}: {state}; {where}")
        print("ranks on this node:\n" + "\n".join(lines), file=sys.stderr, flush=True)

    def _report_failure(self, first: RankStatus, killed: List[int]) -> int:
        log = os.path.join(self.log_dir, "scheduler.log" if first.rank == SCHEDULER else f"worker_{first.rank}.log")
        after = first.finished_at - self.started_at
        _say(f"{first.who} {first.describe()} {after:.1f} s after the launch; its log: {log}")
        tail = log_tail(log)
        print(f"---- last lines of {log} ----\n{tail}\n----", file=sys.stderr, flush=True)
        self._print_progress(read_statuses(self.status_dir))
        if "timeout" in tail.lower() or "time out" in tail.lower():
            _say(f"{first.who} gave up waiting in a collective: the rank that did not arrive is the culprit; "
                 f"it is the one furthest behind in the list above, or on another node")
        hint = (" (with several nodes, a rank failing here may only be reacting to a failure on another "
                "node: check their logs too)" if self.nnodes > 1 else "")
        _say(f"stopped the job: killed msrun, the scheduler and the ranks still running here {killed}{hint}")
        code = first.returncode
        return code if 0 < code < 256 else 128 + (-code if code < 0 else 1)

    def _report_hang(self, stuck: List[int], statuses: Dict[int, RankStatus], first: Optional[RankStatus] = None,
                     msrun_code: Optional[int] = None) -> int:
        """The job hangs on `stuck` (exit 124, relaunched by --max-restarts), whichever timeout noticed it:
        --hang-timeout, a collective's (`first` gave up waiting), or MindSpore's heartbeat (`first` is
        the scheduler, or msrun ended with `msrun_code`)."""
        progress, alive, now = read_progress(self.status_dir), read_alive(self.status_dir), time.time()

        def state(r):
            where = f"step {progress[r]['step']}" if r in progress else "no step yet"
            if _process_stopped(progress.get(r, {}).get("pid")):
                return f"{where}, its process is stopped (SIGSTOP or a debugger)"
            return where + (f", no sign of life for {now - alive[r]:.0f} s" if r in alive else "")

        named = ", ".join(f"rank {r} ({state(r)})" for r in stuck)
        if first is not None and first.rank == SCHEDULER:
            noticed = f"MindSpore's scheduler gave up on it ({first.describe()}: its heartbeat timeout)"
        elif first is not None:
            noticed = f"{first.who} gave up waiting for it in a collective ({first.describe()}; --collective-timeout)"
        elif msrun_code is not None:
            noticed = f"msrun ended with code {msrun_code} (MindSpore's heartbeat timeout)"
        else:
            noticed = f"no step reported for {self.hang_timeout:.0f} s (--hang-timeout)"
        self.kill()          # (after looking at the stuck processes)
        _say(f"the job hangs on {named}: {noticed}; killed the job (exit code 124). "
             f"Logs: {', '.join(os.path.join(self.log_dir, f'worker_{r}.log') for r in stuck)}")
        self._print_progress(statuses)
        return 124


# how a rank's log says it gave up waiting in a collective: CPU (MS_CPU_COMM_OP_TIMEOUT) logs "Ring
# ReduceScatter wait receiving [1,3] failed" and raises "Launch kernel failed, name:Default/AllReduce-op0";
# HCCL / NCCL say "timeout"
_GAVE_UP = re.compile(r"time ?out|timed out|wait receiving .*failed|launch kernel failed.*(allreduce|allgather|"
                      r"broadcast|reducescatter|alltoall|send|receive)|(allreduce|allgather|broadcast)\w*kernelmod "
                      r"launch failed", re.I)


def gave_up_waiting(log_tail_text: str) -> bool:
    """Whether a rank's log ends with it giving up on a collective (a peer did not arrive in time)."""
    return bool(_GAVE_UP.search(log_tail_text))


def _process_stopped(pid) -> bool:
    """Whether process `pid` of this host is stopped (state T: SIGSTOP, a debugger); False if unknown."""
    if not pid:
        return False
    try:
        with open(f"/proc/{int(pid)}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError, ValueError):
        return False


def _say(message: str) -> None:
    print(f"[moetrain.launch] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Attempts: signals and automatic restarts
# ------------------------------------------------------------------------------------------------
def relaunch_command(cmd: Sequence[str], resume_flag: str = "--resume") -> List[str]:
    """The command of an automatic relaunch: `--resume` added (unless already there), `--overwrite`
    dropped (it would move the run's own checkpoints aside)."""
    out = [a for a in cmd if a != "--overwrite"]
    if resume_flag and resume_flag not in out:
        out.append(resume_flag)
    return out


def archive_logs(log_dir: str, attempt: int) -> str:
    """Move attempt `attempt`'s worker and scheduler logs into <log_dir>/attempt_<attempt>/."""
    dest = os.path.join(log_dir, f"attempt_{attempt}")
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(log_dir):
        if name.endswith(".log") and name != "restarts.log":
            shutil.move(os.path.join(log_dir, name), os.path.join(dest, name))
    return dest


class Launcher:
    """Runs the job, relaunching it after a failure up to `max_restarts` times."""

    def __init__(self, cmd: Sequence[str], nproc: int, *, timeout: Optional[float] = None, max_restarts: int = 0,
                 collective_timeout: Optional[int] = DEFAULT_COLLECTIVE_TIMEOUT_S, resume_flag: str = "--resume",
                 **job_kwargs):
        if max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
        self.cmd, self.nproc, self.timeout, self.max_restarts = list(cmd), nproc, timeout, max_restarts
        self.resume_flag = resume_flag
        self.job_kwargs = job_kwargs
        self.env = dict(job_kwargs.pop("env", None) or os.environ)
        if collective_timeout:
            collective_timeout_env(self.env, collective_timeout)
        self.collective_timeout = int(self.env.get("MS_CPU_COMM_OP_TIMEOUT") or 0)
        self.job: Optional[Job] = None
        self.signalled = 0

    def job_for(self, attempt: int) -> Job:
        kwargs = dict(self.job_kwargs)
        cmd = self.cmd if attempt == 0 else relaunch_command(self.cmd, self.resume_flag)
        if attempt:
            port = kwargs.get("master_port")
            if kwargs.get("nnodes", 1) > 1:
                # every node moves to the same new port, so a node still running the failed attempt
                # never meets the new one; the new workers wait long enough for the slowest node to
                # notice the failure (its collectives time out) and follow
                kwargs["master_port"] = port + attempt
                kwargs["cluster_timeout"] = kwargs.get("cluster_timeout", 300) + self.collective_timeout
            else:
                kwargs["master_port"] = free_port()
        return Job(cmd, self.nproc, env={**self.env, RESTART_ENV: str(attempt)}, **kwargs)

    def on_signal(self, signum, _frame) -> None:
        self.signalled += 1
        if self.job is None:
            sys.exit(128 + signum)
        if self.signalled == 1:
            ranks = self.job.forward(signum)
            _say(f"received {signal.Signals(signum).name}: passed it on to ranks {ranks}, which save a checkpoint "
                 f"at the next step boundary and stop (up to {self.job.preempt_grace:.0f} s; signal again to kill "
                 f"the job now)")
            return
        self.job.kill()
        _say(f"received {signal.Signals(signum).name} again; killed the job")
        sys.exit(128 + signum)

    def run(self) -> int:
        attempt = 0
        while True:
            self.job = self.job_for(attempt)
            self.job.start()
            code = self.job.wait(self.timeout)
            if code in NO_RESTART_CODES or self.signalled or self.job.timed_out:
                return code     # success, bad input, a halt, a stop asked for, or the user's time limit
            if attempt >= self.max_restarts:
                if self.max_restarts:
                    _say(f"giving up after {self.max_restarts} restart(s)")
                return code
            attempt += 1
            kept = archive_logs(self.job.log_dir, attempt - 1)
            message = (f"restart {attempt}/{self.max_restarts}: attempt {attempt - 1} ended with code {code} "
                       f"(its logs: {kept}); relaunching every rank from the last complete checkpoint")
            _say(message)
            with open(os.path.join(self.job.log_dir, "restarts.log"), "a") as fh:
                fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}\n")


def launch(cmd: Sequence[str], nproc: int, *, timeout: Optional[float] = None, **kwargs) -> int:
    """Start the job, watch it, relaunch it after failures (`max_restarts`), clean up; the return
    value is the exit code for the shell."""
    launcher = Launcher(cmd, nproc, timeout=timeout, **kwargs)
    previous = {sig: signal.signal(sig, launcher.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return launcher.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if launcher.job is not None and launcher.job.proc is not None and launcher.job.proc.poll() is None:
            launcher.job.kill()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:      # internal: one rank's command, started by msrun
        return _worker_wrapper(argv[1], argv[2:])
    if argv[:1] == ["_msrun"]:       # internal: msrun itself, started by Job
        return _msrun(int(argv[1]), argv[2:])
    if "--" not in argv:
        print("usage: python -m moetrain.distributed.launch [options] -- COMMAND ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m moetrain.distributed.launch",
                                 description="msrun with a watchdog: any failing rank stops the whole job.")
    ap.add_argument("--nproc", type=int, required=True, help="processes on this node")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=None, help="default: $MASTER_PORT or a free port")
    ap.add_argument("--log-dir", default="runs/logs")
    ap.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
    ap.add_argument("--cluster-timeout", type=int, default=300,
                    help="seconds to wait for all ranks to join (msrun --cluster_time_out)")
    ap.add_argument("--tail", default="first",
                    help="rank whose log is echoed to the console: a rank, 'first' (this node's first) or 'none'")
    ap.add_argument("--bind-core", action="store_true", help="pin workers to cores (not on small CPU boxes)")
    ap.add_argument("--max-restarts", type=int, default=0,
                    help="relaunch every rank with --resume after a failure, up to this many times")
    ap.add_argument("--collective-timeout", type=int, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                    help="seconds a collective may wait (MS_CPU_COMM_OP_TIMEOUT, HCCL_EXEC_TIMEOUT, "
                         "HCCL_CONNECT_TIMEOUT unless set); 0: leave the backends' defaults")
    ap.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S,
                    help="stop the job when a rank reports no step for this many seconds (0: off)")
    ap.add_argument("--preempt-grace", type=float, default=DEFAULT_PREEMPT_GRACE_S,
                    help="after SIGTERM/SIGINT, seconds the ranks get to save and exit before they are killed")
    ap.add_argument("--resume-flag", default="--resume",
                    help="argument added to the command on a relaunch ('' for none)")
    args = ap.parse_args(argv[:split])
    tail = {"none": None, "first": args.node_rank * args.nproc}.get(args.tail)
    if args.tail not in ("none", "first"):
        tail = int(args.tail)
    try:
        return launch(argv[split + 1:], args.nproc, timeout=args.timeout, nnodes=args.nnodes,
                      node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                      log_dir=args.log_dir, tail=tail, bind_core=args.bind_core,
                      cluster_timeout=args.cluster_timeout, max_restarts=args.max_restarts,
                      collective_timeout=args.collective_timeout, hang_timeout=args.hang_timeout or None,
                      preempt_grace=args.preempt_grace, resume_flag=args.resume_flag)
    except ValueError as exc:
        _say(f"error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
