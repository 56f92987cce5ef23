"""The suite's own harness: `tests/background.py`'s hang test for processes that run at idle priority
(a wall-clock timeout there measures the suite's load: CI's stop 44 lost a SIGTERM trial that way)."""
import os
import subprocess
import sys
import time

import pytest

from background import run_patiently, wait_patiently


def test_a_process_that_finishes_returns_its_output():
    done = run_patiently([sys.executable, "-c", "print('done')"], cpu_limit=30)
    assert done.returncode == 0 and done.stdout == "done\n"


def test_a_process_without_cpu_progress_is_killed_after_the_stall():
    proc = subprocess.Popen(["sleep", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.time()
    with pytest.raises(subprocess.TimeoutExpired, match="60"):
        wait_patiently(proc, cpu_limit=30, stall_s=2)
    assert time.time() - start < 10 and proc.poll() is not None


def test_a_process_past_its_cpu_limit_is_killed():
    start = time.time()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_patiently([sys.executable, "-c", "while True: pass"], cpu_limit=1)
    assert "CPU s" in raised.value.output and time.time() - start < 20


def test_a_background_run_past_its_timeout_is_killed_when_it_stops_progressing(tmp_path):
    import background

    run = background.BackgroundRun([sys.executable, "-c", "import time; time.sleep(60)"], {}, str(tmp_path), 100.0)
    background._start("sleeper", run)
    start = time.time()
    assert background._wait_while_it_progresses(run, stall_s=2) == -9
    assert time.time() - start < 10 and run.proc.poll() is not None
    os.remove(run.log_path)
