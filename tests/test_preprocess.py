"""tools/preprocess_data.py inputs (text, JSONL, parquet, globs, worker processes) and the tokenizer.json
wrapper. Every shard is compared with a reference stream built here: each document encoded on its
own, followed by EOS."""
import json
import os
import shutil
import sys

import numpy as np
import pytest

from moetrain.data.lm import LMDataset, open_token_shard, shard_files
from moetrain.data.preprocess import expand_inputs, make_units, preprocess
from moetrain.data.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV = os.path.join(REPO, "data", "kjv_tiny")
TOKENIZER = os.path.join(KJV, "kjv_tiny.model")


@pytest.fixture(scope="module")
def docs():
    """600 documents: single verses, and every 7th a paragraph of three verses with newlines inside."""
    verses = open(os.path.join(KJV, "kjv_tiny.txt"), encoding="utf-8").read().splitlines()[:900]
    out, k = [], 0
    while k < len(verses) and len(out) < 600:
        take = 3 if len(out) % 7 == 0 else 1
        out.append("\n".join(verses[k:k + take]))
        k += take
    return out


def reference(tokenizer, documents):
    ids = [tokenizer.encode(d) + [tokenizer.eos_id] for d in documents]
    return np.array([t for d in ids for t in d]), np.concatenate([[0], np.cumsum([len(d) for d in ids])])


def shard_bytes(prefix):
    return [open(path, "rb").read() for path in shard_files(prefix)[:2]]


def write_jsonl(path, documents, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(documents):
            f.write(json.dumps({"id": i, key: d}) + "\n")


def write_parquet(path, documents, row_group_size, key="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(documents))), key: documents}), path, row_group_size=row_group_size)


def test_jsonl_parquet_glob_and_workers_give_identical_shards(docs, tmp_path):
    tok = SentencePieceTokenizer(TOKENIZER)
    tokens, offsets = reference(tok, docs)
    write_jsonl(tmp_path / "all.jsonl", docs)
    for part, k in enumerate(range(0, 600, 200)):                  # the same documents in 3 files
        write_jsonl(tmp_path / f"part{part}.jsonl", docs[k:k + 200])
    write_parquet(tmp_path / "all.parquet", docs, row_group_size=64)  # 10 row groups
    runs = {
        "jsonl": dict(inputs=[str(tmp_path / "all.jsonl")]),
        "glob": dict(inputs=[str(tmp_path / "part*.jsonl")]),
        "glob_workers": dict(inputs=[str(tmp_path / "part*.jsonl")], workers=2, unit_bytes=4096),
        "parquet": dict(inputs=[str(tmp_path / "all.parquet")]),
        "parquet_workers": dict(inputs=[str(tmp_path / "all.parquet")], workers=2),
        "mixed": dict(inputs=[str(tmp_path / "part0.jsonl"), str(tmp_path / "all.parquet")]),
    }
    for name, kwargs in runs.items():
        preprocess(kwargs.pop("inputs"), TOKENIZER, str(tmp_path / name), **kwargs)
    shard = open_token_shard(str(tmp_path / "jsonl"))
    assert np.array_equal(shard.tokens, tokens) and np.array_equal(shard.doc_offsets, offsets)
    assert shard.meta["input_formats"] == ["jsonl"] and shard.meta["json_key"] == "text"
    assert len(make_units(0, str(tmp_path / "part0.jsonl"), "jsonl", "line", 4096)) > 5   # really split
    for name in ("glob", "glob_workers", "parquet", "parquet_workers"):
        assert shard_bytes(str(tmp_path / name)) == shard_bytes(str(tmp_path / "jsonl")), name
    mixed = open_token_shard(str(tmp_path / "mixed"))
    assert np.array_equal(mixed.tokens, np.concatenate([tokens[:offsets[200]], tokens]))
    assert open_token_shard(str(tmp_path / "glob")).meta["sources"] == [str(tmp_path / f"part{i}.jsonl") for i in range(3)]


def test_text_units_and_workers_match_one_process(docs, tmp_path):
    lines = [d.replace("\n", " ") for d in docs]
    text = "".join(line + ("\n\n" if i % 5 == 4 else "\n") for i, line in enumerate(lines))
    (tmp_path / "corpus.txt").write_text(text.replace("\n", "\r\n", 50), encoding="utf-8")  # some CRLF
    for boundary in ("line", "blank_line"):
        for split in (0.0, 0.1):
            one = str(tmp_path / f"one_{boundary}_{split}")
            many = str(tmp_path / f"many_{boundary}_{split}")
            a = preprocess([str(tmp_path / "corpus.txt")], TOKENIZER, one, split, document_boundary=boundary)
            b = preprocess([str(tmp_path / "corpus.txt")], TOKENIZER, many, split, document_boundary=boundary,
                           workers=2, unit_bytes=3000)
            assert a.keys() == b.keys()
            for part in a:
                suffix = "" if part == "all" else f"_{part}"
                assert shard_bytes(one + suffix) == shard_bytes(many + suffix), (boundary, split, part)
    tok = SentencePieceTokenizer(TOKENIZER)
    paragraphs = [" ".join(lines[k:k + 5]) for k in range(0, len(lines), 5)]
    assert np.array_equal(open_token_shard(str(tmp_path / "many_blank_line_0.0")).tokens, reference(tok, paragraphs)[0])
    assert np.array_equal(open_token_shard(str(tmp_path / "many_line_0.0")).tokens, reference(tok, lines)[0])
    units = make_units(0, str(tmp_path / "corpus.txt"), "text", "blank_line", 3000)
    data = open(tmp_path / "corpus.txt", "rb").read()
    assert len(units) > 10 and all(data[u.start - 4:u.start] == b"\r\n\r\n" or data[u.start - 2:u.start] == b"\n\n"
                                   for u in units[1:])                      # cut after a blank line


def test_progress_line_reports_throughput(docs, tmp_path, capsys):
    from moetrain.data.preprocess import Progress

    write_jsonl(tmp_path / "d.jsonl", docs)
    metas = preprocess([str(tmp_path / "d.jsonl")], TOKENIZER, str(tmp_path / "out"), progress=True)
    err = capsys.readouterr().err
    assert "MB/s" in err and f"{len(docs):,} documents" in err and "100%" in err
    assert metas["all"]["input_mb_per_s"] > 0
    progress = Progress(2_000_000, True)
    progress.start -= 2.0                                                    # 2 s ago
    progress.update(1_000_000, 10, 300)
    assert "1.0/2.0 MB (50%)" in progress.line() and "0.50 MB/s" in progress.line()


def test_bad_inputs_are_refused_with_the_fix(docs, tmp_path, monkeypatch):
    write_jsonl(tmp_path / "good.jsonl", docs[:5])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"input text '.*empty\.jsonl' is empty: remove it from --input"):
        preprocess([str(tmp_path / "good.jsonl"), str(tmp_path / "empty.jsonl")], TOKENIZER, str(tmp_path / "o"))
    (tmp_path / "blank.txt").write_text("\n   \n\n")
    with pytest.raises(ValueError, match=r"blank\.txt' is empty \(only blank lines\)"):
        preprocess([str(tmp_path / "blank.txt")], TOKENIZER, str(tmp_path / "o"))
    (tmp_path / "blank.jsonl").write_text('{"text": " "}\n{"text": null}\n')   # records, but no text in them
    with pytest.raises(ValueError, match=r"blank\.jsonl' is empty \(no non-blank documents\)"):
        preprocess([str(tmp_path / "good.jsonl"), str(tmp_path / "blank.jsonl")], TOKENIZER, str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o.json") and not os.path.exists(tmp_path / "o.bin")
    with pytest.raises(ValueError, match=r"good\.jsonl:1: no key 'content' in the record \(keys \['id', 'text'\]\); "
                                         r"name the text field with --json-key"):
        preprocess([str(tmp_path / "good.jsonl")], TOKENIZER, str(tmp_path / "o"), json_key="content")
    with open(tmp_path / "late.jsonl", "w") as f:                           # the key missing on line 4
        f.write('{"text": "a"}\n{"text": "b"}\n\n{"body": "c"}\n')
    with pytest.raises(ValueError, match=r"late\.jsonl:4: no key 'text'"):
        preprocess([str(tmp_path / "late.jsonl")], TOKENIZER, str(tmp_path / "o"), workers=2)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a JSON object"):
        preprocess([str(tmp_path / "bad.jsonl")], TOKENIZER, str(tmp_path / "o"))
    (tmp_path / "number.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match=r"number\.jsonl:1: 'text' holds a int, not text"):
        preprocess([str(tmp_path / "number.jsonl")], TOKENIZER, str(tmp_path / "o"))
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt' is not UTF-8 text \(byte 3.*iconv"):
        preprocess([str(tmp_path / "latin1.txt")], TOKENIZER, str(tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match=r"--input '.*nothing\*\.jsonl' matches no file"):
        expand_inputs([str(tmp_path / "nothing*.jsonl")])
    with pytest.raises(ValueError, match=r"named more than once"):
        expand_inputs([str(tmp_path / "good.jsonl"), str(tmp_path / "go*.jsonl")])
    write_parquet(tmp_path / "t.parquet", docs[:5], 2, key="body")
    with pytest.raises(ValueError, match=r"t\.parquet' has no column 'text' \(columns: \['id', 'body'\]\); name the text "
                                         r"column with --json-key"):
        preprocess([str(tmp_path / "t.parquet")], TOKENIZER, str(tmp_path / "o"))
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        preprocess([str(tmp_path / "good.jsonl")], TOKENIZER, str(tmp_path / "o"), workers=0)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)                  # pyarrow not installed
    with pytest.raises(ImportError, match=r"t\.parquet' needs pyarrow: pip install pyarrow"):
        preprocess([str(tmp_path / "t.parquet")], TOKENIZER, str(tmp_path / "o"), json_key="body")


# ------------------------------------------------------------------------------------------ tokenizer.json
@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A 400-piece byte-level BPE tokenizer.json trained here with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = open(os.path.join(KJV, "kjv_tiny.txt"), encoding="utf-8").read().splitlines()[:800]
    tok.train_from_iterator(lines, trainer)
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    return str(folder / "tokenizer.json"), lines


def test_tokenizer_json_round_trip_and_interface(hf_tokenizer, tmp_path):
    path, lines = hf_tokenizer
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and tok.kind == "huggingface" and tok.name == path
    assert tok.vocab_size == 400 and tok.eos_id == 0 and tok.eos_token == "<|endoftext|>"
    for text in lines[:200] + ["  In the  beginning\n\tGod ", "\u03a9 caf\u00e9 \u2014 \U0001F600", ""]:
        assert tok.decode(tok.encode(text)) == text                          # byte-level: any text
    assert tok.encode_batch(lines[:5]) == [tok.encode(line) for line in lines[:5]]
    assert tok.decode(tok.encode("Amen.") + [tok.eos_id]) == "Amen.<|endoftext|>"
    assert load_tokenizer(os.path.dirname(path)).checksum == tok.checksum    # a model folder
    assert isinstance(load_tokenizer(TOKENIZER), SentencePieceTokenizer)

    # The EOS token: tokenizer_config.json beside the file, else --eos-token, else refused.
    shutil.copy(path, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).eos_id == 1
    assert load_tokenizer(path, eos_token="<pad>").eos_id == 1
    with pytest.raises(ValueError, match=r"eos_token '<nope>' is not in its vocabulary.*--eos-token"):
        load_tokenizer(path, eos_token="<nope>")
    with pytest.raises(ValueError, match=r"--eos-token applies to tokenizer\.json only"):
        load_tokenizer(TOKENIZER, eos_token="</s>")
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ValueError, match=r"broken\.json' is not a valid Hugging Face tokenizer\.json"):
        load_tokenizer(str(tmp_path / "broken.json"))
    os.makedirs(tmp_path / "no_tokenizer")
    with pytest.raises(FileNotFoundError, match=r"no_tokenizer' holds neither tokenizer\.json nor tokenizer\.model"):
        load_tokenizer(str(tmp_path / "no_tokenizer"))


def test_preprocess_and_train_data_with_tokenizer_json(hf_tokenizer, docs, tmp_path):
    path, _ = hf_tokenizer
    tok = load_tokenizer(path)
    write_jsonl(tmp_path / "d.jsonl", docs)
    meta = preprocess([str(tmp_path / "d.jsonl")], path, str(tmp_path / "hf"), workers=2, unit_bytes=8192)["all"]
    assert (meta["tokenizer_kind"], meta["tokenizer_sha256"], meta["vocab_size"], meta["eos_id"]) == \
        ("huggingface", tok.checksum, 400, 0)
    tokens, offsets = reference(tok, docs)
    shard = open_token_shard(str(tmp_path / "hf"))
    assert np.array_equal(shard.tokens, tokens) and np.array_equal(shard.doc_offsets, offsets)
    assert [tok.decode(shard.tokens[a:b - 1]) for a, b in zip(offsets[:-1], offsets[1:])] == docs  # newlines kept
    dataset = LMDataset(str(tmp_path / "hf"), 64, vocab_size=512, tokenizer_path=path)   # data.tokenizer: the json
    assert len(dataset) == (len(tokens) - 1) // 64
    assert len(LMDataset(str(tmp_path / "hf"), 64, tokenizer_path=os.path.dirname(path))) == len(dataset)
    from moetrain.data import DataError

    with pytest.raises(DataError, match=r"vocabulary mismatch: .*400-token vocabulary.*vocab_size=256"):
        LMDataset(str(tmp_path / "hf"), 64, vocab_size=256)
    with pytest.raises(DataError, match=r"tokenizer mismatch: .*tokenizer\.json.*kjv_tiny\.model"):
        LMDataset(str(tmp_path / "hf"), 64, tokenizer_path=TOKENIZER)
