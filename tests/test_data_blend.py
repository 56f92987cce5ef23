"""Blended datasets (moetrain/data/blend.py): the spec, the exact mix, layout independence, resume,
the index cache, per-source evaluation through the real trainer.

The blend is the shipped KJV slice plus a second corpus given as JSONL: the same verses with
their words in reverse order, encoded with the shipped tokenizer.
"""
import json
import os
from fractions import Fraction

import numpy as np
import pytest

from moetrain.config import ConfigError, load_config
from moetrain.data import DataError
from moetrain.data.blend import (BlendedBatchSampler, BlendedDataset, blend_schedule, build_blended_lm_dataset,
                                 evaluate_sources, load_or_build_index, parse_blend)
from moetrain.data.lm import LMDataset
from moetrain.data.preprocess import preprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV = os.path.join(REPO, "data", "kjv_tiny")
TOKENIZER = os.path.join(KJV, "kjv_tiny.model")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    verses = open(os.path.join(KJV, "kjv_tiny.txt"), encoding="utf-8").read().splitlines()[:1500]
    with open(root / "reversed.jsonl", "w", encoding="utf-8") as f:
        for verse in verses:
            f.write(json.dumps({"text": " ".join(reversed(verse.split()))}) + "\n")
    preprocess([str(root / "reversed.jsonl")], TOKENIZER, str(root / "reversed"), eval_fraction=0.1)
    return dict(root=root, kjv_train=os.path.join(KJV, "kjv_tiny_train"), kjv_eval=os.path.join(KJV, "kjv_tiny_eval"),
                rev_train=str(root / "reversed_train"), rev_eval=str(root / "reversed_eval"))


def blend(corpora, weights=(0.65, 0.35), seq_length=32):
    spec = [weights[0], corpora["kjv_train"], weights[1], corpora["rev_train"]]
    return build_blended_lm_dataset(parse_blend(spec), seq_length, 2048, TOKENIZER)


# ------------------------------------------------------------------------------------------ spec
def test_parse_blend_forms():
    assert parse_blend("data/x_train") is None
    sources = parse_blend([0.3, "a/web_train", 7, "b/kjv_train"])
    assert [(s.name, s.weight, s.prefix) for s in sources] == [("web_train", 0.3, "a/web_train"),
                                                                ("kjv_train", 7, "b/kjv_train")]
    named = parse_blend({"web": [1, "a/x"], "book": [3, "b/x"]})
    assert [(s.name, s.weight, s.prefix) for s in named] == [("web", 1, "a/x"), ("book", 3, "b/x")]


@pytest.mark.parametrize("spec, message", [
    ([0.5, "a", 0.5], r"even length, got 3 item"),
    ([], r"even length, got 0 item"),
    ([-0.5, "a", 1.5, "b"], r"weight of 'a' must be a finite number >= 0, got -0.5"),
    (["a", 0.5, "b", 0.5], r"weight of 0.5 must be a finite number >= 0, got 'a'"),
    ([True, "a", 1, "b"], r"weight of 'a' must be"),
    ([0, "a", 0.0, "b"], r"all weights are 0"),
    ([1, "x/a", 1, "y/a"], r"two sources are named \['a'\].*mapping form"),
    ([1, 2, 1, "b"], r"expected a shard prefix after weight 1, got 2"),
    ({"web": 0.5}, r"source 'web' must be \[weight, prefix\]"),
    (5, r"must be a shard prefix, a list"),
])
def test_parse_blend_errors(spec, message):
    with pytest.raises(DataError, match=r"data\.path.*" + message):
        parse_blend(spec)


def test_config_checks_blends(tmp_path):
    base = "configs/moe_tiny.yaml"
    cfg = load_config(os.path.join(REPO, base), ["data.path=[0.7, a/x_train, 0.3, b/y_train]",
                                                  "data.eval_path={x: [1, a/x_eval], y: [1, b/y_eval]}"])
    assert cfg.data.path == [0.7, "a/x_train", 0.3, "b/y_train"] and cfg.data.eval_path["y"] == [1, "b/y_eval"]
    with pytest.raises(ConfigError, match=r"--set data\.eval_path=\[0\.7, a/x_eval, 0\.3\] \(on top of .*moe_tiny\.yaml\): "
                                          r"data\.eval_path: a blend is a list .*even length"):
        load_config(os.path.join(REPO, base), ["data.eval_path=[0.7, a/x_eval, 0.3]"])
    with pytest.raises(ConfigError, match=r"data\.path: the weight of 'a' must be a finite number >= 0, got -1"):
        load_config(os.path.join(REPO, base), ["data.path=[-1, a, 2, b]"])


# ------------------------------------------------------------------------------------------ the mix
def lags(schedule, weights):
    """max over prefixes n of |count_i(n) - w_i n|, exact rational weights."""
    exact = [Fraction(str(w)) / sum(Fraction(str(v)) for v in weights) for w in weights]
    n = np.arange(1, schedule.size + 1)
    worst = 0.0
    for i, w in enumerate(exact):
        counts = np.cumsum(schedule == i)
        worst = max(worst, float(np.max(np.abs(counts * w.denominator - n * w.numerator)) / w.denominator))
    return worst


def test_schedule_keeps_every_source_within_one_sample():
    rng = np.random.default_rng(0)
    cases = [[0.7, 0.3], [3, 1], [1, 1, 1], [0.5, 0.25, 0.125, 0.125], [0, 2, 1]]
    cases += [np.round(rng.dirichlet(np.full(k, a)), 4).tolist() for k in (2, 3, 5, 8) for a in (0.2, 1.0)]
    for weights in cases:
        schedule = blend_schedule(weights, 3000)
        assert lags(schedule, weights) < 1, weights
        assert np.array_equal(schedule[:1000], blend_schedule(weights, 1000))   # a prefix never changes
    assert not np.any(blend_schedule([0, 2, 1], 3000) == 0)                     # weight 0: never drawn
    # Megatron's build_blending_indices rule (the source with the largest w_i * max(n, 1) - count_i)
    # exceeds one sample on these weights (1.31); EPDF does not.
    hard = [0.001, 0.538, 0.009, 0.448, 0.004]
    counts, megatron = np.zeros(5), np.empty(3000, dtype=np.uint8)
    for n in range(3000):
        megatron[n] = np.argmax(np.array(hard) / sum(hard) * max(n, 1) - counts)
        counts[megatron[n]] += 1
    assert lags(megatron, hard) > 1.3
    assert lags(blend_schedule(hard, 3000), hard) < 1


def test_mix_exact_same_on_dp1_and_dp4_and_after_resume(corpora, tmp_path):
    dataset = blend(corpora)
    weights, B, steps = dataset.weights, 16, 100
    sampler = BlendedBatchSampler(dataset, B, steps, seed=3, cache_dir=str(tmp_path))
    per_step = np.array([np.bincount(dataset.source_of(sampler.global_batch(s)), minlength=2) for s in range(steps)])
    cumulative = np.cumsum(per_step, axis=0)
    targets = np.outer(np.arange(1, steps + 1) * B, weights)
    assert np.all(np.abs(cumulative - targets) < 1)                          # every prefix of steps
    assert np.all(np.abs(cumulative[-1] - np.array(weights) * B * steps) < 1)  # the first 100 steps: 1040 / 560
    window = cumulative[60] - cumulative[20]                                  # any window: < 2
    assert np.all(np.abs(window - np.array(weights) * B * 40) < 2)

    for step in range(steps):
        whole = sampler.rank_batch(step, 0, 1)
        assert np.array_equal(whole, sampler.global_batch(step))
        assert np.array_equal(np.concatenate([sampler.rank_batch(step, r, 4) for r in range(4)]), whole)
    inputs_dp1, labels_dp1 = dataset.batch(sampler.rank_batch(7, 0, 1))
    inputs_dp4 = np.concatenate([dataset.batch(sampler.rank_batch(7, r, 4))[0] for r in range(4)])
    assert np.array_equal(inputs_dp1, inputs_dp4)

    # Resume at step k: new dataset and sampler objects from disk, the cached index reused.
    k = 37
    fresh = BlendedBatchSampler(blend(corpora), B, steps, seed=3, cache_dir=str(tmp_path))
    assert not fresh.built and fresh.index_path == sampler.index_path
    for step in range(k, steps):
        assert np.array_equal(fresh.global_batch(step), sampler.global_batch(step))
    longer = BlendedBatchSampler(dataset, B, 2 * steps, seed=3, cache_dir=str(tmp_path))
    assert longer.built and np.array_equal(longer.index[:steps * B], sampler.index)   # more steps: same start
    other_seed = BlendedBatchSampler(dataset, B, steps, seed=4, cache_dir=str(tmp_path))
    assert not np.array_equal(other_seed.index, sampler.index)
    beyond = sampler.global_batch(steps + 5)             # past the index (a rollback's skipped batches): extended
    assert sampler.num_steps == 111 and sampler.built and np.array_equal(beyond, longer.global_batch(steps + 5))
    assert np.array_equal(sampler.global_batch(7), fresh.global_batch(7))


def test_each_source_cycles_through_its_own_epochs(corpora, tmp_path):
    dataset = blend(corpora, weights=(0.5, 0.5), seq_length=256)
    kjv_size, rev_size = dataset.sizes
    steps = 3 * rev_size // 8 + 1             # the reversed corpus (smaller) goes round 3+ times
    sampler = BlendedBatchSampler(dataset, 16, steps, seed=0, cache_dir=str(tmp_path))
    index = np.asarray(sampler.index)
    rev = index[dataset.source_of(index) == 1] - dataset.starts[1]
    epochs = [rev[e * rev_size:(e + 1) * rev_size] for e in range(3)]
    for order in epochs:
        assert sorted(order.tolist()) == list(range(rev_size))               # each sample once per epoch
    assert not np.array_equal(epochs[0], epochs[1])                          # reshuffled each epoch
    kjv = index[dataset.source_of(index) == 0] - dataset.starts[0]
    assert len(set(kjv.tolist())) == kjv.size < kjv_size                     # the larger one still in epoch 0
    unshuffled = BlendedBatchSampler(dataset, 16, steps, seed=0, shuffle=False, cache_dir=str(tmp_path))
    rev_in_order = np.asarray(unshuffled.index)[dataset.source_of(unshuffled.index) == 1] - dataset.starts[1]
    assert np.array_equal(rev_in_order[:rev_size], np.arange(rev_size))


def test_blended_batch_gathers_from_each_source(corpora):
    dataset = blend(corpora)
    kjv, rev = (LMDataset(p, 32) for p in (corpora["kjv_train"], corpora["rev_train"]))
    assert len(dataset) == len(kjv) + len(rev) and dataset.names == ["kjv_tiny_train", "reversed_train"]
    flat = np.array([3, len(kjv) + 5, 0, len(kjv), len(kjv) - 1, len(dataset) - 1])
    inputs, labels = dataset.batch(flat)
    expected = [kjv[3], rev[5], kjv[0], rev[0], kjv[len(kjv) - 1], rev[len(rev) - 1]]
    assert np.array_equal(inputs, np.stack([e[0] for e in expected]))
    assert np.array_equal(labels, np.stack([e[1] for e in expected]))
    with pytest.raises(IndexError, match="out of range"):
        dataset.batch([len(dataset)])


# ------------------------------------------------------------------------------------------ cache
def test_index_cache_reused_when_unchanged_rebuilt_when_inputs_change(corpora, tmp_path, monkeypatch):
    import shutil

    from moetrain.data.lm import shard_files

    for src in shard_files(corpora["rev_train"]):
        shutil.copy(src, tmp_path / os.path.basename(src))
    spec = [0.6, corpora["kjv_train"], 0.4, str(tmp_path / "reversed_train")]

    def sampler(spec=spec, seq_length=32, seed=0, steps=50, **kw):
        dataset = build_blended_lm_dataset(parse_blend(spec), seq_length, 2048)
        return BlendedBatchSampler(dataset, 8, steps, seed=seed, cache_dir=str(tmp_path / "cache"), **kw)

    first = sampler()
    assert first.built and first.index_path.startswith(str(tmp_path / "cache"))
    record = json.load(open(first.index_path[:-4] + ".json"))
    assert record["inputs"]["num_samples"] == 400 and record["inputs"]["weights"] == [3, 2]
    mtime = os.stat(first.index_path).st_mtime_ns
    again = sampler()
    assert not again.built and again.index_path == first.index_path
    assert os.stat(first.index_path).st_mtime_ns == mtime                   # not rewritten
    assert np.array_equal(again.index, first.index)
    changes = {"weights": dict(spec=[0.5, spec[1], 0.5, spec[3]]), "seq_length": dict(seq_length=16),
               "seed": dict(seed=1), "steps": dict(steps=60)}
    paths = {first.index_path}
    for what, kwargs in changes.items():
        changed = sampler(**kwargs)
        assert changed.built and changed.index_path not in paths, what
        paths.add(changed.index_path)
    bin_path = str(tmp_path / "reversed_train.bin")                          # the shard is re-written
    os.utime(bin_path, ns=(mtime + 10**9, mtime + 10**9))
    rewritten = sampler()
    assert rewritten.built and rewritten.index_path not in paths
    assert np.array_equal(rewritten.index, first.index)                      # same sizes, same index
    with open(rewritten.index_path[:-4] + ".json", "w") as f:
        f.write("{broken")                                                   # an interrupted write
    assert sampler().built

    # Default folder: beside the first source's shards, or the fallback when that is read-only.
    beside = BlendedBatchSampler(build_blended_lm_dataset(parse_blend(spec[2:] + spec[:2]), 32, 2048), 8, 50)
    assert os.path.dirname(beside.index_path) == str(tmp_path) and beside.built
    monkeypatch.setattr("moetrain.data.blend.os.access", lambda path, mode: False)
    fallback = BlendedBatchSampler(build_blended_lm_dataset(parse_blend(spec[2:] + spec[:2]), 32, 2048), 8, 50,
                                   fallback_cache_dir=str(tmp_path / "run" / "data_cache"))
    assert os.path.dirname(fallback.index_path) == str(tmp_path / "run" / "data_cache")
    with pytest.raises(DataError, match=r"read-only .*set data\.cache_dir"):
        BlendedBatchSampler(build_blended_lm_dataset(parse_blend(spec[2:] + spec[:2]), 32, 2048), 8, 50)


# ------------------------------------------------------------------------------------------ bad inputs
def test_blend_bad_sources(corpora, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.path: source 'nowhere_train': token shard .*nowhere_train"):
        build_blended_lm_dataset(parse_blend([1, corpora["kjv_train"], 1, str(tmp_path / "nowhere_train")]), 32, 2048)
    preprocess([str(corpora["root"] / "reversed.jsonl")], TOKENIZER, str(tmp_path / "same"))
    from moetrain.data.tokenizer import train_tokenizer

    other = train_tokenizer([os.path.join(KJV, "kjv_tiny.txt")], str(tmp_path / "other"), 300)
    preprocess([str(corpora["root"] / "reversed.jsonl")], other, str(tmp_path / "other_tok"))
    with pytest.raises(DataError, match=r"different tokenizers \(kjv_tiny_train: .*other_tok: .*other\.model"):
        build_blended_lm_dataset(parse_blend([1, corpora["kjv_train"], 1, str(tmp_path / "other_tok")]), 32, 2048)
    tiny = build_blended_lm_dataset(parse_blend([1, str(tmp_path / "same")]), 4096, 2048)
    with pytest.raises(DataError, match=r"blend has \d+ samples, fewer than one global batch of 64"):
        BlendedBatchSampler(tiny, 64, 10, cache_dir=str(tmp_path))


# ------------------------------------------------------------------------------------------ evaluation
def test_evaluate_sources_weights_the_total():
    class Source:
        def __init__(self, loss):
            self.loss = loss

    eval_set = BlendedDataset([("a", 1, [Source(2.0)] * 4), ("b", 3, [Source(4.0)] * 4)])
    seen = []

    def evaluate_one(dataset):
        seen.append(dataset)
        return {"eval_loss": dataset[0].loss}

    record = evaluate_sources(eval_set, evaluate_one)
    assert record == {"eval_loss": 0.25 * 2.0 + 0.75 * 4.0, "eval_loss/a": 2.0, "eval_loss/b": 4.0}
    assert seen == eval_set.datasets
    assert evaluate_sources(["plain"], lambda d: {"eval_loss": 1.5, "eval_accuracy": 0.5}) == \
        {"eval_loss": 1.5, "eval_accuracy": 0.5}


def run_blend_training(corpora, tmp_path, steps, model):
    """`moetrain train configs/moe_tiny.yaml --set ...` with the blend, through the Trainer API."""
    from moetrain.trainer import Trainer

    rev = corpora["root"] / "reversed"
    cfg = load_config(os.path.join(REPO, "configs", "moe_tiny.yaml"), [
        f"data.path=[0.6, {corpora['kjv_train']}, 0.4, {rev}_train]",
        f"data.eval_path={{kjv: [0.6, {corpora['kjv_eval']}], reversed: [0.4, {rev}_eval]}}",
        f"data.cache_dir={tmp_path / 'cache'}", f"data.tokenizer={TOKENIZER}",
        f"train.output_dir={tmp_path / 'run'}", f"train.steps={steps}", "train.global_batch_size=8",
        "lr_schedule.warmup_steps=10", f"train.eval_interval={steps // 2}", "train.eval_max_batches=4",
        "checkpoint.save_at_end=false", "logging.tensorboard=false", "logging.progress_bar=false",
        "model.moe.bias_update_rate=0.001"] + model)
    result = Trainer(cfg).fit()
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    return result, [r for r in records if "eval_loss" in r]


def test_blend_trains_through_the_trainer_with_per_source_eval(corpora, tmp_path):
    result, evals = run_blend_training(corpora, tmp_path, 20, [
        "model.seq_length=32", "model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.moe.num_experts=4", "model.moe.ffn_hidden_size=64", "train.eval_max_batches=2",
        "lr_schedule.warmup_steps=3"])
    assert [r["step"] for r in evals] == [10, 20]
    for record in evals:
        assert set(record) == {"step", "eval_loss", "eval_loss/kjv", "eval_loss/reversed"}
        assert record["eval_loss"] == pytest.approx(0.6 * record["eval_loss/kjv"] + 0.4 * record["eval_loss/reversed"])
    assert evals[-1] == {"step": 20, **result["eval"]}
    for name in ("kjv", "reversed"):   # learning: down from ~ln(2048) = 7.6 nats at random init
        assert evals[1][f"eval_loss/{name}"] < evals[0][f"eval_loss/{name}"] < 7.0, name
    assert os.listdir(tmp_path / "cache")   # the run's blend index was cached where data.cache_dir says


@pytest.mark.slow
def test_blend_eval_losses_fall_below_each_corpus_unigram_entropy(corpora, tmp_path):
    """The issue's check: 200 steps; every source's eval loss below its eval split's unigram entropy."""
    import sys

    sys.path.insert(0, os.path.join(REPO, "tools"))
    from corpus_stats import token_counts, unigram_entropy
    from moetrain.data.lm import open_token_shard

    _, evals = run_blend_training(corpora, tmp_path, 200, ["model.seq_length=64", "model.num_layers=2"])
    for name, prefix in (("kjv", corpora["kjv_eval"]), ("reversed", str(corpora["root"] / "reversed_eval"))):
        entropy = unigram_entropy(token_counts(open_token_shard(prefix)))
        assert evals[-1][f"eval_loss/{name}"] < entropy - 0.1, (name, evals[-1], entropy)

