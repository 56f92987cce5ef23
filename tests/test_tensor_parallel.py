"""Tensor and sequence parallelism (moetrain/parallel/tensor_parallel.py, plans.py) and recompute.

Distributed (msrun on CPU): one 2-rank job checks the parallel layers against numpy (PyNative and
jit) and trains, with tp=2, the tiny GPT (tied embeddings, sequence parallel) and the tiny MoE GPT
(a dense then a MoE layer with a shared expert; without and with sequence parallel). Losses,
gradient norms, routing and balance terms must match a one-process run of the same config (1e-4
relative). Tensor parallelism combined with data, pipeline and expert parallelism, ZeRO and
recompute is tested in tests/test_parallel_3d.py.
Single process: plan slicing and marking on a 2-rank group that never communicates, the layout
checks, and recompute (same loss, stats and gradients over two jitted steps, each recomputed run
compiled in a fresh process; PyNative activation memory measured by benchmarks/measure_recompute.py).

The jobs compile the whole training step several times; on an idle 2-core machine they take a few
minutes, several times that when the machine is shared.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
from distributed import BesideProcess, run_workers  # noqa: E402
from tp_worker import VOCAB, layer_case  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = "tests/workers/tp_worker.py"
CONFIGS = {"gpt": "configs/gpt_tiny.yaml", "moe": "configs/moe_tiny.yaml"}
DATA = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
TINY = [f"data.path={DATA}_train", "data.eval_path=", f"data.tokenizer={DATA}.model",
        "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=128", "model.seq_length=32", "train.steps=5", "train.global_batch_size=4",
        "lr_schedule.warmup_steps=2", "checkpoint.save_at_end=false", "checkpoint.save_steps=0",
        "logging.tensorboard=false", "logging.progress_bar=false"]
# The shipped KJV shards use a 2048-token vocabulary, so the tiny models keep vocab_size 2048.
TINY_GPT = ["model.tie_embeddings=true"]
# Layer 0 dense (column/row-split MLP), layer 1 MoE. The sequence-level aux loss (per sequence) and
# the z-loss (per token) do not depend on the data-parallel split; the micro-batch Switch loss does.
TINY_MOE = ["model.first_k_dense=1", "model.moe.num_experts=4", "model.moe.ffn_hidden_size=64",
            "model.moe.num_shared_experts=1", "model.moe.aux_loss_coeff=0", "model.moe.seq_aux_loss_coeff=0.01",
            "model.moe.z_loss_coeff=0.001"]
TP2, SP = ["parallel.model_parallel=2"], ["parallel.model_parallel=2", "parallel.use_seq_parallel=true"]
TP2_RUNS = {   # name: (model, overrides); the trainer jits its step (PyNative is covered by the layer checks)
    "gpt_sp2": ("gpt", SP + ["parallel.recompute=selective"]),
    "moe_tp2": ("moe", TP2),
    "moe_sp2": ("moe", SP),
}
REL_TOL = 1e-4


def overrides(model):
    return TINY + (TINY_MOE if model == "moe" else TINY_GPT)


def run_spec(name, model, extra):
    return ["--run", f"{name}:{CONFIGS[model]}:" + ",".join(overrides(model) + extra)]


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def run_info(run_dir, rank):
    with open(os.path.join(run_dir, f"rank_{rank}.json")) as fh:
        return json.load(fh)


# ---------------------------------------------------------------------------------------------
# Jobs (module-scoped: each msrun launch runs once for all the tests that read it)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def references(request, tmp_path_factory):
    """One-process training of each tiny model (the reference every layout must reproduce), in one
    process started before the launch and running beside it; None when no selected test reads it."""
    if not any("one_process" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    beside = BesideProcess(str(tmp_path_factory.mktemp("one_process")),
                           [f"{model}:{config}:" + ",".join(overrides(model)) for model, config in CONFIGS.items()])
    yield beside
    beside.stop()


@pytest.fixture(scope="module")
def tp2_job(references):
    args = ["--tp", "2", "--layers"]
    for name, (model, extra) in TP2_RUNS.items():
        args += run_spec(name, model, extra)
    return run_workers(WORKER, 2, args, timeout=1500).check()


@pytest.fixture(scope="module")
def one_process(references, tp2_job):
    """{model: its one-process run's records}."""
    references.wait(timeout=900)
    return {model: metrics(os.path.join(references.out_dir, model)) for model in CONFIGS}


def assert_same_training(reference, parallel):
    steps = [r for r in reference if "loss" in r]
    got = [r for r in parallel if "loss" in r]
    assert len(got) == len(steps) == 5
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in steps], rtol=REL_TOL)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in steps], rtol=REL_TOL)
    if "expert_load" in steps[0]:   # MoE: the same routing and the same balance terms
        np.testing.assert_array_equal([r["expert_load"] for r in got], [r["expert_load"] for r in steps])
        for term in ("seq_aux_loss", "z_loss"):
            np.testing.assert_allclose([r[term] for r in got], [r[term] for r in steps], rtol=REL_TOL, err_msg=term)


# ---------------------------------------------------------------------------------------------
# Parallel layers vs numpy (float64)
# ---------------------------------------------------------------------------------------------
def numpy_reference():
    c = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in layer_case().items()}
    x, w_col, w_row, probe = c["x"], c["w_col"], c["w_row"], c["probe"]
    hidden = x @ w_col.T
    d_hidden = probe @ w_row
    d_emb = np.zeros_like(c["emb"])
    np.add.at(d_emb, c["ids"], probe)
    logits, labels = c["logits"].reshape(-1, VOCAB), c["labels"].reshape(-1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    rows = np.arange(labels.size)
    d_logits = probs.copy()
    d_logits[rows, labels] -= 1.0
    return {
        "col_out": hidden, "mlp_loss": ((hidden @ w_row.T) * probe).sum(), "dx": d_hidden @ w_col,
        "dw_col": np.einsum("bsf,bsh->fh", d_hidden, x), "dw_row": np.einsum("bsh,bsf->hf", probe, hidden),
        "emb_out": c["emb"][c["ids"]], "emb_loss": (c["emb"][c["ids"]] * probe).sum(), "dw_emb": d_emb,
        "ce_loss": -np.log(probs[rows, labels]).mean(), "dlogits": (d_logits / labels.size).reshape(c["logits"].shape),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["pynative", "jit"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_column_row_and_vocab_parallel_layers_match_numpy(tp2_job, mode, sequence_parallel):
    ranks = tp2_job.npz_results()
    ref = numpy_reference()
    tag = f"{mode}_{'sp' if sequence_parallel else 'tp'}"

    def joined(key, axis):
        return np.concatenate([r[f"{tag}_{key}"] for r in ranks], axis)

    def check(got, want, what):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * np.abs(want).max(), err_msg=f"{tag} {what}")

    # weights: column slices are rows of w_col, row slices columns of w_row, vocabulary slices rows
    check(joined("col_out", -1), ref["col_out"], "column-parallel output (features split)")
    check(joined("dw_col", 0), ref["dw_col"], "column-parallel weight gradient")
    check(joined("dw_row", 1), ref["dw_row"], "row-parallel weight gradient")
    check(joined("dw_emb", 0), ref["dw_emb"], "vocab-parallel embedding gradient")
    if sequence_parallel:   # activations and the loss probe are split along the sequence
        check(joined("dx", 1), ref["dx"], "input gradient")
        check(joined("emb_out", 1), ref["emb_out"], "embedding output")
        check(sum(r[f"{tag}_mlp_loss"] for r in ranks), ref["mlp_loss"], "loss (sum of chunks)")
        check(sum(r[f"{tag}_emb_loss"] for r in ranks), ref["emb_loss"], "embedding loss (sum of chunks)")
    else:                   # replicated over tp: every rank holds the whole value
        for r in ranks:
            check(r[f"{tag}_dx"], ref["dx"], "input gradient")
            check(r[f"{tag}_emb_out"], ref["emb_out"], "embedding output")
            check(r[f"{tag}_mlp_loss"], ref["mlp_loss"], "loss")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_vocab_parallel_cross_entropy_matches_numpy(tp2_job, mode):
    ranks = tp2_job.npz_results()
    ref = numpy_reference()
    for r in ranks:
        assert r[f"{mode}_dlogits"].shape[-1] == VOCAB // 2       # no rank sees the whole vocabulary
        np.testing.assert_allclose(r[f"{mode}_ce_loss"], ref["ce_loss"], rtol=1e-6)
    d_logits = np.concatenate([r[f"{mode}_dlogits"] for r in ranks], -1)
    np.testing.assert_allclose(d_logits, ref["dlogits"], rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# Training equals one process
# ---------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(TP2_RUNS))
def test_tp2_training_reproduces_one_process(tp2_job, one_process, name):
    model = TP2_RUNS[name][0]
    assert_same_training(one_process[model], metrics(os.path.join(tp2_job.out_dir, name)))


@pytest.mark.distributed
def test_trained_models_are_really_split(tp2_job):
    hidden, vocab, heads, kv_heads, head_dim = 64, 2048, 4, 2, 16
    for name, (model, extra) in TP2_RUNS.items():
        info = run_info(os.path.join(tp2_job.out_dir, name), rank=1)
        shapes = info["shapes"]
        assert shapes["embed.weight"] == [vocab // 2, hidden]
        assert ("lm_head.weight" not in shapes) if model == "gpt" else shapes["lm_head.weight"] == [vocab // 2, hidden]
        assert shapes["layers.0.attention.wq.weight"] == [heads * head_dim // 2, hidden]
        assert shapes["layers.1.attention.wk.weight"] == [kv_heads * head_dim // 2, hidden]
        assert shapes["layers.1.attention.wo.weight"] == [hidden, heads * head_dim // 2]
        assert shapes["layers.0.mlp.w_gate.weight"] == [64, hidden]
        assert shapes["layers.0.mlp.w_down.weight"] == [hidden, 64]
        if model == "moe":
            assert shapes["layers.1.moe.router.weight"] == [4, hidden]               # replicated
            assert shapes["layers.1.moe.experts.w_gate"] == [4, hidden, 64]           # replicated
            assert shapes["layers.1.moe.shared_experts.w_up.weight"] == [32, hidden]
            assert shapes["layers.1.moe.shared_experts.w_down.weight"] == [hidden, 32]
        norms = sorted(n for n in shapes if n.endswith("norm.weight"))
        assert sorted(info["summed_over_tp"]) == (norms if "parallel.use_seq_parallel=true" in extra else [])


# ---------------------------------------------------------------------------------------------
# Single process: slicing and marking, layout checks
# ---------------------------------------------------------------------------------------------
def tiny_model_config(name, **over):
    from moetrain.config import model_config_from_dict

    raw = dict(name=name, vocab_size=48, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
               ffn_hidden_size=24, seq_length=8)
    if name != "gpt":
        raw["moe"] = dict(num_experts=4, top_k=2, ffn_hidden_size=8, num_shared_experts=1)
    if name == "qwen3_moe":     # head_dim apart from hidden / heads, a dense layer 0
        raw.update(head_dim=8, mlp_only_layers=[0])
    if name == "deepseek_v3":   # MLA (every head its own K/V), a dense layer 0, one MTP depth
        del raw["num_kv_heads"]
        raw.update(q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                   first_k_dense=1, mtp_depth=1)
    raw.update(over)
    return model_config_from_dict(raw)


# Kept whole inside the attention's tensor-parallel region, feeding only this rank's heads: gradient
# summed over tp with or without sequence parallelism (plans.HeadShared).
HEAD_SHARED = ("attention.q_norm.weight", "attention.k_norm.weight", "attention.wq_a.weight",
               "attention.wkv_a.weight", "attention.kv_norm.weight")


@pytest.mark.parametrize("name", ["gpt", "moe_gpt", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_plan_keeps_this_ranks_slice_of_every_split_parameter(name, sequence_parallel):
    """Rank 1 of a 2-rank tp group (slicing needs no communication). DeepSeek-V3: the MLA
    up-projections (wq_b, wkv_b) and the MTP block's split like the layers'; with sequence
    parallelism (refused with MTP by moetrain.layout) the model is built without MTP."""
    import mindspore as ms

    from moetrain.parallel.plans import TP_PLANS
    from moetrain.distributed.sharding import shard_spec
    from moetrain.parallel.tensor_parallel import is_sequence_parallel, parallelize_module
    from moetrain.distributed.topology import Group
    from moetrain.registry import get_model

    ms.set_device("CPU")
    ms.set_seed(3)
    over = {"mtp_depth": 0} if name == "deepseek_v3" and sequence_parallel else {}
    model = get_model(name).cls(tiny_model_config(name, **over))
    before = {p.name: p.asnumpy().copy() for p in model.trainable_params()}
    parallelize_module(model, TP_PLANS[name], Group("tp", (0, 1), 1, "unused"), sequence_parallel)
    params = {p.name: p for p in model.trainable_params()}
    assert list(params) == list(before)                          # same parameters, same names
    if name == "deepseek_v3" and not sequence_parallel:
        assert "mtp.0.block.attention.wkv_b.weight" in params
    split_axis = {"embed.weight": 0, "lm_head.weight": 0}
    for p in params:
        if p.endswith(("wq.weight", "wk.weight", "wv.weight", "w_gate.weight", "w_up.weight", "wq_b.weight",
                       "wkv_b.weight")):
            split_axis[p] = 0
        elif p.endswith(("wo.weight", "w_down.weight")):
            split_axis[p] = 1
    for pname, param in params.items():
        spec = shard_spec(param)
        if pname in split_axis:
            assert (spec.axis, spec.index, spec.count, spec.group_kind) == (split_axis[pname], 1, 2, "tp"), pname
            assert spec.global_shape == before[pname].shape
            np.testing.assert_array_equal(param.asnumpy(), np.split(before[pname], 2, split_axis[pname])[1])
        else:                                                    # norms, router, routed experts: replicated
            assert spec.axis is None, pname
            np.testing.assert_array_equal(param.asnumpy(), before[pname])
        summed_over_tp = pname.endswith(HEAD_SHARED) or (sequence_parallel and pname.endswith("norm.weight"))
        assert is_sequence_parallel(param) == summed_over_tp, pname
    with pytest.raises(ValueError, match="only once"):
        parallelize_module(model, TP_PLANS[name], Group("tp", (0, 1), 1, "unused"), sequence_parallel)


def test_layout_checks_name_every_size_that_does_not_split():
    from moetrain.layout import Layout, ModelShape, layout_problems

    cfg = tiny_model_config("moe_gpt", vocab_size=50, num_heads=6, num_kv_heads=3, hidden_size=24, first_k_dense=1,
                            ffn_hidden_size=30)
    message = "\n".join(layout_problems(Layout(tp=4, sequence_parallel=True), ModelShape.of(cfg), seq_length=6))
    for expected in ("model.num_heads (6)", "model.num_kv_heads (3)", "model.vocab_size (50)",
                     "model.ffn_hidden_size (30)", "sequence length (6)", "choose model_parallel in [1, 2, 3, 6]"):
        assert expected in message
    assert layout_problems(Layout(tp=2, sequence_parallel=True), ModelShape.of(tiny_model_config("gpt")),
                           seq_length=8) == []
    mtp = ModelShape.of(tiny_model_config("deepseek_v3"))        # MTP reads positions SP does not hold
    assert layout_problems(Layout(tp=2), mtp, seq_length=8) == []
    (problem,) = layout_problems(Layout(tp=2, sequence_parallel=True), mtp, seq_length=8)
    assert "model.mtp_depth=1" in problem and "use_seq_parallel=false" in problem
    with pytest.raises(ValueError, match="is not divisible by tp=2"):   # sizes found only while slicing
        from moetrain.parallel.tensor_parallel import shard_parameter
        from moetrain.distributed.topology import Group
        from moetrain.layers import Linear

        shard_parameter(Linear(4, 5).weight, 0, Group("tp", (0, 1), 0, "unused"))


# ---------------------------------------------------------------------------------------------
# Recompute
# ---------------------------------------------------------------------------------------------
def loss_and_grads(name, policy, jit):
    """Two training-step calls (different batches) of the same function, as the trainer makes them:
    `value_and_grad(..., has_aux=True)` returning the model's stats. Returns [(loss, stats, grads)]."""
    import mindspore as ms

    from moetrain.parallel.plans import RECOMPUTE_PLANS, apply_recompute
    from moetrain.registry import get_model

    ms.set_device("CPU")
    ms.set_seed(0)
    model = get_model(name).cls(tiny_model_config(name, seq_length=16))
    if policy != "none":
        assert apply_recompute(model, RECOMPUTE_PLANS[name][policy]) > 0
    rng = np.random.default_rng(0)

    def loss_fn(input_ids, targets):
        return model(input_ids, targets)

    grad_fn = ms.value_and_grad(loss_fn, None, model.trainable_params(), has_aux=True)

    def grad_step(input_ids, targets):   # tuples out, as the runner's: a dict out of jit fails with reused blocks
        (loss, stats), grads = grad_fn(input_ids, targets)
        return loss, tuple(stats.keys()), tuple(stats.values()), grads

    step = ms.jit(grad_step) if jit else grad_step
    calls = []
    for _ in range(2):   # the second call must not see anything of the first (stale outputs)
        ids, labels = (ms.Tensor(rng.integers(0, 48, (2, 16)).astype(np.int32)) for _ in range(2))
        loss, keys, values, grads = step(ids, labels)
        stats = dict(zip(keys, values))
        calls.append((float(loss), {k: v.asnumpy() for k, v in stats.items()}, [g.asnumpy() for g in grads]))
    return calls


FRESH_PROCESS = """
import pickle, sys
sys.path.insert(0, "tests")
from test_tensor_parallel import loss_and_grads
with open(sys.argv[3], "wb") as fh:
    pickle.dump(loss_and_grads(sys.argv[1], sys.argv[2], True), fh)
"""


def jitted_loss_and_grads_in_fresh_process(name, policy, folder):
    """`loss_and_grads(name, policy, jit=True)` in a new process: a process that has compiled one
    model's step runs a later model's step with the first one's recompute marks (measured:
    docs/parallel_engine.md, "Recompute"), so in this one the recomputed runs would not recompute."""
    import pickle

    out = os.path.join(str(folder), f"{name}_{policy}.pkl")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, name, policy, out], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out, "rb") as fh:
        return pickle.load(fh)


@pytest.mark.parametrize("name", ["gpt", "moe_gpt"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "pynative"])
def test_recompute_leaves_loss_stats_and_gradients_unchanged(name, jit, tmp_path):
    """Loss, MoE stats (expert loads, aux and z losses) and gradients of two consecutive steps equal
    the run without recompute; MoE blocks are recomputed whole (their stats are outputs of the
    recomputed cell). Under jit each recomputed run compiles in a fresh process (see
    `jitted_loss_and_grads_in_fresh_process`). (DeepSeek-V3 and Qwen3-MoE with recompute against one
    process without it: the msrun runs of tests/test_families_parallel.py; measured bitwise equal
    here too, docs/parallel_engine.md.)"""
    reference = loss_and_grads(name, "none", jit)
    assert reference[0][0] != reference[1][0]
    if name != "gpt":
        assert not np.array_equal(reference[0][1]["expert_load"], reference[1][1]["expert_load"])
    for policy in ("selective", "full"):
        runs = (jitted_loss_and_grads_in_fresh_process(name, policy, tmp_path) if jit
                else loss_and_grads(name, policy, jit))
        for call, ((loss, stats, grads), (loss_rc, stats_rc, grads_rc)) in enumerate(zip(reference, runs)):
            where = f"{policy}, call {call + 1}"
            assert loss_rc == pytest.approx(loss, rel=1e-6, abs=0), where
            assert sorted(stats_rc) == sorted(stats), where
            for key, value in stats.items():
                np.testing.assert_allclose(stats_rc[key], value, rtol=1e-6, atol=0, err_msg=f"{where} {key}")
            for g, g_rc in zip(grads, grads_rc):
                np.testing.assert_allclose(g_rc, g, rtol=0, atol=1e-6 * max(1.0, np.abs(g).max()), err_msg=where)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("policy", ["selective", "full"])
def test_family_recompute_plans_name_their_cells(name, policy):
    """Every pattern of the family's recompute policies names cells of the model (DeepSeek-V3's MTP
    block included), and applying the policy marks cells there (no compile: cells are only marked)."""
    import mindspore as ms

    from moetrain.parallel.plans import RECOMPUTE_PLANS, apply_recompute
    from moetrain.parallel.tensor_parallel import modules_matching
    from moetrain.registry import get_model

    ms.set_device("CPU")
    model = get_model(name).cls(tiny_model_config(name))
    for pattern in RECOMPUTE_PLANS[name][policy]:   # the fused attention kernel is one cell shared by every
        # layer, so it is listed once (under layers.0): a later `attention.core` pattern may find none
        assert any(modules_matching(model, pattern)) or pattern.endswith("attention.core"), pattern
    assert apply_recompute(model, RECOMPUTE_PLANS[name][policy]) > 0
    marked = {path.split(".")[0] for path, cell in model.cells_and_names() if getattr(cell, "_has_config_recompute", 0)}
    assert marked == ({"layers", "mtp"} if name == "deepseek_v3" else {"layers"}), marked


def test_recompute_lowers_activation_memory_in_pynative():
    """benchmarks/measure_recompute.py: peak RSS rise over one PyNative training step, a fresh process per
    policy. (Under ms.jit, where the trainer runs, the memory pool's peak: tests/test_dryrun.py,
    test_recompute_lowers_the_jitted_activation_peak; docs/parallel_engine.md.) The MoE model: its selective policy also
    recomputes the routed experts, a clear saving (measured 238 / 185 / 163 MB for none / selective /
    full), whereas the dense GPT's selective policy (the attention core) saves little when the fused
    attention kernel already recomputes its probabilities in the backward (187 vs 185 MB)."""
    batch = 12
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "measure_recompute.py"), "--json", "--model", "moe_gpt",
           "--modes", "pynative", "--batch", str(batch)]
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout)
    peak = {policy: result[f"pynative/{policy}"]["step_peak_mb"][str(batch)] for policy in ("none", "selective", "full")}
    assert peak["full"] < peak["selective"] < peak["none"], peak
    for policy in ("selective", "full"):
        assert result[f"pynative/{policy}"]["max_grad_diff"] <= 1e-6
