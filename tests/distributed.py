"""Run msrun jobs from pytest through moetrain's launcher.

    run = run_workers("tests/workers/comm_worker.py", nproc=4, timeout=150)
    run.check()                         # raises with the launcher's report if the job failed
    results = run.json_results()        # [rank_0.json, rank_1.json, ...] written by the workers

A worker script receives its output folder as first argument and writes rank_<r>.json / .npz
there. Jobs run in their own folder (`job_dir`, e.g. pytest's `tmp_path`; default a new temporary
folder), which is also the working directory (MindSpore drops rank_*/ IR dumps there); after each
job every process that still mentions that folder is killed.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def require_msrun() -> None:
    if shutil.which("msrun") is None:
        pytest.skip("msrun (installed with mindspore) is not on PATH; distributed tests need it")


@dataclass
class WorkerRun:
    returncode: int
    output: str              # the launcher's stdout and stderr
    out_dir: str
    log_dir: str
    seconds: float
    leftovers: List[int] = field(default_factory=list)   # pids that had to be killed afterwards

    def check(self) -> "WorkerRun":
        if self.returncode != 0:
            raise AssertionError(f"distributed job failed with exit code {self.returncode}:\n{self.report()}")
        return self

    def report(self) -> str:
        return "\n".join(line for line in self.output.splitlines() if not line.startswith(("[WARNING]", "[INFO]")))

    def json_results(self) -> List[Dict]:
        return [json.load(open(p)) for p in self._rank_files(".json")]

    def npz_results(self) -> List[Dict[str, np.ndarray]]:
        return [dict(np.load(p)) for p in self._rank_files(".npz")]

    def worker_log(self, rank: int) -> str:
        with open(os.path.join(self.log_dir, f"worker_{rank}.log"), errors="replace") as f:
            return f.read()

    def _rank_files(self, suffix: str) -> List[str]:
        names = sorted((n for n in os.listdir(self.out_dir) if n.startswith("rank_") and n.endswith(suffix)),
                       key=lambda n: int(n[5:-len(suffix)]))
        return [os.path.join(self.out_dir, n) for n in names]


def launcher_command(script: str, nproc: int, job_dir: str, args: Sequence[str] = (),
                     launcher_args: Sequence[str] = (), timeout: Optional[float] = None) -> List[str]:
    """The command line that launches `script` on `nproc` local ranks with outputs in `job_dir`."""
    cmd = [sys.executable, "-m", "moetrain.distributed.launch", "--nproc", str(nproc),
           "--log-dir", os.path.join(job_dir, "logs"), "--tail", "none", *launcher_args]
    if timeout is not None:
        cmd += ["--timeout", str(timeout)]
    script = script if os.path.isabs(script) else os.path.join(REPO, script)
    return cmd + ["--", "python", script, os.path.join(job_dir, "out"), *args]


def kill_leftovers(token: str) -> List[int]:
    """Kill (by pid) every process whose command line mentions `token`, a job's unique folder
    (pass it with a trailing separator so that /tmp/job1/ does not match /tmp/job10/)."""
    import psutil

    killed = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid != os.getpid() and token in " ".join(proc.info["cmdline"] or ()):
            try:
                proc.kill()
                killed.append(proc.pid)
            except psutil.NoSuchProcess:
                pass
    return killed


def new_job_dir() -> str:
    return tempfile.mkdtemp(prefix="moetrain-dist-")


def run_workers(script: str, nproc: int, args: Sequence[str] = (), timeout: float = 180, *,
                launcher_args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
                job_dir: Optional[str] = None, base_env: Optional[Dict[str, str]] = None) -> WorkerRun:
    """Launch `script` on `nproc` ranks and wait (the launcher enforces `timeout`; a backstop kills
    the launcher's process group 60 s later). The job's environment: `base_env` (default: this
    process's now) updated with `env`."""
    require_msrun()
    job_dir = job_dir or new_job_dir()
    os.makedirs(os.path.join(job_dir, "out"), exist_ok=True)
    cmd = launcher_command(script, nproc, job_dir, args, launcher_args, timeout)
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=job_dir, env={**(os.environ if base_env is None else base_env), **(env or {})},
                            start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[tests.distributed] launcher still running {timeout + 60:.0f} s after start: killed"
    seconds = time.time() - start
    leftovers = kill_leftovers(os.path.join(job_dir, ""))
    return WorkerRun(proc.returncode, output, os.path.join(job_dir, "out"), os.path.join(job_dir, "logs"),
                     seconds, leftovers)


# ---------------------------------------------------------------------------------------------
# Trainer runs (tests/workers/train_runs_worker.py)
# ---------------------------------------------------------------------------------------------
TRAIN_RUNS_WORKER = "tests/workers/train_runs_worker.py"


def step_records(run_dir: str) -> List[Dict]:
    """The training-step records of a run's metrics.jsonl (rank 0's)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if "loss" in r]


def train_one_process(out_dir: str, spec: str, timeout: float = 1200) -> str:
    """Train one run (`NAME:CONFIG:overrides`, see the worker) in a process of its own (one trainer per
    process keeps MindSpore's state clean); returns the run's folder."""
    result = subprocess.run([sys.executable, os.path.join(REPO, TRAIN_RUNS_WORKER), out_dir, spec], cwd=out_dir,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return os.path.join(out_dir, spec.split(":", 1)[0])


STEP_KEYS = ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm")


def assert_same_steps(reference: List[Dict], steps: List[Dict], name: str, num_steps: int, rtol: float = 1e-4) -> None:
    """A parallel run's step records against the one-process run's: the steps, the losses and the
    gradient norm within `rtol`, the expert loads exactly (the same routing)."""
    assert [r["step"] for r in steps] == [r["step"] for r in reference] == list(range(1, num_steps + 1)), name
    for key in STEP_KEYS:
        np.testing.assert_allclose([r[key] for r in steps], [r[key] for r in reference], rtol=rtol,
                                   err_msg=f"{name}: {key}")
    for a, b in zip(reference, steps):
        np.testing.assert_array_equal(b["expert_load"], a["expert_load"], err_msg=name)


# ---------------------------------------------------------------------------------------------
# Shared trainer jobs: the train_runs_worker runs of several test files in ONE msrun launch per
# world size (a launch costs ~15-20 s before any work: 4 or 8 processes import MindSpore on 2 cores)
# ---------------------------------------------------------------------------------------------
@dataclass
class SharedRuns:
    module: str                 # the test file's module: its runs join a job only when one of its tests is selected
    specs: object               # specs(fixture, out_dir) -> ["NAME:CONFIG:overrides", ...]; fixture(name) gets a
    #                             session fixture, out_dir is the job's output folder (see shared_run_dirs)
    timeout: float              # seconds these runs may take
    last: bool = False          # run after the others (e.g. runs that install a primitive recorder in the process)
    references: object = None   # references(fixture) -> specs of one-process runs, trained in one process
    #                             beside the launch (see shared_reference_dirs)


SHARED_RUNS: Dict[int, List[SharedRuns]] = {}
SELECTED_MODULES: set = set()   # files with a selected test that reads a shared job (tests/conftest.py)
SELECTED_DEFERRED: set = set()  # files with a selected test that requests their deferred launch's fixture


class DeferredLaunch:
    """A test file's own msrun job, launched in a thread once the shared jobs have ended
    (tests/conftest.py), so that it trains beside the files that launch jobs of their own rather
    than after them; its module fixture joins it (`join`). `start(session, job_dirs)` launches and
    returns the job; it appends each job folder it uses to `job_dirs` (killed at the session's end
    if the launch still runs)."""

    def __init__(self, start, fixture: str):
        self._start, self.thread, self.result, self.error, self.job_dirs = start, None, None, None, []
        self.fixture = fixture       # the module fixture that joins it: the launch starts only if a test wants it

    def start(self, session) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, args=(session,), name="deferred-launch", daemon=True)
            self.thread.start()

    def _run(self, session) -> None:
        try:
            self.result = self._start(session, self.job_dirs)
        except BaseException as error:   # handed to the fixture that joins it
            self.error = error

    def join(self, session):
        self.start(session)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result

    def stop(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            for job_dir in self.job_dirs:
                kill_leftovers(os.path.join(job_dir, ""))


DEFERRED_LAUNCHES: Dict[str, DeferredLaunch] = {}


def launch_after_shared_jobs(module: str, start, fixture: str) -> DeferredLaunch:
    """Register `module`'s own launch (see DeferredLaunch; call at import, with `__name__`), joined by
    the module fixture named `fixture`."""
    DEFERRED_LAUNCHES[module] = DeferredLaunch(start, fixture)
    return DEFERRED_LAUNCHES[module]


def start_deferred_launches(session) -> None:
    for module, launch in DEFERRED_LAUNCHES.items():
        if module in SELECTED_DEFERRED:
            launch.start(session)


def stop_deferred_launches() -> None:
    for launch in DEFERRED_LAUNCHES.values():
        launch.stop()


def share_runs(nproc: int, module: str, specs, timeout: float, last: bool = False, references=None) -> None:
    """Register a test file's runs for the shared `nproc`-rank job (call at import, with `__name__`);
    its fixtures read the runs' folders with `shared_run_dirs(out_dir, module)`. `references(fixture)`
    (optional) gives one-process runs that train beside the launch, in one process for all files; read
    with `shared_reference_dirs`. They fill what the launch leaves idle (start-up, the launcher's polling,
    ranks waiting for each other: on the CPU they block rather than spin, see topology.init_parallel)."""
    SHARED_RUNS.setdefault(nproc, []).append(SharedRuns(module, specs, timeout, last, references))


def prepare_shared_job(nproc: int, fixture, job_dir: str) -> Optional[dict]:
    """The `nproc`-rank job of every registered run of the selected test files (None when there is
    none): its specs and references, built in pytest's thread (a specs function may request fixtures;
    `fixture("shared_job_N")` gives job N's output folder before it has run)."""
    groups = sorted((g for g in SHARED_RUNS.get(nproc, []) if g.module in SELECTED_MODULES), key=lambda g: g.last)
    if not groups:
        return None
    out_dir = os.path.join(job_dir, "out")
    specs = [f"{g.module}.{spec}" for g in groups for spec in g.specs(fixture, out_dir)]
    references = [f"{g.module}.{spec}" for g in groups if g.references for spec in g.references(fixture)]
    # the environment as it is now: a test running meanwhile may patch os.environ (monkeypatch.setenv)
    return dict(nproc=nproc, job_dir=job_dir, out_dir=out_dir, specs=specs, references=references,
                timeout=sum(g.timeout for g in groups), env=dict(os.environ))


def launch_shared_job(job: dict) -> str:
    """Run a prepared shared job (see tests/workers/train_runs_worker.py), its one-process references
    in one process beside it; returns the job's output folder, where run NAME of MODULE trained into
    MODULE.NAME and reference NAME into reference_dir(out)/MODULE.NAME."""
    beside = (BesideProcess(reference_dir(job["out_dir"]), job["references"], env=job["env"])
              if job["references"] else None)
    try:
        run_workers(TRAIN_RUNS_WORKER, job["nproc"], job["specs"], timeout=job["timeout"],
                    job_dir=job["job_dir"], base_env=job["env"]).check()
        if beside is not None:
            beside.wait(job["timeout"])
    finally:
        if beside is not None:
            beside.stop()
    return job["out_dir"]


class SharedJobs:
    """The shared jobs (2 ranks, then 4: a 4-rank run may resume a 2-rank run's checkpoint), launched
    in a thread at the first test while pytest goes on with the one-process tests, which
    tests/conftest.py orders first: the launches' ranks start up for ~15 s and wait for each other,
    time the one-process tests fill. `wait(nproc)` blocks for a job's output folder
    (None: no selected file has runs for it)."""

    def __init__(self, fixture, job_dirs: Dict[int, str]):
        planned = {f"shared_job_{n}": os.path.join(d, "out") for n, d in job_dirs.items()}
        lookup = lambda name: planned[name] if name in planned else fixture(name)   # noqa: E731
        self.jobs = {n: prepare_shared_job(n, lookup, d) for n, d in sorted(job_dirs.items())}
        self.results: Dict[int, tuple] = {}
        self.done = {n: threading.Event() for n in self.jobs}
        self.thread = threading.Thread(target=self._run, name="shared-msrun-jobs", daemon=True)
        self.thread.start()
        ACTIVE_JOBS[:] = [self]

    def _run(self) -> None:
        failed = None
        for n, job in self.jobs.items():
            try:
                if failed is not None:
                    raise AssertionError(f"not launched: the {failed}-rank shared job failed")
                self.results[n] = (launch_shared_job(job) if job else None, None)
            except BaseException as error:   # handed to the tests that wait for this job
                self.results[n] = (None, error)
                failed = failed or n
            self.done[n].set()

    def wait(self, nproc: int) -> Optional[str]:
        self.done[nproc].wait()
        out_dir, error = self.results[nproc]
        if error is not None:
            raise error
        return out_dir

    def stop(self) -> None:
        """Session end: kill what still runs (an interrupted session must not leave ranks behind)."""
        for n, job in self.jobs.items():
            if job and not self.done[n].is_set():
                kill_leftovers(os.path.join(job["job_dir"], ""))
                kill_leftovers(os.path.join(reference_dir(job["out_dir"]), ""))
        self.thread.join(timeout=120)
        ACTIVE_JOBS.clear()


ACTIVE_JOBS: List["SharedJobs"] = []   # this session's (tests/conftest.py starts it)


def shared_run_dirs(out_dir: str, module: str, names: Sequence[str]) -> Dict[str, str]:
    """{NAME: folder} of a test file's runs in a shared job."""
    return {name: os.path.join(out_dir, f"{module}.{name}") for name in names}


def reference_dir(out_dir: str) -> str:
    """Where the references beside the job with output folder `out_dir` train: beside the job's folder,
    not in it (run_workers kills every process that mentions the job's folder once the launch ends)."""
    return os.path.dirname(os.path.abspath(out_dir)) + "-reference"


def shared_reference_dirs(out_dir: str, module: str, names: Sequence[str]) -> Dict[str, str]:
    """{NAME: folder} of a test file's one-process references trained beside a shared job."""
    return shared_run_dirs(reference_dir(out_dir), module, names)


class BesideProcess:
    """train_runs_worker runs (`NAME:CONFIG:overrides`) in one process of their own, started now, into
    `out_dir`; its output goes to out_dir/reference.log (a file: a pipe could fill and stall it)."""

    def __init__(self, out_dir: str, specs: Sequence[str], env: Optional[Dict[str, str]] = None):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.log = open(os.path.join(out_dir, "reference.log"), "w+")
        self.proc = subprocess.Popen([sys.executable, os.path.join(REPO, TRAIN_RUNS_WORKER), out_dir, *specs],
                                     cwd=out_dir, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float) -> None:
        if self.proc.wait(timeout=timeout) != 0:
            self.log.seek(0)
            raise AssertionError(f"the one-process runs beside the launch failed:\n{self.log.read()[-3000:]}")

    def stop(self) -> None:
        """Kill it if it still runs (a failed launch must not leave it behind)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
