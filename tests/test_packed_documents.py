"""Packed documents end to end (`data.reset_attention_mask`, `data.reset_position_ids`): every layered
family gives each document of a packed sample the same per-token losses as the document run alone
(fused kernel and plain path), the ids reach every pipeline stage, the config keys are accepted only
where a model takes the ids, and the trainer trains with them in one process and on 2 ranks (tp2 and
pp2 against one process). The kernel and the attention layer against float64: tests/test_kernels.py."""
import json
import os

import numpy as np
import pytest

from moetrain.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
TINY = ["model.vocab_size=64", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4",
        "model.ffn_hidden_size=48", "model.seq_length=32"]
TINY_MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=16"]
FAMILIES = {   # config, overrides: each family's own attention (GQA, q/k-norm GQA, MLA) and MoE layers
    "gpt": ("gpt_tiny.yaml", TINY + ["model.num_kv_heads=2"]),
    "moe_gpt": ("moe_tiny.yaml", TINY + TINY_MOE + ["model.num_kv_heads=2"]),
    "qwen3_moe": ("qwen3_moe_tiny.yaml", TINY + TINY_MOE + ["model.num_kv_heads=2", "model.head_dim=12"]),
    "deepseek_v3": ("deepseek_v3_tiny.yaml", TINY + TINY_MOE + [
        "model.q_lora_rank=24", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4",
        "model.v_head_dim=6", "model.moe.num_groups=2", "model.moe.topk_groups=1", "model.mtp_depth=1"]),
}
# documents per row, 32 tokens each: one-token documents (first, inside, last), a row of one document
LENGTHS = [[1, 9, 1, 13, 7, 1], [32]]


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
    mindspore.set_device("CPU")
    return mindspore


def build(ms, family, *extra):
    from moetrain.build import build_model

    config, overrides = FAMILIES[family]
    cfg = load_config(os.path.join(ROOT, "configs", config), overrides + ["model.init_std=0.2", *extra])
    ms.set_seed(3)
    return build_model(cfg)


def packed_rows(lengths_per_row):
    """(document_ids, position_ids) int32 [B, S], as the LM dataset yields them with both keys set."""
    documents = np.array([np.repeat(np.arange(len(row)), row) for row in lengths_per_row], np.int32)
    positions = np.array([np.concatenate([np.arange(n) for n in row]) for row in lengths_per_row], np.int32)
    return documents, positions


def document_spans(lengths):
    """[(start, end)] of documents of these lengths packed one after another."""
    ends = np.cumsum(lengths)
    return list(zip(ends - np.asarray(lengths), ends))


def token_losses(logits, labels):
    """float64 per-token cross-entropy of logits [..., V] against labels [...]."""
    logits = logits.astype(np.float64)
    logits = logits - logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, labels[..., None].astype(np.int64), -1)[..., 0]


def use_plain_attention(model):
    """Every attention layer on the plain path (RoPE ops, additive mask) instead of the fused kernel."""
    from moetrain.layers import CausalAttention, CausalAttentionCore

    for _, cell in model.cells_and_names():
        if isinstance(cell, CausalAttention) and cell.fused:
            cell.core, cell.fused = CausalAttentionCore(), False


@pytest.mark.parametrize("family,path", [("gpt", "fused"), ("gpt", "plain"), ("moe_gpt", "fused"),
                                         ("qwen3_moe", "fused"), ("deepseek_v3", "fused"),
                                         ("deepseek_v3", "plain")])
def test_packed_sample_gives_each_document_its_own_losses(ms, kernel_ops, family, path):
    """Per-token losses of a packed sample (document ids + positions restarting per document) equal
    those of each document run alone; without the ids the later documents' losses differ (the check
    can fail). DeepSeek-V3's MTP depth agrees too wherever its next token is in the same document."""
    model = build(ms, family)
    if path == "plain":
        use_plain_attention(model)
    documents, positions = packed_rows(LENGTHS)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 64, documents.shape).astype(np.int32)
    labels = rng.integers(0, 64, documents.shape).astype(np.int32)
    packed_ids, packed_docs, packed_pos = ms.Tensor(ids), ms.Tensor(documents), ms.Tensor(positions)
    packed = token_losses(model.logits(packed_ids, packed_docs, packed_pos).asnumpy(), labels)
    unmasked = token_losses(model.logits(packed_ids).asnumpy(), labels)
    alone = np.zeros_like(packed)
    for row, lengths in enumerate(LENGTHS):
        for start, end in document_spans(lengths):
            logits = model.logits(ms.Tensor(ids[row:row + 1, start:end])).asnumpy()
            alone[row, start:end] = token_losses(logits, labels[row:row + 1, start:end])[0]
    np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)
    later = documents > 0                                   # tokens after the first document of a row
    assert np.abs(unmasked - alone)[later].min() > 1e-4      # each later token saw another document before

    if family == "deepseek_v3":   # MTP depth 1: row i reads token i+1's embedding, predicts labels[i+1]
        context = (packed_docs, packed_pos)
        h, _, _ = model.run_layers(model.embed_tokens(packed_ids), context)
        _, mtp_packed, _ = model.mtp_depth_step(0, h, ms.Tensor(labels), context)
        row = 0
        for start, end in document_spans(LENGTHS[row]):
            if end - start < 2:
                continue
            h_alone, _, _ = model.run_layers(model.embed_tokens(ms.Tensor(ids[row:row + 1, start:end])))
            _, mtp_alone, _ = model.mtp_depth_step(0, h_alone, ms.Tensor(labels[row:row + 1, start:end]))
            np.testing.assert_allclose(mtp_packed.asnumpy()[row, start:end - 1], mtp_alone.asnumpy()[0],
                                       rtol=1e-4, atol=1e-5)


def test_pipeline_stages_each_get_the_documents(ms, kernel_ops):
    """Three stages of a MoE model in one process (PyNative, the real executor, 1F1B): every stage,
    the middle one included, gets its micro-batch's document and position ids, so the summed
    gradients and each micro-batch's loss equal the whole model's on the packed batches."""
    from moetrain.parallel.pipeline import PipelineExecutor, build_stages, drive_in_process

    model = build(ms, "moe_gpt", "model.num_layers=3")
    rng = np.random.default_rng(2)
    batches = []
    for lengths in ([[5, 20, 7]], [[1, 31]], [[16, 16]]):
        documents, positions = packed_rows(lengths)
        tokens = rng.integers(0, 64, (2,) + documents.shape).astype(np.int32)
        batches.append(tuple(ms.Tensor(a) for a in (tokens[0], tokens[1], documents, positions)))
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda *batch: model(*batch), None, params, has_aux=True)
    ref_grads, ref_losses = None, []
    for batch in batches:
        (loss, _), grads = grad_fn(*batch)
        ref_losses.append(float(loss))
        grads = [g.asnumpy() for g in grads]
        ref_grads = grads if ref_grads is None else [a + b for a, b in zip(ref_grads, grads)]
    ref_grads = dict(zip((p.name for p in params), ref_grads))

    stages = build_stages(lambda: build(ms, "moe_gpt", "model.num_layers=3"), [(0, 1), (1, 2), (2, 3)])
    executors = [PipelineExecutor(stage, stage.trainable_params(), "1f1b", len(batches), jit=False)
                 for _, stage in sorted(stages.items())]
    scale = ms.Tensor(1.0, ms.float32)
    results = drive_in_process([ex.steps(batches, scale, (1, 32, 32)) for ex in executors])
    got = {}
    for ex, (grads, _) in zip(executors, results):
        for p, g in zip(ex.params, grads):
            got[p.name] = got.get(p.name, 0) + g.asnumpy()
    assert sorted(got) == sorted(ref_grads)
    for name, ref in ref_grads.items():
        np.testing.assert_allclose(got[name], ref, rtol=2e-4, atol=2e-6, err_msg=name)
    for m, ref_loss in enumerate(ref_losses):
        assert sum(float(stats[0][m]["loss"].asnumpy()) for _, stats in results) == pytest.approx(ref_loss, rel=1e-5)
    # the comparison can fail: the middle stage's output depends on the ids it is given
    x = ms.Tensor(rng.standard_normal((1, 32, 32)).astype(np.float32))
    with_ids, _ = stages[1](x, None, *batches[0][2:])
    without, _ = stages[1](x, None)
    assert np.abs(with_ids.asnumpy() - without.asnumpy()).max() > 1e-4


def test_config_accepts_the_keys_only_where_the_model_takes_the_ids(tmp_path):
    for key in ("reset_attention_mask", "reset_position_ids"):
        cfg = load_config(os.path.join(ROOT, "configs", "moe_tiny.yaml"), [f"data.{key}=true"])
        assert getattr(cfg.data, key)
        with pytest.raises(ConfigError, match=rf"'data\.{key}': packed documents exist only in LM data"):
            load_config(os.path.join(ROOT, "configs", "mnist_mlp.yaml"), [f"data.{key}=true"])
    module = tmp_path / "packed_docs_user_model.py"
    module.write_text("from dataclasses import dataclass\nfrom mindspore import nn\n"
                      "from moetrain.registry import register_model\n\n\n@dataclass\nclass Cfg:\n"
                      "    name: str = 'no_documents_lm'\n\n\n@register_model('no_documents_lm', config=Cfg)\n"
                      "class NoDocuments(nn.Cell):\n    def construct(self, input_ids, labels):\n"
                      "        return input_ids\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ConfigError, match=r"'data\.reset_attention_mask': model 'no_documents_lm' \(NoDocuments"
                                              r"\.construct\(self, input_ids, labels\)\) does not take document_ids"):
            load_config(os.path.join(ROOT, "configs", "gpt_tiny.yaml"),
                        ["model_module=packed_docs_user_model", "model={name: no_documents_lm}",
                         "data.reset_attention_mask=true"])
    finally:
        sys.path.remove(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Training through the trainer
# ---------------------------------------------------------------------------------------------
TRAIN = [f"data.path={KJV}_train", f"data.eval_path={KJV}_eval", f"data.tokenizer={KJV}.model",
         "model.vocab_size=2048", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.seq_length=32", "train.steps=4",
         "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_max_batches=2",
         "lr_schedule.warmup_steps=0", "optimizer.clip_grad_norm=0.05", "checkpoint.save_at_end=false",
         "checkpoint.save_steps=0", "logging.tensorboard=false", "logging.progress_bar=false"]
PACKED = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]


def step_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


def train(config, overrides, run_dir):
    from moetrain.trainer import Trainer

    Trainer(load_config(os.path.join(ROOT, "configs", config), overrides + [f"train.output_dir={run_dir}"])).fit()
    return step_records(run_dir)


def test_trainer_trains_on_packed_documents(tmp_path):
    """One process, jitted steps: the trainer's batches carry the ids into the model (the losses differ
    from the same run without them), and the loss falls."""
    (steps, evals) = train("moe_tiny.yaml", TRAIN + TINY_MOE + PACKED, tmp_path / "packed")
    # only its first loss is read: no final evaluation (its graph would be compiled for nothing)
    (plain_steps, _) = train("moe_tiny.yaml", TRAIN + TINY_MOE + ["train.steps=1", "data.eval_path="], tmp_path / "plain")
    losses = [r["loss"] for r in steps]
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert np.isfinite(evals[-1]["eval_loss"])
    assert abs(steps[0]["loss"] - plain_steps[0]["loss"]) > 1e-4     # the same batch and weights


PARALLEL_RUNS = {"tp2": ["parallel.model_parallel=2", "parallel.use_seq_parallel=true"],
                 "pp2": ["parallel.pipeline_stage=2"]}


def _share_parallel_runs():
    """tp2 and pp2 (jitted) join the suite's shared 2-rank msrun job (tests/distributed.py: share_runs)."""
    from distributed import share_runs

    share_runs(2, __name__, lambda fixture, out_dir: [f"{name}:configs/gpt_tiny.yaml:" + ",".join(TRAIN + PACKED + extra)
                                                      for name, extra in PARALLEL_RUNS.items()], timeout=540)


_share_parallel_runs()


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_and_pp2_train_packed_documents_as_one_process(tmp_path, shared_job_2):
    """tp2 with sequence parallelism, then pp2 with 4 micro-batches, jitted, on 2 ranks reproduce the
    one-process losses, gradient norms and evaluation of a packed-document dense run."""
    from distributed import shared_run_dirs

    single_steps, single_evals = train("gpt_tiny.yaml", TRAIN + PACKED, tmp_path / "single")
    for name, run_dir in shared_run_dirs(shared_job_2, __name__, PARALLEL_RUNS).items():
        steps, evals = step_records(run_dir)
        assert [r["step"] for r in steps] == [1, 2, 3, 4], name
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose([r[key] for r in steps], [r[key] for r in single_steps], rtol=1e-4,
                                       err_msg=f"{name} {key}")
        assert evals[-1]["eval_loss"] == pytest.approx(single_evals[-1]["eval_loss"], rel=1e-4), name
