"""moetrain.distributed.launch and run_scripts/: failure handling, two nodes on one machine, and the
launcher's pieces (msrun command line, rank status files, scheduler pinning)."""
import json
import os
import subprocess
import sys
import time

import pytest

from distributed import REPO, kill_leftovers, require_msrun, run_workers
from moetrain.distributed import launch

SCRIPTS = os.path.join(REPO, "run_scripts")
WORKER = os.path.join(REPO, "tests", "workers", "allreduce_worker.py")


# ---------------------------------------------------------------------------------------------
# pieces (no msrun job)
# ---------------------------------------------------------------------------------------------
def test_msrun_command_line(tmp_path):
    job = launch.Job(["python", "w.py", "--x"], 2, nnodes=3, node_rank=1, master_addr="10.0.0.5",
                     master_port=8118, log_dir=str(tmp_path), tail=None)
    cmd = job.msrun_command()
    assert cmd[1:5] == ["-m", "moetrain.distributed.launch", "_msrun", "1"]
    for arg in ("--worker_num=6", "--local_worker_num=2", "--master_addr=10.0.0.5", "--master_port=8118",
                "--node_rank=1", f"--log_dir={tmp_path}", "--join=True", "--tail_worker_log=6"):
        assert arg in cmd
    assert "--bind_core=True" not in cmd
    assert cmd[-8:] == ["python", "-m", "moetrain.distributed.launch", "_worker",
                        os.path.join(str(tmp_path), ".status"), "python", "w.py", "--x"]
    assert job.local_ranks == [2, 3]


@pytest.mark.parametrize("kwargs, message", [
    (dict(cmd=[], nproc=2), "no command to launch"),
    (dict(cmd=["x"], nproc=2, nnodes=2, node_rank=0), "needs the same --master-port on every node"),
    (dict(cmd=["x"], nproc=2, nnodes=2, node_rank=2, master_port=1), "0 <= node_rank < nnodes"),
    (dict(cmd=["x"], nproc=0), "nproc >= 1"),
])
def test_job_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launch.Job(**kwargs)


def test_scheduler_is_pinned_to_node_zero(monkeypatch):
    from mindspore.parallel.cluster.process_entity import _api

    monkeypatch.setattr(_api, "_is_local_ip", _api._is_local_ip)   # restored after the test
    for node_rank, hosts in ((0, True), (1, False)):
        assert launch.pin_scheduler_to_node_zero(node_rank)
        assert _api._is_local_ip("127.0.0.1") is hosts


@pytest.mark.parametrize("child, rank_env, code, recorded", [
    ("import sys; sys.exit(3)", {"RANK_ID": "5"}, 3, {"rank": 5, "returncode": 3}),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", {"RANK_ID": "2"}, 137, {"rank": 2, "returncode": -9}),
])
def test_worker_wrapper_records_how_each_rank_ended(tmp_path, child, rank_env, code, recorded):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK_ID", "MS_ROLE")}
    out = subprocess.run([sys.executable, "-m", "moetrain.distributed.launch", "_worker", str(tmp_path),
                          sys.executable, "-c", child], env={**env, **rank_env})
    assert out.returncode == code
    status = launch.read_statuses(str(tmp_path))[recorded["rank"]]
    assert (status.rank, status.returncode) == (recorded["rank"], recorded["returncode"])
    assert abs(status.finished_at - time.time()) < 60


def test_the_scheduler_runs_only_init():
    assert launch.role_and_command(["python", "train.py"], {"MS_ROLE": "MS_WORKER", "RANK_ID": "3"}) == \
        (3, ["python", "train.py"])
    rank, cmd = launch.role_and_command(["python", "train.py"], {"MS_ROLE": "MS_SCHED", "RANK_ID": "0"})
    assert rank == launch.SCHEDULER and cmd == [sys.executable, "-c", launch.SCHEDULER_PROGRAM]


def test_status_descriptions_and_log_tail(tmp_path):
    assert launch.RankStatus(3, -9, 0).describe() == "was killed by SIGKILL"
    assert launch.RankStatus(3, 2, 0).describe() == "exited with code 2"
    assert launch.RankStatus(-1, 1, 0).who == "the scheduler"
    log = tmp_path / "worker_0.log"
    log.write_text("[WARNING] ME noise\nTraceback (most recent call last):\n[INFO] more noise\nValueError: bad\n")
    assert launch.log_tail(str(log)) == "Traceback (most recent call last):\nValueError: bad"


# ---------------------------------------------------------------------------------------------
# msrun jobs
# ---------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_a_killed_rank_stops_the_job_and_is_named(tmp_path):
    run = run_workers(WORKER, nproc=2, args=["--fail-rank", "1", "--fail-mode", "kill", "--steps", "50"],
                      timeout=150, job_dir=str(tmp_path))
    ended = time.time()
    failure = json.load(open(os.path.join(run.out_dir, "failure.json")))
    log = os.path.join(run.log_dir, "worker_1.log")
    assert run.returncode == 137, run.report()
    assert f"rank 1 was killed by SIGKILL" in run.output and f"its log: {log}" in run.output, run.report()
    assert ended - failure["time"] < 60, f"job ended {ended - failure['time']:.0f} s after the failure"
    assert not run.leftovers, f"processes survived the job: {run.leftovers}"


def _script_env(out_dir, **extra):
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    return {**env, "MOETRAIN_ENTRY": f"python {WORKER}", "MOETRAIN_OUTPUT_DIR": out_dir, "MOETRAIN_DEVICE": "cpu",
            "MOETRAIN_TIMEOUT": "150",
            **extra}


@pytest.mark.distributed
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
    assert f"rank 1 exited with code 1" in output and os.path.join(job_dir, "logs", "worker_1.log") in output
    assert "RuntimeError: rank 1 fails on purpose at step 1" in output   # the end of its log, echoed
    assert not leftovers

