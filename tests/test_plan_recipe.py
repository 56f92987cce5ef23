"""`moetrain plan`'s memory under Megatron-Core's recipe (`precision.param_dtype: bfloat16`; docs/plan.md,
"Memory per device"), checked against the published figures it follows, and the published layouts
fitting their 80 GiB devices with it. Pure Python, a fraction of a second each."""
import json

import pytest

from models.gpt import GPTConfig
from moetrain.layout import Layout
from moetrain.planner import Job, main, plan_layout
from moetrain.planner.costs import recipe_activation_bytes

H, A, F, S = 1024, 16, 2816, 4096


def dense_job(**over):
    model = GPTConfig(vocab_size=32000, hidden_size=H, num_layers=8, num_heads=A, num_kv_heads=A, ffn_hidden_size=F,
                      seq_length=S)
    kw = dict(model=model, seq_length=S, global_batch_size=64, compute_dtype="bfloat16", param_dtype="bfloat16")
    kw.update(over)
    return Job(**kw)


@pytest.mark.parametrize("dp", [1, 8, 32])
def test_static_bytes_are_megatrons_distributed_optimizer_table(dp):
    """Megatron-LM README, "Distributed optimizer": bf16 parameters with fp32 gradients hold 6 + 12/d
    bytes a parameter (d: the data-parallel size); moetrain's own fp32 model holds 8 + 12/d at ZeRO-1
    (fp32 parameters and gradients, the moments and an fp32 master row over dp)."""
    layout = Layout(dp=dp, micro_batch_size=1, num_micro_batches=64 // dp, zero=1)
    r = plan_layout(dense_job(), layout, "gpu_h100")
    params = r.stages[0].params
    static = r.memory["weights"] + r.memory["gradients"] + r.memory["optimizer"]
    assert static / params == pytest.approx(6 + 12 / dp, rel=1e-9)
    own = plan_layout(dense_job(param_dtype="float32"), layout, "gpu_h100")
    assert (own.memory["weights"] + own.memory["gradients"] + own.memory["optimizer"]) / params == \
        pytest.approx(8 + 12 / dp, rel=1e-9)
    bf16_moments = plan_layout(dense_job(moment_dtype="bfloat16"), layout, "gpu_h100")   # DeepSeek-V3 3.3.3
    assert bf16_moments.memory["optimizer"] / params == pytest.approx(8 / dp, rel=1e-9)


@pytest.mark.parametrize("tp,sp", [(1, False), (4, True)])
def test_a_dense_layer_keeps_korthikantis_activations(tp, sp):
    """Korthikanti et al. 2022, table 2: a layer keeps s b h (34 + 5 a s / h) bytes, / t with sequence
    parallelism; with flash attention (no 5 a s / h), no dropout (its two 1-byte masks: 34 -> 32) and
    SwiGLU's 6 F bytes a token in place of the GeLU MLP's 16 h, plus the log-sum-exp (4 a)."""
    layout = Layout(tp=tp, sequence_parallel=sp)
    job = dense_job(recompute_modules=("core_attn",))
    tokens = S
    got = recipe_activation_bytes(job.arch, False, tokens, layout, job, frozenset({"core_attn"}))
    assert got == pytest.approx(tokens * (H * (34 - 2 - 16) + 6 * F + 4 * A) / tp, rel=1e-12)
    # layernorm recompute drops the two norm outputs (2 s b h each), moe_act the SwiGLU product (2 s b F)
    fewer = recipe_activation_bytes(job.arch, False, tokens, layout, job, frozenset({"layernorm", "moe_act"}))
    assert got - fewer == pytest.approx(tokens * (4 * H + 2 * F) / tp, rel=1e-12)


PUBLISHED = ["qwen3_235b_a22b_h100.yaml", "deepseek_v3_h100_megatron.yaml", "deepseek_v3_h800.yaml",
             "mixtral_8x22b_h100.yaml"]


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_layouts_fit_their_80_gib_under_their_recipe(name, capsys):
    path = f"configs/published/{name}"
    assert main([path, "--json"]) == 0
    recipe = json.loads(capsys.readouterr().out)
    assert recipe["fits"] and recipe["total_memory"] < 80 * 2 ** 30, recipe["memory"]
    # the same layout under this trainer's fp32 model does not (what the search used to discard)
    assert main([path, "--json", "--set", "precision.param_dtype=float32", "--set", "precision.moment_dtype=float32"]) == 1
    assert not json.loads(capsys.readouterr().out)["fits"]
