"""moetrain.distributed.launch's pieces (msrun command line, rank status files, scheduler pinning); its
msrun jobs (a killed rank, a raising rank under run_distributed.sh) are in tests/test_launch_faults.py."""
import os
import subprocess
import sys
import time

import pytest

from moetrain.distributed import launch


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
