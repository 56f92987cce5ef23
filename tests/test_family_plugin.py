"""A model family from outside the repository: the README's "Adding a model" transformer example,
written into a temporary folder and named by the config key `model_module` (a path, relative to the
config), with no edit anywhere else. It trains on one process, tp2, pp2 and dp2·ep2 (runs of the
suite's shared 2-rank job, tests/distributed.py `share_runs`; the one-process run trains beside it),
is planned, and goes out through the Hugging Face path and back."""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed import assert_same_steps, share_runs, shared_reference_dirs, shared_run_dirs, step_records  # noqa: E402
from test_registry_example import readme_blocks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
STEPS = 3
RUN = [
    f"data.path={KJV}_train", "data.eval_path=", f"data.tokenizer={KJV}.model", "model.seq_length=32",
    f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_interval=0",
    "lr_schedule.warmup_steps=0", "checkpoint.save_at_end=false", "checkpoint.save_steps=0",
    "logging.tensorboard=false", "logging.progress_bar=false", "parallel.moe_capacity=bound",
    "train.jit=false",   # PyNative: 3 steps of this tiny model cost less than compiling them
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=64", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=16",
]
LAYOUTS = {"toy_tp2": ["parallel.model_parallel=2"], "toy_pp2": ["parallel.pipeline_stage=2"],
           "toy_dp2_ep2": ["parallel.data_parallel=2", "parallel.expert_parallel=2"]}


def write_family(folder) -> str:
    """The README's toy family and its config (every code block as written there) in `folder`; returns
    the config's path."""
    os.makedirs(folder, exist_ok=True)
    code = next(block for block in readme_blocks("python") if block.startswith("# toy_moe.py"))
    config = next(block for block in readme_blocks("yaml") if block.startswith("# toy_moe.yaml"))
    with open(os.path.join(folder, "toy_moe.py"), "w") as fh:
        fh.write(code)
    with open(os.path.join(folder, "toy_moe.yaml"), "w") as fh:
        fh.write(config.replace("base: configs/", f"base: {ROOT}/configs/"))
    return os.path.join(folder, "toy_moe.yaml")


def family_config(fixture) -> str:
    return write_family(os.path.join(str(fixture("tmp_path_factory").getbasetemp()), "family_plugin"))


def spec(name, config, extra=()):
    return f"{name}:{config}:" + ",".join(RUN + list(extra))


share_runs(2, __name__, lambda fixture, out_dir: [spec(n, family_config(fixture), x) for n, x in LAYOUTS.items()],
           timeout=400, references=lambda fixture: [spec("toy", family_config(fixture))])


@pytest.mark.distributed
def test_toy_family_layouts_reproduce_one_process(shared_job_2):
    """tp2, pp2 and dp2·ep2 of the out-of-tree family give the one-process losses, gradient norms and
    expert loads, and each split what it should (heads, stages, experts)."""
    reference = step_records(shared_reference_dirs(shared_job_2, __name__, ["toy"])["toy"])
    runs = shared_run_dirs(shared_job_2, __name__, list(LAYOUTS))
    for name, run_dir in runs.items():
        assert_same_steps(reference, step_records(run_dir), name, STEPS)

    def rank(name, r):
        with open(os.path.join(runs[name], f"rank_{r}.json")) as fh:
            return json.load(fh)

    assert rank("toy_tp2", 1)["shapes"]["layers.0.attention.wq.weight"] == [16, 32]     # 2 of 4 heads of 8
    assert [rank("toy_pp2", r)["stage_layers"] for r in (0, 1)] == [[0, 1], [1, 2]]
    assert rank("toy_dp2_ep2", 1)["shapes"]["layers.1.moe.experts.w_up"][0] == 2      # 2 of 4 experts


def test_toy_family_plans_and_converts_through_hf(tmp_path, capsys):
    """The planner counts the family's parameters exactly and searches its layouts; hf-export writes
    the family's own config.json and tensor names, hf-import reads them back bit for bit."""
    import dataclasses

    from moetrain.checkpoint.hf import hf_export, hf_import
    from moetrain.checkpoint.model_dir import load_model_dir, save_model_dir
    from moetrain.config import load_config
    from moetrain.planner import cli as plan_cli
    from moetrain.planner.arch import count_parameters
    from moetrain.registry import get_model

    path = write_family(str(tmp_path / "family"))
    small = [o for o in RUN if o.startswith("model.")]
    cfg = load_config(path, small)
    assert os.path.isabs(cfg.model_module) and cfg.model_module.endswith("toy_moe.py")
    model = get_model("toy_moe").cls(cfg.model)
    params = {p.name: p.asnumpy() for p in model.get_parameters()}
    total = sum(v.size for v in params.values())
    assert count_parameters(cfg.model)[0] == total
    assert plan_cli.main([path, "--world", "4", "--search", *sum((["--set", o] for o in small), [])]) == 0
    report = capsys.readouterr().out                          # the search, then the chosen layout's plan
    assert "layout search:" in report and "toy_moe: 2 layers, hidden 32" in report
    assert f"({total:,}; trainable" in report and "FITS" in report

    model_dir, hf_dir, back = (str(tmp_path / n) for n in ("model", "hf", "back"))
    save_model_dir(model_dir, {"model": dataclasses.asdict(cfg.model), "model_module": cfg.model_module}, params)
    hf_config = hf_export(model_dir, hf_dir)
    assert hf_config["model_type"] == "toy_moe" and hf_config["depth"] == 2 and hf_config["experts"] == 4
    from safetensors.numpy import load_file

    names = set(load_file(os.path.join(hf_dir, "model.safetensors")))
    assert {"tok.weight", "blocks.1.attention.wq.weight", "blocks.0.experts.3.down.weight"} <= names
    assert not any(n.startswith("layers.") for n in names)
    section = hf_import(hf_dir, back)
    assert section["name"] == "toy_moe" and section["moe"]["num_experts"] == 4
    config, state = load_model_dir(back)
    assert config["model_module"] == cfg.model_module        # the converted model finds its family again
    assert set(state) == set(params)
    for name, value in params.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
