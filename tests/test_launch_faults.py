"""The launcher's fault handling (docs/faults.md): collective timeouts, parent-death signals,
preemption pass-through, the hang watchdog, automatic restarts; then msrun jobs: a killed rank, a
raising rank under run_distributed.sh, SIGTERM to the launcher of a dp2 run and an exact resume, one
fault-drill trial, the shared-filesystem check, two nodes relaunching, a full disk.

The msrun jobs mostly wait on their own timeouts: they run in this file's child pytest, at normal
priority, started when the suite's shared jobs end (tests/background.py), beside the files that
launch jobs of their own; `test_the_msrun_jobs_of_this_file_pass` reads the child's outcome."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from background import child_only, heavy_tests_in_child, wait_for_background
from distributed import REPO, kill_leftovers, require_msrun, run_workers
from moetrain.faults import EXIT_BAD_INPUT, EXIT_PREEMPTED
from moetrain.distributed import launch

MNIST = os.path.join(REPO, "configs", "mnist_mlp.yaml")
SCRIPTS = os.path.join(REPO, "run_scripts")
ALLREDUCE_WORKER = os.path.join(REPO, "tests", "workers", "allreduce_worker.py")
heavy_tests_in_child(__name__, os.path.abspath(__file__), "background_child", cwd=REPO, timeout=1500, nice=0,
                     after_shared_jobs=True, reader="test_the_msrun_jobs_of_this_file_pass")


# ---------------------------------------------------------------------------------------------
# pieces (no msrun job)
# ---------------------------------------------------------------------------------------------
def test_collective_timeouts_are_set_unless_the_user_set_them():
    env = {"HCCL_EXEC_TIMEOUT": "900"}
    added = launch.collective_timeout_env(env, 60)
    assert added == {"MS_CPU_COMM_OP_TIMEOUT": "60", "HCCL_CONNECT_TIMEOUT": "120"}   # CANN's lower bound
    assert env["HCCL_EXEC_TIMEOUT"] == "900"
    env = {}
    launch.collective_timeout_env(env, 20000)
    assert env == {"MS_CPU_COMM_OP_TIMEOUT": "20000", "HCCL_EXEC_TIMEOUT": "17340", "HCCL_CONNECT_TIMEOUT": "7200"}


def test_relaunch_adds_resume_and_drops_overwrite():
    cmd = ["python", "-m", "moetrain.cli", "train", "c.yaml", "--overwrite", "--set", "a=1"]
    assert launch.relaunch_command(cmd) == ["python", "-m", "moetrain.cli", "train", "c.yaml", "--set", "a=1",
                                            "--resume"]
    assert launch.relaunch_command(cmd + ["--resume"]) == launch.relaunch_command(cmd)
    assert launch.relaunch_command(["python", "x.py"], "") == ["python", "x.py"]


def _wrapper(status_dir, child_code, env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK_ID", "MS_ROLE")}
    return subprocess.Popen([sys.executable, "-m", "moetrain.distributed.launch", "_worker", str(status_dir),
                             sys.executable, "-c", child_code], env={**env, "RANK_ID": "3"})


def test_a_preempted_rank_is_a_success_for_msrun_but_recorded_as_preempted(tmp_path):
    code = f"import os, sys; assert os.environ['{launch.STATUS_DIR_ENV}']; sys.exit({EXIT_PREEMPTED})"
    assert _wrapper(tmp_path, code).wait(60) == 0
    status = launch.read_statuses(str(tmp_path))[3]
    assert status.returncode == EXIT_PREEMPTED and not status.failed
    launch.write_progress(str(tmp_path), 3, 7, "step")
    beat = launch.read_progress(str(tmp_path))[3]
    assert (beat["step"], beat["pid"]) == (7, os.getpid()) and abs(beat["time"] - time.time()) < 60


def test_a_rank_dies_with_its_wrapper(tmp_path):
    wrapper = _wrapper(tmp_path, "import time; time.sleep(120)")
    deadline = time.time() + 60
    children = []
    while not children and time.time() < deadline:
        children = psutil.Process(wrapper.pid).children()
        time.sleep(0.1)
    assert children, "the wrapper did not start its rank"
    wrapper.kill()                    # SIGKILL: the wrapper cannot pass anything on
    wrapper.wait()
    gone, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, "the rank outlived its wrapper"


def _fake_job(tmp_path, command, **kwargs):
    job = launch.Job(["x"], 2, log_dir=str(tmp_path), **kwargs)
    os.makedirs(job.status_dir, exist_ok=True)
    job.proc = subprocess.Popen(command, start_new_session=True)
    job.started_at = time.time()
    return job


def test_the_watchdog_names_a_stalled_rank_and_stops_the_job(tmp_path, capsys):
    job = _fake_job(tmp_path, ["sleep", "60"], hang_timeout=2)
    assert job.stalled_ranks({}, time.time() + 10) == []      # no heartbeats at all: a script, not judged
    launch.write_progress(job.status_dir, 0, 5, "step")
    assert job.stalled_ranks({}, time.time() + 10) == [0, 1]  # rank 1 silent since the launch
    launch.write_progress(job.status_dir, 1, 3, "step")
    with open(os.path.join(job.status_dir, "progress_1.json")) as fh:
        stale = dict(json.load(fh), time=time.time() - 10)
    with open(os.path.join(job.status_dir, "progress_1.json"), "w") as fh:
        json.dump(stale, fh)
    start = time.time()
    assert job.wait(poll_interval=0.1) == 124
    assert time.time() - start < 5 and job.proc.poll() is not None      # killed, in bounded time
    err = capsys.readouterr().err
    assert "the job hangs on rank 1 (step 3): no step reported for 2 s (--hang-timeout)" in err
    assert "rank 0: was still running; last at step 5" in err


def test_ranks_stopping_after_a_signal_end_the_job_with_the_preemption_code(tmp_path):
    job = _fake_job(tmp_path, ["true"])
    for rank in (0, 1):
        with open(os.path.join(job.status_dir, f"rank_{rank}.json"), "w") as fh:
            json.dump({"rank": rank, "returncode": EXIT_PREEMPTED, "finished_at": time.time()}, fh)
    assert job.wait(poll_interval=0.1) == EXIT_PREEMPTED


class _ScriptedJob:
    """Stands in for Job: ends with the next scripted exit code."""

    def __init__(self, codes, seen, cmd, nproc, env, log_dir, **kwargs):
        self.codes, self.log_dir, self.timed_out, self.started_at = codes, log_dir, False, time.time()
        seen.append((list(cmd), env.get(launch.RESTART_ENV), kwargs.get("master_port")))
        os.makedirs(log_dir, exist_ok=True)
        open(os.path.join(log_dir, "worker_0.log"), "w").write(f"attempt {len(seen) - 1}\n")

    def start(self):
        pass

    def wait(self, timeout=None):
        return self.codes.pop(0)


@pytest.mark.parametrize("codes, restarts, result", [([137, 1, 0], 3, 0), ([137, 137], 1, 137),
                                                      ([EXIT_BAD_INPUT], 3, EXIT_BAD_INPUT),
                                                      ([EXIT_PREEMPTED], 3, EXIT_PREEMPTED)])
def test_failed_attempts_are_relaunched_with_resume_up_to_max_restarts(tmp_path, monkeypatch, codes, restarts,
                                                                        result):
    seen = []
    monkeypatch.setattr(launch, "Job", lambda cmd, nproc, env, **kw: _ScriptedJob(codes, seen, cmd, nproc, env, **kw))
    runner = launch.Launcher(["python", "train.py", "--overwrite"], 2, max_restarts=restarts,
                             log_dir=str(tmp_path), nnodes=2, node_rank=0, master_port=9000, collective_timeout=30)
    assert runner.run() == result
    attempts = len(seen)
    assert attempts == {0: 3, 137: 2}.get(result, 1)
    assert seen[0] == (["python", "train.py", "--overwrite"], "0", 9000)
    for k, (cmd, restart, port) in enumerate(seen[1:], 1):
        assert cmd == ["python", "train.py", "--resume"] and restart == str(k) and port == 9000 + k
    if attempts > 1:
        log = open(tmp_path / "restarts.log").read().splitlines()
        assert len(log) == attempts - 1 and "restart 1/" in log[0] and "ended with code 137" in log[0]
        assert open(tmp_path / "attempt_0" / "worker_0.log").read() == "attempt 0\n"


# ---------------------------------------------------------------------------------------------
# msrun jobs
# ---------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.background_child
@child_only(__name__)
def test_a_killed_rank_stops_the_job_and_is_named(tmp_path):
    run = run_workers(ALLREDUCE_WORKER, nproc=2, args=["--fail-rank", "1", "--fail-mode", "kill", "--steps", "50"],
                      timeout=150, job_dir=str(tmp_path))
    ended = time.time()
    failure = json.load(open(os.path.join(run.out_dir, "failure.json")))
    log = os.path.join(run.log_dir, "worker_1.log")
    assert run.returncode == 137, run.report()
    assert "rank 1 was killed by SIGKILL" in run.output and f"its log: {log}" in run.output, run.report()
    assert ended - failure["time"] < 60, f"job ended {ended - failure['time']:.0f} s after the failure"
    assert not run.leftovers, f"processes survived the job: {run.leftovers}"


def _script_env(out_dir, **extra):
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    return {**env, "MOETRAIN_ENTRY": f"python {ALLREDUCE_WORKER}", "MOETRAIN_OUTPUT_DIR": out_dir, "MOETRAIN_DEVICE": "cpu",
            "MOETRAIN_TIMEOUT": "150",
            **extra}


@pytest.mark.distributed
@pytest.mark.background_child
@child_only(__name__)
def test_run_distributed_sh_reports_a_rank_that_raises(tmp_path):
    require_msrun()
    job_dir = str(tmp_path)
    results = os.path.join(job_dir, "results")
    os.makedirs(results)
    # The entry gets CONFIG first: here the worker's output folder.
    proc = subprocess.run([os.path.join(SCRIPTS, "run_distributed.sh"), "--nproc", "2", results,
                           "--fail-rank", "1", "--fail-mode", "raise"], cwd=job_dir, env=_script_env(job_dir),
                          capture_output=True, text=True, timeout=240)
    leftovers = kill_leftovers(os.path.join(job_dir, ""))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "rank 1 exited with code 1" in output and os.path.join(job_dir, "logs", "worker_1.log") in output
    assert "RuntimeError: rank 1 fails on purpose at step 1" in output   # the end of its log, echoed
    assert not leftovers


def _mnist_args(data, out, *extra):
    sets = [f"data.path={data}", f"train.output_dir={out}", "model.hidden_size=32", "train.epochs=0",
            "train.global_batch_size=32", "train.eval_batch_size=32", "lr_schedule.warmup_steps=0",
            "logging.tensorboard=false", "logging.progress_bar=false", "train.jit=false", *extra]
    return [a for s in sets for a in ("--set", s)]


def _losses(run_dir):
    from moetrain.logger import read_metrics

    return [r["loss"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]


def _train_cmd(job_dir, args, nproc=2, launcher_args=()):
    cmd = [sys.executable, "-m", "moetrain.distributed.launch", "--nproc", str(nproc), "--log-dir",
           os.path.join(job_dir, "logs"), "--tail", "none", "--timeout", "400", *launcher_args, "--",
           "python", "-m", "moetrain.cli", "train", MNIST, *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    env.pop("MASTER_PORT", None)
    return cmd, env


DRILL_STEPS = 10


@pytest.fixture(scope="module")
def fault_drill(tiny_mnist, tmp_path_factory):
    """benchmarks/fault_drill.py, one trial on dp2: a clean run of DRILL_STEPS, then SIGSTOP of a random rank
    at a random step under --max-restarts --hang-timeout 60 --collective-timeout 15 (issue 37: the
    launcher names the stopped rank, whichever timeout fires first, exit 124, and relaunches). Returns
    (exit code, workdir); workdir/clean is the clean run, also the uninterrupted reference of the
    SIGTERM test (the same MNIST job: the drill saves every step, which does not change a loss)."""
    require_msrun()
    import importlib.util

    spec = importlib.util.spec_from_file_location("fault_drill", os.path.join(REPO, "benchmarks", "fault_drill.py"))
    drill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drill)
    workdir = tmp_path_factory.mktemp("fault_drill")
    sets = [f"data.path={tiny_mnist}", "model.hidden_size=32", "train.global_batch_size=32",
            "train.eval_batch_size=32", "lr_schedule.warmup_steps=0"]
    code = drill.main(["--config", MNIST, "--nproc", "2", "--trials", "1", "--steps", str(DRILL_STEPS),
                       "--max-restarts", "2", "--seed", "3", "--workdir", str(workdir), "--timeout", "400",
                       "--fault", "stop", "--collective-timeout", "15", "--hang-timeout", "60",
                       *[a for s in sets for a in ("--set", s)]])
    kill_leftovers(os.path.join(str(workdir), ""))
    return code, workdir


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.background_child
@child_only(__name__)
def test_sigterm_to_the_launcher_of_a_dp2_run_saves_one_step_on_every_rank_then_resume_is_exact(tiny_mnist, tmp_path,
                                                                                                 fault_drill):
    require_msrun()
    straight = str(fault_drill[1] / "clean")     # the drill's clean run: DRILL_STEPS uninterrupted on dp2
    assert len(_losses(straight)) == DRILL_STEPS
    split = str(tmp_path / "split")
    cmd, env = _train_cmd(str(tmp_path / "b"), _mnist_args(tiny_mnist, split, f"train.steps={DRILL_STEPS}"))
    proc = subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(os.path.join(split, "metrics.jsonl")) and len(_losses(split)) >= 2:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    output, _ = proc.communicate(timeout=300)
    kill_leftovers(os.path.join(str(tmp_path), ""))
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    statuses = launch.read_statuses(os.path.join(str(tmp_path / "b"), "logs", launch.STATUS_DIR))
    assert [statuses[r].returncode for r in (0, 1)] == [EXIT_PREEMPTED, EXIT_PREEMPTED]
    saved = sorted(os.listdir(os.path.join(split, "checkpoints")))
    assert len(saved) == 1 and len(_losses(split)) == int(saved[0][5:]) < DRILL_STEPS, output[-3000:]
    resumed = subprocess.run(cmd + ["--resume"], env=env, cwd=str(tmp_path), capture_output=True, text=True,
                             timeout=460)
    kill_leftovers(os.path.join(str(tmp_path), ""))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(split) == _losses(straight)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.background_child
@child_only(__name__)
def test_fault_drill_one_trial_on_dp2(fault_drill):
    """benchmarks/fault_drill.py --fault stop: SIGSTOP of a random rank at a random step under
    --max-restarts; the launcher names that rank as the one the job hangs on and ends the attempt with
    124 (whichever timeout fired first; the drill checks its output), relaunches, and the job finishes
    every step with the clean run's losses."""
    code, workdir = fault_drill
    assert code == 0
    restarts = open(workdir / "trial_1" / "logs" / "restarts.log").read()
    assert restarts.count("restart 1/2") == 1 and "attempt 0 ended with code 124" in restarts, restarts


@pytest.mark.distributed
@pytest.mark.background_child
@child_only(__name__)
def test_an_output_dir_that_is_not_shared_by_every_rank_is_refused(tmp_path):
    require_msrun()
    run = run_workers("tests/workers/shared_fs_worker.py", nproc=2, args=["--private-rank", "1"], timeout=150,
                      job_dir=str(tmp_path), env={"MOETRAIN_SHARED_FS_TIMEOUT": "2"})
    results = {r["rank"]: r for r in run.json_results()}
    assert sorted(results) == [0, 1], run.report()
    for rank in (0, 1):
        assert "not one folder shared by every rank" in results[rank]["error"]
        assert "rank(s) [1]" in results[rank]["error"] and "NFS" in results[rank]["error"]
    # (a shared folder passes: every distributed trainer run in the suite starts with this check)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.background_child
@child_only(__name__)
def test_two_nodes_relaunch_together_after_a_rank_fails(tmp_path):
    """run_multinode.sh --max-restarts 1: rank 3 (node 1) fails in the first attempt; node 1
    relaunches at once on port P+1, node 0 when its collectives time out; the second attempt runs
    on both nodes to the end: 4 ranks of a world of 4, their all-reduces correct (this also is the
    suite's two-nodes-on-one-machine check); the ranks that wait for a late rank 3 use little CPU."""
    require_msrun()
    job_dir = str(tmp_path)
    results = os.path.join(job_dir, "results")
    os.makedirs(results)
    port = launch.free_port()
    worker = os.path.join(REPO, "tests", "workers", "allreduce_worker.py")
    nodes = []
    for node in (0, 1):
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", launch.RESTART_ENV)}
        env.update(MOETRAIN_ENTRY=f"python {worker}", MOETRAIN_OUTPUT_DIR=os.path.join(job_dir, f"node{node}"),
                   MOETRAIN_DEVICE="cpu", MOETRAIN_TIMEOUT="200",
                   PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        cmd = [os.path.join(REPO, "run_scripts", "run_multinode.sh"), "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--max-restarts", "1", "--collective-timeout", "10", results,
               "--fail-rank", "3", "--fail-mode", "raise", "--fail-attempt", "0", "--steps", "4",
               "--late-rank", "3", "--late-s", "3"]
        nodes.append(subprocess.Popen(cmd, cwd=job_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [p.communicate(timeout=500)[0] for p in nodes]
    leftovers = kill_leftovers(os.path.join(job_dir, ""))
    for node, (proc, output) in enumerate(zip(nodes, outputs)):
        assert proc.returncode == 0, f"node {node}:\n{output[-3000:]}"
        restarts = open(os.path.join(job_dir, f"node{node}", "logs", "restarts.log")).read()
        assert restarts.count("restart 1/1") == 1, restarts
    for rank in range(4):
        report = json.load(open(os.path.join(results, f"rank_{rank}.json")))
        assert (report["rank"], report["world"]) == (rank, 4)
        assert report["sums"] == [sum(r + step for r in range(4)) for step in range(4)]
        # ranks 0-2 waited ~3 s for rank 3 in their first all_reduce, blocked: a spinning wait
        # (MindSpore's asynchronous PyNative dispatch) costs about its wall time in CPU
        wall, cpu = report["first_wait"]
        assert report["host_blocking_run"] == "1"
        if rank != 3:
            assert wall > 2.0 and cpu < 0.3 * wall, (rank, wall, cpu)
    # node 1's ranks log on node 1, which runs no scheduler (node 0 does)
    assert os.path.exists(os.path.join(job_dir, "node1", "logs", "worker_3.log"))
    assert not os.path.exists(os.path.join(job_dir, "node1", "logs", "scheduler.log"))
    assert not leftovers


@pytest.mark.distributed
@pytest.mark.background_child
@child_only(__name__)
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_previous_checkpoint(tiny_mnist, tmp_path):
    from moetrain.faults import EXIT_SAVE_FAILED

    require_msrun()
    run_dir = str(tmp_path / "run")
    args = ["--fail-save", "1:2", MNIST, *_mnist_args(tiny_mnist, run_dir, "train.steps=3", "checkpoint.save_steps=1",
                                                     "parallel.optimizer_shard=1")]
    run = run_workers("tests/workers/ckpt_train.py", 2, args, timeout=200, job_dir=str(tmp_path),
                      launcher_args=["--max-restarts", "2"])
    assert run.returncode == EXIT_SAVE_FAILED, run.report()        # not relaunched: a full disk stays full
    assert "restart 1/" not in run.output
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_00000001"]
    rank1 = run.worker_log(1)
    assert "step_00000002" in rank1 and "No space left on device" in rank1 and "step_00000001 is intact" in rank1
    assert "failed on rank(s) [1]" in run.worker_log(0)


@pytest.mark.distributed
def test_the_msrun_jobs_of_this_file_pass():
    """The outcome of this file's child pytest (its msrun jobs, above)."""
    done = wait_for_background(__name__)
    tail = done.stdout[-6000:]
    assert done.returncode == 0, tail
    assert re.search(r"\b7 passed\b", tail) and "failed" not in tail, tail    # the 7 msrun tests above
