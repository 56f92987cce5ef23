"""The LM stack end to end: a short moe_tiny run learns from context (eval loss well below the
unigram entropy of the eval split) and reports the MoE metrics of the interface contract."""
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def test_moe_tiny_short_run_beats_unigram_entropy(tmp_path, monkeypatch):
    from corpus_stats import token_counts, unigram_entropy
    from moetrain.config import load_config
    from moetrain.data.lm import open_token_shard
    from moetrain.trainer import Trainer

    monkeypatch.chdir(ROOT)  # the config's data paths are relative to the repository
    entropy = unigram_entropy(token_counts(open_token_shard("data/kjv_tiny/kjv_tiny_eval")))
    cfg = load_config("configs/moe_tiny.yaml", [
        f"train.output_dir={tmp_path}", "train.steps=60", "train.global_batch_size=8", "model.seq_length=64",
        "model.num_layers=2", "lr_schedule.warmup_steps=10", "train.eval_interval=0", "train.eval_max_batches=8",
        "checkpoint.save_at_end=false", "logging.tensorboard=false", "model.moe.bias_update_rate=0.001"])
    result = Trainer(cfg).fit()
    assert result["eval"]["eval_loss"] < entropy - 0.3, (result["eval"]["eval_loss"], entropy)

    records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    train = [r for r in records if "loss" in r]
    last = train[-1]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "lm_loss", "aux_loss", "z_loss",
                "expert_load", "drop_rate"):
        assert key in last, key
    load = np.asarray(last["expert_load"])
    assert load.shape == (2, 8)                                     # MoE layers x experts
    assert load.sum(axis=1).tolist() == [8 * 64 * 2] * 2            # every token routed top_k times
    assert last["drop_rate"] == 0.0                                 # dropless
    assert last["loss"] > last["lm_loss"] > 0


def test_resume_restores_the_moe_dispatch_capacities(tmp_path, monkeypatch):
    """With a capacity-layout expert path (the GPU one: `[L, C, H]` batched matmuls) the dispatch
    capacities follow the routing; a checkpoint keeps them and their sizing window, so the resumed
    run sizes its buffers exactly as the uninterrupted one and its losses are bitwise the same."""
    from moetrain.config import load_config
    from moetrain.trainer import Trainer

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MOETRAIN_MOE_PLATFORM", "gpu")

    def trainer(out, *extra, resume=None):
        return Trainer(load_config("configs/moe_tiny.yaml", [
            f"train.output_dir={out}", "train.steps=4", "train.global_batch_size=4", "model.seq_length=16",
            "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.moe.ffn_hidden_size=64",
            "lr_schedule.warmup_steps=0", "train.eval_interval=0", "logging.tensorboard=false",
            # no final evaluation: only the steps and the capacities are compared (each of the three
            # runs evaluated the whole eval split, 735 sequences in batches of 4, the last partial one
            # a graph of its own)
            "data.eval_path=", "logging.progress_bar=false", *extra]), resume=resume)

    straight = trainer(tmp_path / "straight")
    straight.fit()
    split = trainer(tmp_path / "split", "train.stop_after=2")
    split.fit()
    saved = split.runner.capacity_state()
    assert saved and any(c for c in saved["capacities"].values())   # sized from the counts, one set for all layers
    resumed = trainer(tmp_path / "split", resume="")
    assert resumed.step == 2 and resumed.runner.capacity_state() == saved
    resumed.fit()
    assert resumed.runner.capacity_state() == straight.runner.capacity_state()
    losses = [[json.loads(l)["loss"] for l in open(d / "metrics.jsonl") if '"loss"' in l]
              for d in (tmp_path / "straight", tmp_path / "split")]
    assert losses[0] == losses[1] and len(losses[0]) == 4
