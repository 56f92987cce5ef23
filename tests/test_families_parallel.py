"""DeepSeek-V3 (MLA, MTP) and Qwen3-MoE on every parallel dimension, each against one process.

The suite's shared 2-rank msrun job (tests/distributed.py: share_runs) trains, one after another
(tests/workers/train_runs_worker.py):
  deepseek_tp2          MLA heads split (wq_b/wkv_b column-, wo row-parallel; latents whole), MTP block
                        split like the layers, full recompute
  deepseek_pp2          dense layer | MoE layer + head + MTP (the embedding on both stages), selective
                        recompute; saves a checkpoint at step 2
  deepseek_dp2_ep2      half the experts per rank (MTP block's too), ZeRO-2
  deepseek_ep2_from_pp2 dp2·ep2 ZeRO-2 resuming deepseek_pp2's checkpoint (two stages' files, the
                        embedding in both -> ep slices and ZeRO-sharded optimizer state)
  qwen3_tp2_sp          per-head q/k norms on local heads, sequence parallel, selective recompute;
                        saves a checkpoint at step 2
  qwen3_dp2_ep2         half the experts per rank, ZeRO-1
  qwen3_pp2_from_tp2    pp2 (full recompute) resuming qwen3_tp2_sp's checkpoint
  mixtral_dp2_ep2       an imported Hugging Face Mixtral continued through checkpoint.load_path
and one process, running beside the launch, trains both families' references. Tiny
widths, the shipped KJV tokenizer's 2048 tokens, 3 steps of 4 micro-batches of one sample, per-micro-
batch aux loss: every layout sees the same micro-batches, so losses, aux terms, MTP loss and gradient
norm agree within 1e-4 and expert loads exactly (the aux-loss-free bias moves every step, so routing in
steps 2 and 3 depends on the balancing too).
A resumed run's step 3 matches the reference's step 3 the same way.
"""
import json
import os
import sys

import numpy as np
import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed import share_runs, shared_reference_dirs, shared_run_dirs  # noqa: E402
from test_load_path import import_tiny_mixtral  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
STEPS, SAVED_AT = 3, 2
# dispatch buffers at their bound for the whole run: adaptive sizing (moetrain/moe/capacity.py, tested in
# test_moe_native_ops and test_expert_parallel) recompiles and re-runs micro-batches, costly in 3-step runs
FIXED_CAPACITIES = "parallel.moe_capacity=bound"
RUN = [
    f"data.path={KJV}_train", "data.eval_path=", f"data.tokenizer={KJV}.model", "model.seq_length=32",
    f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_interval=0",
    "lr_schedule.warmup_steps=0", "checkpoint.save_at_end=false", "checkpoint.save_steps=0",
    "logging.tensorboard=false", "logging.progress_bar=false", FIXED_CAPACITIES,
]
DEEPSEEK = ("configs/deepseek_v3_tiny.yaml", RUN + [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.ffn_hidden_size=64",
    "model.q_lora_rank=24", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4",
    "model.v_head_dim=8", "model.first_k_dense=1", "model.mtp_depth=1",
    "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden_size=16",
    "model.moe.aux_loss_coeff=0.01", "model.moe.seq_aux_loss_coeff=0.001", "model.moe.bias_update_rate=0.01"])
QWEN3 = ("configs/qwen3_moe_tiny.yaml", RUN + [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
    "model.ffn_hidden_size=64", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=16",
    "model.moe.aux_loss_coeff=0.01"])
SAVE = [f"checkpoint.save_steps={SAVED_AT}"]
DP2_EP2 = ["parallel.data_parallel=2", "parallel.expert_parallel=2"]
TP2, PP2 = ["parallel.model_parallel=2"], ["parallel.pipeline_stage=2"]
RUNS = {   # name: (family, overrides); the runs that resume come after the runs they resume
    "deepseek_tp2": (DEEPSEEK, TP2 + ["parallel.recompute=full"]),
    "deepseek_pp2": (DEEPSEEK, PP2 + ["parallel.recompute=selective"] + SAVE),
    "deepseek_dp2_ep2": (DEEPSEEK, DP2_EP2 + ["parallel.optimizer_shard=2"]),
    "qwen3_tp2_sp": (QWEN3, TP2 + ["parallel.use_seq_parallel=true", "parallel.recompute=selective"] + SAVE),
    "qwen3_dp2_ep2": (QWEN3, DP2_EP2 + ["parallel.optimizer_shard=1"]),
}
RESUMED = {   # name: (the run whose step-2 checkpoint it resumes, its own overrides)
    "deepseek_ep2_from_pp2": ("deepseek_pp2", DP2_EP2 + ["parallel.optimizer_shard=2"]),
    "qwen3_pp2_from_tp2": ("qwen3_tp2_sp", PP2 + ["parallel.recompute=full"]),
}
FAMILIES = {"deepseek": DEEPSEEK, "qwen3": QWEN3}
STEP_KEYS = {"deepseek": ("loss", "lm_loss", "mtp_loss", "aux_loss", "seq_aux_loss", "z_loss", "grad_norm"),
             "qwen3": ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm")}


def spec(name, family, extra=()):
    config, overrides = family
    return f"{name}:{config}:" + ",".join(list(overrides) + list(extra))


def step_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if "loss" in r]


def checkpoint_dir(run_dir, step=SAVED_AT):
    return os.path.join(run_dir, "checkpoints", f"step_{step:08d}")


# ---------------------------------------------------------------------------------------------
# The runs: in the suite's shared 2-rank job, the references beside it
# ---------------------------------------------------------------------------------------------
def mixtral_paths(out_dir):
    """(imported model folder, run config) of the Mixtral run of the shared job with output folder `out_dir`."""
    root = os.path.join(os.path.dirname(out_dir), "families_mixtral")
    return os.path.join(root, "model"), os.path.join(root, "mixtral_load_path.yaml")


def write_mixtral_config(out_dir):
    """Imports the tiny Mixtral and writes a run config continuing it (`checkpoint.load_path`) for one
    step on KJV; returns the config's path."""
    model_dir, path = mixtral_paths(out_dir)
    _, section = import_tiny_mixtral(os.path.dirname(model_dir))
    config = {
        "model": section,
        "data": {"type": "lm", "path": f"{KJV}_train", "eval_path": "", "seq_length": 32},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "train": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 1, "seed": 7, "eval_interval": 0},
        "checkpoint": {"load_path": str(model_dir), "save_at_end": False, "save_steps": 0},
        "logging": {"progress_bar": False, "tensorboard": False, "log_interval": 1},
    }
    with open(path, "w") as fh:
        yaml.safe_dump(config, fh)
    return path


def job_specs(fixture, out_dir):
    """The layouts, then the runs resuming their checkpoints, then the imported Mixtral on dp2·ep2."""
    runs = [spec(name, family, extra) for name, (family, extra) in RUNS.items()]
    saved = shared_run_dirs(out_dir, __name__, [saver for saver, _ in RESUMED.values()])
    runs += [spec(name, FAMILIES[saver.split("_")[0]], extra + [f"resume={checkpoint_dir(saved[saver])}"])
             for name, (saver, extra) in RESUMED.items()]
    return runs + [f"mixtral_dp2_ep2:{write_mixtral_config(out_dir)}:" + ",".join(DP2_EP2 + [FIXED_CAPACITIES])]


share_runs(2, __name__, job_specs, timeout=1500,
           references=lambda fixture: [spec(name, family) for name, family in FAMILIES.items()])


@pytest.fixture(scope="module")
def launch(shared_job_2):
    """{run name: its folder} in the shared job."""
    return shared_run_dirs(shared_job_2, __name__, [*RUNS, *RESUMED, "mixtral_dp2_ep2"])


@pytest.fixture(scope="module")
def one_process(shared_job_2):
    """{family: step records} of the one-process references."""
    return {name: step_records(run_dir) for name, run_dir in shared_reference_dirs(shared_job_2, __name__,
                                                                                    FAMILIES).items()}


@pytest.fixture(scope="module")
def mixtral(shared_job_2):
    """(imported model folder, run config) of the Mixtral run."""
    return mixtral_paths(shared_job_2)


# ---------------------------------------------------------------------------------------------
# Layouts reproduce one process
# ---------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_family_layout_reproduces_one_process(launch, one_process, name):
    family = name.split("_")[0]
    reference, steps = one_process[family], step_records(launch[name])
    assert [r["step"] for r in steps] == [r["step"] for r in reference] == list(range(1, STEPS + 1)), name
    for key in STEP_KEYS[family]:
        np.testing.assert_allclose([r[key] for r in steps], [r[key] for r in reference], rtol=1e-4,
                                   err_msg=f"{name}: {key}")
    for a, b in zip(reference, steps):
        np.testing.assert_array_equal(b["expert_load"], a["expert_load"], err_msg=name)
    rows = 2 if family == "deepseek" else 1        # deepseek: MoE layer 1 and the MTP block
    assert np.asarray(reference[0]["expert_load"]).shape[0] == rows
    assert len({tuple(np.ravel(r["expert_load"])) for r in reference}) == STEPS   # routing changes every step


@pytest.mark.distributed
@pytest.mark.slow
def test_family_layouts_split_what_they_should(launch):
    """The ranks hold what each layout promises (the reproduction above could hide a run that did
    not split at all): MLA up-projections and MTP blocks halved on tp, latents whole with their
    gradient summed over tp; on pp the last stage holds the MTP block and its own embedding copy;
    on ep every MoE layer, the MTP block's included, holds half the experts."""
    def rank_info(name, rank):
        with open(os.path.join(launch[name], f"rank_{rank}.json")) as fh:
            return json.load(fh)

    tp = rank_info("deepseek_tp2", 1)
    for prefix in ("layers.1.", "mtp.0.block."):
        assert tp["shards"][prefix + "attention.wq_b.weight"][1:] == [0, 1, 2, "tp"]
        assert tp["shards"][prefix + "attention.wkv_b.weight"][1:] == [0, 1, 2, "tp"]
        assert tp["shards"][prefix + "attention.wo.weight"][1:] == [1, 1, 2, "tp"]
        for whole in ("wq_a", "q_norm", "wkv_a", "kv_norm"):
            assert tp["shards"][f"{prefix}attention.{whole}.weight"][1] is None
            assert f"{prefix}attention.{whole}.weight" in tp["summed_over_tp"]
    assert tp["shards"]["mtp.0.eh_proj.weight"][1] is None and "mtp.0.eh_proj.weight" not in tp["summed_over_tp"]
    qwen = rank_info("qwen3_tp2_sp", 0)
    assert {"layers.0.attention.q_norm.weight", "layers.1.attention.k_norm.weight"} <= set(qwen["summed_over_tp"])
    assert qwen["shapes"]["layers.1.attention.wq.weight"] == [2 * 16, 32]          # 2 of 4 heads of 16
    first, last = rank_info("deepseek_pp2", 0), rank_info("deepseek_pp2", 1)
    assert first["stage_layers"] == [0, 1] and last["stage_layers"] == [1, 2]
    assert "embed.weight" in first["shapes"] and "embed.weight" in last["shapes"]    # MTP reads the embedding
    assert not any(n.startswith("mtp.") for n in first["shapes"])
    assert "mtp.0.block.moe.router.weight" in last["shapes"]
    ep = rank_info("deepseek_dp2_ep2", 1)
    for prefix in ("layers.1.", "mtp.0.block."):
        assert ep["shards"][prefix + "moe.experts.w_up"][1:] == [0, 1, 2, "ep"]
        assert ep["shapes"][prefix + "moe.experts.w_up"][0] == 4
    assert ep["zero_level"] == 2
    qwen_ep = rank_info("qwen3_dp2_ep2", 0)
    assert qwen_ep["zero_level"] == 1 and qwen_ep["shapes"]["layers.1.moe.experts.w_up"][0] == 2   # 2 of 4
    resumed_ep = rank_info("deepseek_ep2_from_pp2", 1)
    assert resumed_ep["shards"]["mtp.0.block.moe.experts.w_up"][1:] == [0, 1, 2, "ep"]
    assert rank_info("qwen3_pp2_from_tp2", 1)["stage_layers"] == [1, 2]
    pp_params = [dict(np.load(os.path.join(launch["deepseek_pp2"], f"rank_{r}.npz"))) for r in (0, 1)]
    np.testing.assert_array_equal(pp_params[0]["embed.weight"], pp_params[1]["embed.weight"])   # one weight, two copies


# ---------------------------------------------------------------------------------------------
# Checkpoints: saved on one layout, resumed on another
# ---------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMED))
def test_family_checkpoint_resumes_on_another_layout(launch, one_process, name):
    """A step-2 checkpoint (DeepSeek's MTP weights and their optimizer state included) resliced for
    another layout continues as the one process does (step 3 within 1e-4, expert loads exactly), and
    as the run that saved it did."""
    saver, _ = RESUMED[name]
    family = name.split("_")[0]
    with open(os.path.join(checkpoint_dir(launch[saver]), "metadata.json")) as fh:
        tensors = json.load(fh)["tensors"]
    if family == "deepseek":
        parts = {tensors[key]["part"] for key in tensors if ".mtp.0.block.attention.wkv_b." in f".{key}"}
        assert parts == {"model", "optimizer"}, "the MTP block's weights or optimizer state are not in the checkpoint"
        pieces = tensors["mtp.0.block.attention.wq_b.weight"]["pieces"]
    else:
        pieces = tensors["layers.1.attention.wq.weight"]["pieces"]
    if "_tp2" in saver:
        assert sorted((p["slice_kind"], p["index"]) for p in pieces) == [("tp", 0), ("tp", 1)]
    else:
        assert {p["file"] for p in pieces} == {"model-rank00001.safetensors"}   # the last stage's
    resumed = step_records(launch[name])
    continued = step_records(launch[saver])[SAVED_AT:]
    reference = one_process[family][SAVED_AT:]
    assert [r["step"] for r in resumed] == [r["step"] for r in continued] == list(range(SAVED_AT + 1, STEPS + 1))
    for key in STEP_KEYS[family]:
        for other, what in ((reference, "one process"), (continued, saver)):
            np.testing.assert_allclose([r[key] for r in resumed], [r[key] for r in other], rtol=1e-4,
                                       err_msg=f"{name} against {what}: {key}")
    for a, b in zip(reference, resumed):
        np.testing.assert_array_equal(b["expert_load"], a["expert_load"])


# ---------------------------------------------------------------------------------------------
# checkpoint.load_path on dp2·ep2
# ---------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.slow
def test_imported_mixtral_continues_on_dp2_ep2(launch, mixtral):
    """The first step's loss is the imported model's loss on that step's micro-batches (one process,
    PyNative, no trainer), and every rank's weights, its half of the experts included, moved from
    the imported ones by AdamW's first step (about lr)."""
    import mindspore as ms

    from moetrain.checkpoint.model_dir import load_model, load_model_dir
    from moetrain.config import load_config
    from moetrain.data import build_datasets, build_sampler, fetch

    model_dir, mixtral_config = mixtral
    cfg = load_config(mixtral_config)
    train_set, _ = build_datasets(cfg)
    model, _ = load_model(str(model_dir))
    losses = [float(model(*(ms.Tensor(b) for b in fetch(train_set, [i])))[0])
              for i in build_sampler(cfg, train_set).global_batch(0)]
    first = step_records(launch["mixtral_dp2_ep2"])[0]
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    _, imported = load_model_dir(str(model_dir))
    for rank in (0, 1):
        trained = dict(np.load(os.path.join(launch["mixtral_dp2_ep2"], f"rank_{rank}.npz")))
        assert trained["layers.0.moe.experts.w_up"].shape[0] == 2       # 2 of 4 experts
        for name, start in (("layers.0.attention.wq.weight", None), ("layers.0.moe.experts.w_up", 2 * rank)):
            before = imported[name] if start is None else imported[name][start:start + 2]
            moved = np.abs(trained[name] - before)
            assert 0.5e-3 < moved.max() <= 1.01e-3, (rank, name)
