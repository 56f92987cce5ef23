import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
os.environ.setdefault("GLOG_v", "3")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def write_idx(path, array, magic):
    with open(path, "wb") as fh:
        fh.write(np.array([magic], ">u4").tobytes())
        fh.write(np.array(array.shape, ">u4").tobytes())
        fh.write(array.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def kernel_ops(ms):
    """`moetrain.kernels.ops` (needs the module's `ms` fixture); skips where the kernels cannot be built."""
    from moetrain import kernels

    if not kernels.available():
        pytest.skip("moetrain.kernels cannot be built here (no C++ compiler or no oneDNN in MindSpore)")
    from moetrain.kernels import ops

    return ops


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory):
    """A 256/64-sample MNIST-format folder with learnable labels (class = brightest row band)."""
    folder = tmp_path_factory.mktemp("mnist")
    rng = np.random.default_rng(0)
    for split, n in (("train", 256), ("t10k", 64)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 60, (n, 28, 28))
        for i, label in enumerate(labels):
            images[i, 2 + 2 * label:4 + 2 * label, :] = 250
        write_idx(folder / f"{split}-images-idx3-ubyte", images, 0x803)
        write_idx(folder / f"{split}-labels-idx1-ubyte", labels, 0x801)
    return str(folder)


@pytest.fixture
def mnist_overrides(tiny_mnist, tmp_path):
    """Overrides that make configs/mnist_mlp.yaml tiny and fast."""
    return [f"data.path={tiny_mnist}", f"train.output_dir={tmp_path / 'run'}", "model.hidden_size=32",
            "train.epochs=0", "train.steps=6", "train.global_batch_size=32", "train.eval_batch_size=32",
            "lr_schedule.warmup_steps=2", "checkpoint.save_steps=0", "logging.tensorboard=false",
            "logging.progress_bar=false"]
