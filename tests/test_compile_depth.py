"""Compile at production depth: a 16-layer model of tiny width trains on one process, tp2, pp2 and
dp2·ep2, and every layout reproduces the one-process run (loss, lm loss, aux terms and gradient
norm within 1e-4 over 3 steps; expert loads exact).

At commit 040a2c0 none of this ran: the 12-layer GPT failed with "Exceed function call depth limit"
while compiling the optimizer step, a 12-layer MoE forward took minutes, and tp2 hung from 3
layers on (docs/performance.md, "Compile time at depth"). The model mixes dense and MoE layers
(every second layer MoE, dropless) with tied embeddings, so the tp, pp and ep paths all see both.
First-step times are recorded (`seconds` in the rank files) but not asserted: timings live in
benchmarks/compile_depth.py and docs/performance.md.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from distributed import (assert_same_steps, share_runs, shared_reference_dirs, shared_run_dirs,  # noqa: E402
                         step_records)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/moe_tiny.yaml"
KJV = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
LAYERS = 16
MODEL = [
    f"data.path={KJV}_train", f"data.eval_path={KJV}_eval", f"data.tokenizer={KJV}.model",
    "model.hidden_size=32", f"model.num_layers={LAYERS}", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=64", "model.seq_length=32", "model.vocab_size=2048", "model.tie_embeddings=true",
    "model.moe_layer_freq=2", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=32",
    "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001",
    "train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_interval=0",
    "train.eval_max_batches=1", "lr_schedule.warmup_steps=0", "optimizer.clip_grad_norm=0.05",
    "checkpoint.save_at_end=false", "checkpoint.save_steps=0", "logging.tensorboard=false",
    "logging.progress_bar=false",
    # dispatch buffers at their bound for the whole run: adaptive sizing (moetrain/moe/capacity.py, tested in
    # test_moe_native_ops and test_expert_parallel) recompiled this depth's dp2·ep2 step three times in 3 steps
    "parallel.moe_capacity=bound",
]
# 2 ranks, in the suite's shared 2-rank msrun job (tests/distributed.py: share_runs); its runs train one
# after another (expert parallelism is carved out of data parallelism: dp2·ep2 is 2 ranks, each holding
# half the experts)
RUNS = {"tp2": ["parallel.model_parallel=2"],
        "pp2": ["parallel.pipeline_stage=2"],
        "dp2_ep2": ["parallel.data_parallel=2", "parallel.expert_parallel=2", "parallel.optimizer_shard=1"]}


def spec(name, parallel=()):
    return f"{name}:{CONFIG}:" + ",".join(MODEL + list(parallel))


share_runs(2, __name__, lambda fixture, out_dir: [spec(name, parallel) for name, parallel in RUNS.items()],
           timeout=1500, references=lambda fixture: [spec("reference")])


@pytest.fixture(scope="module")
def one_process(shared_job_2):
    """The reference, trained in one process beside the shared job (tests/distributed.py: share_runs).
    Micro-batches of one sample and the per-micro-batch aux loss: every layout sees the same
    micro-batches, so losses and routing are the same."""
    return step_records(shared_reference_dirs(shared_job_2, __name__, ["reference"])["reference"])


@pytest.fixture(scope="module")
def launch(shared_job_2):
    return {name: step_records(run_dir) for name, run_dir in shared_run_dirs(shared_job_2, __name__, RUNS).items()}


@pytest.mark.distributed
@pytest.mark.slow
def test_sixteen_layers_train_on_every_layout_and_reproduce_one_process(one_process, launch):
    for name, steps in launch.items():
        assert_same_steps(one_process, steps, name, num_steps=3)
        assert all(len(r["expert_load"]) == LAYERS // 2 for r in one_process)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_final_evaluation_matches_one_process_on_every_layout(shared_job_2):
    """train.eval_max_batches=1 on dp2·ep2: one batch, which rank 0 evaluates while rank 1 runs it
    again uncounted (the experts' all-to-all needs every dp rank); the eval loss is that batch's."""
    runs = {**shared_run_dirs(shared_job_2, __name__, RUNS), **shared_reference_dirs(shared_job_2, __name__, ["reference"])}
    final = {name: eval_records(run_dir)[-1]["eval_loss"] for name, run_dir in runs.items()}
    assert final["reference"] > 1.0
    for name in RUNS:
        np.testing.assert_allclose(final[name], final["reference"], rtol=1e-4, err_msg=name)


def eval_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if "eval_loss" in r]


BROKEN_MODEL = """
from dataclasses import dataclass

from mindspore import nn

from moetrain.registry import register_model


@dataclass
class BrokenConfig:
    name: str = "broken_mlp"
    compute_dtype: str = "float32"


@register_model("broken_mlp", config=BrokenConfig)
class Broken(nn.Cell):
    def __init__(self, cfg):
        super().__init__()
        self.linear = nn.Dense(784, 10)

    def construct(self, images, labels):
        return self.linear(images).reshape(7, -1).sum(), {}    # 80 logits in rows of 7: shape inference fails
"""


def test_failed_compile_names_the_model_and_layout_and_leaves_no_dump_in_the_working_dir(tiny_mnist, tmp_path):
    """A step that cannot compile: `moetrain train` fails with a message naming the model, the
    layout, where MindSpore's analysis went (under the run's logs, not ./rank_0) and what to try;
    nothing is written into the working directory."""
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    (tmp_path / "broken_model.py").write_text(BROKEN_MODEL)
    config = tmp_path / "broken.yaml"
    config.write_text(f"base: {os.path.join(ROOT, 'configs', 'mnist_mlp.yaml')}\nmodel_module: broken_model\n"
                      "model: {name: broken_mlp}\n")
    run = tmp_path / "run"
    overrides = [f"data.path={tiny_mnist}", f"train.output_dir={run}", "train.steps=1", "train.epochs=0",
                 "train.global_batch_size=8", "checkpoint.save_steps=0", "checkpoint.save_at_end=false",
                 "logging.tensorboard=false"]
    env = {**{k: v for k, v in os.environ.items() if k != "MS_OM_PATH"},
           "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "moetrain.cli", "train", str(config),
                             *[a for o in overrides for a in ("--set", o)]],
                            cwd=workdir, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    message = result.stderr
    assert "compile error" in message and "'broken_mlp'" in message and "dp=1 tp=1 pp=1 ep=1" in message
    assert "train.jit=false" in message and "MOETRAIN_DISABLE_KERNELS=1" in message
    assert "Traceback (most recent call last)" not in message
    assert list(workdir.iterdir()) == [], "MindSpore wrote into the working directory"
    if "analysis:" in message:
        assert str(run / "logs" / "compile") in message


REUSE_SCRIPT = """
import sys
import numpy as np
import mindspore as ms
sys.path.insert(0, {root!r})
from moetrain.config import load_config
from moetrain.build import build_model, setup_device

setup_device("cpu")
cfg = load_config({config!r}, ["model.num_layers=3", "model.first_k_dense=1", "model.tie_embeddings=true",
                                "model.hidden_size=32", "model.moe.num_experts=4", "model.moe.ffn_hidden_size=32",
                                "train.cell_reuse=" + sys.argv[2]])
ms.set_seed(0)
model = build_model(cfg)
params = model.trainable_params()
ids = ms.Tensor(np.random.default_rng(0).integers(0, 2048, (2, 32)).astype(np.int32))
def loss_of(i, l):
    return model(i, l)[0]


grad_fn = ms.value_and_grad(loss_of, None, params)


def step(i, l):
    return grad_fn(i, l)


loss, grads = ms.jit(step)(ids, ids)
np.savez(sys.argv[1], loss=loss.asnumpy(), **{{p.name: g.asnumpy() for p, g in zip(params, grads)}})
"""


def test_cell_reuse_compiles_one_block_graph_with_bitwise_the_same_results(tmp_path):
    """Blocks are compiled once and reused for every layer (`moetrain.modeling.reused_block`); the
    jitted loss and every gradient are bitwise those of the plain per-layer graph."""
    script = tmp_path / "reuse.py"
    script.write_text(REUSE_SCRIPT.format(root=ROOT, config=os.path.join(ROOT, CONFIG)))
    results = {}
    for reuse in ("1", "0"):
        out = tmp_path / f"reuse{reuse}.npz"
        proc = subprocess.run([sys.executable, str(script), str(out), {"1": "true", "0": "false"}[reuse]],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[reuse] = dict(np.load(out))
    assert sorted(results["1"]) == sorted(results["0"]) and len(results["1"]) > 10
    for name, value in results["0"].items():
        np.testing.assert_array_equal(results["1"][name], value, err_msg=name)
