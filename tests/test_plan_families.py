"""The planner on DeepSeek-V3 (MLA, MTP) and Qwen3-MoE: parameter counts against the built models,
FLOPs against a hand count from the built model's weights, the published DeepSeek-V3 size, the CLI."""
import dataclasses
import os

import numpy as np
import pytest

from moetrain.planner import flops_per_token, main, parameter_counts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 16


def deepseek(**over):
    from moetrain.models.deepseek_v3 import DeepSeekV3Config
    from moetrain.moe.config import MoEConfig

    kw = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, ffn_hidden_size=48, seq_length=SEQ,
              q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense=1,
              mtp_depth=2, moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=16, num_shared_experts=1,
                                         score_func="sigmoid", num_groups=4, topk_groups=2, group_score_topk=2))
    kw.update(over)
    return DeepSeekV3Config(**kw)


def qwen3(**over):
    from moetrain.models.qwen3_moe import Qwen3MoEConfig
    from moetrain.moe.config import MoEConfig

    kw = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=12,
              ffn_hidden_size=40, seq_length=SEQ, decoder_sparse_step=2, mlp_only_layers=[3],
              moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=16))
    kw.update(over)
    return Qwen3MoEConfig(**kw)


def built(model_cfg):
    import mindspore as ms

    from moetrain.registry import get_model

    ms.set_context(device_target="CPU")
    return get_model(model_cfg.name).cls(model_cfg)


CASES = {"deepseek_mtp2": deepseek(), "deepseek_plain_query_tied": deepseek(q_lora_rank=0, mtp_depth=0, tie_embeddings=True),
         "deepseek_mtp1_no_dense": deepseek(first_k_dense=0, mtp_depth=1), "qwen3": qwen3()}


@pytest.mark.parametrize("name", CASES)
def test_parameter_count_equals_built_model(name):
    model_cfg = CASES[name]
    model = built(model_cfg)
    counts = parameter_counts(model_cfg)
    assert counts.total == sum(p.size for p in model.get_parameters())
    assert counts.trainable == sum(p.size for p in model.trainable_params())


@pytest.mark.parametrize("name", CASES)
def test_flops_equal_a_hand_count_from_the_built_weights(name):
    """6 x the matmul weights one token meets, read off the built model, + the attention core by hand."""
    model_cfg = CASES[name]
    model = built(model_cfg)
    moe = model_cfg.moe
    depth = getattr(model_cfg, "mtp_depth", 0)
    matmul = 0.0
    for param_name, param in model.parameters_and_names():
        if param.ndim < 2 or param_name == "embed.weight":       # norms, expert_bias; the lookup
            continue
        share = moe.top_k / moe.num_experts if ".experts.w_" in param_name else 1.0
        matmul += param.size * share
    head = model_cfg.vocab_size * model_cfg.hidden_size
    matmul += head * (int(model_cfg.tie_embeddings) + depth)     # tied head, and the head again per MTP depth
    qk = model_cfg.head_dim
    v = getattr(model_cfg, "v_head_dim", qk)
    attention = 3 * (2 * SEQ * model_cfg.num_heads * qk + 2 * SEQ * model_cfg.num_heads * v) * (model_cfg.num_layers + depth)
    assert flops_per_token(model_cfg, SEQ) == pytest.approx(6 * matmul + attention, rel=1e-12)


def test_full_size_deepseek_v3_has_the_published_size():
    from moetrain.config import load_config

    path = os.path.join(ROOT, "configs", "deepseek_v3_671b.yaml")
    main_model = parameter_counts(load_config(path, ["model.mtp_depth=0"]).model)
    assert abs(main_model.total - 671e9) / 671e9 < 1e-3          # DeepSeek-V3: 671 B parameters ...
    assert abs(main_model.active - 37e9) / 37e9 < 0.03            # ... 37 B activated per token
    with_mtp = parameter_counts(load_config(path).model)
    assert 11e9 < with_mtp.total - main_model.total < 14e9        # the MTP module (its embedding and head are shared)


def test_plan_prints_deepseek_configs(capsys):
    assert main([os.path.join(ROOT, "configs", "deepseek_v3_671b.yaml")]) == 0       # fits
    out = capsys.readouterr().out
    assert "MLA: q_lora 1536, kv_lora 512, q/k head 128 + rope 64, v head 128; MTP depth 1" in out
    assert "682.64 B" in out and "FITS" in out
    assert main([os.path.join(ROOT, "configs", "deepseek_v3_tiny.yaml")]) == 0
    assert "deepseek_v3: 4 layers" in capsys.readouterr().out


def test_zero2_gradient_pass_books_one_layer_and_one_bucket():
    """At ZeRO-2 a micro-batch's gradients are packed and reduce-scattered bucket by bucket as the
    backward produces them (`OptimizerStep._bucketed_rows`), so a gradient pass holds one layer's
    per-parameter gradients and one bucket beside its activations, never every gradient of the
    stage with a flat buffer concatenated whole (what the plan booked before: 9.58 GiB for the 671B
    stage 8 at full depth and 32 tokens). Stage 8 (4 MoE layers, 4 of the 256 experts each): the
    activations must cover a layer's gradients plus its largest weight (wo, 128 x 128 x 7168) and stay
    below the stage's gradients whole."""
    from moetrain.config import load_config
    from moetrain.layout import Layout
    from moetrain.planner import Job
    from moetrain.planner.costs import plan_layout

    path = os.path.join(ROOT, "configs", "deepseek_v3_671b.yaml")
    cfg = load_config(path, ["parallel.optimizer_shard=2", "model.seq_length=32", "data.seq_length=32"])
    job = dataclasses.replace(Job.of(cfg), compute_dtype="float32", grad_dtype="float32")    # as run on the CPU
    stage = plan_layout(job, Layout.of(cfg), "cpu", 2048).stages[8]
    m = cfg.model
    trained = stage.memory["weights"] / 4 - 4 * m.moe.num_experts      # the routers' biases: not trained
    wo = m.num_heads * m.v_head_dim * m.hidden_size
    assert stage.memory["activations"] >= 4 * (trained / 4 + wo)       # one of the 4 layers' gradients + a bucket
    assert stage.memory["activations"] < 4 * trained                    # not the stage's gradients whole


def test_last_stage_books_the_head_weight_gradient_once():
    """The 671B last stage (2 MoE layers, the MTP block, the LM head) at ZeRO-2 and 32 tokens, as run
    on the CPU: the fused head makes d(head weight) in the backward, once for the main and the MTP
    heads, and reduce-scatters it first, in column pieces. Its activations hold that gradient (the
    largest unit) and less than another head-sized tensor: 4.93 GiB against 3.45 for the gradient.
    Before, two forward-kept head gradients and the head's whole collective output were booked:
    13.88 GiB."""
    from moetrain.config import load_config
    from moetrain.layout import Layout
    from moetrain.planner import Job
    from moetrain.planner.costs import plan_layout

    path = os.path.join(ROOT, "configs", "deepseek_v3_671b.yaml")
    cfg = load_config(path, ["parallel.optimizer_shard=2", "model.seq_length=32", "data.seq_length=32"])
    job = dataclasses.replace(Job.of(cfg), compute_dtype="float32", grad_dtype="float32")    # as run on the CPU
    stage = plan_layout(job, Layout.of(cfg), "cpu", 2048).stages[15]
    head = 4 * cfg.model.vocab_size * cfg.model.hidden_size
    assert head <= stage.memory["activations"] < 2 * head, stage.memory["activations"] / head
