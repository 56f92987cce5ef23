"""Blended datasets: several token-shard corpora mixed with weights, exactly and resumably.

`data.path` (and `data.eval_path`) take Megatron's weighted list or a mapping that names sources:

    path: [0.7, data/kjv_tiny/kjv_tiny_train, 0.3, data/web/web_train]     # names: basenames
    path: {bible: [0.7, data/kjv_tiny/kjv_tiny_train], web: [0.3, data/web/web_train]}

Training draws sample n of the run from the source an EPDF (earliest pseudo-deadline first)
schedule gives it: source i's j-th sample is due in the window [floor((j-1)/w_i), ceil(j/w_i))
and each slot goes to the released source with the earliest deadline. On one "processor" with
weights summing to 1 this keeps every source within one sample of its share at every n
(|count_i(n) - w_i n| < 1, the Pfair lag bound), so any window of steps follows the weights to
within two samples, with no drift. Weights are read as exact decimals, so the arithmetic is
integer. Each source walks through its own epochs independently: its j-th draw is sample
perm_(seed, i, j // N_i)[j % N_i] of a per-epoch permutation.

The result, one flat int64 index per sample of the run into the sources laid end to end, is
built once and cached as an .npy file beside the first source's shards (or `data.cache_dir`, or
`<train.output_dir>/data_cache` when that folder is read-only), named by a checksum of
everything it depends on, with the sha256 of the array itself in its .json record (checked at every
open: a cache changed after it was built is rebuilt with a warning); a training rank memory-maps
it. Step s's global batch is index[s*B:(s+1)*B], a pure function of (inputs, seed, s): the same for
any parallel layout, and a resumed run needs only the step.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from moetrain.data.errors import DataError
from moetrain.data.lm import LMDataset, shard_files
from moetrain.data.sampler import BatchSampler
from moetrain.fileio import file_in_the_way, sha256_of, temp_path

INDEX_VERSION = 1
BUILD_CHUNK = 1 << 22      # samples written per block while building an index


@dataclass(frozen=True)
class BlendSource:
    name: str
    weight: float          # as written (the blend normalises: only ratios matter)
    prefix: str


def parse_blend(value, key: str = "data.path") -> Optional[List[BlendSource]]:
    """The sources of a blend spec, or None for a plain prefix string. Raises DataError for a
    malformed spec (odd-length list, a weight that is not a number >= 0, all weights 0, a prefix
    that is not a string, two sources of the same name)."""
    if isinstance(value, str):
        return None
    if isinstance(value, dict):
        pairs = []
        for name, item in value.items():
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise DataError(f"{key}: source {name!r} must be [weight, prefix], got {item!r}")
            pairs.append((str(name), item[0], item[1]))
    elif isinstance(value, (list, tuple)):
        if len(value) == 0 or len(value) % 2:
            raise DataError(f"{key}: a blend is a list [weight1, prefix1, weight2, prefix2, ...] of even length, "
                            f"got {len(value)} item(s): {list(value)!r}")
        pairs = [(None, value[k], value[k + 1]) for k in range(0, len(value), 2)]
    else:
        raise DataError(f"{key} must be a shard prefix, a list [weight1, prefix1, ...] or a mapping "
                        f"{{name: [weight, prefix]}}, got {value!r}")
    for name, weight, prefix in pairs:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0 or math.isinf(weight):
            raise DataError(f"{key}: the weight of {prefix!r} must be a finite number >= 0, got {weight!r} "
                            f"(the list alternates weight, prefix)")
        if not isinstance(prefix, str) or not prefix:
            raise DataError(f"{key}: expected a shard prefix after weight {weight!r}, got {prefix!r} "
                            f"(the list alternates weight, prefix)")
    if sum(Fraction(str(w)) for _, w, _ in pairs) == 0:
        raise DataError(f"{key}: all weights are 0; give at least one source a positive weight")
    sources = [BlendSource(name or os.path.basename(prefix.rstrip("/")), w, prefix) for name, w, prefix in pairs]
    names = [s.name for s in sources]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise DataError(f"{key}: two sources are named {repeated}; name them with the mapping form "
                        f"{{name: [weight, prefix], ...}}")
    return sources


def exact_weights(weights: Sequence[float]) -> List[int]:
    """Integer weights in the exact ratio of the decimal values written (0.3 -> 3/10), reduced."""
    fractions = [Fraction(str(w)) for w in weights]
    denominator = math.lcm(*(f.denominator for f in fractions))
    integers = [int(f * denominator) for f in fractions]
    divisor = math.gcd(*integers)
    return [i // divisor for i in integers]


def blend_schedule(weights: Sequence[float], num_samples: int) -> np.ndarray:
    """Source id of each of the first `num_samples` samples (EPDF; see the module docstring).
    Exact integer arithmetic; the schedule repeats with period sum(exact_weights)."""
    integer = exact_weights(weights)
    period = sum(integer)
    active = [i for i, w in enumerate(integer) if w > 0]
    dtype = np.uint8 if len(integer) <= 256 else np.uint16
    slots = min(num_samples, period)
    one_period = np.empty(slots, dtype=dtype)
    count = {i: 0 for i in active}
    release = {i: 0 for i in active}                               # floor(count * period / w)
    deadline = {i: -(-period // integer[i]) for i in active}       # ceil((count + 1) * period / w)
    for t in range(slots):
        chosen, due = -1, 0
        for i in active:
            if release[i] <= t and (chosen < 0 or deadline[i] < due):
                chosen, due = i, deadline[i]
        one_period[t] = chosen
        c = count[chosen] = count[chosen] + 1
        release[chosen] = c * period // integer[chosen]
        deadline[chosen] = -(-(c + 1) * period // integer[chosen])
    repeats = -(-num_samples // slots) if slots else 0
    return np.tile(one_period, repeats)[:num_samples]


def epoch_order(seed: int, source: int, epoch: int, size: int, shuffle: bool) -> np.ndarray:
    """The order in which source `source` (of `size` samples) is read in its epoch `epoch`."""
    if not shuffle:
        return np.arange(size, dtype=np.int64)
    return np.random.default_rng([seed, source, epoch]).permutation(size).astype(np.int64)


def write_blend_index(out: np.ndarray, sizes: Sequence[int], weights: Sequence[float], seed: int,
                      shuffle: bool) -> None:
    """Fill `out` (int64 [num_samples], e.g. a memory-mapped .npy) with flat sample indices into the
    sources laid end to end, in blocks of BUILD_CHUNK samples."""
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    schedule = blend_schedule(weights, out.shape[0])
    drawn = [0] * len(sizes)                 # draws so far per source
    orders: Dict[int, Tuple[int, np.ndarray]] = {}
    for first in range(0, out.shape[0], BUILD_CHUNK):
        block = schedule[first:first + BUILD_CHUNK]
        flat = np.empty(block.size, dtype=np.int64)
        for i, size in enumerate(sizes):
            where = np.flatnonzero(block == i)
            picked = np.empty(where.size, dtype=np.int64)
            done = 0
            while done < where.size:            # consecutive draws: one slice per epoch touched
                epoch, offset = divmod(drawn[i] + done, size)
                if orders.get(i, (None,))[0] != epoch:
                    orders[i] = (epoch, epoch_order(seed, i, epoch, size, shuffle))
                take = min(size - offset, where.size - done)
                picked[done:done + take] = orders[i][1][offset:offset + take]
                done += take
            flat[where] = starts[i] + picked
            drawn[i] += where.size
        out[first:first + block.size] = flat


class BlendedDataset:
    """Several datasets (LMDataset or alike: `batch`, `len`) under one flat index: sample k of source
    i is flat index starts[i] + k. Built from (name, weight as written, dataset); `sources` keeps
    (name, normalised weight, dataset) for per-source evaluation."""

    def __init__(self, sources: Sequence[Tuple[str, float, object]]):
        self.raw_weights = [weight for _, weight, _ in sources]
        total = sum(Fraction(str(w)) for w in self.raw_weights)
        self.weights = [float(Fraction(str(w)) / total) for w in self.raw_weights]
        self.names = [name for name, _, _ in sources]
        self.datasets = [dataset for _, _, dataset in sources]
        self.sources = list(zip(self.names, self.weights, self.datasets))
        self.sizes = [len(d) for d in self.datasets]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.tokens_per_sample = getattr(self.datasets[0], "tokens_per_sample", 0)
        self.fields = getattr(self.datasets[0], "fields", None)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def source_of(self, indices) -> np.ndarray:
        """Source number of each flat index."""
        return np.searchsorted(self.starts, np.asarray(indices, dtype=np.int64), side="right") - 1

    def batch(self, indices) -> Tuple[np.ndarray, ...]:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"blend sample indices {indices.min()}..{indices.max()} out of range for "
                             f"{len(self)} samples")
        sources = self.source_of(indices)
        out = None
        for i in np.unique(sources):
            rows = np.flatnonzero(sources == i)
            part = self.datasets[i].batch(indices[rows] - self.starts[i])
            if out is None:
                out = tuple(np.empty((indices.size,) + field.shape[1:], field.dtype) for field in part)
            for whole, field in zip(out, part):
                whole[rows] = field
        return out

    def __getitem__(self, index: int):
        return tuple(field[0] for field in self.batch([int(index)]))


def build_blended_lm_dataset(sources: Sequence[BlendSource], seq_length: int, vocab_size: Optional[int],
                             tokenizer_path: Optional[str] = None, reset_attention_mask: bool = False,
                             reset_position_ids: bool = False, key: str = "data.path") -> BlendedDataset:
    """One LMDataset per source (each checked as a single prefix is), all encoded with one tokenizer."""
    datasets = []
    for source in sources:
        try:
            datasets.append(LMDataset(source.prefix, seq_length, vocab_size, tokenizer_path,
                                      reset_attention_mask, reset_position_ids))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{key}: source {source.name!r}: {e}") from e
    checksums = {d.shard.meta.get("tokenizer_sha256") for d in datasets}
    if len(checksums) > 1:
        used = ", ".join(f"{s.name}: {d.shard.meta.get('tokenizer')!r}" for s, d in zip(sources, datasets))
        raise DataError(f"{key}: the sources were encoded with different tokenizers ({used}); a blend needs "
                        f"one vocabulary: re-encode them with the same tokenizer (tools/preprocess_data.py)")
    return BlendedDataset([(s.name, s.weight, d) for s, d in zip(sources, datasets)])


# ------------------------------------------------------------------------------------------ index cache
def index_inputs(dataset: BlendedDataset, seed: int, shuffle: bool, num_samples: int) -> dict:
    """Everything the index depends on, and what says the shards changed (sizes, mtimes)."""
    def stat(path):
        info = os.stat(path)
        return [os.path.basename(path), info.st_size, info.st_mtime_ns]

    sources = [dict(name=name, prefix=os.path.abspath(d.shard.prefix), num_samples=len(d),
                    seq_length=d.seq_length, files=[stat(p) for p in shard_files(d.shard.prefix)])
               for name, _, d in dataset.sources]
    return dict(version=INDEX_VERSION, sources=sources, weights=exact_weights(dataset.raw_weights),
                seed=seed, shuffle=shuffle, num_samples=num_samples)


def index_checksum(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def cache_folder(dataset: BlendedDataset, cache_dir: str = "", fallback: str = "") -> str:
    """`cache_dir` if set; else the first source's folder if writable; else `fallback`."""
    if cache_dir:
        probe = file_in_the_way(cache_dir)
        if probe:
            raise DataError(f"data.cache_dir {cache_dir!r} cannot hold the blend index cache: {probe!r} is a file; "
                            f"set data.cache_dir to a folder (or to '' for the folder of the first source's shards)")
        return cache_dir
    beside = os.path.dirname(os.path.abspath(dataset.datasets[0].shard.prefix))
    if os.access(beside, os.W_OK):
        return beside
    if not fallback:
        raise DataError(f"cannot cache the blend index: {beside!r} is read-only and no fallback folder "
                        f"was given; set data.cache_dir")
    return fallback


def _cached_index_problem(path: str, record: dict, checksum: str, num_samples: int) -> Optional[str]:
    """Why the cached index at `path` (described by `record`) cannot be used; None if it can. Its
    contents are checked against the sha256 and size recorded when it was built."""
    if record.get("checksum") != checksum:
        return "it was built from other inputs"
    index = np.load(path, mmap_mode="r")
    if index.shape != (num_samples,) or index.dtype != np.int64:
        return f"it holds {index.dtype} {index.shape}, not int64 ({num_samples},)"
    saved = record.get("index_sha256")
    if saved is None:
        return "its record has no checksum of the array (written by an older moetrain)"
    if os.path.getsize(path) != record.get("index_bytes") or sha256_of(path) != saved:
        return "its contents do not match the sha256 recorded when it was built (the file was changed or damaged)"
    return None


def load_or_build_index(dataset: BlendedDataset, seed: int, shuffle: bool, num_samples: int,
                        folder: str) -> Tuple[np.ndarray, str, bool]:
    """(memory-mapped index, its path, whether it was built now). A cached index is used when its
    record's checksum matches the inputs and the array's sha256 (recorded beside it at build) matches
    its contents; a damaged one is rebuilt with a warning. Built indices are written atomically
    (ranks that build at once write identical files; the last rename wins)."""
    inputs = index_inputs(dataset, seed, shuffle, num_samples)
    checksum = index_checksum(inputs)
    path = os.path.join(folder, f"blend-{checksum[:16]}.npy")
    record_path = path[:-len(".npy")] + ".json"
    if os.path.isfile(record_path) and os.path.isfile(path):
        try:
            with open(record_path) as f:
                record = json.load(f)
            problem = _cached_index_problem(path, record if isinstance(record, dict) else {}, checksum, num_samples)
        except (ValueError, OSError) as exc:
            problem = f"it is unreadable ({exc})"
        if problem is None:
            return np.load(path, mmap_mode="r"), path, False
        warnings.warn(f"the blend index cache {path} cannot be used: {problem}; rebuilding it")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create the blend index cache folder {folder!r} ({exc}); set data.cache_dir to "
                        f"a writable folder") from None
    start = time.perf_counter()
    tmp = temp_path(path)
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int64, shape=(num_samples,))
    write_blend_index(out, dataset.sizes, dataset.raw_weights, seed, shuffle)
    out.flush()
    del out
    record = dict(checksum=checksum, build_seconds=round(time.perf_counter() - start, 3),
                  index_sha256=sha256_of(tmp), index_bytes=os.path.getsize(tmp), inputs=inputs)
    os.replace(tmp, path)
    record_tmp = temp_path(record_path)
    with open(record_tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(record_tmp, record_path)   # written last: it marks the index complete
    return np.load(path, mmap_mode="r"), path, True


class BlendedBatchSampler(BatchSampler):
    """Global batches of a blend from its cached index (`load_or_build_index`); the same interface
    as GlobalBatchSampler. `steps_per_epoch` counts one pass over all sources' samples together.
    A step past `num_steps` (a fault rollback that skips batches, or more train.steps on resume)
    extends the index: its start does not depend on its length, so earlier batches stay the same."""

    def __init__(self, dataset: BlendedDataset, global_batch_size: int, num_steps: int, seed: int = 0,
                 shuffle: bool = True, cache_dir: str = "", fallback_cache_dir: str = ""):
        super().__init__(global_batch_size)
        if len(dataset) < global_batch_size:
            raise DataError(f"the blend has {len(dataset)} samples, fewer than one global batch of "
                            f"{global_batch_size}; use more data or a smaller train.global_batch_size")
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.steps_per_epoch = len(dataset) // global_batch_size
        self.folder = cache_folder(dataset, cache_dir, fallback_cache_dir)
        self._build(num_steps)

    def _build(self, num_steps: int) -> None:
        self.num_steps = num_steps
        self.index, self.index_path, self.built = load_or_build_index(
            self.dataset, self.seed, self.shuffle, num_steps * self.global_batch_size, self.folder)

    def global_batch(self, step: int) -> np.ndarray:
        if step < 0:
            raise IndexError(f"step {step} is negative")
        if step >= self.num_steps:
            self._build(max(step + 1, self.num_steps + self.num_steps // 10 + 1))
        B = self.global_batch_size
        return np.asarray(self.index[step * B:(step + 1) * B])


# ------------------------------------------------------------------------------------------ evaluation
def evaluate_sources(eval_set, evaluate_one: Callable[[object], Dict]) -> Dict:
    """Evaluation record for `eval_set`: `evaluate_one(dataset)` (a dict with at least `eval_loss`)
    for a plain dataset; for a blend, `eval_loss/<name>` per source plus `eval_loss` = the sum of
    weight x source loss (the loss on the mixture the weights describe, whatever the sources'
    sizes). Every data-parallel rank must call this alike (evaluate_one may communicate)."""
    if not isinstance(eval_set, BlendedDataset):
        return evaluate_one(eval_set)
    record, total = {}, 0.0
    for name, weight, dataset in eval_set.sources:
        loss = evaluate_one(dataset)["eval_loss"]
        record[f"eval_loss/{name}"] = loss
        total += weight * loss
    return {"eval_loss": total, **record}
