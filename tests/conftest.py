import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
os.environ.setdefault("GLOG_v", "3")
# PyNative ops on the calling thread, as the trainer and `moetrain generate` run them on the CPU
# (moetrain/distributed/topology.py cpu_ops_on_calling_thread): MindSpore reads the switch at the process's
# first op, which in a session is some earlier test's, so a module fixture that sets it later has no
# effect; without it a queue thread spins beside every op-by-op test (same kernels, same values)
os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")
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
    """After -k/-m deselection: the test files whose runs join the shared jobs, and the order: files
    of one-process tests first (they run while the shared jobs train in the background), then the
    files that read the shared jobs, then those that launch jobs of their own (after the shared jobs,
    so their launches and timeouts see the machine as before), then those whose own launch started
    in the background when the shared jobs ended (distributed.DEFERRED_LAUNCHES: the later their
    fixture joins it, the less it waits), and last the files whose child process runs in the background (tests/background.py: the more of the session it has had, the
    less its test waits). Whole files move, so module fixtures are built once."""
    import background
    import distributed

    def module(item):
        return item.module.__name__ if item.module is not None else ""

    # what the selected tests need: a file's shared runs join the shared jobs only if a selected test
    # reads them (a shared_job_N fixture), a deferred launch starts only for a selected test that
    # requests its fixture, a background child only for its selected reader (`-k` or `-m "not
    # distributed"` then start no msrun job that nothing reads)
    fixtures = {(module(item), name) for item in items for name in getattr(item, "fixturenames", ())}
    tests = {(module(item), getattr(item, "originalname", None) or item.name) for item in items}
    distributed.SELECTED_MODULES.update(m for m, name in fixtures if name in ("shared_job_2", "shared_job_4"))
    distributed.SELECTED_DEFERRED.update(m for m, launch in distributed.DEFERRED_LAUNCHES.items()
                                         if (m, launch.fixture) in fixtures)
    background.SELECTED.update(m for m, run in background.REGISTERED.items() if (m, run.reader) in tests)
    shared = {g.module for groups in distributed.SHARED_RUNS.values() for g in groups}
    order = {}
    for item in items:
        rank = (3 if module(item) in background.REGISTERED else 1 if module(item) in shared
                else 2.5 if module(item) in distributed.DEFERRED_LAUNCHES
                else 2 if item.get_closest_marker("distributed") else 0)
        order[module(item)] = max(order.get(module(item), 0), rank)
    items[:] = sorted(items, key=lambda item: order[module(item)])


@pytest.fixture(scope="session", autouse=True)
def shared_jobs(request, tmp_path_factory):
    """The shared 2- and 4-rank jobs, launched in the background at the first test; the selected
    files' idle-priority children (tests/background.py) start then too."""
    import background
    import distributed

    background.start_selected()
    jobs = distributed.SharedJobs(request.getfixturevalue,
                                  {n: str(tmp_path_factory.mktemp(f"shared{n}")) for n in (2, 4)})
    yield jobs
    jobs.stop()
    distributed.stop_deferred_launches()
    background.stop_all()


def pytest_runtest_setup(item):
    """Once the shared jobs have ended, the children registered `after_shared_jobs`
    (tests/background.py) and the deferred launches (tests/distributed.py) start."""
    import background
    import distributed

    if distributed.ACTIVE_JOBS:
        jobs = distributed.ACTIVE_JOBS[0]
        if all(done.is_set() for done in jobs.done.values()):
            background.start_selected(after_shared_jobs=True)
            distributed.start_deferred_launches(item.session)


@pytest.fixture(scope="session")
def shared_job_2(shared_jobs):
    """Output folder of the shared 2-rank job (None when no selected test file has 2-rank runs)."""
    return shared_jobs.wait(2)


@pytest.fixture(scope="session")
def shared_job_4(shared_jobs):
    """Output folder of the shared 4-rank job (run after the 2-rank job)."""
    return shared_jobs.wait(4)
