"""Launch an SPMD job with msrun and stop all of it, loudly, when one rank fails.

    python -m moetrain.parallel.launch --nproc 4 [--log-dir DIR] [--timeout S] -- python train.py ...
    python -m moetrain.parallel.launch --nnodes 2 --node-rank 1 --nproc 2 \\
        --master-addr 10.0.0.1 --master-port 8118 -- python train.py ...

What msrun 2.10 does by itself (measured on CPU workers): when a worker exits non-zero it
SIGKILLs the other local workers within ~1 s, then waits for its scheduler, which only gives up on
the dead node after its ~30 s heartbeat timeout; it then exits 1 naming a *pid*, not a rank. Ranks
on other nodes blocked in a collective fail after the ~30 s CPU collective timeout. Nothing hangs,
but the failing rank is hard to find. This launcher wraps every worker command so that it writes
its rank and exit status to ``<log_dir>/.status/``; the watchdog polls those files and, on the first
failure, names the rank, prints the end of its log, and kills workers, scheduler and msrun at
once (~1 s instead of ~40 s).

It also pins the scheduler to node rank 0: msrun starts one on every node whose addresses include
``--master-addr``, so two "nodes" on one machine (the multi-node test) would both start one, and
all but the first would fail.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

STATUS_DIR = ".status"
SCHEDULER = -1  # status "rank" of msrun's scheduler process
SCHEDULER_PROGRAM = "from mindspore.communication import init; init()"  # serves the cluster, then exits
NOISE_PREFIXES = ("[INFO]", "[WARNING]", "[DEBUG]")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankStatus:
    rank: int
    returncode: int
    finished_at: float

    @property
    def who(self) -> str:
        return "the scheduler" if self.rank == SCHEDULER else f"rank {self.rank}"

    def describe(self) -> str:
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"was killed by {name}"
        return f"exited with code {self.returncode}"


def read_statuses(status_dir: str) -> Dict[int, RankStatus]:
    out = {}
    if not os.path.isdir(status_dir):
        return out
    for name in os.listdir(status_dir):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(status_dir, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue  # being written; read again at the next poll
        out[int(data["rank"])] = RankStatus(int(data["rank"]), int(data["returncode"]), float(data["finished_at"]))
    return out


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
        from mindspore.parallel.cluster.process_entity import _api
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
    from mindspore.parallel.cluster.run import main as msrun_main

    sys.argv = ["msrun", *msrun_args]
    msrun_main()
    return 0


def role_and_command(cmd: Sequence[str], env: Dict[str, str]):
    """(status rank, command) of a process msrun started: the scheduler runs SCHEDULER_PROGRAM."""
    if env.get("MS_ROLE") == "MS_SCHED":
        return SCHEDULER, [sys.executable, "-c", SCHEDULER_PROGRAM]
    return int(env.get("RANK_ID", "-1")), list(cmd)


def _worker_wrapper(status_dir: str, cmd: Sequence[str]) -> int:
    """Run one rank's command and record how it ended (msrun starts this in place of the command).

    msrun also starts the command as its scheduler (MS_ROLE=MS_SCHED), where everything before
    `init()` would run a second time on node 0; the scheduler only needs `init()`, so it runs
    `SCHEDULER_PROGRAM` instead. Its status is recorded as rank -1.
    """
    rank, cmd = role_and_command(cmd, os.environ)
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    returncode = child.wait()
    os.makedirs(status_dir, exist_ok=True)
    tmp = os.path.join(status_dir, f".rank_{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "returncode": returncode, "finished_at": time.time()}, f)
    os.replace(tmp, os.path.join(status_dir, f"rank_{rank}.json"))
    return returncode if returncode >= 0 else 128 - returncode


class Job:
    """One node's share of the job: msrun, its scheduler (node 0) and the local workers."""

    def __init__(self, cmd: Sequence[str], nproc: int, *, nnodes: int = 1, node_rank: int = 0,
                 master_addr: str = "127.0.0.1", master_port: Optional[int] = None, log_dir: str = "runs/logs",
                 tail: Optional[int] = None, bind_core: bool = False, cluster_timeout: int = 300,
                 env: Optional[Dict[str, str]] = None):
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
        self.proc: Optional[subprocess.Popen] = None

    def msrun_command(self) -> List[str]:
        # msrun echoes the log of the rank given to --tail_worker_log; a rank that does not exist: none
        tail = str(self.tail) if self.tail is not None else str(self.nproc * self.nnodes)
        cmd = [sys.executable, "-m", "moetrain.parallel.launch", "_msrun", str(self.node_rank),
               f"--worker_num={self.nproc * self.nnodes}", f"--local_worker_num={self.nproc}",
               f"--master_addr={self.master_addr}", f"--master_port={self.master_port}",
               f"--node_rank={self.node_rank}", f"--log_dir={self.log_dir}", "--join=True",
               f"--cluster_time_out={self.cluster_timeout}", f"--tail_worker_log={tail}"]
        if self.bind_core:
            cmd.append("--bind_core=True")
        return cmd + ["python", "-m", "moetrain.parallel.launch", "_worker", self.status_dir] + self.cmd

    def start(self) -> None:
        os.makedirs(self.status_dir, exist_ok=True)
        for name in os.listdir(self.status_dir):
            os.remove(os.path.join(self.status_dir, name))
        self.started_at = time.time()
        # Own session: killing its process group takes msrun, the scheduler and the tail processes.
        self.proc = subprocess.Popen(self.msrun_command(), env=self.env, start_new_session=True,
                                     stdout=None, stderr=None)

    def kill(self) -> None:
        """SIGKILL everything this job started on this node (workers run in their own sessions)."""
        if self.proc is None:
            return
        import psutil

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
        """Watch until the job ends; return 0 on success, non-zero (and a report on stderr) otherwise."""
        assert self.proc is not None, "start() first"
        while True:
            statuses = read_statuses(self.status_dir)
            failed = sorted((s for s in statuses.values() if s.returncode != 0), key=lambda s: s.finished_at)
            if failed:
                running = [r for r in self.local_ranks if r not in statuses]
                self.kill()
                return self._report_failure(failed[0], running)
            returncode = self.proc.poll()
            if returncode is not None:
                return self._finish(returncode, read_statuses(self.status_dir))
            if timeout is not None and time.time() - self.started_at > timeout:
                running = [r for r in self.local_ranks if r not in statuses]
                self.kill()
                _say(f"timed out after {timeout:.0f} s; ranks still running were killed: {running}; "
                     f"logs in {self.log_dir}")
                return 124
            time.sleep(poll_interval)

    def _finish(self, returncode: int, statuses: Dict[int, RankStatus]) -> int:
        failed = sorted((s for s in statuses.values() if s.returncode != 0), key=lambda s: s.finished_at)
        if failed:
            return self._report_failure(failed[0], [])
        missing = [r for r in self.local_ranks if r not in statuses]
        if returncode == 0 and not missing:
            return 0
        self.kill()  # e.g. msrun or the scheduler failed; leave nothing behind
        _say(f"msrun exited with code {returncode} (ranks without an exit status: {missing}); "
             f"see {os.path.join(self.log_dir, 'scheduler.log')}")
        tail = log_tail(os.path.join(self.log_dir, "scheduler.log"), 10)
        if tail:
            print(tail, file=sys.stderr, flush=True)
        return returncode or 1

    def _report_failure(self, first: RankStatus, killed: List[int]) -> int:
        log = os.path.join(self.log_dir, "scheduler.log" if first.rank == SCHEDULER else f"worker_{first.rank}.log")
        after = first.finished_at - self.started_at
        _say(f"{first.who} {first.describe()} {after:.1f} s after the launch; its log: {log}")
        print(f"---- last lines of {log} ----\n{log_tail(log)}\n----", file=sys.stderr, flush=True)
        hint = (" (with several nodes, a rank failing here may only be reacting to a failure on another "
                "node: check their logs too)" if self.nnodes > 1 else "")
        _say(f"stopped the job: killed msrun, the scheduler and the ranks still running here {killed}{hint}")
        code = first.returncode
        return code if 0 < code < 256 else 128 + (-code if code < 0 else 1)


def _say(message: str) -> None:
    print(f"[moetrain.launch] {message}", file=sys.stderr, flush=True)


def launch(cmd: Sequence[str], nproc: int, *, timeout: Optional[float] = None, **job_kwargs) -> int:
    """Start the job, watch it, clean up; the return value is the exit code for the shell."""
    job = Job(cmd, nproc, **job_kwargs)

    def on_signal(signum, _frame):
        job.kill()
        _say(f"received {signal.Signals(signum).name}; killed the job")
        sys.exit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        job.start()
        return job.wait(timeout)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:      # internal: one rank's command, started by msrun
        return _worker_wrapper(argv[1], argv[2:])
    if argv[:1] == ["_msrun"]:       # internal: msrun itself, started by Job
        return _msrun(int(argv[1]), argv[2:])
    if "--" not in argv:
        print("usage: python -m moetrain.parallel.launch [options] -- COMMAND ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m moetrain.parallel.launch",
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
    args = ap.parse_args(argv[:split])
    tail = {"none": None, "first": args.node_rank * args.nproc}.get(args.tail)
    if args.tail not in ("none", "first"):
        tail = int(args.tail)
    try:
        return launch(argv[split + 1:], args.nproc, timeout=args.timeout, nnodes=args.nnodes,
                      node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                      log_dir=args.log_dir, tail=tail, bind_core=args.bind_core,
                      cluster_timeout=args.cluster_timeout)
    except ValueError as exc:
        _say(f"error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
