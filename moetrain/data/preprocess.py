"""Text, JSONL and parquet corpora -> token shards (`tools/preprocess_data.py` is the command line).

The input is cut into units that hold whole documents: byte ranges of text and JSONL files, cut
just after a line end (after a blank line for `blank_line` documents), and row groups of parquet
files. Worker processes encode units; the writer takes their results in input order, so the
shard is byte-identical for any number of workers. Each document is followed by the tokenizer's
EOS. With an eval fraction, everything is first written to one temporary shard, then its
documents are split into PREFIX_train and PREFIX_eval (a seeded choice of exactly
round(fraction x documents)), which needs the document count and so cannot happen earlier.
"""
from __future__ import annotations

import glob
import io
import json
import multiprocessing
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from moetrain.data.lm import TokenShardWriter, open_token_shard, shard_files, token_dtype
from moetrain.fileio import temp_path
from moetrain.data.tokenizer import check_text_file, load_tokenizer

FORMATS = ("text", "jsonl", "parquet")
UNIT_BYTES = 4 << 20        # text per work unit: large enough to amortise a task, small enough to stream
SPLIT_TOKENS = 1 << 24      # tokens copied per block when splitting off the eval set


@dataclass(frozen=True)
class Unit:
    """Whole documents of one input: bytes [start, end) of a text/JSONL file, or parquet row group `start`."""
    file_index: int
    path: str
    format: str
    start: int
    end: int
    size: int               # input bytes it accounts for (progress and MB/s)


def input_format(path: str, forced: Optional[str] = None) -> str:
    """`forced`, else by suffix: .jsonl/.ndjson/.json (one JSON object a line) -> jsonl, .parquet -> parquet,
    anything else -> text."""
    if forced:
        return forced
    name = path.lower()
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """Files named by `patterns` (paths or globs, a glob's matches sorted so the shard does not depend
    on the file system's order)."""
    files = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matched = [p for p in sorted(glob.glob(pattern, recursive=True)) if os.path.isfile(p)]
            if not matched:
                raise FileNotFoundError(f"--input {pattern!r} matches no file")
            files.extend(matched)
        elif not os.path.isfile(pattern):
            raise FileNotFoundError(f"input {pattern!r} does not exist")
        else:
            files.append(pattern)
    repeated = sorted({p for p in files if files.count(p) > 1})
    if repeated:
        raise ValueError(f"inputs {repeated} are named more than once (check overlapping globs); "
                         f"each would be encoded twice")
    return files


def _pyarrow_parquet(path: str):
    try:
        import pyarrow.parquet as pq   # optional dependency (moetrain[data]): parquet input only
    except ImportError as e:
        raise ImportError(f"reading the parquet input {path!r} needs pyarrow: pip install pyarrow "
                          f"(or pip install -e '.[data]')") from e
    return pq


def check_input(path: str, fmt: str, json_key: str) -> None:
    """Refuse an input before any encoding: an empty, blank or binary file, parquet without the text
    column, JSONL whose first record has no `json_key`."""
    if fmt != "parquet":
        check_text_file(path, "input text", fix="remove it from --input")
    elif os.path.getsize(path) == 0:
        raise ValueError(f"input {path!r} is empty (0 bytes); remove it from --input")
    if fmt == "parquet":
        pq = _pyarrow_parquet(path)
        try:
            parquet = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises ArrowInvalid and friends
            raise ValueError(f"{path!r} is not a readable parquet file ({e})") from e
        columns = parquet.schema_arrow.names
        if json_key not in columns:
            raise ValueError(f"parquet input {path!r} has no column {json_key!r} (columns: {columns}); "
                             f"name the text column with --json-key")
        if parquet.metadata.num_rows == 0:
            raise ValueError(f"parquet input {path!r} has no rows; remove it from --input")
    elif fmt == "jsonl":
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    _json_text(line.decode("utf-8", errors="replace"), json_key, f"{path}:{number}")
                    break


def _json_text(line: str, key: str, where: str) -> Optional[str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object ({e.msg}); JSONL input holds one JSON object a line") from e
    if not isinstance(record, dict) or key not in record:
        found = f"keys {list(record)[:12]}" if isinstance(record, dict) else f"a {type(record).__name__}"
        raise ValueError(f"{where}: no key {key!r} in the record ({found}); name the text field with --json-key")
    value = record[key]
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} holds a {type(value).__name__}, not text")
    return value


def make_units(file_index: int, path: str, fmt: str, boundary: str, unit_bytes: int = UNIT_BYTES) -> List[Unit]:
    if fmt == "parquet":
        metadata = _pyarrow_parquet(path).ParquetFile(path).metadata
        size, rows = os.path.getsize(path), max(1, metadata.num_rows)
        return [Unit(file_index, path, fmt, g, g + 1, size * metadata.row_group(g).num_rows // rows)
                for g in range(metadata.num_row_groups)]
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + unit_bytes < size:
            f.seek(cuts[-1] + unit_bytes)
            f.readline()                            # finish the line we landed in
            if fmt == "text" and boundary == "blank_line":
                while True:                         # a block of lines ends at a blank line
                    line = f.readline()
                    if not line or not line.decode("utf-8", errors="replace").strip():
                        break
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    cuts.append(size)
    return [Unit(file_index, path, fmt, a, b, b - a) for a, b in zip(cuts[:-1], cuts[1:])]


def unit_documents(unit: Unit, boundary: str, json_key: str) -> Iterator[str]:
    """The non-blank documents of `unit`, in order."""
    if unit.format == "parquet":
        table = _pyarrow_parquet(unit.path).ParquetFile(unit.path).read_row_group(unit.start, columns=[json_key])
        for row, value in enumerate(table.column(0).to_pylist()):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{unit.path}: row group {unit.start}, row {row}: column {json_key!r} holds a "
                                 f"{type(value).__name__}, not text")
            if value and value.strip():
                yield value
        return
    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        data = f.read(unit.end - unit.start)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{unit.path!r} is not UTF-8 text (byte {unit.start + e.start}: {e.reason}); "
                         f"convert it, e.g. with iconv") from e
    lines = io.StringIO(text, newline=None)         # universal newlines, as open() in text mode
    if unit.format == "jsonl":
        for number, line in enumerate(lines):
            if line.strip():
                try:
                    value = _json_text(line, json_key, "")
                except ValueError as e:              # name the line: count the lines before this unit
                    with open(unit.path, "rb") as f:
                        first = f.read(unit.start).count(b"\n") + 1
                    raise ValueError(f"{unit.path}:{first + number}{e}") from e
                if value and value.strip():
                    yield value
        return
    block: List[str] = []
    for line in lines:
        line = line.rstrip("\r\n")
        if boundary == "line":
            if line.strip():
                yield line
        elif line.strip():
            block.append(line)
        elif block:
            yield " ".join(block)
            block = []
    if block:
        yield " ".join(block)


class UnitEncoder:
    """Encodes a unit into (tokens, document lengths, document text bytes); one thread."""

    def __init__(self, tokenizer, append_eos: bool, boundary: str, json_key: str):
        self.tokenizer, self.boundary, self.json_key = tokenizer, boundary, json_key
        self.eos = [tokenizer.eos_id] if append_eos else []
        self.dtype = token_dtype(tokenizer.vocab_size)

    def __call__(self, unit: Unit) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        texts = list(unit_documents(unit, self.boundary, self.json_key))
        encoded = [ids + self.eos for ids in self.tokenizer.encode_batch(texts, num_threads=1)] if texts else []
        lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
        tokens = np.fromiter((t for ids in encoded for t in ids), dtype=np.int64, count=int(lengths.sum()))
        if tokens.size and tokens.max() >= self.tokenizer.vocab_size:
            raise ValueError(f"{unit.path}: the tokenizer emitted id {tokens.max()} >= its vocab_size "
                             f"{self.tokenizer.vocab_size}")
        text_bytes = np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)
        return tokens.astype(self.dtype), lengths, text_bytes


_worker_encoder: Optional[UnitEncoder] = None


def _start_worker(tokenizer_path: str, eos_token: Optional[str], append_eos: bool, boundary: str,
                  json_key: str) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker_encoder = UnitEncoder(load_tokenizer(tokenizer_path, eos_token), append_eos, boundary, json_key)


def _encode_in_worker(unit: Unit):
    return _worker_encoder(unit)


class Progress:
    """One status line on stderr: input MB done, MB/s, documents, tokens, ETA (a terminal gets it
    redrawn in place; a log file gets a line every 10% of the input)."""

    def __init__(self, total_bytes: int, enabled: bool, stream=None):
        self.total, self.enabled, self.stream = max(1, total_bytes), enabled, stream or sys.stderr
        self.tty = enabled and self.stream.isatty()
        self.bytes = self.docs = self.tokens = 0
        self.start = self.shown = time.perf_counter()
        self.next_decile = 1

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(1e-9, time.perf_counter() - self.start)

    def update(self, nbytes: int, docs: int, tokens: int) -> None:
        self.bytes, self.docs, self.tokens = self.bytes + nbytes, self.docs + docs, self.tokens + tokens
        if not self.enabled:
            return
        now, done = time.perf_counter(), self.bytes >= self.total
        if self.tty and (now - self.shown > 0.2 or done):
            self.stream.write("\r" + self.line() + ("\n" if done else ""))
        elif not self.tty and self.bytes * 10 >= self.next_decile * self.total:
            self.stream.write(self.line() + "\n")
            self.next_decile = self.bytes * 10 // self.total + 1
        else:
            return
        self.stream.flush()
        self.shown = now

    def line(self) -> str:
        rate = self.mb_per_s
        eta = (self.total - self.bytes) / 1e6 / rate if rate > 0 else 0.0
        return (f"{self.bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB ({100 * self.bytes / self.total:.0f}%) "
                f"{rate:.2f} MB/s  {self.docs:,} documents  {self.tokens:,} tokens  ETA {eta:.0f} s")


def split_names(prefix: str, eval_fraction: float) -> dict:
    return {"train": prefix + "_train", "eval": prefix + "_eval"} if eval_fraction > 0 else {"all": prefix}


def preprocess(inputs: Sequence[str], tokenizer_path: str, output_prefix: str, eval_fraction: float = 0.0,
               append_eos: bool = True, document_boundary: str = "line", split_seed: int = 0,
               json_key: str = "text", forced_format: Optional[str] = None, workers: int = 1,
               eos_token: Optional[str] = None, progress: bool = False, unit_bytes: int = UNIT_BYTES) -> dict:
    """Encode `inputs` (files or globs) into shards; returns {split name: metadata written}.
    The metadata of each split also carries `seconds` and `input_mb_per_s` of the encoding pass
    (not written to disk)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if document_boundary not in ("line", "blank_line"):
        raise ValueError(f"--document-boundary must be 'line' or 'blank_line', got {document_boundary!r}")
    if forced_format not in (None,) + FORMATS:
        raise ValueError(f"--input-format must be one of {FORMATS}, got {forced_format!r}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    tokenizer = load_tokenizer(tokenizer_path, eos_token)
    files = expand_inputs(inputs)
    formats = [input_format(p, forced_format) for p in files]
    for path, fmt in zip(files, formats):
        check_input(path, fmt, json_key)
    units = [u for i, (p, fmt) in enumerate(zip(files, formats)) for u in make_units(i, p, fmt, document_boundary, unit_bytes)]

    names = split_names(output_prefix, eval_fraction)
    whole = names.get("all", temp_path(output_prefix + "_all"))   # the unsplit shard, removed below
    writer = TokenShardWriter(whole, tokenizer.vocab_size)
    meter = Progress(sum(u.size for u in units), progress)
    docs_per_file = np.zeros(len(files), dtype=np.int64)
    doc_bytes = []
    common = dict(tokenizer=tokenizer.name, tokenizer_kind=tokenizer.kind, tokenizer_sha256=tokenizer.checksum,
                  eos_id=tokenizer.eos_id, append_eos=append_eos, document_boundary=document_boundary,
                  input_formats=sorted(set(formats)), json_key=json_key if {"jsonl", "parquet"} & set(formats) else None,
                  sources=list(files), eval_fraction=eval_fraction, split_seed=split_seed)
    try:
        for unit, (tokens, lengths, text_bytes) in zip(units, _encode_units(units, workers, tokenizer, eos_token,
                                                                            append_eos, document_boundary, json_key)):
            writer.add_stream(tokens, lengths)
            doc_bytes.append(text_bytes)
            docs_per_file[unit.file_index] += lengths.size
            meter.update(unit.size, lengths.size, tokens.size)
        for path, count in zip(files, docs_per_file):
            if count == 0:
                raise ValueError(f"input {path!r} is empty (no non-blank documents); remove it from --input")
        doc_bytes = np.concatenate(doc_bytes)
        timing = dict(seconds=time.perf_counter() - meter.start, input_mb_per_s=meter.mb_per_s)
        if eval_fraction == 0:
            meta = writer.close(split="all", num_text_bytes=int(doc_bytes.sum()), **common)
            return {"all": dict(meta, **timing)}
        writer.close(split="all", num_text_bytes=int(doc_bytes.sum()), **common)
        num_docs = doc_bytes.size
        num_eval = int(round(eval_fraction * num_docs))
        if not 0 < num_eval < num_docs:
            raise ValueError(f"--eval-fraction {eval_fraction} of {num_docs} documents gives {num_eval} eval "
                             f"documents; choose a fraction that leaves at least one document in each split")
        is_eval = np.zeros(num_docs, dtype=bool)
        is_eval[np.random.default_rng(split_seed).choice(num_docs, num_eval, replace=False)] = True
        metas = split_documents(whole, names, is_eval, doc_bytes, common)
        return {split: dict(meta, **timing) for split, meta in metas.items()}
    except BaseException:
        writer.abort()
        raise
    finally:
        if whole != names.get("all"):
            for path in shard_files(whole):
                if os.path.exists(path):
                    os.remove(path)


def _encode_units(units: List[Unit], workers: int, tokenizer, eos_token, append_eos, boundary, json_key):
    """Encoded units in input order: in this process (workers=1) or from a pool of spawned processes
    (spawn, not fork: safe when the caller has MindSpore's threads running)."""
    if workers == 1:
        encoder = UnitEncoder(tokenizer, append_eos, boundary, json_key)
        yield from map(encoder, units)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(workers, len(units)), _start_worker,
                      (tokenizer.path, eos_token, append_eos, boundary, json_key)) as pool:
        yield from pool.imap(_encode_in_worker, units)


def split_documents(whole: str, names: dict, is_eval: np.ndarray, doc_bytes: np.ndarray, common: dict) -> dict:
    """Copy the documents of the shard `whole` into names['train'] / names['eval'] by `is_eval`,
    in blocks of about SPLIT_TOKENS tokens."""
    shard = open_token_shard(whole)
    offsets, vocab = shard.doc_offsets, shard.vocab_size
    writers = {split: TokenShardWriter(names[split], vocab) for split in ("train", "eval")}
    try:
        first = 0
        while first < shard.num_documents:
            last = max(first + 1, int(np.searchsorted(offsets, offsets[first] + SPLIT_TOKENS, side="right")) - 1)
            last = min(last, shard.num_documents)
            tokens = np.asarray(shard.tokens[offsets[first]:offsets[last]])
            lengths = np.diff(offsets[first:last + 1])
            chosen = is_eval[first:last]
            per_token = np.repeat(chosen, lengths)
            writers["eval"].add_stream(tokens[per_token], lengths[chosen])
            writers["train"].add_stream(tokens[~per_token], lengths[~chosen])
            first = last
        return {split: writer.close(split=split, num_text_bytes=int(doc_bytes[is_eval == (split == "eval")].sum()),
                                    **common)
                for split, writer in writers.items()}
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise


def peak_rss_mb() -> Tuple[float, float]:
    """(this process, the largest finished child process) peak resident memory in MB. This process:
    VmHWM from /proc (Linux), as ru_maxrss would also count the parent's memory it was forked from;
    children: ru_maxrss, which may include the memory of this process at the time they were spawned."""
    try:
        with open("/proc/self/status") as f:
            own = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
