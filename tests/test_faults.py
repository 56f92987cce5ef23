"""Faults on one process (docs/faults.md): run identity and output-directory safety, damaged
checkpoints on resume, atomic re-saves and pruning, crash-safe metrics.jsonl, preemption by
SIGTERM with an exact resume, numerical faults (skip / rollback / stop), failed saves.
Trainer cases use the tiny MNIST MLP (tests/conftest.py)."""
import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from moetrain.checkpoint.manager import (CheckpointError, CheckpointSaveError, CheckpointWriter, list_checkpoints,
                                         prune_checkpoints, resolve_resume_path, verify_checkpoint)
from moetrain.checkpoint.run_dir import OutputDirError, read_run_id
from moetrain.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST = os.path.join(ROOT, "configs", "mnist_mlp.yaml")


def make_trainer(overrides, resume=None, overwrite=False):
    from moetrain.trainer import Trainer

    return Trainer(load_config(MNIST, overrides), resume=resume, overwrite=overwrite)


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r["loss"] for r in map(json.loads, fh) if "loss" in r]


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def params(trainer):
    return {p.name: p.asnumpy().copy() for p in trainer.model.trainable_params()}


def steps_of(root):
    return [s for s, _ in list_checkpoints(str(root))]


# ---------------------------------------------------------------------------------------------
# Run identity, output directory, checkpoint selection
# ---------------------------------------------------------------------------------------------
def test_a_new_run_into_a_used_output_dir_is_refused_and_overwrite_moves_the_old_run_aside(mnist_overrides, tmp_path):
    run = tmp_path / "run"
    sets = mnist_overrides + [f"train.output_dir={run}", "train.steps=2", "checkpoint.save_steps=1",
                              "checkpoint.keep_max=1"]
    make_trainer(sets).fit()
    old_id = read_run_id(str(run))
    old_metrics = (run / "metrics.jsonl").read_text()
    with pytest.raises(OutputDirError, match=r"already holds a run .*--resume.*--overwrite"):
        make_trainer(sets + ["train.steps=1"])
    assert steps_of(run / "checkpoints") == [2] and (run / "metrics.jsonl").read_text() == old_metrics

    new = make_trainer(sets + ["train.steps=1"], overwrite=True)
    moved = run / f"overwritten-{old_id}"
    assert new.run.run_id != old_id and read_run_id(str(run)) == new.run.run_id
    assert steps_of(moved / "checkpoints") == [2] and (moved / "metrics.jsonl").read_text() == old_metrics
    new.fit()
    # keep_max=1: the new run's step 1 is its newest, whatever the old run's numbers were
    assert steps_of(run / "checkpoints") == [1]
    assert [r["step"] for r in records(run) if "loss" in r] == [1]

    # an older run's higher step in the folder: --resume skips it, pruning leaves it alone
    import shutil

    shutil.copytree(moved / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
    with pytest.warns(UserWarning, match=rf"step_00000002: it belongs to run {old_id}"):
        resumed = make_trainer(sets + ["train.steps=3"], resume="")
    assert resumed.step == 1 and resumed.run.run_id == new.run.run_id
    resumed.fit()          # saves its own step 2 over the stale folder (old copy moved aside first), then 3
    assert steps_of(run / "checkpoints") == [3]
    with open(run / "checkpoints" / "step_00000003" / "metadata.json") as fh:
        assert json.load(fh)["run_id"] == new.run.run_id


def test_resume_skips_damaged_checkpoints_naming_them_and_never_starts_at_step_0(mnist_overrides, tmp_path):
    from moetrain.checkpoint.distributed import CheckpointReader

    run = tmp_path / "run"
    sets = mnist_overrides + [f"train.output_dir={run}", "train.steps=3", "checkpoint.save_steps=1",
                              "checkpoint.keep_max=3"]
    make_trainer(sets).fit()
    step2, step3 = (run / "checkpoints" / f"step_0000000{s}" for s in (2, 3))
    os.remove(step3 / "metadata.json")
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_00000003: .*metadata\.json"):
        assert make_trainer(sets, resume="").step == 2
    os.remove(step2 / "manifest.json")
    with pytest.warns(UserWarning) as caught:
        resumed = make_trainer(sets, resume="")
    assert resumed.step == 1
    messages = [str(w.message) for w in caught]
    assert any("step_00000002: manifest.json is missing" in m for m in messages), messages
    with pytest.raises(CheckpointError, match=r"step_00000003: cannot resume .*metadata\.json.*--resume .*step_00000001"):
        make_trainer(sets, resume=str(step3))
    with pytest.raises(CheckpointError, match=r"without metadata\.json"):     # not a "model directory at step 0"
        CheckpointReader(str(step3))
    resumed.fit()                          # re-saves steps 2 and 3 in place of the damaged folders
    assert steps_of(run / "checkpoints") == [1, 2, 3]
    for step in (2, 3):
        verify_checkpoint(str(run / "checkpoints" / f"step_0000000{step}"))


def test_a_resave_keeps_the_old_copy_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    def save(version):
        writer = CheckpointWriter(str(tmp_path), 1)
        writer.json("metadata.json", {"step": 1, "version": version})
        return writer

    first = save("old").commit(run_id="r")
    second = save("new")
    real_rename = os.rename

    def crash_before_publishing(src, dst):
        if src == second.tmp:
            raise OSError(errno.EIO, "killed between the two renames")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_before_publishing)
    with pytest.raises(OSError):
        second.commit(run_id="r")
    monkeypatch.undo()
    (step, path), = list_checkpoints(str(tmp_path))       # the old complete copy, renamed aside, still counts
    assert step == 1 and os.path.basename(path).startswith(".old-step_00000001")
    assert json.load(open(os.path.join(path, "metadata.json")))["version"] == "old"
    assert resolve_resume_path(path, str(tmp_path)) == path
    assert save("newer").commit(run_id="r") == first
    prune_checkpoints(str(tmp_path), 1, "r", 1)
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]
    assert json.load(open(os.path.join(first, "metadata.json")))["version"] == "newer"


def test_pruning_deletes_only_older_checkpoints_of_the_current_run(tmp_path):
    for run_id, step in (("a", 1), ("a", 2), ("a", 3), ("b", 4), ("a", 6)):
        writer = CheckpointWriter(str(tmp_path), step)
        writer.json("metadata.json", {"step": step})
        writer.commit(run_id=run_id)
    prune_checkpoints(str(tmp_path), keep_max=2, run_id="a", upto_step=3)
    # run a keeps its newest 2 up to the step just saved; run b's step and a's later step 6 stay
    assert steps_of(tmp_path) == [2, 3, 4, 6]


def test_metrics_jsonl_torn_last_line_is_repaired_and_truncation_is_atomic(tmp_path, monkeypatch):
    from moetrain.logger import MetricsLogger, truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 5))
                    + '{"step": 5, "lo')
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (replaced.append((src, dst)), real_replace(src, dst)))
    with pytest.warns(UserWarning, match=r"line 5 is a torn last line"):
        truncate_metrics(str(path), 3)
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2, 3]
    from moetrain.fileio import temp_path

    assert replaced == [(temp_path(str(path)), str(path))]          # written aside (pid, rank), then swapped in
    assert str(os.getpid()) in replaced[0][0]

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    logger = MetricsLogger(str(tmp_path), 10, True, False, False, 100, resume_step=2)
    for step in (3, 4):
        logger.log({"step": step, "loss": 0.5, "lr": 0.1, "grad_norm": 1.0})
    logger.close()
    assert len(synced) == 1 + 2           # the truncation, then every record
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_output_dir_that_is_a_file_is_refused_before_work(mnist_overrides, tmp_path, capsys):
    from moetrain import cli

    target = tmp_path / "taken"
    target.write_text("not a folder")
    with pytest.raises(OutputDirError, match=r"taken.* is a file"):
        make_trainer(mnist_overrides + [f"train.output_dir={target}"])
    code = cli.main(["train", MNIST, *[a for s in mnist_overrides + [f"train.output_dir={target / 'sub'}"]
                                       for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2 and "is a file" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# Preemption
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_saves_at_the_step_boundary_and_resume_continues_exactly(mnist_overrides, tmp_path):
    from moetrain.faults import EXIT_PREEMPTED

    steps = 300     # long enough that the signal, sent after step 2, lands before the run ends on a fast machine
    sets = mnist_overrides + [f"train.steps={steps}", "lr_schedule.warmup_steps=0"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    make_trainer(sets + [f"train.output_dir={straight}"]).fit()
    cmd = [sys.executable, "-m", "moetrain.cli", "train", MNIST,
           *[a for s in sets + [f"train.output_dir={split}"] for a in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (split / "metrics.jsonl").exists() and len(losses(split)) >= 2:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, output
    stopped = steps_of(split / "checkpoints")
    assert len(stopped) == 1 and 2 <= stopped[0] < steps and len(losses(split)) == stopped[0], output
    assert "run the same command with --resume" in output.lower()
    resumed = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(split) == losses(straight)            # bitwise, as if never interrupted


# ---------------------------------------------------------------------------------------------
# Numerical faults
# ---------------------------------------------------------------------------------------------
def test_guard_decisions():
    from moetrain.faults import SPIKE_MIN_STEPS, NonFiniteGuard

    guard = NonFiniteGuard("skip", limit=2, spike_factor=3.0)
    for step in range(1, SPIKE_MIN_STEPS + 1):
        assert guard.check(step, 2.0, 1.0, True) == "apply"
    assert guard.check(11, 5.0, 1.0, True) == "apply"            # 5 < 3 x the running mean 2.0
    assert guard.rejects_loss(30.0) and "loss spike" in guard.diagnose(30.0)
    assert guard.check(12, 30.0, 1.0, True) == "skip"
    assert guard.check(13, float("nan"), float("nan"), False) == "skip"
    assert guard.last["reason"] == "non-finite loss (nan)" and guard.last["faults"] == 2
    assert guard.check(14, 2.0, float("inf"), False) == "stop"     # the third fault is past the limit of 2
    assert guard.last["reason"].startswith("non-finite gradients")
    assert NonFiniteGuard("rollback", 5, 0.0).check(1, 1e30, 1.0, True) == "apply"   # spike test off
    scaled = NonFiniteGuard("stop", 0, 3.0, active=False)        # a loss scaler handles overflow itself
    assert scaled.check(1, float("nan"), float("nan"), False) == "skip" and scaled.last is None
    assert not scaled.rejects_loss(float("nan"))


def test_skip_leaves_the_weights_of_a_non_finite_step_untouched(mnist_overrides, tmp_path):
    run = tmp_path / "run"
    trainer = make_trainer(mnist_overrides + [f"train.output_dir={run}", "optimizer.lr=1e4", "train.steps=3",
                                              "lr_schedule.warmup_steps=0", "train.on_nonfinite=skip"])
    first = trainer.train_step()
    assert trainer.faults.guard.last_action == "apply" and np.isfinite(first["loss"])
    before = params(trainer)
    trainer.train_step()
    assert trainer.faults.guard.last_action == "skip"
    for name, value in params(trainer).items():
        np.testing.assert_array_equal(value, before[name])


def test_lr_1e4_under_rollback_stops_after_the_limit_and_the_last_good_checkpoint_loads(mnist_overrides, tmp_path):
    from moetrain.faults import TrainingHalted

    run = tmp_path / "run"
    sets = mnist_overrides + [f"train.output_dir={run}", "optimizer.lr=1e4", "precision.compute_dtype=float32",
                              "lr_schedule.warmup_steps=0", "train.steps=6", "checkpoint.save_steps=1",
                              "train.on_nonfinite=rollback", "train.nonfinite_limit=2"]
    trainer = make_trainer(sets)
    with pytest.raises(TrainingHalted) as info:
        trainer.fit()
    good = str(run / "checkpoints" / "step_00000001")
    message = str(info.value)
    assert message.startswith("step 2: non-finite") and "exceed train.nonfinite_limit=2" in message
    assert f"The last good checkpoint is {good}" in message and f"--resume {good}" in message
    events = [r for r in records(run) if r.get("event") == "nonfinite"]
    assert [(e["step"], e["action"]) for e in events] == [(2, "rollback"), (2, "rollback"), (2, "stop")]
    assert [e.get("skipped_batches") for e in events[:2]] == [1, 1]
    assert [r["step"] for r in records(run) if "loss" in r] == [1]
    assert steps_of(run / "checkpoints") == [1]
    verify_checkpoint(good)
    reloaded = make_trainer(sets, resume=good)
    assert reloaded.step == 1 and reloaded.sampler.offset == 0      # the state saved at step 1, as it was
    assert all(np.isfinite(v).all() for v in params(reloaded).values())


def test_rollback_returns_to_the_checkpoint_and_skips_the_batches_since(mnist_overrides, tmp_path):
    run = tmp_path / "run"
    sets = mnist_overrides + [f"train.output_dir={run}", "train.steps=6", "checkpoint.save_steps=2",
                              "train.on_nonfinite=rollback", "lr_schedule.warmup_steps=0"]
    trainer = make_trainer(sets)
    guard, real = trainer.faults.guard, trainer.faults.guard.diagnose
    pending = [4]                                   # step 4 is a fault, once

    def diagnose(loss, grad_norm=None, finite=True):
        if pending and trainer.step + 1 == pending[0]:
            if grad_norm is not None:
                pending.clear()
            return "injected fault"
        return real(loss, grad_norm, finite)

    guard.diagnose = diagnose
    trainer.fit()
    event, = [r for r in records(run) if r.get("event")]
    assert (event["step"], event["action"], event["resumed_at_step"], event["skipped_batches"]) == (4, "rollback", 2, 2)
    assert [r["step"] for r in records(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    inner = trainer.sampler.inner
    assert trainer.sampler.offset == 2
    np.testing.assert_array_equal(trainer.sampler.global_batch(2), inner.global_batch(4))  # step 3 reads batch 5
    resumed = make_trainer(sets + ["train.steps=7"], resume="")
    assert resumed.step == 6 and resumed.sampler.offset == 2 and resumed.faults.guard.faults == 1


def test_a_checkpoint_loaded_after_compiling_is_what_the_next_steps_train_from(mnist_overrides, tmp_path):
    """A rollback loads a checkpoint into a trainer whose jitted graphs are compiled: they must read
    the loaded weights and optimizer state. Steps 3-4 again after loading step 2 equal the first
    steps 3-4 exactly. (Loaded with `Parameter.set_data`, MindSpore 2.10 trained on from the replaced,
    pre-rollback weights and 2.7 read freed memory: checkpoint.distributed.write_in_place.)"""
    run = tmp_path / "run"
    trainer = make_trainer(mnist_overrides + [f"train.output_dir={run}", "train.steps=4", "checkpoint.save_steps=2",
                                              "lr_schedule.warmup_steps=0"])
    trainer.fit()
    first = [r["loss"] for r in records(run) if "loss" in r]
    trainer.load(str(run / "checkpoints" / "step_00000002"))
    assert trainer.step == 2
    again = [trainer.train_step()["loss"] for _ in range(2)]
    assert again == first[2:], (again, first)


# ---------------------------------------------------------------------------------------------
# Failed saves
# ---------------------------------------------------------------------------------------------
def _fail_step(monkeypatch, step):
    real = CheckpointWriter.tensors

    def tensors(self, filename, arrays):
        if self.name == f"step_{step:08d}":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, filename, arrays)

    monkeypatch.setattr(CheckpointWriter, "tensors", tensors)


def test_a_full_disk_during_save_keeps_the_previous_checkpoint_and_names_the_path(mnist_overrides, tmp_path,
                                                                                   monkeypatch, capsys):
    from moetrain import cli
    from moetrain.faults import EXIT_SAVE_FAILED

    run = tmp_path / "stop"
    sets = mnist_overrides + [f"train.output_dir={run}", "train.steps=3", "checkpoint.save_steps=1"]
    _fail_step(monkeypatch, 2)
    with pytest.raises(CheckpointSaveError, match=r"could not write checkpoint .*step_00000002 .*No space left on "
                                                  r"device.*previous checkpoint .*step_00000001 is intact"):
        make_trainer(sets).fit()
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000001"]       # the partial folder is gone
    assert make_trainer(sets, resume="").step == 1
    code = cli.main(["train", MNIST, "--resume", *[a for s in sets for a in ("--set", s)]])
    assert code == EXIT_SAVE_FAILED and "step_00000002" in capsys.readouterr().err

    run = tmp_path / "continue"
    trainer = make_trainer(mnist_overrides + [f"train.output_dir={run}", "train.steps=3", "checkpoint.save_steps=1",
                                              "checkpoint.on_save_error=continue", "checkpoint.keep_max=3"])
    trainer.fit()
    assert trainer.step == 3 and steps_of(run / "checkpoints") == [1, 3]
    assert "on_save_error=continue: training goes on" in capsys.readouterr().err


def test_a_failing_process_does_not_wait_for_its_background_save(tmp_path):
    """The asynchronous save thread is a daemon: a rank that fails exits at once (a normal end
    waits for the save: test_checkpoint_distributed's async test)."""
    script = f"""
import time, sys
from moetrain.checkpoint import distributed
from moetrain.distributed.topology import ParallelContext
distributed.write_rank_pieces = lambda *args: time.sleep(120)        # a save that takes long
saver = distributed.ShardedCheckpointer({str(tmp_path)!r}, ParallelContext.single(), 2, async_save=True)
saver.save(1, [], {{"layout": {{"tp": 1, "pp": 1, "ep": 1}}, "step": 1}}, "unused")
assert saver._thread.daemon and saver._thread.is_alive()
raise SystemExit(3)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    start = time.time()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 3, out.stderr
    assert time.time() - start < 60
