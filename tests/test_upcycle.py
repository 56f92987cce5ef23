"""`moetrain convert upcycle`: a gpt_tiny trained for a few steps becomes a MoE model with the same
forward (plain and fine-grained), and training continues from it through checkpoint.load_path."""
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.seq_length=32",
         "data.seq_length=32", "data.eval_path=", "train.global_batch_size=4", "logging.progress_bar=false",
         "logging.tensorboard=false", "checkpoint.save_steps=0", "lr_schedule.warmup_steps=0"]


def config(out_dir, *extra):
    from moetrain.config import load_config

    return load_config(os.path.join(ROOT, "configs", "gpt_tiny.yaml"), SMALL + [f"train.output_dir={out_dir}", *extra])


@pytest.fixture(scope="module")
def trained_gpt(tmp_path_factory):
    from moetrain.trainer import Trainer

    out = tmp_path_factory.mktemp("gpt")
    trainer = Trainer(config(out, "train.steps=3"))
    trainer.fit()
    batch = next(trainer._micro_batches(3))
    return os.path.join(out, "checkpoints", "step_00000003"), batch


def logits_and_loss(model_dir, batch):
    import mindspore as ms

    from moetrain.checkpoint.model_dir import load_model

    model, _ = load_model(model_dir)
    ids, labels = (ms.Tensor(b) for b in batch)
    return model.logits(ids).asnumpy(), float(model(ids, labels)[1]["lm_loss"]), model


@pytest.mark.parametrize("granularity", [1, 2])
def test_upcycled_forward_equals_dense(trained_gpt, tmp_path, granularity):
    from moetrain.checkpoint.upcycle import main

    dense_dir, batch = trained_gpt
    out = str(tmp_path / "moe")
    assert main([dense_dir, out, "--num-experts", "4", "--top-k", "2", "--granularity", str(granularity)]) == 0
    dense, dense_loss, _ = logits_and_loss(dense_dir, batch)
    moe, moe_loss, model = logits_and_loss(out, batch)
    assert model.cfg.moe.num_experts == 4 * granularity and model.cfg.moe.top_k == 2 * granularity
    assert model.cfg.moe.ffn_hidden_size == 128 // granularity
    np.testing.assert_allclose(moe, dense, rtol=0, atol=1e-5)
    assert moe_loss == pytest.approx(dense_loss, abs=1e-5)
    if granularity > 1:   # the virtual-group router is what makes it exact: break it and the output moves
        import mindspore as ms

        router = model.layers[0].moe.router.weight
        rows = router.asnumpy()
        rows[1] = np.random.default_rng(0).standard_normal(rows.shape[1]).astype(np.float32)
        router.set_data(ms.Tensor(rows))
        assert np.abs(model.logits(ms.Tensor(batch[0])).asnumpy() - dense).max() > 1e-3


def test_training_continues_from_the_upcycled_model(trained_gpt, tmp_path):
    from moetrain.checkpoint.upcycle import upcycle
    from moetrain.trainer import Trainer

    dense_dir, _ = trained_gpt
    model, _ = upcycle(dense_dir, str(tmp_path / "moe"), num_experts=4, top_k=2, granularity=2)
    sets = [f"model.{k}={v}" for k, v in model.items() if k not in ("moe", "compute_dtype")]
    sets += [f"model.moe.{k}={v}" for k, v in model["moe"].items()]
    trainer = Trainer(config(tmp_path / "run", *sets, "train.steps=2", f"checkpoint.load_path={tmp_path / 'moe'}"))
    batch = next(trainer._micro_batches(0))
    _, dense_loss, _ = logits_and_loss(dense_dir, batch)
    first = trainer.train_step()
    assert first["lm_loss"] == pytest.approx(dense_loss, rel=1e-5)
    assert np.isfinite(trainer.train_step()["loss"])


def test_upcycle_refuses_bad_arguments(trained_gpt, tmp_path):
    from moetrain.checkpoint.upcycle import upcycle

    dense_dir, _ = trained_gpt
    with pytest.raises(ValueError, match=r"--granularity 3 must divide the FFN width model.ffn_hidden_size \(128\)"):
        upcycle(dense_dir, str(tmp_path / "a"), 4, 2, 3)
    with pytest.raises(ValueError, match=r"--top-k \(5\) cannot exceed --num-experts \(4\)"):
        upcycle(dense_dir, str(tmp_path / "b"), 4, 5, 1)
