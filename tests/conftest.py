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


# ---------------------------------------------------------------------------------------------
# Shared msrun jobs (tests/distributed.py: share_runs): one launch per world size for the
# train_runs_worker runs of every selected test file
# ---------------------------------------------------------------------------------------------
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """After -k/-m deselection: the test files whose runs join the shared jobs."""
    import distributed

    distributed.SELECTED_MODULES.update(item.module.__name__ for item in items if item.module is not None)


@pytest.fixture(scope="session")
def shared_job_2(request, tmp_path_factory):
    """Output folder of the shared 2-rank job (None when no selected test file has 2-rank runs)."""
    import distributed

    return distributed.shared_job(2, request.getfixturevalue, str(tmp_path_factory.mktemp("shared2")))


@pytest.fixture(scope="session")
def shared_job_4(request, tmp_path_factory, shared_job_2):
    """Output folder of the shared 4-rank job; after the 2-rank job (a 4-rank run may resume a
    2-rank run's checkpoint)."""
    import distributed

    return distributed.shared_job(4, request.getfixturevalue, str(tmp_path_factory.mktemp("shared4")))
