"""`moetrain eval MODEL --data PREFIX_OR_BLEND`: the training code's evaluation of a saved model, per source."""
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_load_path import import_tiny_mixtral  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL = os.path.join(ROOT, "data/kjv_tiny/kjv_tiny_eval")
TRAIN = os.path.join(ROOT, "data/kjv_tiny/kjv_tiny_train")


@pytest.fixture(scope="module")
def imported_mixtral(tmp_path_factory):
    return import_tiny_mixtral(tmp_path_factory.mktemp("mixtral"))


def direct_loss(model_dir, prefix, seq_length, max_samples=None):
    """Mean next-token loss over the shard's samples, computed here with the model's own forward
    (its `lm_loss`: the MoE aux loss depends on the batch and is no part of an evaluation)."""
    import mindspore as ms

    from moetrain.checkpoint.model_dir import load_model
    from moetrain.data.lm import LMDataset

    model, _ = load_model(str(model_dir))
    dataset = LMDataset(prefix, seq_length)
    n = len(dataset) if max_samples is None else min(max_samples, len(dataset))
    total = 0.0
    for start in range(0, n, 8):
        input_ids, labels = dataset.batch(np.arange(start, min(n, start + 8)))
        _, stats = model(ms.Tensor(input_ids), ms.Tensor(labels))
        total += float(stats["lm_loss"]) * len(input_ids)
    return total / n


def test_eval_prints_loss_and_perplexity(imported_mixtral, capsys):
    from moetrain.cli import main

    model_dir, _ = imported_mixtral
    assert main(["eval", str(model_dir), "--data", EVAL, "--seq-length", "32"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("all: loss ")
    loss = float(last.split()[2])
    expected = direct_loss(model_dir, EVAL, 32)
    assert loss == pytest.approx(expected, abs=1e-4)
    assert float(last.split()[-1]) == pytest.approx(math.exp(expected), rel=1e-3)


def test_eval_of_a_blend_reports_each_source(imported_mixtral, tmp_path):
    from moetrain.evaluate import evaluate, parse_data, report

    model_dir, _ = imported_mixtral
    record = evaluate(str(model_dir), parse_data(f"{{bible: [0.25, {EVAL}], more: [0.75, {TRAIN}]}}"),
                      seq_length=32, batch_size=4, max_batches=2, overrides=[f"data.cache_dir={tmp_path}"])
    # eval_max_batches counts global batches (here 4 samples): 8 samples of each source
    assert record["eval_loss/bible"] == pytest.approx(direct_loss(model_dir, EVAL, 32, 8), rel=1e-5)
    assert record["eval_loss/more"] == pytest.approx(direct_loss(model_dir, TRAIN, 32, 8), rel=1e-5)
    assert record["eval_loss"] == pytest.approx(0.25 * record["eval_loss/bible"] + 0.75 * record["eval_loss/more"])
    lines = report(record)
    assert [line.split(":")[0] for line in lines] == ["bible", "more", "total (weighted by the blend)"]


def test_eval_refuses_what_is_not_a_model(tmp_path):
    from moetrain.cli import main

    assert main(["eval", str(tmp_path), "--data", EVAL]) == 2
