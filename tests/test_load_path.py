"""`checkpoint.load_path`: a new run from an imported Hugging Face Mixtral (or a training checkpoint)
starts at step 0 with a fresh optimizer, and its first loss is the loaded model's loss on that batch."""
import os
import sys

import numpy as np
import pytest
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from test_hf_convert import MIXTRAL_CONFIG, random_hf_weights, write_hf_checkpoint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV_VOCAB = 2048
TINY_MIXTRAL = dict(MIXTRAL_CONFIG, vocab_size=KJV_VOCAB, max_position_embeddings=32)


def run_config(model_section, out_dir, load_path, steps=2, seq_length=32):
    from moetrain.config import config_from_dict

    return config_from_dict({
        "model": model_section,
        "data": {"type": "lm", "path": os.path.join(ROOT, "data/kjv_tiny/kjv_tiny_train"), "seq_length": seq_length},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "train": {"steps": steps, "global_batch_size": 4, "output_dir": str(out_dir), "seed": 7},
        "checkpoint": {"load_path": str(load_path), "save_at_end": True},
        "logging": {"progress_bar": False, "tensorboard": False, "log_interval": 1},
    })


def import_tiny_mixtral(root):
    """A tiny random Hugging Face Mixtral written under `root` and imported: (model folder, its model section)."""
    from pathlib import Path

    from moetrain.checkpoint.hf import hf_import

    root = Path(root)
    write_hf_checkpoint(root / "hf", TINY_MIXTRAL, random_hf_weights(TINY_MIXTRAL, seed=11, scale=0.2))
    hf_import(str(root / "hf"), str(root / "model"))
    with open(root / "model" / "config.yaml") as fh:
        return root / "model", yaml.safe_load(fh)["model"]


@pytest.fixture(scope="module")
def imported_mixtral(tmp_path_factory):
    return import_tiny_mixtral(tmp_path_factory.mktemp("mixtral"))


def loaded_model_loss(model_dir, batch, **model_changes):
    """The loss of the model saved in `model_dir` (with `model_changes` to its `model:` section) on `batch`."""
    import mindspore as ms

    from moetrain.checkpoint.model_dir import build_model_from_dict, load_model_dir, load_model_state

    config, state = load_model_dir(str(model_dir))
    model = build_model_from_dict(dict(config["model"], **model_changes))
    load_model_state(model, state, strict=True)
    loss, _ = model(*(ms.Tensor(b) for b in batch))
    return float(loss)


def test_imported_mixtral_continues_training(imported_mixtral, tmp_path):
    from moetrain.trainer import Trainer

    model_dir, section = imported_mixtral
    trainer = Trainer(run_config(section, tmp_path / "run", model_dir))
    assert trainer.step == 0 and trainer.lr_at(0) == pytest.approx(1e-3)
    batch = next(trainer._micro_batches(0))
    first = trainer.train_step()
    assert first["loss"] == pytest.approx(loaded_model_loss(model_dir, batch), rel=1e-5)
    # the optimizer started fresh: AdamW's first step moves every weight by about lr
    weights = {p.name: p.asnumpy() for p in trainer.model.trainable_params()}
    from moetrain.checkpoint.model_dir import load_model_dir

    _, saved = load_model_dir(str(model_dir))
    moved = np.abs(weights["layers.0.attention.wq.weight"] - saved["layers.0.attention.wq.weight"])
    assert 0.5e-3 < moved.max() <= 1.01e-3


@pytest.mark.slow   # two trainers (a jit compile each): ~20 s idle, more on a loaded machine
def test_load_path_from_a_training_checkpoint(imported_mixtral, tmp_path):
    """A training checkpoint (with optimizer state) as load_path: its weights, but step 0 and no moments."""
    from moetrain.trainer import Trainer

    model_dir, section = imported_mixtral
    first = Trainer(run_config(section, tmp_path / "a", model_dir, steps=2))
    first.fit()
    checkpoint = os.path.join(tmp_path / "a", "checkpoints", "step_00000002")
    again = Trainer(run_config(dict(section, init_std=0.5), tmp_path / "b", checkpoint, steps=3))  # init: training-only
    assert again.step == 0
    moments = [p for p in again.opt_step.state_parameters() if p.name.startswith(("adam_m.", "adam_v."))]
    assert moments and all(float(np.abs(p.asnumpy()).max()) == 0.0 for p in moments)
    batch = next(again._micro_batches(0))
    assert again.train_step()["loss"] == pytest.approx(loaded_model_loss(checkpoint, batch), rel=1e-5)


def test_load_path_at_another_sequence_length(tmp_path, capsys):
    """A model imported with 131072 positions (a published Mixtral's max_position_embeddings) fine-tunes
    at 64 with another RoPE theta: positions hold no weights, so the weights load unchanged (each
    difference logged) and the first loss is the imported model's on that batch at those settings."""
    from pathlib import Path

    from moetrain.checkpoint.hf import hf_import
    from moetrain.trainer import Trainer

    long = dict(TINY_MIXTRAL, max_position_embeddings=131072)
    write_hf_checkpoint(Path(tmp_path) / "hf", long, random_hf_weights(long, seed=11, scale=0.2))
    section = hf_import(str(tmp_path / "hf"), str(tmp_path / "model"))
    assert section["seq_length"] == 131072
    short = dict(section, seq_length=64, rope_theta=5e5)
    trainer = Trainer(run_config(short, tmp_path / "run", tmp_path / "model", seq_length=64))
    log = capsys.readouterr().out
    assert "model.seq_length (saved 131072, config 64)" in log and "model.rope_theta (saved 1000.0, config 500000.0)" in log
    batch = next(trainer._micro_batches(0))
    assert batch[0].shape[-1] == 64
    reference = loaded_model_loss(tmp_path / "model", batch, seq_length=64, rope_theta=5e5)
    assert trainer.train_step()["loss"] == pytest.approx(reference, rel=1e-5)
    # the theta change reaches the model: the loss at the saved theta is another number
    assert abs(loaded_model_loss(tmp_path / "model", batch) - reference) > 1e-4


def test_load_path_refuses_another_model(imported_mixtral, tmp_path):
    from moetrain.checkpoint.manager import CheckpointError
    from moetrain.trainer import Trainer

    model_dir, section = imported_mixtral
    other = dict(section, ffn_hidden_size=64, moe=dict(section["moe"], top_k=1))
    with pytest.raises(CheckpointError, match=r"mismatching keys: model.ffn_hidden_size \(saved 20, config 64\); "
                                              r"model.moe.top_k \(saved 2, config 1\)"):
        Trainer(run_config(other, tmp_path / "run", model_dir))
