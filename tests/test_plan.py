"""`moetrain plan`: parameter counts against built models, memory / FLOPs / communication against
hand arithmetic, layout validation, the layout search, the 910B production config and the CLI."""
import dataclasses
import os

import pytest

from moetrain.devices import GiB, DeviceProfile, get_device
from moetrain.layout import Layout, LayoutError
from moetrain.planner import (DISPATCH_ROW_MARGIN, THROUGHPUT_TIE, Job, apply_layout, choose_layout, count_parameters,
                              explain_cannot_run_here, flops_per_token, format_plan, load_plan_config, main,
                              parameter_counts, plan, plan_layout, plan_problems)
from moetrain.planner.costs import dispatch_rows
from moetrain.planner.search import _tie_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
MOE_1B = os.path.join(CONFIGS, "moe_1b.yaml")

# A device whose only job is to make memory arithmetic exact: no runtime reserve, no emulation.
EXACT = DeviceProfile(name="exact", description="test device", memory_bytes=1024 * GiB,
                      peak_flops={"float32": 1e12, "bfloat16": 1e12}, compute_efficiency=1.0,
                      intra_node_bandwidth=1e10, inter_node_bandwidth=1e9, devices_per_node=8, runtime_bytes=0)


def tiny_gpt(**over):
    from moetrain.models.gpt import GPTConfig

    kw = dict(vocab_size=32, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, ffn_hidden_size=16,
              seq_length=4)
    kw.update(over)
    return GPTConfig(**kw)


def tiny_moe(moe=None, **over):
    from moetrain.models.moe_gpt import MoEGPTConfig
    from moetrain.moe.config import MoEConfig

    moe_kw = dict(num_experts=8, top_k=2, ffn_hidden_size=16)
    moe_kw.update(moe or {})
    kw = dict(vocab_size=64, hidden_size=16, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=32,
              seq_length=16, moe=MoEConfig(**moe_kw))
    kw.update(over)
    return MoEGPTConfig(**kw)


def tiny_moe_cfg(world=8, **train):
    """A full Config of a tiny MoE (as `moetrain plan` would load it)."""
    from moetrain.config import config_from_dict

    raw = {"model": {"name": "moe_gpt", "vocab_size": 256, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                     "num_kv_heads": 2, "ffn_hidden_size": 64, "seq_length": 32,
                     "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 32}},
           "train": {"steps": 1, "global_batch_size": 16, **train},
           "parallel": {"data_parallel": world}}
    return config_from_dict(raw, source="tiny_moe")


def built_counts(model_cfg):
    import mindspore as ms

    from moetrain.registry import get_model

    ms.set_context(device_target="CPU")
    model = get_model(model_cfg.name).cls(model_cfg)
    return (sum(p.size for p in model.get_parameters()), sum(p.size for p in model.trainable_params()))


# ------------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("model_cfg", [
    tiny_gpt(), tiny_gpt(tie_embeddings=True, num_kv_heads=2, head_dim=6),
    tiny_moe(), tiny_moe({"num_shared_experts": 2, "top_k": 3}, first_k_dense=1, moe_layer_freq=2, num_layers=5),
    tiny_moe({"num_shared_experts": 1, "shared_ffn_hidden_size": 24}, tie_embeddings=True),
], ids=["gpt", "gpt_tied_headdim", "moe", "moe_dense_first_shared", "moe_tied_shared_width"])
def test_parameter_count_equals_built_model(model_cfg):
    counts = parameter_counts(model_cfg)
    total, trainable = built_counts(model_cfg)
    assert count_parameters(model_cfg)[0] == counts.total == total
    assert counts.trainable == trainable              # the difference is the frozen expert_bias


@pytest.mark.parametrize("name", ["gpt_tiny.yaml", "moe_tiny.yaml", "moe_tiny_8p.yaml"])
def test_parameter_count_of_shipped_tiny_configs(name):
    path = os.path.join(CONFIGS, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is not in this checkout")
    cfg = load_plan_config(path)
    assert count_parameters(cfg.model)[0] == built_counts(cfg.model)[0]


def test_active_parameters_and_flops_by_hand():
    cfg = tiny_moe({"num_shared_experts": 1}, first_k_dense=1)        # layer 0 dense, 1-3 MoE
    h, E, k, F, Fs, V, L, S = 16, 8, 2, 16, 16, 64, 4, 16
    attention = h * 4 * 4 + 2 * h * 2 * 4 + 4 * 4 * h                # wq, wk+wv (2 kv heads of 4), wo
    dense_layer = attention + 2 * h + 3 * h * 32
    moe_layer_active = attention + 2 * h + E * h + k * 3 * h * F + 3 * h * Fs + E
    active = V * h * 2 + h + dense_layer + 3 * moe_layer_active
    total = active + 3 * (E - k) * 3 * h * F
    assert count_parameters(cfg) == (total, active)
    matmul = V * h + attention * L + 3 * h * 32 + 3 * (E * h + k * 3 * h * F + 3 * h * Fs)
    assert flops_per_token(cfg, S) == 6 * matmul + 12 * L * h * S


# ------------------------------------------------------------------------------- memory, comm
def hand_job(global_batch=4):
    return Job(model=tiny_gpt(), seq_length=4, global_batch_size=global_batch)


def test_memory_and_comm_of_a_small_layout_by_hand():
    # tiny_gpt: embed 256, layer = attention 192 (wq 64, wk 32, wv 32, wo 64) + norms 16 + mlp 384 = 592,
    # final norm 8, head 256 -> 1704 parameters, fp32 everywhere, AdamW.
    assert count_parameters(tiny_gpt())[0] == 1704
    r = plan_layout(hand_job(), Layout(dp=2, micro_batch_size=1, num_micro_batches=2, zero=1), EXACT)
    assert r.memory["weights"] == 1704 * 4
    assert r.memory["gradients"] == 1704 * 4
    assert r.memory["optimizer"] == 1704 * 12 / 2                   # fp32 master + m + v, ZeRO-1 over dp = 2
    # One layer, 4 tokens, hidden 8: norm inputs + matmul inputs 2 x (4 + 4) x 4 x 8 = 512,
    # Q K V O 4 x 4 x 4 x (2 + 1 + 1 + 2) = 384, probs 4 B x 2 heads x 4 x 4 = 128, MLP 4 x 4 x 4 x 16 = 1024.
    layer = 512 + 384 + 128 + 1024
    logits = 2 * 4 * 4 * 32 + (4 + 4) * 4 * 8                      # fp32 logits + CE grad, final norm/head inputs
    logits += 4 * 32 * 8                                           # + the head weight's fp32 gradient (once)
    by_mode = r.stages[0].activations_by_recompute
    assert by_mode["none"] == 2 * layer + logits
    # ... but this model's peak is the backward's end: every parameter's fp32 gradient live while
    # its packed copy is filled (1704 x 4 each), the per-parameter ones shown apart
    assert r.memory["activations"] == 2 * 1704 * 4 and r.stages[0].unpacked_gradients == 1704 * 4
    assert by_mode["selective"] == 2 * (layer - 128) + logits
    assert by_mode["full"] == 2 * 4 * 4 * 8 + layer + logits       # layer inputs + one layer recomputed
    assert r.comm_bytes["dp"] == (2 - 1) / 2 * 1704 * (4 + 4)      # reduce-scatter grads + all-gather fp32 masters
    assert r.model_flops_per_token == 6 * (2 * (192 + 384) + 256) + 12 * 2 * 8 * 4
    # ZeRO-0 all-reduces the same bytes: 2 (dp - 1) / dp x grads
    assert plan_layout(hand_job(), Layout(dp=2, micro_batch_size=1, num_micro_batches=2), EXACT
                       ).comm_bytes["dp"] == 1704 * 4


def test_pipeline_stages_by_hand():
    # pp = 2, 2 micro-batches, 1F1B: stage 0 (embed + layer 0, 848 parameters) runs F0 F1 B0 B1,
    # stage 1 (layer 1 + final norm + head, 856) F0 B0 F1 B1. The pipeline keeps each in-flight
    # micro-batch's chunk input (int32 token ids on stage 0, the fp32 [4, 8] hidden state on stage 1),
    # every hidden state or gradient received and not yet used, and recomputes the chunk in its
    # backward; a backward (stage 1: its forward) holds the chunk's activations, or at its end the
    # per-parameter gradients and their packed copy (2 G), on top of the running sum G from the
    # previous micro-batch. `activations` is the peak less the gradient buffers G.
    r = plan_layout(hand_job(global_batch=2), Layout(pp=2, micro_batch_size=1, num_micro_batches=2), EXACT)
    layer, logits = 2048, 1280
    ids, hidden = 4 * 4, 4 * 4 * 8
    g0, g1 = (256 + 592) * 4, (592 + 8 + 256) * 4
    s0, s1 = r.stages
    assert max(layer, layer + logits) < 2 * min(g0, g1)          # the gradients make the peak here
    # stage 0 at B1: micro-batch 1's ids and received gradient, the sum G, then 2 G
    assert s0.activations_by_recompute["none"] == ids + hidden + g0 + 2 * g0 - g0
    # stage 1 at F1 (micro-batch 0's input gradient left with the exchange that brought micro-batch
    # 1's input): that input, the sum G, then 2 G
    assert s1.activations_by_recompute["none"] == hidden + g1 + 2 * g1 - g1
    assert s0.memory["weights"] == g0 and s1.memory["weights"] == g1
    assert s0.total_memory == g0 * 4 + s0.memory["activations"]  # fp32 weights, grads, m + v: 16 B a parameter
    assert r.peak_stage == 1
    assert s0.comm_bytes["pp"] == 2 * 4 * 4 * 8                     # one fp32 [4, 8] send per micro-batch
    # GPipe: stage 1 runs F0 F1 B0 B1: at F1 it also holds micro-batch 0's input and input gradient
    gpipe = plan_layout(hand_job(global_batch=2), Layout(pp=2, micro_batch_size=1, num_micro_batches=2,
                                                         schedule="gpipe"), EXACT)
    assert gpipe.stages[1].activations_by_recompute["none"] == 3 * hidden + g1 + 2 * g1 - g1
    # 8 sequences a micro-batch: one micro-batch's activations make the peak (stage 0 at B1: + the
    # ids and received gradient of micro-batch 1, the sum G)
    big = plan_layout(hand_job(global_batch=16), Layout(pp=2, micro_batch_size=8, num_micro_batches=2), EXACT)
    assert 8 * layer > 2 * g0
    assert big.stages[0].activations_by_recompute["none"] == 8 * layer + 8 * ids + 8 * hidden + g0 - g0


def test_pipeline_pass_costs_and_step_by_hand():
    """The split backward's cost on this runtime, and each schedule's step from its own lists, by
    hand for tiny_gpt with 4 layers at pp 2, 2 micro-batches of 4 tokens, on a device of 1 TFLOP/s
    with free links. FLOPs per token and layer: matmuls of 576 parameters, 1152 forward, as much
    for the input gradient and for the weight gradient; attention core 128 forward, 256 backward;
    the head (256 parameters) 512 forward, 1536 in all. F = 1280. A chunk's backward recomputes
    its forward: 1280 + 1152 + 1152 + 256 = 3840, a chunk 5120 a layer; the last virtual stage
    takes its gradients in its forward without the recompute: 3840 a layer. Split (ZB) on a middle
    chunk: B (a forward and an input gradient, booked as two forwards: 2560) and W (a forward and
    both gradients) each recompute: 7808 a layer instead of 5120, W = 7808 - 1280 - 2560 = 3968.
    The first virtual stage's B is empty (token ids), its W the whole backward."""
    device = dataclasses.replace(EXACT, p2p_latency=0.0, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30)
    job = Job(model=tiny_gpt(num_layers=4), seq_length=4, global_batch_size=2)
    unit = 4 / 1e12                     # seconds a FLOP-per-token costs for 4 tokens
    result = {kind: plan_layout(job, Layout(pp=2, micro_batch_size=1, num_micro_batches=2, schedule=kind), device)
              for kind in ("1f1b", "zero_bubble_h1", "zero_bubble_v")}

    def costs(kind):
        return [[tuple(round(x / unit) for x in chunk) for chunk in st.pass_costs] for st in result[kind].stages]
    assert costs("1f1b") == [[(2560, 7680, 0)], [(9216, 0, 0)]]            # layers 0-1 | 2-3 + head
    assert costs("zero_bubble_h1") == [[(2560, 0, 7680)], [(9216, 0, 0)]]
    assert costs("zero_bubble_v") == [[(1280, 0, 3840), (5376, 0, 0)],      # layer 0 | layer 3 + head
                                      [(1280, 2560, 3968), (1280, 2560, 3968)]]   # layers 1 | 2
    # 1F1B: F0 0-2560, F1 -5120 | stage 1 F0 2560-11776, F1 11776-20992 | B0 11776-19456, B1 20992-28672
    # ZB-H1 at pp 2 has no middle stage: the same passes, the same times (W in B's place)
    for kind in ("1f1b", "zero_bubble_h1"):
        assert result[kind].step_seconds == pytest.approx(28672 * unit)
        assert result[kind].bubble_fraction == pytest.approx(1 - 20480 / 28672)
    # ZB-V: stage 1 runs F 1280, B 2560, W 3968 for 2 chunks x 2 micro-batches (31232 busy); its four
    # W run last, from 19712 (after B1 of both chunks, which waits on stage 0's head at 14592)
    assert result["zero_bubble_v"].step_seconds == pytest.approx((19712 + 4 * 3968) * unit)
    assert result["zero_bubble_v"].bubble_fraction == pytest.approx(1 - 31232 / 35584)


def test_zero_and_recompute_shrink_memory():
    job = Job(model=tiny_moe(), seq_length=16, global_batch_size=16, compute_dtype="bfloat16")
    base = dict(dp=8, ep=2, micro_batch_size=2, num_micro_batches=1)
    z0, z1, z2 = (plan_layout(job, Layout(zero=z, **base), "ascend910b") for z in (0, 1, 2))
    # Dense states shard over dp = 8, expert states over the expert-data-parallel group dp / ep = 4.
    stage = z0.stages[0]
    expert = 3 * 16 * 16 * 8 / 2 * 4                               # 4 MoE layers of 4 local experts
    dense = stage.params - expert - 4 * 8                           # expert_bias is frozen
    assert z0.memory["weights"] == (dense + expert) * 4 + 4 * 8 * 4 # fp32 parameters (cast to bf16 per matmul)
    assert z0.memory["optimizer"] == (dense + expert) * 8           # fp32 m + v; no master without ZeRO
    assert z1.memory["optimizer"] == pytest.approx(dense * 12 / 8 + expert * 12 / 4)   # + this rank's fp32 master
    assert z1.memory["gradients"] == z0.memory["gradients"]
    assert z2.memory["gradients"] == pytest.approx(dense * 4 / 8 + expert * 4 / 4)
    # Without experts the ZeRO-1 optimizer is 1/dp of ZeRO-0's moments plus the masters.
    dense_job = Job(model=tiny_gpt(), seq_length=4, global_batch_size=8)
    o0, o1 = (plan_layout(dense_job, Layout(dp=8, zero=z), EXACT).memory["optimizer"] for z in (0, 1))
    assert o1 == o0 * 12 / 8 / 8                                   # ZeRO adds the fp32 master rows
    acts = [plan_layout(job, Layout(recompute=m, **base), "ascend910b").memory["activations"]
            for m in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]


def test_sequence_and_tensor_parallel_split_activations():
    job = Job(model=tiny_moe(), seq_length=16, global_batch_size=4)
    one = plan_layout(job, Layout(dp=1, micro_batch_size=4), EXACT).memory["activations"]
    tp = plan_layout(job, Layout(dp=1, tp=2, micro_batch_size=4), EXACT)
    sp = plan_layout(job, Layout(dp=1, tp=2, micro_batch_size=4, sequence_parallel=True), EXACT)
    assert one > tp.memory["activations"] > sp.memory["activations"] > one / 2 - 1
    assert tp.comm_bytes["tp"] > 0 and tp.comm_bytes["sp"] == 0 and sp.comm_bytes["sp"] > 0


def test_expert_all_to_all_volume():
    job = Job(model=tiny_moe(), seq_length=16, global_batch_size=16)
    r = plan_layout(job, Layout(dp=4, ep=4, micro_batch_size=2, num_micro_batches=2), EXACT)
    tokens = 2 * 16
    # dispatch + combine, forward and backward, 4 MoE layers, 2 micro-batches, fp32
    # rows: top_k per token, load-proportional (DISPATCH_ROW_MARGIN for the dispatcher's buckets)
    assert r.comm_bytes["ep"] == pytest.approx(2 * 4 * 4 * (4 - 1) / 4 * tokens * 2 * DISPATCH_ROW_MARGIN * 16 * 4)
    emulated = plan_layout(job, Layout(dp=4, ep=4, micro_batch_size=2, num_micro_batches=2), "cpu")
    assert emulated.comm_bytes["ep"] == r.comm_bytes["ep"] * 2 * 4   # all-to-all as an all-reduce on CPU


# ------------------------------------------------------------------------------- validation
def test_validation_messages():
    job = Job(model=tiny_moe({"num_experts": 6}), seq_length=16, global_batch_size=16)
    problems = plan_problems(job, Layout(dp=2, tp=8, pp=3, ep=4, etp=2, micro_batch_size=3, num_micro_batches=2),
                             world_size=32)
    text = "\n".join(problems)
    assert "= 48 processes, but 32 were launched" in text
    assert ("parallel.expert_parallel (4) must divide data_parallel (2) x model_parallel (8) / "
            "expert_tensor_parallel (2) = 8") not in text          # ep may span tp ranks (MoE folding)
    assert "model.moe.num_experts (6) is not divisible by parallel.expert_parallel (4)" in text
    assert "model.num_heads (4) is not divisible by parallel.model_parallel (8)" in text
    assert "model.num_kv_heads (2) is not divisible by parallel.model_parallel (8)" in text
    assert "model.num_layers=4 cannot be split evenly into parallel.pipeline_stage=3 stages" in text
    assert "2 micro-batch(es) per step cannot keep 3 pipeline stages busy" in text
    assert "train.global_batch_size (16) != data_parallel (2) x micro-batch size (3) x micro-batches (2)" in text
    with pytest.raises(LayoutError, match="use_seq_parallel needs model_parallel > 1"):
        plan_layout(job, Layout(dp=16, sequence_parallel=True), EXACT)
    dense = Job(model=tiny_gpt(), seq_length=4, global_batch_size=4)
    assert plan_problems(dense, Layout(dp=4, ep=2)) == [
        "parallel.expert_parallel (2) > 1 needs a MoE model; set it to 1"]


def test_plan_of_config_checks_world_size():
    cfg = tiny_moe_cfg(world=8)
    with pytest.raises(LayoutError, match=r"= 8 processes, but 16 were launched: set parallel.data_parallel=16"):
        plan(cfg, world_size=16)
    assert plan(cfg).layout.world == 8


# ------------------------------------------------------------------------------- search
def test_choose_layout_tiny_moe_world_8():
    cfg = tiny_moe_cfg()
    settings, search = choose_layout(cfg, 8, device="cpu")
    chosen = search.chosen
    assert chosen.fits and plan_problems(Job.of(cfg), chosen.layout, 8) == []
    assert settings["data_parallel"] * settings["model_parallel"] * settings["pipeline_stage"] == 8
    assert settings == chosen.layout.parallel_settings() and settings["mode"] == "manual"
    invalid = search.with_status("invalid")
    assert invalid and all(c.problems for c in invalid)
    assert any("model.num_kv_heads (2) is not divisible by parallel.model_parallel (4)" in c.reason for c in invalid)
    slower = search.with_status("slower")
    best = max(c.result.tokens_per_second for c in slower + search.with_status("chosen"))
    assert slower and chosen.tokens_per_second >= best * (1 - THROUGHPUT_TIE)
    for c in slower:     # slower, or as fast but with more communication / a more complex layout
        assert (c.result.tokens_per_second < best * (1 - THROUGHPUT_TIE)) or _tie_key(c.result) > _tie_key(chosen)
    text = str(search)
    assert "chosen" in text and "invalid:" in text and "slower:" in text
    # The config, set to the chosen layout, plans to the same numbers.
    assert plan(apply_layout(cfg, chosen.layout), device="cpu").step_seconds == pytest.approx(chosen.step_seconds)


def test_memory_forces_sharding():
    # Big vocabulary, short sequences: model states dominate, so only sharding makes it fit.
    cfg = tiny_moe_cfg(global_batch_size=8)
    cfg.model.vocab_size = 65536
    roomy = dataclasses.replace(EXACT, memory_bytes=64 * GiB)
    _, free = choose_layout(cfg, 8, device=roomy)
    assert free.chosen.layout.zero == 0 and free.chosen.layout.recompute == "none"
    replicated = plan_layout(Job.of(cfg), Layout(dp=8, micro_batch_size=1), roomy).total_memory
    tight = dataclasses.replace(EXACT, memory_bytes=replicated * 0.6 / 0.9)
    _, search = choose_layout(cfg, 8, device=tight)
    L = search.chosen.layout
    assert search.chosen.fits and (L.zero >= 1 or L.tp * L.pp * L.ep > 1)
    unfit = search.with_status("does not fit")
    plain = [c for c in unfit if (c.layout.zero, c.layout.tp, c.layout.pp, c.layout.ep, c.layout.cp) == (0, 1, 1, 1, 1)]
    assert len(plain) == 3               # the replicated layout (1 sequence per rank) in every recompute mode
    assert all("GiB >" in c.reason and "GiB usable" in c.reason for c in plain)
    with pytest.raises(LayoutError, match="fits in memory"):
        choose_layout(cfg, 8, device=dataclasses.replace(EXACT, memory_bytes=1e6))


# ------------------------------------------------------------------------------- production config
def test_moe_1b_fits_one_910b_node():
    cfg = load_plan_config(MOE_1B)
    r = plan(cfg)
    assert r.device.name == "ascend910b" and r.layout.world == 8
    assert 0.9e9 <= r.params.total <= 1.2e9 and r.params.active < 0.4 * r.params.total
    assert (r.layout.ep, r.layout.zero, r.layout.recompute, cfg.precision.compute_dtype) == (8, 1, "selective",
                                                                                           "bfloat16")
    assert r.fits and r.total_memory < 64 * GiB
    # Selective recompute drops exactly the bf16 attention probabilities (16 layers x 16 heads x S^2 x
    # 4 seqs) and, as moe_gpt's plan recomputes the routed experts, their SwiGLU intermediates (gate,
    # up, silu(gate), product: 4 x bf16 x expert_ffn 1152 per dispatched row) in the 15 MoE layers.
    by_mode = r.stages[0].activations_by_recompute
    rows = dispatch_rows(r.job.arch, 4 * 4096, r.layout, r.job, "ascend910b")
    assert by_mode["none"] - by_mode["selective"] == 16 * 2 * 16 * 4096 ** 2 * 4 + 15 * 4 * 2 * rows * 1152
    table = format_plan(r)
    for text in ("FITS", "ep all-to-all", "MFU", "1,018,", "ZeRO-1"):
        assert text in table


def test_moe_1b_32p_plans_on_four_nodes():
    path = os.path.join(CONFIGS, "moe_1b_32p.yaml")
    r = plan(load_plan_config(path))
    assert r.layout.world == 32 and r.fits
    assert r.comm_seconds["dp"] > 0 and "inter-node" in format_plan(r)


def test_explain_cannot_run_here(monkeypatch):
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    message = explain_cannot_run_here(load_plan_config(MOE_1B))
    assert "train.device: ascend" in message and "configs/moe_tiny_8p.yaml" in message and "FITS" in message
    monkeypatch.setenv("ASCEND_HOME_PATH", "/usr/local/Ascend")
    assert explain_cannot_run_here(load_plan_config(MOE_1B)) is None
    assert explain_cannot_run_here(tiny_moe_cfg()) is None                # cpu


def test_cli(capsys):
    assert main([MOE_1B]) == 0
    out = capsys.readouterr().out
    assert "8 x ascend910b" in out and "FITS" in out
    assert main([MOE_1B, "--set", "train.micro_batch_size=16", "--set", "parallel.recompute=none"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main([MOE_1B, "--world", "16"]) == 2
    assert "set parallel.data_parallel=16" in capsys.readouterr().err
    # the CLI's search path (the search itself: tests/test_plan_published.py, test_auto_mode_*); with
    # recompute, micro-batching, schedule and cp held it plans 258 layouts in ~2 s instead of ~25 s
    assert main([MOE_1B, "--device", "gpu_h100", "--search", "--world", "8",
                 "--keep", "recompute,micro,schedule,cp"]) in (0, 1)
    out = capsys.readouterr().out
    assert "layout search" in out and "8 x gpu_h100" in out
    # --search's default world counts every layout dimension, cp included
    assert main(["configs/moe_tiny.yaml", "--set", "parallel.context_parallel=2", "--set", "parallel.data_parallel=2",
                 "--search", "--keep", "tp,pp,ep,zero,recompute,micro,sp,schedule"]) == 0
    assert "candidates on 4 x cpu" in capsys.readouterr().out
    with pytest.raises(ValueError, match="did you mean 'gpu_h100'"):
        get_device("gpu_h10")


def test_run_8p_on_moe_1b_stops_before_workers_on_a_machine_without_ascend():
    """The production command prints the plan and the CPU alternative instead of starting msrun."""
    import os
    import subprocess

    from moetrain.planner import device_available

    if device_available("ascend"):
        pytest.skip("this machine has Ascend: the production command would really start")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(["bash", "run_scripts/run_8p.sh", "configs/moe_1b.yaml"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3
    assert "FITS" in proc.stderr and "8 x ascend910b" in proc.stderr
    assert "configs/moe_tiny_8p.yaml" in proc.stderr
    assert "run_distributed.sh:" not in proc.stderr      # the launcher's "N ranks ... logs in" line never came


# ------------------------------------------------------------------------------- parallel.mode: auto
@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["gpt_tiny", "moe_tiny"])
def test_auto_mode_picks_a_layout_that_validates_and_fits(name, world):
    from moetrain.config import load_config
    from moetrain.layout import check_layout
    from moetrain.trainer import resolve_auto_layout

    cfg = load_config(os.path.join(CONFIGS, f"{name}.yaml"), ["parallel.mode=auto"])
    chosen, search = resolve_auto_layout(cfg, world)
    layout = Layout.of(chosen)
    assert chosen.parallel.mode == "manual" and layout == search.chosen.layout and layout.world == world
    assert plan_problems(Job.of(chosen), layout, world) == []
    check_layout(layout, world=world)
    result = plan(chosen, world_size=world)
    assert result.fits and result.step_seconds == pytest.approx(search.chosen.step_seconds)
    assert chosen.dp * chosen.micro_batch_size * chosen.num_micro_batches == cfg.train.global_batch_size
    assert cfg.parallel.mode == "auto"                         # the loaded config is left as it was


def test_auto_mode_trains_with_the_chosen_layout(tmp_path):
    import json

    from moetrain.config import load_config
    from moetrain.trainer import Trainer

    out = tmp_path / "run"
    cfg = load_config(os.path.join(CONFIGS, "moe_tiny.yaml"),
                      ["parallel.mode=auto", "train.steps=2", f"train.output_dir={out}", "train.eval_interval=0",
                       "data.eval_path=", "checkpoint.save_at_end=false", "logging.tensorboard=false",
                       "logging.progress_bar=false", "model.num_layers=2", "model.seq_length=32"])
    trainer = Trainer(cfg)
    assert trainer.cfg.parallel.mode == "manual" and trainer.layout_search is not None
    trainer.fit()
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    resolved = (out / "resolved_config.yaml").read_text()
    assert "mode: manual" in resolved                          # a resume runs the chosen layout as is
    assert "chosen" in (out / "layout_search.txt").read_text()


def test_auto_mode_on_a_model_the_planner_does_not_model_runs_data_parallel(capsys):
    from moetrain.config import load_config
    from moetrain.trainer import resolve_auto_layout

    cfg = load_config(os.path.join(CONFIGS, "mnist_mlp.yaml"), ["parallel.mode=auto"])
    chosen, search = resolve_auto_layout(cfg, 4)
    assert search is None and chosen.parallel.mode == "manual" and chosen.dp == 4
    assert chosen.dp * chosen.micro_batch_size * chosen.num_micro_batches == cfg.train.global_batch_size
    assert "running data parallel over 4 rank(s)" in capsys.readouterr().out


def _held_by_rank(model_cfg, layout, rank=0):
    """Parameters rank `rank` of `layout` holds once the model is sliced as training slices it
    (tensor-parallel plan, then experts over ep and etp), counted on the built cells."""
    import mindspore as ms

    from moetrain.config import ParallelConfig
    from moetrain.distributed.topology import ParallelContext
    from moetrain.parallel.expert_parallel import parallelize_moe
    from moetrain.parallel.plans import TP_PLANS
    from moetrain.parallel.tensor_parallel import parallelize_module
    from moetrain.registry import get_model

    ms.set_context(device_target="CPU")
    pctx = ParallelContext.build(layout.world, rank, layout.dp, layout.tp, layout.pp, layout.ep, layout.etp)
    model = get_model(model_cfg.name).cls(model_cfg)
    parallelize_module(model, TP_PLANS[model_cfg.name], pctx.group("tp"))
    parallelize_moe(model, ParallelConfig(), pctx)
    return sum(p.size for p in model.get_parameters())


@pytest.mark.parametrize("folded", [Layout(dp=2, tp=2, ep=2, etp=2), Layout(dp=2, tp=2, etp=2), Layout(tp=2, ep=2),
                                    Layout(dp=2, tp=2, ep=4)], ids=lambda L: L.describe().split(" zero")[0])
def test_expert_parameters_per_rank_with_etp_and_ep_over_tp_match_the_sliced_model(folded):
    """The planner's parameters per device on folded layouts (experts E/ep x F/etp) minus those of the
    same tp x dp without expert parallelism equal the same difference counted on the sliced cells."""
    cfg = tiny_moe()
    job = Job(model=cfg, seq_length=16, global_batch_size=folded.dp)
    plain = Layout(dp=folded.dp, tp=folded.tp)
    planned = [plan_layout(job, L, EXACT).stages[0].params for L in (folded, plain)]
    held = [_held_by_rank(cfg, L) for L in (folded, plain)]
    assert planned[0] - planned[1] == held[0] - held[1] < 0
    experts = 3 * 16 * 16 * 8 * 4                                  # 4 MoE layers of 8 experts, h = F = 16
    assert held[1] - held[0] == experts - experts // (folded.ep * folded.etp)


def test_folded_layout_costs_and_search():
    """etp splits the experts' compute and weights; the tp_tokens gathers and etp all-reduces are
    counted; the auto-layout search proposes etp > 1 and ep spanning tp ranks."""
    job = Job(model=tiny_moe(), seq_length=16, global_batch_size=4)
    unfolded = plan_layout(job, Layout(dp=2, tp=2, micro_batch_size=2), EXACT)
    folded = plan_layout(job, Layout(dp=2, tp=2, etp=2, micro_batch_size=2), EXACT)
    assert folded.stages[0].compute_seconds_per_micro_batch < unfolded.stages[0].compute_seconds_per_micro_batch
    assert folded.comm_bytes["tp"] > unfolded.comm_bytes["tp"]                # the etp all-reduces
    assert folded.comm_bytes["dp"] < unfolded.comm_bytes["dp"]                # half of each expert to sync
    spanning = plan_layout(job, Layout(tp=2, ep=2, dp=1, micro_batch_size=4), EXACT)
    assert spanning.comm_bytes["ep"] > 0
    from moetrain.planner import candidate_layouts

    layouts = candidate_layouts(job, 4)
    assert any(L.etp == 2 for L in layouts) and any(L.ep > L.dp for L in layouts)
    assert all((L.dp * L.cp * L.tp // L.etp) % L.ep == 0 and L.tp % L.etp == 0 for L in layouts)


def test_flops_per_token_equals_the_gemms_of_one_moe_tiny_step():
    """The `mfu` numerator against an independent count: every matrix product of one training step of
    configs/moe_tiny.yaml listed from its shapes (M x K x N, 2 M K N FLOPs forward; the backward's
    input and weight gradients are two more products of the same size: x3), divided by the step's
    tokens. Attention scores count the full S x S matrix (PaLM's MFU convention; a causal kernel
    computes about half), the experts the top_k rows each token is dispatched to (dropless)."""
    cfg = load_plan_config(os.path.join(CONFIGS, "moe_tiny.yaml"))
    m, moe = cfg.model, cfg.model.moe
    B, S = cfg.train.global_batch_size, cfg.data.seq_length or m.seq_length
    T, h, a, g, d = B * S, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    gemms = []                                            # (M, K, N) of one forward
    for _ in range(m.num_layers):
        gemms += [(T, h, a * d), (T, h, g * d), (T, h, g * d), (T, a * d, h)]          # q, k, v, o
        gemms += [(S, d, S)] * (B * a) + [(S, S, d)] * (B * a)                          # Q K^T, P V per head
        gemms += [(T, h, moe.num_experts)]                                              # router
        rows = T * moe.top_k
        gemms += [(rows, h, moe.ffn_hidden_size)] * 2 + [(rows, moe.ffn_hidden_size, h)]   # gate, up, down
    gemms += [(T, h, m.vocab_size)]                                                     # LM head
    assert m.first_k_dense == 0 and not moe.num_shared_experts   # every layer the MoE block counted above
    step_flops = 3 * sum(2 * M * K * N for M, K, N in gemms)
    assert flops_per_token(m, S) == step_flops / T
    assert round(step_flops / T / 1e6, 2) == 5.92       # docs/performance.md's MFU numerator for this model


def test_cpu_peak_is_measured_on_this_host(tmp_path, monkeypatch):
    """The cpu profile's peak is this host's fp32 GEMM rate, measured once and kept per host, so the
    trainer's `mfu` (a step's model FLOP/s over it) stays below 1; the cost model's compute rate is
    the measured whole-step figure, unchanged."""
    import time

    import numpy as np

    from moetrain import devices

    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path))
    devices.host_fp32_peak.cache_clear()
    try:
        peak = get_device("cpu").peak("float32")
        x, rate = np.ones((1024, 1024), np.float32), 0.0      # what a plain numpy GEMM does here now,
        for _ in range(5):                                   # undisturbed: per CPU-second x the cores
            cpu = time.process_time()
            np.matmul(x, x)
            rate = max(rate, 2 * 1024 ** 3 / max(time.process_time() - cpu, 1e-9) * len(os.sched_getaffinity(0)))
        assert peak >= 0.9 * rate
        assert os.path.isfile(devices.peak_cache_file())
        assert get_device("cpu").peak("float16") == peak / 2
        assert get_device("cpu").sustained("float32") == 0.042e12
        devices.host_fp32_peak.cache_clear()                # a second process: read from the cache, not measured
        monkeypatch.setattr(devices, "measure_fp32_gemm_peak", lambda *a: pytest.fail("measured again"))
        assert get_device("cpu").peak("float32") == peak
    finally:
        devices.host_fp32_peak.cache_clear()

