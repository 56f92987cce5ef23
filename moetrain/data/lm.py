"""Token shards on disk and the packed language-modelling dataset over them.

A shard `PREFIX` is three files written by `tools/preprocess_data.py`:
  PREFIX.bin      the concatenated token stream, raw uint16 (vocab <= 65536) or uint32
  PREFIX.idx.npy  int64 document offsets into the stream, `num_documents + 1` entries
  PREFIX.json     metadata: dtype, num_tokens, vocab_size, max_token_id, eos_id, tokenizer sha256, sources
Each document ends with EOS (unless written with --no-append-eos), so a packed sample that spans
documents sees the boundary. The stream is read through a memory map: opening is O(1) in the
data size and a sample is one contiguous slice. docs/data.md has the measurements behind this.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import numpy as np

from moetrain.data.errors import DataError
from moetrain.data.tokenizer import resolve_tokenizer_path
from moetrain.fileio import sha256_of

FORMAT_VERSION = 1
_FIX = "regenerate it with tools/preprocess_data.py"


def shard_files(prefix: str) -> Tuple[str, str, str]:
    """(tokens, document index, metadata) file paths of the shard `prefix`."""
    return prefix + ".bin", prefix + ".idx.npy", prefix + ".json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class TokenShardWriter:
    """Streams documents (token id sequences) into the shard `prefix`; `close(meta)` finishes it."""

    def __init__(self, prefix: str, vocab_size: int):
        self.prefix, self.vocab_size = prefix, vocab_size
        self.dtype = token_dtype(vocab_size)
        self.bin_path, self.idx_path, self.meta_path = shard_files(prefix)
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        # The metadata is written last, so a shard whose writing did not finish cannot be opened.
        if os.path.exists(self.meta_path):
            os.remove(self.meta_path)
        self._bin = open(self.bin_path, "wb")
        self._lengths = []          # int64 arrays of document lengths, one per add call
        self.num_tokens = 0
        self._max_id = -1

    def add_documents(self, documents: Iterable[Iterable[int]]) -> None:
        arrays = [np.asarray(doc, dtype=np.int64) for doc in documents]
        if arrays:
            self.add_stream(np.concatenate(arrays), np.array([a.size for a in arrays], dtype=np.int64))

    def add_stream(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one concatenated token stream and their lengths."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"document lengths add up to {int(lengths.sum())}, the stream has {tokens.size} tokens")
        if tokens.size and ((tokens.dtype.kind == "i" and tokens.min() < 0) or tokens.max() >= self.vocab_size):
            raise DataError(f"token id out of range [0, {self.vocab_size}) while writing {self.bin_path!r}")
        if tokens.size:
            self._max_id = max(self._max_id, int(tokens.max()))
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(lengths)
        self.num_tokens += tokens.size

    def close(self, **meta) -> dict:
        """Write the index and metadata (`meta` adds keys such as the tokenizer checksum)."""
        self._bin.close()
        if self.num_tokens == 0:
            os.remove(self.bin_path)
            raise DataError(f"no tokens to write to {self.prefix!r}: every input document was empty")
        lengths = np.concatenate(self._lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        np.save(self.idx_path, offsets)
        meta = dict(format_version=FORMAT_VERSION, dtype=self.dtype.name, vocab_size=self.vocab_size,
                    num_tokens=self.num_tokens, num_documents=lengths.size, max_token_id=self._max_id, **meta)
        with open(self.meta_path, "w") as f:
            json.dump(meta, f, indent=1)
        return meta

    def abort(self) -> None:
        """Close and delete what was written (an error stopped the run)."""
        self._bin.close()
        for path in (self.bin_path, self.idx_path):
            if os.path.exists(path):
                os.remove(path)


@dataclass
class TokenShard:
    prefix: str
    tokens: np.ndarray       # memory-mapped, read-only, [num_tokens]
    doc_offsets: np.ndarray  # int64 [num_documents + 1]; document d is tokens[off[d]:off[d+1]]
    meta: dict

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.doc_offsets.shape[0]) - 1

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def max_token_id(self) -> int:
        """The largest token id in the shard: recorded by the writer; for shards written before it
        was, one pass over the memory map (then kept for this process)."""
        if "max_token_id" not in self.meta:
            self.meta["max_token_id"] = int(self.tokens.max())
        return int(self.meta["max_token_id"])


def open_token_shard(prefix: str) -> TokenShard:
    """Open and validate the shard `prefix` (a path without the .bin/.idx.npy/.json suffix)."""
    prefix = os.fspath(prefix)
    bin_path, idx_path, meta_path = shard_files(prefix)
    missing = [p for p in (bin_path, idx_path, meta_path) if not os.path.isfile(p)]
    if missing:
        nearby = [p for p in (prefix + "_train", prefix + "_eval", prefix.rsplit(".", 1)[0])
                  if p != prefix and os.path.isfile(p + ".json")]
        raise FileNotFoundError(
            f"token shard {prefix!r} is missing {missing}; data.path / data.eval_path must be the "
            f"prefix given to tools/preprocess_data.py --output-prefix, plus _train or _eval when it "
            f"split off an eval set, without a file suffix" + (f" (did you mean {nearby}?)" if nearby else ""))
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        dtype = np.dtype(meta["dtype"])
        num_tokens = int(meta["num_tokens"])
        version = meta["format_version"]
        if dtype not in (np.uint16, np.uint32) or int(meta["vocab_size"]) < 1:
            raise DataError(f"dtype {dtype.name} / vocab_size {meta['vocab_size']} are not a valid pair")
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"corrupted shard metadata {meta_path!r} ({type(e).__name__}: {e}); {_FIX}") from e
    if version != FORMAT_VERSION:
        raise DataError(f"{meta_path!r} has format_version {version}, this code reads {FORMAT_VERSION}; {_FIX}")
    if num_tokens == 0:
        raise DataError(f"token shard {prefix!r} is empty (0 tokens); {_FIX} from non-empty text")
    expected_bytes = num_tokens * dtype.itemsize
    actual_bytes = os.path.getsize(bin_path)
    if actual_bytes != expected_bytes:
        raise DataError(f"corrupted token file {bin_path!r}: {actual_bytes} bytes, but {meta_path!r} says "
                         f"{num_tokens} {dtype.name} tokens = {expected_bytes} bytes; {_FIX}")
    try:
        offsets = np.load(idx_path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"corrupted document index {idx_path!r} ({e}); {_FIX}") from e
    if (offsets.ndim != 1 or offsets.dtype != np.int64 or offsets.size < 2 or offsets[0] != 0
            or offsets[-1] != num_tokens or np.any(np.diff(offsets) < 0)):
        raise DataError(f"corrupted document index {idx_path!r}: expected non-decreasing int64 offsets "
                         f"from 0 to num_tokens={num_tokens} ({meta_path!r}, {bin_path!r}), got {offsets.dtype} "
                         f"shape {offsets.shape} first/last {offsets[:1].tolist()}/{offsets[-1:].tolist()} (truncated, "
                         f"or the index of another shard); {_FIX}")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,))
    return TokenShard(prefix, tokens, offsets, meta)


class LMDataset:
    """Packed next-token samples over the token stream of one shard.

    Sample `i` is the window `stream[i*S : i*S + S + 1]`: `input_ids` its first S tokens and
    `labels` its last S, both int32. Consecutive samples share one boundary token, so every
    token but the first is a label exactly once per epoch. Order, sharding and resumption come
    from `moetrain.data.sampler.GlobalBatchSampler`, which draws indices into this dataset.

    Document-aware attention (`reset_attention_mask`, `reset_position_ids`, the data.* keys of the
    same names): a sample then has four fields, `fields` names them:
      document_ids  int32 [S]: 0 for the document the window starts in, +1 at each document start
                    inside it (from the shard's document index; a document's EOS has its id);
                    all 0 unless reset_attention_mask. Attend only where query and key ids are equal.
      position_ids  int32 [S]: the token's position in its document, counted from the window start
                    for the first one (as Megatron's reset_position_ids); arange(S) unless
                    reset_position_ids.

    `vocab_size` (the model's) must cover the data's vocabulary; a larger one is fine (e.g. padded
    to a multiple of the tensor-parallel size). `tokenizer_path`, if given, must be the model the
    shard was encoded with (compared by sha256).
    """

    def __init__(self, path_prefix: str, seq_length: int, vocab_size: Optional[int] = None,
                 tokenizer_path: Optional[str] = None, reset_attention_mask: bool = False,
                 reset_position_ids: bool = False):
        if not isinstance(seq_length, (int, np.integer)) or seq_length < 1:
            raise DataError(f"seq_length must be a positive integer, got {seq_length!r} (data.seq_length)")
        self.shard = open_token_shard(path_prefix)
        self.seq_length = int(seq_length)
        self.reset_attention_mask, self.reset_position_ids = reset_attention_mask, reset_position_ids
        prefix, data_vocab = self.shard.prefix, self.shard.vocab_size
        if vocab_size is not None and vocab_size < data_vocab:
            raise DataError(
                f"vocabulary mismatch: {prefix!r} was encoded with a {data_vocab}-token vocabulary "
                f"(tokenizer {self.shard.meta.get('tokenizer')!r}) but the model has vocab_size={vocab_size}; "
                f"set model.vocab_size to at least {data_vocab} or re-encode the data with a matching tokenizer")
        max_id = self.shard.max_token_id     # < data_vocab <= model.vocab_size, or the embedding is overrun
        if max_id >= data_vocab:
            raise DataError(
                f"{prefix!r} holds token ids up to {max_id}, but its metadata says a {data_vocab}-token vocabulary"
                + (f" and model.vocab_size is {vocab_size}" if vocab_size is not None and max_id >= vocab_size else "")
                + ": ids past the vocabulary would index past the embedding table (the shard is damaged or was "
                f"written by another tool); re-encode the text with tools/preprocess_data.py and this model's tokenizer")
        if tokenizer_path is not None:
            tokenizer_path = resolve_tokenizer_path(tokenizer_path)
            if not os.path.isfile(tokenizer_path):
                raise FileNotFoundError(f"tokenizer model {tokenizer_path!r} (data.tokenizer) does not exist; "
                                        f"{prefix!r} was encoded with {self.shard.meta.get('tokenizer')!r}")
            checksum = sha256_of(tokenizer_path)
            if checksum != self.shard.meta.get("tokenizer_sha256"):
                raise DataError(
                    f"tokenizer mismatch: {prefix!r} was encoded with {self.shard.meta.get('tokenizer')!r} "
                    f"(sha256 {self.shard.meta.get('tokenizer_sha256')}), but data.tokenizer is {tokenizer_path!r} "
                    f"(sha256 {checksum}); point data.tokenizer at the model the data was encoded with, "
                    f"or re-run tools/preprocess_data.py --tokenizer {tokenizer_path}")
        self.num_samples = (self.shard.num_tokens - 1) // self.seq_length
        if self.num_samples == 0:
            raise DataError(
                f"{prefix!r} has {self.shard.num_tokens} tokens, too few for one sample of seq_length="
                f"{self.seq_length} (which needs {self.seq_length + 1}); lower data.seq_length or use more data")

    @property
    def vocab_size(self) -> int:
        return self.shard.vocab_size

    @property
    def eos_id(self) -> Optional[int]:
        return self.shard.meta.get("eos_id")

    def __len__(self) -> int:
        return self.num_samples

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_length

    @property
    def fields(self) -> Tuple[str, ...]:
        if self.reset_attention_mask or self.reset_position_ids:
            return "input_ids", "labels", "document_ids", "position_ids"
        return "input_ids", "labels"

    def __getitem__(self, index: int) -> Tuple[np.ndarray, ...]:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.shard.prefix!r} with {self.num_samples} samples")
        return tuple(field[0] for field in self.batch([index]))

    def batch(self, indices) -> Tuple[np.ndarray, ...]:
        """Samples `indices` stacked: (input_ids, labels[, document_ids, position_ids]), int32
        [len(indices), S] each (see `fields`); one gather."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_samples):
            raise IndexError(f"sample indices {indices.min()}..{indices.max()} out of range for "
                             f"{self.shard.prefix!r} with {self.num_samples} samples")
        positions = indices[:, None] * self.seq_length + np.arange(self.seq_length + 1)
        windows = self.shard.tokens[positions].astype(np.int32)
        batch = (np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:]))
        if len(self.fields) == 2:
            return batch
        return batch + self.document_layout(positions[:, :-1])

    def document_layout(self, positions: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(document_ids, position_ids) int32 for the stream positions [B, S] of input tokens."""
        documents = np.searchsorted(self.shard.doc_offsets, positions, side="right") - 1
        document_ids = (documents - documents[:, :1]).astype(np.int32)
        if self.reset_position_ids:
            starts = np.maximum(self.shard.doc_offsets[documents], positions[:, :1])
            position_ids = (positions - starts).astype(np.int32)
        else:
            position_ids = np.broadcast_to(np.arange(positions.shape[1], dtype=np.int32), positions.shape).copy()
        if not self.reset_attention_mask:
            document_ids[:] = 0
        return document_ids, position_ids


def build_lm_dataset(path_prefix: str, seq_length: int, vocab_size: int,
                     tokenizer_path: Optional[str] = None, reset_attention_mask: bool = False,
                     reset_position_ids: bool = False) -> LMDataset:
    """The dataset for config keys data.path (or data.eval_path) as one prefix, data.seq_length,
    model.vocab_size, data.tokenizer, data.reset_attention_mask and data.reset_position_ids."""
    if not path_prefix:
        raise DataError("no data path given: set data.path (and data.eval_path) to the --output-prefix "
                         "of tools/preprocess_data.py, e.g. data/kjv_tiny/kjv_tiny_train")
    return LMDataset(path_prefix, seq_length, vocab_size, tokenizer_path, reset_attention_mask, reset_position_ids)
