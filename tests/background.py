"""Child test processes that run at idle priority through the whole session.

A test file registers a command at import (`run_in_background(__name__, argv, env, reader=TEST)`); when
its reader TEST is selected, tests/conftest.py starts the command at the session's first test under `nice 19`
and orders the file last, and its test reads the outcome with `wait_for_background(__name__)`.

Why: the first half of the suite keeps both cores busy (one-process tests beside the shared msrun
jobs) and the second half does not (launches start up, ranks wait for each other, the fault drills
sleep; measured: about a third of the two cores idle over its last 13 minutes). A niced child takes
next to nothing while the others are busy and the idle share when they are not, so a child pytest
that would add two minutes at the end runs in time that was idle.

The launcher's fault tests (tests/test_launch_faults.py) mostly wait on their own timeouts
(collective timeouts, the hang watchdog, relaunches): their child starts at normal priority (a
starved rank would miss its timeouts) once the shared jobs have ended, and runs beside the
files that launch jobs of their own instead of after them.
"""
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

IDLE_NICE = 19


@dataclass
class BackgroundRun:
    argv: List[str]
    env: Dict[str, str]
    cwd: str
    timeout: float
    nice: int = 19
    after_shared_jobs: bool = False
    reader: str = ""                 # the test (function name) that reads its outcome: it starts only if that one is selected
    proc: Optional[subprocess.Popen] = None
    log_path: str = ""
    started: float = 0.0


REGISTERED: Dict[str, BackgroundRun] = {}
SELECTED: set = set()    # the files whose reader test is selected (tests/conftest.py)


def run_in_background(module: str, argv: List[str], env: Dict[str, str], cwd: str, timeout: float, *, reader: str,
                      nice: int = IDLE_NICE, after_shared_jobs: bool = False) -> None:
    """Register `argv` for the session's background (call at import, with `__name__`). By default it
    starts at the session's first test at idle priority; `after_shared_jobs` starts it once the shared
    msrun jobs have ended (tests/conftest.py), at priority `nice`."""
    REGISTERED[module] = BackgroundRun(list(argv), dict(env), cwd, timeout, nice, after_shared_jobs, reader)


def start_selected(after_shared_jobs: bool = False) -> None:
    """Start the registered commands of the selected test files that start at this point of the
    session: the first test (tests/conftest.py), or the end of the shared jobs (`after_shared_jobs`)."""
    for module, run in REGISTERED.items():
        if module in SELECTED and run.proc is None and run.after_shared_jobs == after_shared_jobs:
            _start(module, run)


def _start(module: str, run: BackgroundRun) -> None:
    fd, run.log_path = tempfile.mkstemp(prefix=f"moetrain-background-{module}-", suffix=".log")
    log = os.fdopen(fd, "w")
    run.started = time.time()
    run.proc = subprocess.Popen(run.argv, cwd=run.cwd, env=run.env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.nice(run.nice))
    log.close()


def wait_for_background(module: str) -> subprocess.CompletedProcess:
    """The registered command's outcome (its output in `stdout`). Past its timeout, counted from its
    start, it is killed once it makes no progress (`_wait_while_it_progresses`)."""
    run = REGISTERED[module]
    if run.proc is None:     # not started by the session (e.g. the test run without conftest's hook)
        _start(module, run)
    remaining = max(1.0, run.timeout - (time.time() - run.started))
    try:
        code = run.proc.wait(timeout=remaining)
    except subprocess.TimeoutExpired:
        code = _wait_while_it_progresses(run)
    with open(run.log_path) as fh:
        output = fh.read()
    os.remove(run.log_path)
    return subprocess.CompletedProcess(run.argv, code, output, "")


def _wait_while_it_progresses(run: BackgroundRun, stall_s: float = 180.0) -> int:
    """Past its timeout a niced child may only have been starved by the suite (CI's load): let it go on
    while its process tree gets CPU time, up to twice the timeout; kill it when it gets none for
    `stall_s` (a hang) or at that cap."""
    last_cpu, last_progress = tree_cpu_seconds(run.proc.pid), time.time()
    while run.proc.poll() is None:
        cpu = tree_cpu_seconds(run.proc.pid)
        if cpu > last_cpu:
            last_cpu, last_progress = cpu, time.time()
        if time.time() - last_progress > stall_s or time.time() - run.started > 2 * run.timeout:
            for pid in _descendants(run.proc.pid):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            run.proc.kill()
            break
        time.sleep(2)
    return run.proc.wait()


def _descendants(pid: int) -> List[int]:
    parents: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(_stat(int(entry))[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process, its ended (waited) children and its live descendants (Linux /proc)."""
    total = 0.0
    for member in [pid] + _descendants(pid):
        try:
            total += sum(int(f) for f in _stat(member)[11:15]) / os.sysconf("SC_CLK_TCK")
        except OSError:     # it ended meanwhile
            continue
    return total


def stop_all() -> None:
    """Session end: kill what still runs (an interrupted session leaves no child behind)."""
    for run in REGISTERED.values():
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        if run.log_path and os.path.exists(run.log_path):   # its test did not read it
            os.remove(run.log_path)


CHILD_ENV = "MOETRAIN_TEST_CHILD"   # set in a child that runs a file's own heavy tests


def in_child(module: str) -> bool:
    """True inside the idle-priority child that runs `module`'s own heavy tests (`heavy_tests_in_child`)."""
    return os.environ.get(CHILD_ENV) == module


def heavy_tests_in_child(module: str, path: str, marker: str, cwd: str, timeout: float, *, reader: str,
                         nice: int = IDLE_NICE, after_shared_jobs: bool = False) -> None:
    """Register a child pytest that runs the tests of file `path` marked `marker` (at idle priority
    from the session's first test, or as `run_in_background` says); in that child nothing is
    registered. The parent skips those tests (`child_only`) and a test of its own reads the child's
    outcome (`wait_for_background`)."""
    import sys

    if in_child(module):
        return
    env = dict(os.environ, **{CHILD_ENV: module})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, env.get("PYTHONPATH", "")) if p)
    run_in_background(module, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, path],
                      env=env, cwd=cwd, timeout=timeout, reader=reader, nice=nice, after_shared_jobs=after_shared_jobs)


def child_only(module: str):
    """Decorator: the test runs in `module`'s idle-priority child only (see `heavy_tests_in_child`)."""
    import pytest

    return pytest.mark.skipif(not in_child(module), reason="runs in this file's idle-priority child process "
                                                           "(tests/background.py); a test here reads its outcome")


def _stat(pid: int) -> List[str]:
    """The fields of /proc/PID/stat after the command name (Linux): [1] the parent, [11:15] utime,
    stime, cutime, cstime in clock ticks."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads)."""
    return sum(int(f) for f in _stat(pid)[11:13]) / os.sysconf("SC_CLK_TCK")


def wait_patiently(proc: subprocess.Popen, cpu_limit: float, stall_s: float = 180.0, poll_s: float = 1.0):
    """`proc.communicate()` for a process that may run at idle priority beside a busy suite, where a
    wall-clock timeout measures the load, not the process (a nice-19 run got ~1.5 % of a core for
    minutes in CI). It is killed, and `subprocess.TimeoutExpired` raised, only when it hangs: its own
    CPU time passes `cpu_limit`, or it gets none at all for `stall_s` of wall time."""
    import threading

    out: Dict[str, str] = {}
    reader = threading.Thread(target=lambda: out.update(zip(("stdout", "stderr"), proc.communicate())), daemon=True)
    reader.start()
    last_cpu, last_progress = 0.0, time.time()
    while reader.is_alive():
        reader.join(poll_s)
        if not reader.is_alive():
            break
        try:
            cpu = process_cpu_seconds(proc.pid)
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue                                  # it just ended: communicate() returns now
        if cpu > last_cpu:
            last_cpu, last_progress = cpu, time.time()
        if cpu > cpu_limit or time.time() - last_progress > stall_s:
            proc.kill()
            reader.join()
            why = f"{cpu:.0f} CPU s" if cpu > cpu_limit else f"no CPU time for {stall_s:.0f} s"
            raise subprocess.TimeoutExpired(proc.args, cpu_limit, output=f"({why}) " + (out.get("stdout") or ""),
                                            stderr=out.get("stderr"))
    return out.get("stdout"), out.get("stderr")


def run_patiently(argv: List[str], cpu_limit: float, **popen) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True, ...)` with `wait_patiently`'s hang test
    in place of a wall-clock timeout."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    stdout, stderr = wait_patiently(proc, cpu_limit)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
