"""Bad inputs refused before work with what, where and how to fix (issue 16): config counts,
sequence lengths, errors blamed on the `--set` that caused them, the data-parallel size inferred
from the world, `plan --world`, token shards with ids past the vocabulary or a broken index, and
text tools on empty, blank or binary files (a message, no traceback)."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from moetrain.config import ConfigError, load_config
from moetrain.data import DataError
from moetrain.data.lm import LMDataset, shard_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE_TINY = os.path.join(REPO, "configs", "moe_tiny.yaml")
GPT_TINY = os.path.join(REPO, "configs", "gpt_tiny.yaml")
KJV = os.path.join(REPO, "data", "kjv_tiny")


@pytest.mark.parametrize("item, message", [
    ("train.eval_interval=-5", r"'train.eval_interval': must be >= 0 .*got -5"),
    ("train.stop_after=-1", r"'train.stop_after': must be >= 0"),
    ("train.eval_max_batches=-2", r"'train.eval_max_batches': must be >= 0"),
    ("train.eval_batch_size=-8", r"'train.eval_batch_size': must be >= 0"),
    ("train.seed=-1", r"'train.seed': must be >= 0"),
    ("lr_schedule.warmup_steps=-10", r"'lr_schedule.warmup_steps': must be >= 0"),
    ("lr_schedule.decay_steps=-1", r"'lr_schedule.decay_steps': must be >= 0"),
    ("optimizer.weight_decay=-0.1", r"'optimizer.weight_decay': must be >= 0"),
    ("optimizer.beta2=1.5", r"'optimizer.beta2': must be in \[0, 1\)"),
    ("train.nonfinite_limit=-1", r"'train.nonfinite_limit': must be >= 0"),
    ("train.loss_spike_factor=0.5", r"'train.loss_spike_factor': must be 0 \(off\) or > 1"),
    ("checkpoint.on_save_error=ignore", r"'checkpoint.on_save_error' = 'ignore' is not one of 'stop', 'continue'"),
])
def test_negative_counts_and_bad_values_are_blamed_on_their_set(item, message):
    with pytest.raises(ConfigError, match=rf"^--set {item} \(on top of .*moe_tiny\.yaml\): key " + message):
        load_config(MOE_TINY, [item])


def test_data_longer_than_the_model_is_refused_at_load_naming_both_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set data.seq_length=256 .*'data.seq_length': 256 is longer than "
                                          r"'model.seq_length' \(128\).*lower data.seq_length or raise"):
        load_config(MOE_TINY, ["data.seq_length=256"])
    config = tmp_path / "long.yaml"
    config.write_text(f"base: {MOE_TINY}\ndata:\n  seq_length: 512\n")
    # the same error from the file names the file, even when an unrelated --set is given
    with pytest.raises(ConfigError, match=rf"^{config}: key 'data.seq_length': 512 is longer"):
        load_config(str(config), ["optimizer.lr=1e-3"])


def test_data_parallel_is_inferred_from_the_launched_world_size(monkeypatch, capsys):
    monkeypatch.setenv("MS_WORKER_NUM", "4")
    monkeypatch.delenv("RANK_ID", raising=False)
    cfg = load_config(MOE_TINY)
    assert cfg.parallel.data_parallel == 4 and cfg.parallel.data_parallel_inferred
    assert "parallel.data_parallel inferred from the world size: 4 processes" in capsys.readouterr().err
    cfg = load_config(MOE_TINY, ["parallel.model_parallel=2"])
    assert cfg.parallel.data_parallel == 2
    assert load_config(MOE_TINY, ["parallel.data_parallel=4"]).parallel.data_parallel_inferred is False
    monkeypatch.setenv("MS_WORKER_NUM", "3")
    with pytest.raises(ConfigError, match=r"inferred as 3 processes .* = 3, which cannot split "
                                          r"train.global_batch_size=16: launch \[1, 2, 4, 8, 16\] processes"):
        load_config(MOE_TINY)
    monkeypatch.delenv("MS_WORKER_NUM")
    assert load_config(MOE_TINY).parallel.data_parallel == 1


def test_plan_never_suggests_a_data_parallel_the_batch_cannot_use(capsys):
    from moetrain.planner import main as plan

    assert plan([GPT_TINY, "--world", "3"]) == 2
    err = capsys.readouterr().err
    assert "cannot split train.global_batch_size=16" in err and "data_parallel to 3" not in err
    assert plan([GPT_TINY, "--world", "3", "--set", "parallel.data_parallel=1"]) == 2
    err = capsys.readouterr().err
    assert "data_parallel would have to be 3, which cannot split" in err and "set parallel.data_parallel=3" not in err
    assert plan([GPT_TINY, "--world", "2", "--set", "parallel.data_parallel=1"]) == 2
    assert "set parallel.data_parallel=2" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# token shards
# ---------------------------------------------------------------------------------------------
def _copy_shard(tmp_path, name="copy"):
    dst = str(tmp_path / name)
    for src, out in zip(shard_files(os.path.join(KJV, "kjv_tiny_eval")), shard_files(dst)):
        shutil.copyfile(src, out)
    return dst


def _edit_meta(prefix, **changes):
    meta_path = shard_files(prefix)[2]
    meta = json.load(open(meta_path))
    meta.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del meta[key]
    json.dump(meta, open(meta_path, "w"))


def test_token_ids_past_the_vocabulary_are_refused(tmp_path):
    prefix = _copy_shard(tmp_path)
    top = int(np.memmap(shard_files(prefix)[0], np.uint16, "r").max())
    assert json.load(open(shard_files(prefix)[2])).get("max_token_id", top) == top
    _edit_meta(prefix, vocab_size=top, max_token_id=top)       # metadata that under-states the vocabulary
    with pytest.raises(DataError, match=rf"holds token ids up to {top}, but its metadata says a {top}-token "
                                        rf"vocabulary and model.vocab_size is {top}: .*tools/preprocess_data.py"):
        LMDataset(prefix, 16, vocab_size=top)
    _edit_meta(prefix, max_token_id=None)                     # a shard written before max_token_id: one memmap pass
    with pytest.raises(DataError, match=rf"holds token ids up to {top}"):
        LMDataset(prefix, 16, vocab_size=top)
    _edit_meta(prefix, vocab_size=2048)
    assert len(LMDataset(prefix, 16, vocab_size=2048)) > 0


def test_preprocessing_records_the_largest_token_id(tmp_path):
    from moetrain.data.lm import TokenShardWriter, open_token_shard

    writer = TokenShardWriter(str(tmp_path / "s"), 100)
    writer.add_documents([[5, 17, 2], [99, 2]])
    assert writer.close()["max_token_id"] == 99 and open_token_shard(str(tmp_path / "s")).max_token_id == 99


def test_truncated_or_mismatched_index_is_refused(tmp_path):
    prefix = _copy_shard(tmp_path, "cut")
    idx = shard_files(prefix)[1]
    with open(idx, "r+b") as fh:
        fh.truncate(os.path.getsize(idx) - 16)
    with pytest.raises(DataError, match=r"corrupted document index .*cut\.idx\.npy.*tools/preprocess_data\.py"):
        LMDataset(prefix, 16)
    prefix = _copy_shard(tmp_path, "other")
    shutil.copyfile(shard_files(os.path.join(KJV, "kjv_tiny_train"))[1], shard_files(prefix)[1])
    with pytest.raises(DataError, match=r"other\.idx\.npy.*num_tokens=.*or the index of another shard"):
        LMDataset(prefix, 16)


# ---------------------------------------------------------------------------------------------
# text tools
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    (root / "empty.txt").write_bytes(b"")
    (root / "blank.txt").write_bytes(b"\n   \n\t\n")
    (root / "binary.dat").write_bytes(bytes(range(256)) * 8)
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1") * 4)
    return root


def _tool(name, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", f"{name}.py"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name, message", [("empty.txt", r"is empty: remove it from --input"),
                                           ("blank.txt", r"is empty \(only blank lines\)"),
                                           ("binary.dat", r"is binary, not text \(a NUL byte at offset 0\)"),
                                           ("latin1.txt", r"is not UTF-8 text .*iconv")])
def test_preprocess_data_refuses_empty_blank_and_binary_files_without_a_traceback(text_files, tmp_path, name, message):
    out = _tool("preprocess_data", "--input", str(text_files / name), "--tokenizer",
                os.path.join(KJV, "kjv_tiny.model"), "--output-prefix", str(tmp_path / "out"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"preprocess_data.py: error: input text '{text_files / name}' ")
    assert re.search(message, out.stderr), out.stderr


def test_train_tokenizer_refuses_a_binary_file_without_a_traceback(text_files, tmp_path):
    out = _tool("train_tokenizer", "--input", str(text_files / "binary.dat"), "--model-prefix", str(tmp_path / "t"),
                "--vocab-size", "64")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "tokenizer training input" in out.stderr and "is binary, not text" in out.stderr
    assert not os.path.exists(tmp_path / "t.model")
