"""The MNIST sanity run on the real idx files: two epochs of the shipped config reaches 97%."""
import os

import pytest

from conftest import SHARED_DATA

MNIST_DIR = os.path.join(SHARED_DATA, "mnist")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not os.path.isdir(MNIST_DIR), reason="real MNIST not at ../shared/data/mnist")
def test_mnist_mlp_reaches_97_percent(tmp_path):
    from moetrain.config import load_config
    from moetrain.trainer import Trainer

    cfg = load_config(os.path.join(ROOT, "configs", "mnist_mlp.yaml"),
                      [f"data.path={MNIST_DIR}", f"train.output_dir={tmp_path}", "train.epochs=2",
                       "logging.tensorboard=false", "checkpoint.save_steps=0"])
    result = Trainer(cfg).fit()
    assert result["eval"]["eval_accuracy"] >= 0.97
