"""Tokenizer training (tools/train_tokenizer.py) and the sentencepiece wrapper."""
import hashlib
import importlib.util
import os

import pytest

from moetrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV_TINY = os.path.join(REPO, "data", "kjv_tiny")


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    lines = open(os.path.join(KJV_TINY, "kjv_tiny.txt"), encoding="utf-8").read().splitlines()[:1500]
    path = tmp_path_factory.mktemp("tok") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path), lines


@pytest.fixture(scope="module")
def tokenizer(corpus):
    prefix = os.path.join(os.path.dirname(corpus[0]), "tok300")
    return load_tool("train_tokenizer").main(
        ["--input", corpus[0], "--model-prefix", prefix, "--vocab-size", "300",
         "--special-tokens", "<|endoftext|>", "<|sep|>"])


def test_fixed_special_ids_and_user_tokens(tokenizer):
    assert tokenizer.vocab_size == 300
    assert (tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (0, 1, 2, 3)
    assert (UNK_ID, BOS_ID, EOS_ID, PAD_ID) == (0, 1, 2, 3)
    assert [tokenizer.id_to_piece(i) for i in range(6)] == ["<unk>", "<s>", "</s>", "<pad>", "<|endoftext|>", "<|sep|>"]
    ids = tokenizer.encode("Amen.<|endoftext|>In the beginning<|sep|>")
    assert ids.count(4) == 1 and ids.count(5) == 1  # never split into pieces
    assert tokenizer.decode(ids) == "Amen.<|endoftext|>In the beginning<|sep|>"


def test_round_trip_every_line_and_whitespace(corpus, tokenizer):
    _, lines = corpus
    encoded = tokenizer.encode_batch(lines)
    assert [tokenizer.decode(ids) for ids in encoded] == lines
    assert encoded[0] == tokenizer.encode(lines[0])
    assert all(0 <= t < 300 and t != UNK_ID for ids in encoded for t in ids)
    # Identity normalisation: repeated, leading and trailing spaces survive.
    for text in ["  And  God said ", " the earth", "light.  ", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    compression = sum(len(line) for line in lines) / sum(len(ids) for ids in encoded)
    assert compression > 2.0  # BPE merges happened: well above one token per character


def test_unseen_characters_unk_or_byte_fallback(corpus, tmp_path):
    plain = Tokenizer(train_tokenizer([corpus[0]], str(tmp_path / "plain"), 300))
    assert UNK_ID in plain.encode("God is \u03a9")
    assert plain.decode(plain.encode("God is \u03a9")) != "God is \u03a9"
    fallback = Tokenizer(train_tokenizer([corpus[0]], str(tmp_path / "bytes"), 400, byte_fallback=True))
    ids = fallback.encode("God is \u03a9")
    assert UNK_ID not in ids and fallback.decode(ids) == "God is \u03a9"


def test_training_deterministic_and_checksum(corpus, tmp_path):
    prefix = str(tmp_path / "det")
    first = Tokenizer(train_tokenizer([corpus[0]], prefix, 300)).checksum
    second = Tokenizer(train_tokenizer([corpus[0]], prefix, 300))
    assert first == second.checksum
    assert second.checksum == hashlib.sha256(open(prefix + ".model", "rb").read()).hexdigest()


def test_unigram_model_type(corpus, tmp_path):
    tok = Tokenizer(train_tokenizer([corpus[0]], str(tmp_path / "uni"), 300, model_type="unigram"))
    assert tok.vocab_size == 300 and tok.eos_id == EOS_ID
    assert all(tok.decode(tok.encode(line)) == line for line in corpus[1][:200])


def test_errors_name_the_file_and_the_fix(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no/such\.model.*tools/train_tokenizer\.py"):
        Tokenizer("no/such.model")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a protobuf \x00\x01\x02")
    with pytest.raises(ValueError, match=r"garbage\.model.*not a valid sentencepiece model"):
        Tokenizer(str(garbage))
    with pytest.raises(FileNotFoundError, match=r"missing\.txt.*does not exist"):
        train_tokenizer([str(tmp_path / "missing.txt")], str(tmp_path / "x"), 300)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt.*is empty"):
        train_tokenizer([str(empty)], str(tmp_path / "x"), 300)
    with pytest.raises(ValueError, match=r"vocab_size=100000.*Vocabulary size too high.*<= "):
        train_tokenizer([corpus[0]], str(tmp_path / "x"), 100000)
    with pytest.raises(ValueError, match="model_type must be 'bpe' or 'unigram'"):
        train_tokenizer([corpus[0]], str(tmp_path / "x"), 300, model_type="wordpiece")


def test_shipped_tokenizer():
    tok = Tokenizer(os.path.join(KJV_TINY, "kjv_tiny.model"))
    assert (tok.vocab_size, tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (2048, 0, 1, 2, 3)
    lines = open(os.path.join(KJV_TINY, "kjv_tiny.txt"), encoding="utf-8").read().splitlines()
    assert [tok.decode(ids) for ids in tok.encode_batch(lines)] == lines
