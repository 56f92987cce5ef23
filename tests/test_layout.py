"""moetrain.layout: every rule a parallel layout must satisfy, in one place, and where it is applied
(config loading with the launched world size, one process included, and the launcher's pre-flight)."""
import os
import subprocess
import sys

import pytest

from moetrain.config import ConfigError, load_config
from moetrain.layout import Layout, LayoutError, ModelShape, check_layout, layout_problems, split_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = os.path.join(ROOT, "configs", "moe_tiny.yaml")
MOE_SHAPE = ModelShape(layers=4, heads=4, kv_heads=2, vocab=2048, ffn=None, experts=8)


@pytest.mark.parametrize("layout, shape, known, messages", [
    (Layout(dp=2, tp=2), None, dict(world=8),
     ["= 4 processes, but 8 were launched: set parallel.data_parallel=4", "--nproc 4"]),
    (Layout(dp=1, tp=4), None, dict(world=6), ["model_parallel x pipeline_stage (4) must divide 6"]),
    (Layout(dp=2, micro_batch_size=8), None, dict(world=3, global_batch_size=16),
     ["data_parallel would have to be 3, which cannot split train.global_batch_size (16)"]),
    (Layout(dp=6, ep=4), None, {}, ["parallel.expert_parallel (4) must divide data_parallel (6)", "[1, 2, 3, 6]"]),
    (Layout(dp=4, ep=4), ModelShape(experts=6), {},
     ["model.moe.num_experts (6) is not divisible by parallel.expert_parallel (4)", "use one of [1, 2]"]),
    (Layout(ep=1, dp=2, tp=2), ModelShape(experts=4, shared_ffn=5, heads=4, kv_heads=4), {},
     ["the shared-expert FFN width (5) is not divisible by parallel.model_parallel (2)"]),
    (Layout(dp=2, ep=2), ModelShape(layers=2, heads=2), {}, ["expert_parallel (2) > 1 needs a MoE model"]),
    # MoE parallel folding: experts on the tp x dp ranks as etp x ep x edp
    (Layout(tp=4, etp=3), None, {}, ["expert_tensor_parallel (3) must divide model_parallel (4)", "[1, 2, 4]"]),
    (Layout(dp=2, tp=2, etp=2, ep=4), None, {},
     ["expert_parallel (4) must divide data_parallel (2) x model_parallel (2) / expert_tensor_parallel (2) = 2"]),
    (Layout(dp=2, tp=2, etp=2), ModelShape(experts=4, expert_ffn=15), {},
     ["model.moe.ffn_hidden_size (15) is not divisible by parallel.expert_tensor_parallel (2)"]),
    (Layout(tp=2, ep=2, micro_batch_size=1), ModelShape(experts=4), dict(seq_length=7),
     ["a micro-batch's 7 tokens (micro_batch_size x seq_length) cannot be cut into", "= 2 equal slices"]),
    (Layout(tp=2, etp=2), ModelShape(layers=2, heads=2), {}, ["expert_tensor_parallel (2) > 1 needs a MoE model"]),
    (Layout(tp=4), ModelShape(heads=6), {}, ["model.num_heads (6) is not divisible by parallel.model_parallel (4)"]),
    (Layout(tp=4), ModelShape(heads=8, kv_heads=2), {},
     ["model.num_kv_heads (2) is not divisible by parallel.model_parallel (4)", "[1, 2]"]),
    (Layout(tp=2), ModelShape(vocab=51), {}, ["model.vocab_size (51) is not divisible", "pad the vocabulary"]),
    (Layout(tp=2, sequence_parallel=True), None, dict(seq_length=7), ["sequence length (7) is not divisible"]),
    (Layout(sequence_parallel=True), None, {}, ["use_seq_parallel needs model_parallel > 1"]),
    (Layout(pp=4, num_micro_batches=4), ModelShape(layers=6), {},
     ["model.num_layers=6 cannot be split evenly into parallel.pipeline_stage=4", "[1, 2, 3, 6]"]),
    (Layout(pp=2, num_micro_batches=2, pipeline_layers=(3, 2)), ModelShape(layers=4), {},
     ["pipeline_layers=[3, 2] must give 2 stages"]),
    (Layout(pp=4, num_micro_batches=2), ModelShape(layers=8), {}, ["2 micro-batch(es) per step cannot keep 4"]),
    (Layout(pp=2, num_micro_batches=2), ModelShape(), {}, ["pipeline_stage (2) > 1 needs a model made of layers"]),
    (Layout(dp=4, micro_batch_size=2, num_micro_batches=1), None, dict(global_batch_size=30),
     ["train.global_batch_size (30) != data_parallel (4) x micro-batch size (2) x micro-batches (1)"]),
    (Layout(dp=0), None, {}, ["parallel.data_parallel must be an integer >= 1, got 0"]),
    (Layout(dp=2.0), None, {}, ["got 2.0"]),
    (Layout(zero=3, recompute="all"), None, {}, ["optimizer_shard must be 0, 1 or 2", "recompute must be one of"]),
])
def test_every_rule_names_the_keys_and_the_fix(layout, shape, known, messages):
    text = "\n".join(layout_problems(layout, shape, **known))
    for message in messages:
        assert message in text, text


def test_all_problems_at_once_and_good_layouts_pass():
    with pytest.raises(LayoutError) as info:
        check_layout(Layout(dp=2, tp=2, ep=8), ModelShape(layers=5, heads=3, experts=8), world=8)
    assert str(info.value).count("\n  - ") == 3
    check_layout(Layout(dp=4, tp=2, pp=2, ep=2, micro_batch_size=2, num_micro_batches=8),
                 ModelShape(layers=8, heads=8, kv_heads=2, vocab=64, ffn=None, experts=8), world=16,
                 global_batch_size=64)
    check_layout(Layout(pp=4, num_micro_batches=4), ModelShape(layers=4), world=4)
    # folded: ep spanning the tp ranks (ep up to dp x tp / etp), and etp > 1 with ep = 1
    for folded in (Layout(tp=2, ep=2), Layout(dp=2, tp=2, ep=4), Layout(dp=2, tp=2, etp=2, ep=2),
                   Layout(dp=2, tp=2, etp=2), Layout(dp=2, tp=4, etp=2, ep=4)):
        check_layout(folded, ModelShape(layers=2, heads=4, kv_heads=4, experts=8, expert_ffn=32), world=folded.world,
                     seq_length=16)
        assert folded.expert_folded
    assert not Layout(dp=2, tp=2, ep=2).expert_folded and Layout(dp=2, tp=2, ep=2).token_slices == 1
    assert Layout(tp=4, etp=2, ep=2).token_slices == 2


def test_split_layers_even_and_explicit():
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_layers(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    assert split_layers(5, 1) == [(0, 5)]
    with pytest.raises(LayoutError, match="summing to model.num_layers=4; it has 2 entries summing to 5"):
        split_layers(4, 2, [2, 3])


def test_config_loading_applies_the_rules_with_the_launched_world_size(monkeypatch):
    """One process (nothing announced): a layout for several processes, or one the model cannot split,
    is refused at config load, before any work; the launched world size is checked when announced."""
    for var in ("MOETRAIN_WORLD_SIZE", "MS_WORKER_NUM", "RANK_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=r"expert_parallel \(3\) must divide data_parallel \(1\)"):
        load_config(MOE, ["parallel.expert_parallel=3"])
    with pytest.raises(ConfigError, match=r"expert_parallel \(2\) must divide data_parallel \(1\)"):
        load_config(MOE, ["parallel.expert_parallel=2"])
    from moetrain.trainer import Trainer

    cfg = load_config(MOE, ["parallel.data_parallel=2", "train.output_dir=/nonexistent/never-created"])
    with pytest.raises(LayoutError, match=r"= 2 processes, but 1 was launched"):
        Trainer(cfg)                                                # refused before anything is built
    assert not os.path.exists("/nonexistent/never-created")
    monkeypatch.setenv("MOETRAIN_WORLD_SIZE", "4")
    cfg = load_config(MOE, ["parallel.expert_parallel=2"])          # dp inferred as 4, ep 2 divides it
    assert (cfg.parallel.data_parallel, cfg.parallel.expert_parallel) == (4, 2)
    with pytest.raises(ConfigError, match=r"model.num_heads \(4\) is not divisible by parallel.model_parallel \(8\)"):
        load_config(MOE, ["parallel.model_parallel=8", "parallel.data_parallel=1", "train.global_batch_size=16"])


def test_launcher_refuses_a_bad_layout_before_any_worker_starts(tmp_path):
    """run_distributed.sh stops on a layout error before msrun starts: no worker log, no msrun."""
    out = tmp_path / "run"
    result = subprocess.run(["bash", os.path.join(ROOT, "run_scripts", "run_distributed.sh"), "--nproc", "2", MOE,
                             "--set", "parallel.expert_parallel=4", "--set", f"train.output_dir={out}"],
                            capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert result.returncode != 0
    assert "expert_parallel (4) must divide data_parallel (2)" in result.stderr
    assert "msrun" not in result.stdout + result.stderr.replace("run_distributed", "")
    assert not (out / "logs").exists() or not any((out / "logs").glob("worker_*.log"))
