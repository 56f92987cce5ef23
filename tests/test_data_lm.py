"""Preprocessing (tools/preprocess_data.py), token shards, LMDataset + GlobalBatchSampler, corpus stats.

Every check compares against a reference token stream built here independently: each non-blank
line encoded on its own with the tokenizer, followed by EOS.
"""
import collections
import importlib.util
import json
import math
import os
import shutil

import numpy as np
import pytest

from moetrain.data import DataError
from moetrain.data.lm import LMDataset, build_lm_dataset, open_token_shard, shard_files
from moetrain.data.sampler import GlobalBatchSampler, collate
from moetrain.data.tokenizer import EOS_ID, Tokenizer, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV_TINY = os.path.join(REPO, "data", "kjv_tiny")
VOCAB = 300


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preprocess_tool = load_tool("preprocess_data")
corpus_stats_tool = load_tool("corpus_stats")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A 400-line KJV corpus (with blank lines sprinkled in), its tokenizer and its encoded shard."""
    root = tmp_path_factory.mktemp("lm")
    lines = open(os.path.join(KJV_TINY, "kjv_tiny.txt"), encoding="utf-8").read().splitlines()[:400]
    text = "".join(line + ("\n\n" if i % 50 == 49 else "\n") for i, line in enumerate(lines))
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    tokenizer = Tokenizer(train_tokenizer([str(root / "corpus.txt")], str(root / "tok"), VOCAB))
    preprocess_tool.main(["--input", str(root / "corpus.txt"), "--tokenizer", tokenizer.path,
                          "--output-prefix", str(root / "all")])
    reference = np.array([t for line in lines for t in tokenizer.encode(line) + [EOS_ID]])
    return dict(root=root, lines=lines, tokenizer=tokenizer, prefix=str(root / "all"), reference=reference)


def copy_shard(src_prefix, dst_prefix):
    for src, dst in zip(shard_files(src_prefix), shard_files(dst_prefix)):
        shutil.copyfile(src, dst)
    return dst_prefix


def test_shard_holds_reference_stream(work):
    shard = open_token_shard(work["prefix"])
    ref = work["reference"]
    assert shard.tokens.dtype == np.uint16 and np.array_equal(shard.tokens, ref)
    lengths = [len(work["tokenizer"].encode(line)) + 1 for line in work["lines"]]
    assert np.array_equal(shard.doc_offsets, np.concatenate([[0], np.cumsum(lengths)]))
    assert shard.meta["num_documents"] == len(work["lines"]) == shard.num_documents  # blank lines skipped
    assert shard.meta["tokenizer_sha256"] == work["tokenizer"].checksum
    assert (shard.vocab_size, shard.meta["eos_id"], shard.meta["num_tokens"]) == (VOCAB, EOS_ID, len(ref))
    assert os.path.getsize(shard_files(work["prefix"])[0]) == 2 * len(ref)


@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_items_are_next_token_windows(work, seq_length):
    ref = work["reference"]
    dataset = LMDataset(work["prefix"], seq_length, vocab_size=VOCAB, tokenizer_path=work["tokenizer"].path)
    assert len(dataset) == (len(ref) - 1) // seq_length
    for i in list(range(len(dataset)))[:: max(1, len(dataset) // 300)] + [len(dataset) - 1]:
        inputs, labels = dataset[np.int64(i)]
        assert inputs.dtype == labels.dtype == np.int32 and inputs.shape == labels.shape == (seq_length,)
        assert np.array_equal(inputs, ref[i * seq_length:(i + 1) * seq_length])
        assert np.array_equal(labels, ref[i * seq_length + 1:(i + 1) * seq_length + 1])
    with pytest.raises(IndexError, match=f"out of range.*{len(dataset)} samples"):
        dataset[len(dataset)]
    assert dataset.tokens_per_sample == seq_length


def test_vectorised_batch_equals_per_sample_collate(work):
    dataset = LMDataset(work["prefix"], 16)
    indices = np.random.default_rng(0).permutation(len(dataset))[:12]
    inputs, labels = dataset.batch(indices)
    expected_inputs, expected_labels = collate(dataset, indices)
    assert inputs.dtype == labels.dtype == np.int32 and inputs.flags["C_CONTIGUOUS"]
    assert np.array_equal(inputs, expected_inputs) and np.array_equal(labels, expected_labels)
    with pytest.raises(IndexError, match=f"sample indices 0..{len(dataset)} out of range"):
        dataset.batch([0, len(dataset)])


def test_document_boundaries_are_eos(work):
    shard, tok = open_token_shard(work["prefix"]), work["tokenizer"]
    ends = shard.doc_offsets[1:] - 1
    assert np.all(shard.tokens[ends] == EOS_ID)
    assert np.count_nonzero(shard.tokens == EOS_ID) == shard.num_documents  # and nowhere else
    starts = shard.doc_offsets[:-1]
    assert [tok.decode(shard.tokens[a:b - 1]) for a, b in zip(starts, ends + 1)] == work["lines"]


def test_no_append_eos_and_blank_line_documents(work):
    root, tok = work["root"], work["tokenizer"]
    preprocess_tool.main(["--input", str(root / "corpus.txt"), "--tokenizer", tok.path,
                          "--output-prefix", str(root / "noeos"), "--no-append-eos"])
    shard = open_token_shard(str(root / "noeos"))
    assert np.array_equal(shard.tokens, [t for line in work["lines"] for t in tok.encode(line)])
    assert shard.meta["append_eos"] is False

    preprocess_tool.main(["--input", str(root / "corpus.txt"), "--tokenizer", tok.path,
                          "--output-prefix", str(root / "para"), "--document-boundary", "blank_line"])
    shard = open_token_shard(str(root / "para"))
    paragraphs = [" ".join(work["lines"][k:k + 50]) for k in range(0, len(work["lines"]), 50)]
    assert shard.num_documents == len(paragraphs) == 8
    assert np.array_equal(shard.tokens, [t for p in paragraphs for t in tok.encode(p) + [EOS_ID]])


def test_eval_split_partitions_documents_deterministically(work):
    root, tok, n = work["root"], work["tokenizer"], len(work["lines"])

    def split(name, seed):
        preprocess_tool.main(["--input", str(root / "corpus.txt"), "--tokenizer", tok.path, "--output-prefix",
                              str(root / name), "--eval-fraction", "0.1", "--split-seed", str(seed)])
        shards = [open_token_shard(str(root / f"{name}_{s}")) for s in ("train", "eval")]
        return [[tok.decode(sh.tokens[a:b - 1]) for a, b in zip(sh.doc_offsets[:-1], sh.doc_offsets[1:])]
                for sh in shards]

    train, held_out = split("s0", 0)
    assert len(held_out) == round(0.1 * n) and len(train) == n - len(held_out)
    assert sorted(train + held_out) == sorted(work["lines"])
    rank = {line: i for i, line in enumerate(work["lines"])}  # KJV verses in the slice are distinct
    assert len(rank) == n
    assert [rank[x] for x in train] == sorted(rank[x] for x in train)  # input order kept
    assert split("s0_again", 0) == [train, held_out]
    assert split("s1", 1)[1] != held_out
    for part in ("train", "eval"):
        assert open(str(root / f"s0_{part}.bin"), "rb").read() == open(str(root / f"s0_again_{part}.bin"), "rb").read()


def test_sampler_batches_disjoint_deterministic_resumable(work):
    """Uses the per-sample `collate`; the vectorised `batch` is checked equal to it above."""
    seq_length, global_batch, dp_size = 16, 8, 2
    dataset = build_lm_dataset(work["prefix"], seq_length, VOCAB)
    ref = work["reference"]
    sampler = GlobalBatchSampler(len(dataset), global_batch, seed=7)
    total_steps = 2 * sampler.steps_per_epoch + 3  # crosses two epoch boundaries

    def run(sampler, steps):
        return [[collate(dataset, sampler.rank_batch(step, rank, dp_size)) for rank in range(dp_size)]
                for step in steps]

    uninterrupted = run(sampler, range(total_steps))
    seen_per_epoch = collections.defaultdict(list)
    for step, per_rank in enumerate(uninterrupted):
        indices = [sampler.rank_batch(step, rank, dp_size) for rank in range(dp_size)]
        assert not set(indices[0]) & set(indices[1])  # ranks disjoint ...
        assert np.array_equal(np.concatenate(indices), sampler.global_batch(step))  # ... and cover the batch
        seen_per_epoch[sampler.epoch_of(step)].extend(np.concatenate(indices).tolist())
        for rank_indices, (inputs, labels) in zip(indices, per_rank):
            assert inputs.shape == (global_batch // dp_size, seq_length)
            for row, i in enumerate(rank_indices):
                assert np.array_equal(inputs[row], ref[i * seq_length:(i + 1) * seq_length])
                assert np.array_equal(labels[row], ref[i * seq_length + 1:(i + 1) * seq_length + 1])
    for epoch in (0, 1):  # within an epoch no sample repeats
        assert len(set(seen_per_epoch[epoch])) == sampler.steps_per_epoch * global_batch
    assert seen_per_epoch[0] != seen_per_epoch[1]  # reshuffled per epoch

    # Resume at step k with new dataset and sampler objects: the same batches, bit for bit.
    k = sampler.steps_per_epoch + 1
    fresh_dataset = LMDataset(work["prefix"], seq_length, VOCAB)
    fresh_sampler = GlobalBatchSampler(len(fresh_dataset), global_batch, seed=7)
    resumed = [[collate(fresh_dataset, fresh_sampler.rank_batch(step, rank, dp_size)) for rank in range(dp_size)]
               for step in range(k, total_steps)]
    for a, b in zip(uninterrupted[k:], resumed):
        for (xa, ya), (xb, yb) in zip(a, b):
            assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    other_seed = GlobalBatchSampler(len(dataset), global_batch, seed=8)
    assert not np.array_equal(other_seed.global_batch(0), sampler.global_batch(0))


def test_corpus_stats_entropy_against_naive_count(work, capsys):
    stats = corpus_stats_tool.main([work["prefix"], "--reference", work["prefix"]])
    counts = collections.Counter(work["reference"].tolist())
    total = sum(counts.values())
    entropy = -sum(c / total * math.log(c / total) for c in counts.values())
    smoothed = {t: (counts.get(t, 0) + 1) / (total + VOCAB) for t in range(VOCAB)}
    cross = -sum(c * math.log(smoothed[t]) for t, c in counts.items()) / total
    assert stats["tokens"] == total and stats["distinct_tokens"] == len(counts)
    assert stats["entropy"] == pytest.approx(entropy, rel=1e-12)
    assert stats["cross_entropy"] == pytest.approx(cross, rel=1e-12) and cross > entropy
    assert f"entropy: {entropy:.4f}" in capsys.readouterr().out


# ----------------------------------------------------------------------------- bad input


def test_missing_and_empty_inputs(work, tmp_path):
    tok = work["tokenizer"]
    with pytest.raises(FileNotFoundError,
                       match=r"nowhere/data.*missing.*nowhere/data\.bin.*preprocess_data\.py.*suffix$"):
        LMDataset("nowhere/data", 8)
    prefix = copy_shard(work["prefix"], str(tmp_path / "copy"))
    os.remove(prefix + ".idx.npy")
    with pytest.raises(FileNotFoundError, match=r"missing \[.*copy\.idx\.npy'\]"):
        LMDataset(prefix, 8)
    with pytest.raises(FileNotFoundError, match=r"did you mean \[.*all'\]"):
        LMDataset(work["prefix"] + ".bin", 8)
    with pytest.raises(DataError, match="set data.path"):
        build_lm_dataset("", 8, VOCAB)
    with pytest.raises(FileNotFoundError, match=r"input .*absent\.txt.* does not exist"):
        preprocess_tool.preprocess([str(tmp_path / "absent.txt")], tok.path, str(tmp_path / "o"))
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    with pytest.raises(ValueError, match=r"blank\.txt.* is empty .*remove it from --input"):
        preprocess_tool.preprocess([str(work["root"] / "corpus.txt"), str(blank)], tok.path, str(tmp_path / "o"))
    with pytest.raises(ValueError, match=r"--eval-fraction 0.001 of 400 documents gives 0 eval"):
        preprocess_tool.preprocess([str(work["root"] / "corpus.txt")], tok.path, str(tmp_path / "o"), 0.001)
    # An empty shard (e.g. written by hand or by another tool) is refused when opened.
    bin_path, idx_path, meta_path = shard_files(str(tmp_path / "empty"))
    open(bin_path, "wb").close()
    np.save(idx_path, np.zeros(1, dtype=np.int64))
    json.dump(dict(json.load(open(shard_files(work["prefix"])[2])), num_tokens=0, num_documents=0),
              open(meta_path, "w"))
    with pytest.raises(DataError, match=r"empty.* is empty \(0 tokens\)"):
        LMDataset(str(tmp_path / "empty"), 8)


def test_vocabulary_and_tokenizer_mismatch(work, tmp_path):
    with pytest.raises(DataError, match=r"vocabulary mismatch: .*300-token vocabulary.*vocab_size=256.*at least 300"):
        LMDataset(work["prefix"], 8, vocab_size=256)
    assert len(LMDataset(work["prefix"], 8, vocab_size=384)) > 0  # a padded model vocabulary is fine
    other = train_tokenizer([str(work["root"] / "corpus.txt")], str(tmp_path / "other"), 280)
    with pytest.raises(DataError, match=r"tokenizer mismatch: .*tok\.model.*other\.model.*--tokenizer"):
        build_lm_dataset(work["prefix"], 8, VOCAB, tokenizer_path=other)
    with pytest.raises(FileNotFoundError, match=r"gone\.model.*data\.tokenizer.* does not exist"):
        LMDataset(work["prefix"], 8, tokenizer_path=str(tmp_path / "gone.model"))


def test_sequence_longer_than_data(work):
    num_tokens = len(work["reference"])
    assert len(LMDataset(work["prefix"], num_tokens - 1)) == 1
    with pytest.raises(DataError, match=rf"has {num_tokens} tokens, too few for one sample of seq_length="
                                         rf"{num_tokens} .*lower data.seq_length"):
        LMDataset(work["prefix"], num_tokens)
    with pytest.raises(DataError, match="seq_length must be a positive integer"):
        LMDataset(work["prefix"], 0)


def test_corrupted_shards(work, tmp_path):
    def corrupt(name, edit):
        prefix = copy_shard(work["prefix"], str(tmp_path / name))
        edit(*shard_files(prefix))
        return prefix

    def truncate(bin_path, idx_path, meta_path):
        with open(bin_path, "r+b") as f:
            f.truncate(os.path.getsize(bin_path) - 2)

    def shift_last_offset(bin_path, idx_path, meta_path):
        offsets = np.load(idx_path)
        offsets[-1] -= 1
        np.save(idx_path, offsets)

    def unsort_offsets(bin_path, idx_path, meta_path):
        offsets = np.load(idx_path)
        offsets[1], offsets[2] = offsets[2], offsets[1]
        np.save(idx_path, offsets)

    def garble(path):
        return lambda *paths: open(paths[path], "wb").write(b"\x93NUMPY garbage")

    def bump_version(bin_path, idx_path, meta_path):
        json.dump(dict(json.load(open(meta_path)), format_version=99), open(meta_path, "w"))

    cases = [("truncated", truncate, r"corrupted token file .*truncated\.bin.*bytes, but"),
             ("shifted", shift_last_offset, r"corrupted document index .*shifted\.idx\.npy.*first/last \[0\]/\["),
             ("unsorted", unsort_offsets, r"corrupted document index .*non-decreasing"),
             ("garbled_idx", garble(1), r"corrupted document index .*garbled_idx\.idx\.npy"),
             ("garbled_meta", garble(2), r"corrupted shard metadata .*garbled_meta\.json"),
             ("future", bump_version, r"format_version 99, this code reads 1")]
    for name, edit, message in cases:
        with pytest.raises(DataError, match=message + r".*tools/preprocess_data\.py"):
            LMDataset(corrupt(name, edit), 8)


def test_shipped_kjv_tiny_is_consistent():
    tok = Tokenizer(os.path.join(KJV_TINY, "kjv_tiny.model"))
    train = LMDataset(os.path.join(KJV_TINY, "kjv_tiny_train"), 256, vocab_size=2048, tokenizer_path=tok.path)
    held_out = LMDataset(os.path.join(KJV_TINY, "kjv_tiny_eval"), 256, vocab_size=2048, tokenizer_path=tok.path)
    lines = open(os.path.join(KJV_TINY, "kjv_tiny.txt"), encoding="utf-8").read().splitlines()
    expected = collections.Counter(tuple(ids + [EOS_ID]) for ids in tok.encode_batch(lines))
    shipped = collections.Counter(
        tuple(shard.tokens[a:b].tolist())
        for shard in (train.shard, held_out.shard) for a, b in zip(shard.doc_offsets[:-1], shard.doc_offsets[1:]))
    assert shipped == expected  # every line, encoded by the shipped tokenizer, in exactly one split
    assert held_out.shard.num_documents == round(0.05 * len(lines))
    entropy = corpus_stats_tool.unigram_entropy(corpus_stats_tool.token_counts(held_out.shard))
    readme = open(os.path.join(KJV_TINY, "README.md"), encoding="utf-8").read()
    assert f"{entropy:.4f}" in readme  # README quotes the current eval baseline


@pytest.mark.parametrize("reset_attention_mask, reset_position_ids", [(True, True), (True, False), (False, True)])
def test_document_ids_and_positions_follow_eos(work, reset_attention_mask, reset_position_ids):
    """Reference from the token stream alone: a document ends at its EOS (the last token of the
    document), so the token after an EOS starts the next document at position 0."""
    seq_length = 48
    dataset = LMDataset(work["prefix"], seq_length, reset_attention_mask=reset_attention_mask,
                        reset_position_ids=reset_position_ids)
    assert dataset.fields == ("input_ids", "labels", "document_ids", "position_ids")
    indices = np.arange(0, len(dataset), 7)
    inputs, labels, document_ids, position_ids = dataset.batch(indices)
    assert document_ids.dtype == position_ids.dtype == np.int32
    assert document_ids.shape == position_ids.shape == inputs.shape == (indices.size, seq_length)
    for row, i in enumerate(indices):
        window = work["reference"][i * seq_length:(i + 1) * seq_length]
        doc, position, expected_docs, expected_positions = 0, 0, [], []
        for token in window:
            expected_docs.append(doc)
            expected_positions.append(position)
            doc, position = (doc + 1, 0) if token == EOS_ID else (doc, position + 1)
        assert document_ids[row].tolist() == (expected_docs if reset_attention_mask else [0] * seq_length)
        assert position_ids[row].tolist() == (expected_positions if reset_position_ids else list(range(seq_length)))
    assert document_ids.max() > 0 or not reset_attention_mask               # windows do span documents
    single = dataset[int(indices[3])]
    assert len(single) == 4 and all(np.array_equal(a, b[3]) for a, b in zip(single, (inputs, labels, document_ids,
                                                                                         position_ids)))
    assert LMDataset(work["prefix"], seq_length).fields == ("input_ids", "labels")


def test_blended_batch_carries_document_layout(work):
    from moetrain.data.blend import BlendedDataset

    parts = [LMDataset(work["prefix"], 32, reset_attention_mask=True, reset_position_ids=True) for _ in range(2)]
    blend = BlendedDataset([("a", 1, parts[0]), ("b", 1, parts[1])])
    fields = blend.batch([1, len(parts[0]) + 2, 5])
    expected = [parts[0][1], parts[1][2], parts[0][5]]
    assert len(fields) == 4 and blend.fields == parts[0].fields
    for k, field in enumerate(fields):
        assert field.dtype == np.int32 and np.array_equal(field, np.stack([e[k] for e in expected]))
