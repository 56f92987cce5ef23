"""Trainer core on the MNIST MLP with a tiny synthetic idx dataset: accumulation, resume,
checkpoint atomicity and integrity, loss scaling."""
import json
import os

import numpy as np
import pytest

from moetrain.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST = os.path.join(ROOT, "configs", "mnist_mlp.yaml")


def make_trainer(overrides, resume=None):
    from moetrain.trainer import Trainer

    return Trainer(load_config(MNIST, overrides), resume=resume)


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r["loss"] for r in map(json.loads, fh) if "loss" in r]


def params(trainer):
    return {p.name: p.asnumpy().copy() for p in trainer.model.trainable_params()}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_gradient_accumulation_equals_one_large_batch(mnist_overrides, tmp_path, optimizer):
    common = mnist_overrides + [f"optimizer.name={optimizer}", "optimizer.lr=0.05", "train.steps=3",
                                "checkpoint.save_at_end=false", "optimizer.clip_grad_norm=1.0"]
    whole = make_trainer(common + [f"train.output_dir={tmp_path / 'a'}", "train.micro_batch_size=32"])
    whole.fit()
    accumulated = make_trainer(common + [f"train.output_dir={tmp_path / 'b'}", "train.micro_batch_size=8"])
    assert accumulated.n_micro == 4
    accumulated.fit()
    np.testing.assert_allclose(losses(tmp_path / "a"), losses(tmp_path / "b"), rtol=1e-5)
    pa, pb = params(whole), params(accumulated)
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_resume_continues_exactly(mnist_overrides, tmp_path):
    mnist_overrides = mnist_overrides + ["lr_schedule.warmup_steps=0"]  # cosine from step 0: lr depends on train.steps
    straight = tmp_path / "straight"
    make_trainer(mnist_overrides + [f"train.output_dir={straight}", "train.steps=6"]).fit()
    split = tmp_path / "split"
    make_trainer(mnist_overrides + [f"train.output_dir={split}", "train.steps=6", "train.stop_after=3"]).fit()
    resumed = make_trainer(mnist_overrides + [f"train.output_dir={split}", "train.steps=6"], resume="")
    assert resumed.step == 3
    resumed.fit()
    assert losses(straight) == losses(split)           # bitwise identical on CPU
    assert len(losses(split)) == 6


def test_interrupted_save_keeps_previous_checkpoint(mnist_overrides, tmp_path, monkeypatch):
    from moetrain.checkpoint import manager

    run = tmp_path / "run"
    trainer = make_trainer(mnist_overrides + [f"train.output_dir={run}", "train.steps=2",
                                              "checkpoint.save_at_end=false"])
    trainer.fit()
    first = trainer.save()
    before = params(trainer)
    trainer.train_step()

    def crash(self, filename, arrays):
        raise KeyboardInterrupt("killed while writing " + filename)

    monkeypatch.setattr(manager.CheckpointWriter, "tensors", crash)
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    monkeypatch.undo()
    root = run / "checkpoints"
    assert any(n.startswith(".tmp-step_") for n in os.listdir(root))   # the half-written one
    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        assert manager.latest_checkpoint(str(root)) == first
    restored = make_trainer(mnist_overrides + [f"train.output_dir={run}", "train.steps=4"], resume="")
    assert restored.step == 2
    for name, value in params(restored).items():
        np.testing.assert_array_equal(value, before[name])


def test_damaged_and_incompatible_checkpoints_are_refused(mnist_overrides, tmp_path):
    from moetrain.checkpoint.manager import CheckpointError, latest_checkpoint

    run = tmp_path / "run"
    make_trainer(mnist_overrides + [f"train.output_dir={run}", "train.steps=1"]).fit()
    ckpt = latest_checkpoint(str(run / "checkpoints"))
    with pytest.raises(CheckpointError, match="mismatching keys: model.hidden_size"):
        make_trainer(mnist_overrides + [f"train.output_dir={run}", "model.hidden_size=16"], resume="")
    with open(os.path.join(ckpt, "optimizer.safetensors"), "r+b") as fh:
        fh.seek(-8, os.SEEK_END)
        fh.write(b"\x00garbage")
    with pytest.raises(CheckpointError, match="optimizer.safetensors") as info:
        make_trainer(mnist_overrides + [f"train.output_dir={run}"], resume="")
    assert "checksum" in str(info.value)


def test_keep_max_prunes_old_checkpoints(mnist_overrides, tmp_path):
    from moetrain.checkpoint.manager import list_checkpoints

    run = tmp_path / "run"
    make_trainer(mnist_overrides + [f"train.output_dir={run}", "train.steps=6", "checkpoint.save_steps=1",
                                    "checkpoint.keep_max=2"]).fit()
    assert [s for s, _ in list_checkpoints(str(run / "checkpoints"))] == [5, 6]


def test_fp16_dynamic_loss_scale_skips_overflow(mnist_overrides, tmp_path):
    trainer = make_trainer(mnist_overrides + [f"train.output_dir={tmp_path / 'r'}", "precision.compute_dtype=float16",
                                              "precision.loss_scale=dynamic", "precision.initial_loss_scale=1e30",
                                              "precision.scale_window=2"])
    before = params(trainer)
    record = trainer.train_step()      # 1e30 * loss overflows fp16 gradients: skipped, scale halves
    assert record["skipped"] and record["loss_scale"] == 5e29
    for name, value in params(trainer).items():
        np.testing.assert_array_equal(value, before[name])
    trainer.scaler.scale = 1024.0
    records = [trainer.train_step() for _ in range(3)]
    assert not any(r["skipped"] for r in records)
    assert records[-1]["loss_scale"] == 2048.0          # grew after scale_window finite steps
    assert np.isfinite(records[-1]["loss"]) and records[-1]["loss"] < 2.4


def test_pynative_matches_jit(mnist_overrides, tmp_path):
    a = make_trainer(mnist_overrides + [f"train.output_dir={tmp_path / 'a'}", "train.steps=2"])
    b = make_trainer(mnist_overrides + [f"train.output_dir={tmp_path / 'b'}", "train.steps=2", "train.jit=false"])
    ra = [a.train_step()["loss"] for _ in range(2)]
    rb = [b.train_step()["loss"] for _ in range(2)]
    np.testing.assert_allclose(ra, rb, rtol=1e-5)


def test_metrics_jsonl_contract(mnist_overrides, tmp_path):
    run = tmp_path / "run"
    make_trainer(mnist_overrides + [f"train.output_dir={run}", "train.steps=3"]).fit()
    records = [json.loads(l) for l in open(run / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "samples_per_s"} <= set(r)
    evals = [r for r in records if "eval_loss" in r]
    assert evals and 0.0 <= evals[-1]["eval_accuracy"] <= 1.0
    assert os.path.isfile(run / "resolved_config.yaml")
    assert os.listdir(run / "checkpoints")


def test_a_cpu_trainer_runs_pynative_ops_on_the_calling_thread(mnist_overrides, tmp_path, monkeypatch):
    """setup_device sets MS_DEV_HOST_BLOCKING_RUN=1 on the CPU before the process's first PyNative op
    (MindSpore reads it then): a fresh process that trains one step has no PyNative queue thread
    ("frontend_queue"), whose busy-wait spun a core; a value the user set is kept."""
    import subprocess
    import sys

    from moetrain.distributed.topology import HOST_BLOCKING_RUN, cpu_ops_on_calling_thread

    script = ("import glob, os, sys\n"
              "from moetrain.config import load_config\n"
              "from moetrain.trainer import Trainer\n"
              f"Trainer(load_config({MNIST!r}, sys.argv[1:])).train_step()\n"
              "names = [open(f).read().strip() for f in glob.glob(f'/proc/{os.getpid()}/task/*/comm')]\n"
              "print(os.environ.get('MS_DEV_HOST_BLOCKING_RUN'), 'frontend_queue' in names)\n")
    env = {k: v for k, v in os.environ.items() if k != HOST_BLOCKING_RUN}
    runs = {}
    for chosen in (None, "0"):
        out = str(tmp_path / f"run_{chosen}")
        done = subprocess.run([sys.executable, "-c", script, *mnist_overrides, f"train.output_dir={out}"],
                              cwd=ROOT, env=env if chosen is None else {**env, HOST_BLOCKING_RUN: chosen},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[chosen] = done.stdout.strip().splitlines()[-1]
    assert runs == {None: "1 False", "0": "0 True"}     # the user's 0 brings the queue thread back
    monkeypatch.delenv(HOST_BLOCKING_RUN, raising=False)
    cpu_ops_on_calling_thread()
    assert os.environ[HOST_BLOCKING_RUN] == "1"
