"""Sharded training checkpoints: every rank writes what it alone holds; any layout reads them back.

One checkpoint folder (`<output_dir>/checkpoints/step_NNNNNNNN/`):

    metadata.json                      step, trainer state, resolved config, parallel layout and, for
                                       every tensor, its global shape and where each piece sits
    model.safetensors                  the whole model when nothing slices it (tp = pp = ep = 1); with
                                       config.yaml the folder is then also a model directory
    model-rankNNNNN.safetensors        otherwise: the model pieces that rank writes
    optimizer.safetensors              optimizer state when it is neither sliced nor ZeRO-sharded
    optimizer-rankNNNNN.safetensors    otherwise: the optimizer pieces that rank writes
    config.yaml                        the resolved config of the run
    manifest.json                      sha256 and size of every file; written last (completeness marker)

Tensor keys do not depend on the layout: a model tensor is its Parameter name; an optimizer moment
is `<state prefix>.<parameter name>` (`adam_m.layers.0.attn.wq.weight`) at any ZeRO level; ZeRO's
fp32 masters are `zero_master.<parameter name>` (at level 0 the parameter is its own master).

A piece is the tensor a rank holds: a `ShardSpec` slice of the global tensor (tensor / expert
parallel, see `moetrain.distributed.sharding`) and, under ZeRO, the `flat` range [start, stop) of that
slice's flattened elements (the padding past the end is not saved). Inside a shard file a piece is
stored under its key. Replicas are written once, by the first holder: rank 0 of the parameter's
reduction group (dp, or edp for expert parameters) and tensor-parallel rank 0 unless the tensor is
sliced over tp. Loading assembles each tensor's global value from its pieces, then cuts out what
this rank holds in its own layout, so dp, tp, pp, ep and the ZeRO level may all change on resume.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
from safetensors import safe_open

from moetrain.checkpoint.manager import (MANIFEST, METADATA, CheckpointError, CheckpointSaveError, CheckpointWriter,
                                         latest_of_run, prune_checkpoints, read_manifest, sha256_of, verify_files)
from moetrain.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE, save_model_dir
from moetrain.config import model_config_from_dict
from moetrain.distributed.sharding import MASTER_PREFIX, ShardSpec, reduction_group_kind, shard_spec, tp_copies
from moetrain.distributed.topology import ParallelContext
from moetrain.faults import failed_ranks
from moetrain.param_init import region_runs
from moetrain.layout import Layout, LayoutError, ModelShape, check_layout, layout_problems
from moetrain.fileio import read_yaml

FORMAT = "moetrain-sharded-v1"
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
                      "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
PARTS = ("model", "optimizer")
_INDEX = "pieces-rank{rank:05d}.json"    # one rank's piece list; merged into metadata.json by rank 0
_FAILED = "failed-rank{rank:05d}.txt"    # an asynchronous save failed on that rank: rank 0 stops waiting
ASYNC_COMMIT_TIMEOUT_S = 600.0          # rank 0 waits this long for the other ranks' files (async save)


# ------------------------------------------------------------------------------------------------
# What one rank holds
# ------------------------------------------------------------------------------------------------
@dataclass
class LocalTensor:
    """One tensor held by this rank, and where it sits in its global tensor."""

    key: str                                  # layout-independent name (see the module docstring)
    part: str                                 # "model" or "optimizer"
    spec: ShardSpec                           # the tp/ep slice of the global tensor
    flat: Optional[Tuple[int, int]] = None    # ZeRO: [start, stop) of the slice's flattened elements
    group_kind: str = "dp"                    # reduction group whose ranks hold replicas (dp or edp)
    writes: bool = True                       # this rank saves it (the first of its replicas)
    param: Any = None                         # the Parameter to save from and load into
    fallback: Optional[str] = None            # key to load when `key` is absent (a master from its parameter)

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return (self.flat[1] - self.flat[0],) if self.flat else self.spec.local_shape()

    def valid_count(self) -> int:
        """Elements that are real data (the ZeRO padding past the end of the slice is not)."""
        if not self.flat:
            return int(np.prod(self.local_shape))
        return max(0, min(self.flat[1], int(np.prod(self.spec.local_shape()))) - self.flat[0])


def first_replica(pctx, spec: ShardSpec, group_kind: str, zero_sharded: bool) -> bool:
    """Whether this rank is the one that writes a tensor (replicas are identical: write once)."""
    if tp_copies(spec, group_kind, pctx) > 1 and pctx.tp_rank != 0:     # a copy on every tensor-parallel rank
        return False
    if zero_sharded:                                      # every group member holds another range
        return True
    return pctx.group(group_kind).rank_in_group == 0


def write_in_place(param, value: np.ndarray) -> None:
    """Copy `value` into `param`'s own memory (`ops.assign`), not `set_data`: a rollback loads into
    a trainer whose jitted graphs are compiled, and those keep the parameter's old memory. After
    `set_data` they read the replaced data (MindSpore 2.10: the pre-rollback weights, silently) or
    freed memory (2.7: garbage, then a segfault); measured, tests/test_faults.py checks it."""
    # MindSpore only where Parameters are loaded: reshard and consolidate never start it
    import mindspore as ms
    from mindspore import ops

    ops.assign(param, ms.Tensor(np.ascontiguousarray(value), dtype=param.dtype))


class _FlatRows:
    """Host copies of ZeRO's flat rows (optimizer state and masters), read and written once each."""

    def __init__(self):
        self.values: Dict[int, np.ndarray] = {}
        self.params: Dict[int, Any] = {}
        self.dirty = set()

    def read(self, param) -> np.ndarray:
        if id(param) not in self.values:
            self.values[id(param)], self.params[id(param)] = param.asnumpy().copy(), param
        return self.values[id(param)]

    def write(self, param, start: int, value: np.ndarray) -> None:
        self.read(param)[start:start + value.size] = value.reshape(-1)
        self.dirty.add(id(param))

    def flush(self) -> None:
        for key in sorted(self.dirty):
            write_in_place(self.params[key], self.values[key])
        self.dirty.clear()


class _RowPiece:
    """One parameter's shard `[start, stop)` of a flat ZeRO row, with a Parameter's save/load surface.
    `set_data` stages the value on the host; `flush()` writes every staged row once."""

    def __init__(self, rows: _FlatRows, row, start: int, stop: int):
        self.rows, self.row, self.start, self.stop = rows, row, start, stop
        self.shape, self.dtype = (stop - start,), row.dtype

    def asnumpy(self) -> np.ndarray:
        return self.rows.read(self.row)[self.start:self.stop]

    def set_data(self, tensor) -> None:
        self.rows.write(self.row, self.start, tensor.asnumpy())

    def flush(self) -> None:
        self.rows.flush()


def local_tensors(model, opt_step, pctx) -> List[LocalTensor]:
    """Every model and optimizer tensor this rank holds (`opt_step`: `OptimizerStep`)."""
    out = []
    for param in model.get_parameters():
        spec, kind = shard_spec(param), reduction_group_kind(param)
        out.append(LocalTensor(param.name, "model", spec, None, kind, first_replica(pctx, spec, kind, False), param))
    rows = _FlatRows()
    for key, param, buffer, index, in_row, state in opt_step.checkpoint_pieces():
        spec, kind = shard_spec(param), reduction_group_kind(param)
        master = key.startswith(MASTER_PREFIX)
        if buffer is None:      # level 0: one state tensor per parameter
            out.append(LocalTensor(key, "optimizer", spec, None, kind, first_replica(pctx, spec, kind, False), state))
            continue
        shard, r = buffer.shards[index], buffer.group.rank_in_group
        out.append(LocalTensor(key, "optimizer", spec, (r * shard, (r + 1) * shard), kind,
                               first_replica(pctx, spec, kind, True), _RowPiece(rows, state, *in_row),
                               fallback=param.name if master else None))
    return out


def layout_of(pctx, optimizer_shard: int) -> Dict[str, int]:
    cp = {"cp": pctx.cp} if pctx.cp > 1 else {}     # context parallel; absent: 1 (as saved before it existed)
    return {"world_size": pctx.world_size, "dp": pctx.dp, "tp": pctx.tp, "pp": pctx.pp, "ep": pctx.ep,
            "etp": pctx.etp, **cp, "optimizer_shard": optimizer_shard}


def whole_parts(layout: Dict[str, int], tensors: Iterable[LocalTensor]) -> Dict[str, bool]:
    """Per part: nothing in it is sliced, so only rank 0 writes it and it is named `<part>.safetensors`."""
    unsliced = layout["tp"] == layout["pp"] == layout["ep"] == 1
    out = {part: unsliced for part in PARTS}
    for t in tensors:
        if t.spec.axis is not None or t.flat:
            out[t.part] = False
    return out


def shard_file(part: str, rank: int, whole: bool) -> str:
    return f"{part}.safetensors" if whole else f"{part}-rank{rank:05d}.safetensors"


# ------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------
def host_copy(t: LocalTensor) -> np.ndarray:
    """What a rank saves of `t`: its value without the ZeRO padding (a host copy, safe to write later)."""
    value = t.param.asnumpy()
    return value.reshape(-1)[:t.valid_count()].copy() if t.flat else value.copy()


def _piece_json(t: LocalTensor, filename: str, value: np.ndarray) -> Dict[str, Any]:
    return {"key": t.key, "part": t.part, "file": filename, "global_shape": list(t.spec.global_shape),
            "dtype": str(value.dtype), "group": t.group_kind, "axis": t.spec.axis, "index": t.spec.index,
            "count": t.spec.count, "slice_kind": t.spec.group_kind, "extra": [list(e) for e in t.spec.extra],
            "flat": [t.flat[0], t.flat[0] + int(value.size)] if t.flat else None}


def write_rank_pieces(writer: CheckpointWriter, rank: int, items: Sequence[Tuple[LocalTensor, np.ndarray]],
                      whole: Dict[str, bool]) -> None:
    """Write one rank's pieces (host copies) into its shard files, then its piece index (last)."""
    files, pieces = {}, []
    for part in PARTS:
        arrays = {t.key: v for t, v in items if t.part == part and v.size}
        if not arrays:
            continue
        filename = shard_file(part, rank, whole[part])
        writer.tensors(filename, arrays)
        path = os.path.join(writer.tmp, filename)
        files[filename] = {"sha256": sha256_of(path), "bytes": os.path.getsize(path)}
        pieces += [_piece_json(t, filename, v) for t, v in items if t.part == part and v.size]
    index_path = os.path.join(writer.tmp, _INDEX.format(rank=rank))
    with open(index_path + ".tmp", "w") as fh:
        json.dump({"rank": rank, "files": files, "pieces": pieces}, fh)
    os.replace(index_path + ".tmp", index_path)      # its presence says: this rank is done


def merge_indices(folder: str, world_size: int) -> Tuple[Dict[str, dict], Dict[str, dict]]:
    """(tensors, file checksums) from every rank's piece index; the index files are removed."""
    tensors: Dict[str, dict] = {}
    checksums: Dict[str, dict] = {}
    for rank in range(world_size):
        path = os.path.join(folder, _INDEX.format(rank=rank))
        with open(path) as fh:
            index = json.load(fh)
        checksums.update(index["files"])
        for piece in index["pieces"]:
            entry = tensors.setdefault(piece["key"], {"part": piece["part"], "global_shape": piece["global_shape"],
                                                      "dtype": piece["dtype"], "group": piece["group"],
                                                      "pieces": []})
            if entry["global_shape"] != piece["global_shape"]:
                raise CheckpointError(f"{piece['key']}: rank {rank} holds a piece of global shape "
                                      f"{piece['global_shape']}, another rank of {entry['global_shape']}")
            entry["pieces"].append({k: piece.get(k, []) for k in ("file", "axis", "index", "count", "slice_kind",
                                                                  "extra", "flat")})
    for rank in range(world_size):
        os.remove(os.path.join(folder, _INDEX.format(rank=rank)))
    problems = [p for key, entry in sorted(tensors.items()) for p in coverage_problems(key, entry)]
    if problems:
        raise CheckpointError("the ranks' pieces do not cover every tensor: " + "; ".join(problems[:8]))
    return dict(sorted(tensors.items())), checksums


def _slicings(piece: Dict[str, Any]) -> List[Tuple[int, int, int]]:
    """(axis, index, count) of every slicing of a saved piece: its first axis, then its `extra` ones
    (an expert tensor cut over ep and etp); [] for a whole tensor."""
    first = [] if piece["axis"] is None else [(piece["axis"], piece["index"], piece["count"])]
    return first + [(e[0], e[1], e[2]) for e in piece.get("extra") or []]


def coverage_problems(key: str, entry: Dict[str, Any]) -> List[str]:
    """What is missing for `key` to be reassembled from its pieces (empty list: complete)."""
    pieces = entry["pieces"]
    if not pieces:
        return [f"{key}: no pieces"]
    slicings = {tuple((a, c) for a, _, c in _slicings(p)) for p in pieces}
    if len(slicings) != 1:
        return [f"{key}: pieces sliced in different ways {sorted(slicings, key=str)}"]
    (cuts,) = slicings
    numel = int(np.prod(_slice_shape(entry["global_shape"], _slicings(pieces[0]))))
    problems = []
    for indices in itertools.product(*(range(c) for _, c in cuts)):
        mine = [p for p in pieces if tuple(i for _, i, _ in _slicings(p)) == indices]
        if not mine:
            problems.append(f"{key}: slice {list(indices)} of {[c for _, c in cuts]} along axes "
                            f"{[a for a, _ in cuts]} is missing")
            continue
        if any(p["flat"] is None for p in mine):
            continue
        covered = np.zeros(numel, bool)
        for p in mine:
            covered[p["flat"][0]:p["flat"][1]] = True
        if not covered.all():
            first = int(np.argmin(covered))
            problems.append(f"{key}: elements from {first} of slice {list(indices)} ({numel} elements) are in no "
                            f"piece")
    return problems


def _slice_shape(global_shape, slicings) -> Tuple[int, ...]:
    shape = list(global_shape)
    for axis, _, count in slicings:
        shape[axis] //= count
    return tuple(shape)


def _piece_box(global_shape, slicings) -> Tuple[Tuple[int, int], ...]:
    """`[lo, hi)` per axis of the global tensor that a piece cut by `slicings` covers."""
    box = [(0, int(d)) for d in global_shape]
    for axis, index, count in slicings:
        size = global_shape[axis] // count
        box[axis] = (index * size, (index + 1) * size)
    return tuple(box)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")   # a checkpoint's copy of its run's tokenizer


def finish_checkpoint(writer: CheckpointWriter, world_size: int, metadata: Dict[str, Any], config_file: str) -> str:
    """Rank 0, once every rank's pieces are written: metadata.json, config.yaml, the run's tokenizer
    (so that `moetrain generate CHECKPOINT` reads text from any folder, as a model saved with its
    tokenizer does), manifest, publish."""
    tensors, checksums = merge_indices(writer.tmp, world_size)
    writer.json(METADATA, {**metadata, "tensors": tensors})
    writer.copy("config.yaml", config_file)
    tokenizer = ((read_yaml(config_file) or {}).get("data") or {}).get("tokenizer") or ""
    if tokenizer and os.path.isfile(tokenizer):     # as the run resolved it (relative to its working dir)
        writer.copy(TOKENIZER_FILES[0] if tokenizer.endswith(".json") else TOKENIZER_FILES[1], tokenizer)
    return writer.commit(known=checksums, run_id=metadata.get("run_id"))


class ShardedCheckpointer:
    """Saves one rank's share of every checkpoint; rank 0 completes and publishes it.

    With `async_save`, `save` only takes host copies of this rank's tensors (a few ms) and a
    background (daemon) thread writes them; rank 0's thread waits for every rank's piece index (a
    file, so no collective runs off the main thread), then publishes. The next `save` (or `wait`)
    first finishes the previous one. A process that fails does not wait for the thread.

    A failed write (disk full, I/O error) on any rank fails the save on every rank (they agree
    through an all-reduce where a plain save would barrier): the temporary folder is removed, the
    previous checkpoints stay as they were, and the error names the path. `on_save_error`: "stop"
    raises CheckpointSaveError; "continue" warns and training goes on (the next save tries again; the
    trainer retries the run's final checkpoint and fails the run without it). `saved_step` is the step
    of the last checkpoint known to be published (an asynchronous one once `wait` has confirmed it)."""

    def __init__(self, root: str, pctx, keep_max: int, async_save: bool = False, on_save_error: str = "stop"):
        self.root, self.pctx, self.keep_max, self.async_save = root, pctx, keep_max, async_save
        self.on_save_error = on_save_error
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._pending: Optional[Tuple[int, CheckpointWriter, Optional[str]]] = None   # async: step, writer, run
        self.saved_step: Optional[int] = None

    def save(self, step: int, tensors: Sequence[LocalTensor], metadata: Dict[str, Any],
             config_file: str, final: bool = False) -> Optional[str]:
        """Write checkpoint `step`; returns its path (None when it failed under on_save_error=continue).
        `final`: synchronously, and a failure raises whatever on_save_error says."""
        self.wait()
        asynchronous, self.async_save = self.async_save, self.async_save and not final
        try:
            return self._save(step, tensors, metadata, config_file)
        except CheckpointSaveError as exc:
            if final:
                raise
            return self._failed(exc)
        finally:
            self.async_save = asynchronous

    def wait(self) -> None:
        """Finish the pending asynchronous save; a failure is handled as in `save`."""
        try:
            self._wait()
        except CheckpointSaveError as exc:
            self._failed(exc)

    def _failed(self, exc: CheckpointSaveError) -> None:
        if self.on_save_error == "stop":
            raise exc
        print(f"moetrain: warning: {exc} (checkpoint.on_save_error=continue: training goes on; the next save "
              f"tries again)", file=sys.stderr, flush=True)
        return None

    def _attempt(self, writer: Optional[CheckpointWriter], step: int, fn) -> Optional[CheckpointSaveError]:
        """Run `fn`; an OSError (ENOSPC, EIO, ...) becomes a CheckpointSaveError naming the folder."""
        try:
            fn()
        except CheckpointSaveError as exc:
            return exc
        except OSError as exc:
            where = writer.tmp if writer is not None else os.path.join(self.root, f"step_{step:08d}")
            return CheckpointSaveError(f"could not write checkpoint {os.path.join(self.root, f'step_{step:08d}')} "
                                       f"(files in {where}): {exc}")
        return None

    def _agree(self, error: Optional[CheckpointSaveError], step: int, writer: Optional[CheckpointWriter],
               run_id: Optional[str]) -> None:
        """Every rank learns whether any rank failed; then all raise, and rank 0 removes the folder."""
        failed = failed_ranks(error is not None, self.pctx) if self.pctx.world_size > 1 else ([0] if error else [])
        if not failed:
            return
        if self.pctx.rank == 0 and writer is not None:
            shutil.rmtree(writer.tmp, ignore_errors=True)      # free what the failed save took
        previous = latest_of_run(self.root, run_id)
        kept = (f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists")
        if error is not None:
            raise CheckpointSaveError(f"{error}; checkpoint step {step} was not saved, {kept}") from error
        raise CheckpointSaveError(f"checkpoint step {step} failed on rank(s) {failed} (their logs name the path); "
                                  f"it was not saved, {kept}")

    def _save(self, step: int, tensors: Sequence[LocalTensor], metadata: Dict[str, Any], config_file: str) -> str:
        rank, world = self.pctx.rank, self.pctx.world_size
        run_id = metadata.get("run_id")
        holder: List[CheckpointWriter] = []
        error = self._attempt(None, step, lambda: holder.append(
            CheckpointWriter(self.root, step, suffix="job" if world > 1 else None, create=rank == 0)))
        writer = holder[0] if holder else None
        self._agree(error, step, writer, run_id)      # the folder exists before anyone writes into it
        whole = whole_parts(metadata["layout"], tensors)
        items = [(t, host_copy(t)) for t in tensors if t.writes]
        final = os.path.join(self.root, writer.name)
        if self.async_save:
            self._pending = (step, writer, run_id)
            self._thread = threading.Thread(target=self._background, name=f"checkpoint-{writer.name}",
                                            args=(writer, items, whole, metadata, config_file), daemon=True)
            self._thread.start()
            return final
        error = self._attempt(writer, step, lambda: write_rank_pieces(writer, rank, items, whole))
        self._agree(error, step, writer, run_id)
        if rank == 0:
            error = self._attempt(writer, step, lambda: (finish_checkpoint(writer, world, metadata, config_file),
                                                         prune_checkpoints(self.root, self.keep_max, run_id, step)))
        self._agree(error, step, writer, run_id)
        self.saved_step = step
        return final

    def _background(self, writer, items, whole, metadata, config_file) -> None:
        rank = self.pctx.rank
        try:
            write_rank_pieces(writer, rank, items, whole)
            if rank == 0:
                self._wait_for_ranks(writer.tmp)
                finish_checkpoint(writer, self.pctx.world_size, metadata, config_file)
                prune_checkpoints(self.root, self.keep_max, metadata.get("run_id"), metadata["step"])
        except BaseException as exc:  # handled on the main thread by wait()
            self._error = exc
            print(f"moetrain: asynchronous save of {writer.name} failed: {exc!r}", file=sys.stderr, flush=True)
            try:    # tell rank 0's thread to stop waiting for this rank
                with open(os.path.join(writer.tmp, _FAILED.format(rank=rank)), "w") as fh:
                    fh.write(repr(exc))
            except OSError:
                pass

    def _wait_for_ranks(self, folder: str) -> None:
        deadline = time.monotonic() + ASYNC_COMMIT_TIMEOUT_S
        missing = list(range(self.pctx.world_size))
        while missing:
            failed = [r for r in range(self.pctx.world_size) if os.path.isfile(os.path.join(folder, _FAILED.format(rank=r)))]
            if failed:
                raise CheckpointError(f"ranks {failed} failed to write their part of {folder}")
            missing = [r for r in missing if not os.path.isfile(os.path.join(folder, _INDEX.format(rank=r)))]
            if missing and time.monotonic() > deadline:
                raise CheckpointError(f"ranks {missing} did not finish writing {folder} within "
                                      f"{ASYNC_COMMIT_TIMEOUT_S:.0f} s; the checkpoint stays incomplete")
            if missing:
                time.sleep(0.05)

    def _wait(self) -> None:
        if self._pending is None:
            return
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        (step, writer, run_id), self._pending = self._pending, None
        error, self._error = self._error, None
        if error is not None and not isinstance(error, CheckpointSaveError):
            wrapped = CheckpointSaveError(f"the asynchronous save of {writer.tmp} failed: {error!r}")
            error = wrapped.with_traceback(error.__traceback__)
        self._agree(error, step, writer, run_id)
        self.saved_step = step


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------
class CheckpointReader:
    """A sharded checkpoint, or a model directory (config.yaml + model.safetensors, as step 0)."""

    def __init__(self, path: str):
        self.path = path
        self._handles: Dict[str, Any] = {}
        self._verified: set = set()
        meta_path = os.path.join(path, METADATA)
        if os.path.isfile(meta_path):
            self.manifest = read_manifest(path)
            self.verify([METADATA])
            with open(meta_path) as fh:
                self.metadata = json.load(fh)
            if self.metadata.get("format") != FORMAT:
                raise CheckpointError(f"{meta_path}: unknown format {self.metadata.get('format')!r} "
                                      f"(this moetrain reads {FORMAT})")
        elif os.path.isfile(os.path.join(path, "trainer_state.json")):
            raise CheckpointError(f"{path} was written by an older moetrain (trainer_state.json, no {METADATA}); "
                                  f"its format is not readable any more: retrain, or consolidate it with that version")
        elif os.path.isfile(os.path.join(path, MANIFEST)) or os.path.basename(os.path.normpath(path)).startswith("step_"):
            # a training checkpoint without its metadata: refuse, never fall back to "weights only at step 0"
            raise CheckpointError(f"{path} is a training checkpoint without {METADATA} (damaged or not fully "
                                  f"copied): its step, data position and optimizer layout are unknown; resume from "
                                  f"another checkpoint")
        elif os.path.isfile(os.path.join(path, WEIGHTS_FILE)) and os.path.isfile(os.path.join(path, CONFIG_FILE)):
            self.manifest = None
            self.metadata = _model_dir_metadata(path)
        else:
            raise CheckpointError(f"{path} is neither a checkpoint ({METADATA} + {MANIFEST}) nor a model "
                                  f"directory ({CONFIG_FILE} + {WEIGHTS_FILE})")
        self.tensors: Dict[str, dict] = self.metadata["tensors"]

    @property
    def step(self) -> int:
        return int(self.metadata.get("step", 0))

    @property
    def trainer_state(self) -> Dict[str, Any]:
        return self.metadata.get("trainer_state", {})

    def keys(self, part: Optional[str] = None) -> List[str]:
        return [k for k, e in self.tensors.items() if part is None or e["part"] == part]

    def files_of(self, keys: Iterable[str]) -> List[str]:
        return sorted({p["file"] for k in keys for p in self.tensors[k]["pieces"]})

    def verify(self, files: Iterable[str]) -> None:
        """Check `files` against the manifest (size and sha256); the error names the bad file."""
        if self.manifest is not None:
            new = [name for name in files if name not in self._verified]
            verify_files(self.path, self.manifest, new)
            self._verified.update(new)

    def _handle(self, filename: str):
        self.verify([filename])
        if filename not in self._handles:
            self._handles[filename] = safe_open(os.path.join(self.path, filename), framework="np")
        return self._handles[filename]

    def _read(self, filename: str, key: str, box: Optional[Tuple[Tuple[int, int], ...]] = None) -> np.ndarray:
        """A stored tensor, or only `box` (`[lo, hi)` per axis) of it: a safetensors slice read, so
        nothing else of the file's tensor is brought into memory."""
        handle = self._handle(filename)
        if box is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[tuple(slice(lo, hi) for lo, hi in box)]

    def global_tensor(self, key: str) -> np.ndarray:
        """The whole tensor, reassembled from its pieces (offline tools: consolidate, export)."""
        entry = self.tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.path} has no tensor {key!r}")
        return self.read_region(key, tuple((0, d) for d in entry["global_shape"]))

    def read_region(self, key: str, region: Tuple[Tuple[int, int], ...]) -> np.ndarray:
        """`region` (`[lo, hi)` per axis) of the global tensor `key`, read straight from the files:
        from each saved piece only its intersection with the region (a slice read), so a rank never
        holds what it does not own. A ZeRO piece (a flat range of its slice) is read run by run:
        the region's contiguous runs inside the slice, cut to the piece's range."""
        entry = self.tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.path} has no tensor {key!r}")
        problems = coverage_problems(key, entry)
        if problems:
            raise CheckpointError(f"{self.path}: " + "; ".join(problems))
        shape = tuple(entry["global_shape"])
        out = np.zeros(tuple(hi - lo for lo, hi in region), entry["dtype"])
        for piece in entry["pieces"]:
            box = _piece_box(shape, _slicings(piece))
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, region))
            if any(lo >= hi for lo, hi in inter):
                continue
            target = tuple(slice(lo - r, hi - r) for (lo, hi), (r, _) in zip(inter, region))
            if piece["flat"] is None:
                out[target] = self._read(piece["file"], key, tuple((lo - b, hi - b) for (lo, hi), (b, _) in
                                                                    zip(inter, box))).reshape(out[target].shape)
                continue
            start, stop = piece["flat"]
            box_shape = tuple(hi - lo for lo, hi in box)
            runs, length = region_runs(box_shape, tuple((lo - b, hi - b) for (lo, hi), (b, _) in zip(inter, box)))
            inside = ((runs + length) > start) & (runs < stop)
            if not inside.any():
                continue
            dest = out[target].reshape(-1) if out[target].flags.c_contiguous else None
            staged = out[target].reshape(-1) if dest is None else dest   # a copy: other pieces' values kept
            for j in np.nonzero(inside)[0]:
                lo, hi = max(int(runs[j]), start), min(int(runs[j]) + length, stop)
                offset = j * length + lo - int(runs[j])
                staged[offset:offset + hi - lo] = self._read(piece["file"], key, ((lo - start, hi - start),))
            if dest is None:
                out[target] = staged.reshape(out[target].shape)
        return out

    def local_value(self, t: LocalTensor) -> np.ndarray:
        """What `t`'s rank holds of the saved tensor, in its own layout (slice, then ZeRO range), read
        straight into its slice (`read_region`); for a ZeRO range, the rows of the slice's first axis
        that the range touches (the range plus at most two rows)."""
        key = t.key if t.key in self.tensors else t.fallback
        saved_shape = tuple(self.tensors[key]["global_shape"])
        if saved_shape != tuple(t.spec.global_shape):
            raise CheckpointError(f"{self.path}: '{key}' has shape {saved_shape} in the checkpoint but "
                                  f"{tuple(t.spec.global_shape)} in the model (was it saved with another model "
                                  f"config?)")
        region = _piece_box(saved_shape, [(a, i, c) for a, i, c, _ in t.spec.slicings()])
        if not t.flat:
            return self.read_region(key, region)
        out = np.zeros(t.flat[1] - t.flat[0], self.tensors[key]["dtype"])
        valid = t.valid_count()
        if not valid:
            return out
        if not region:                                          # a scalar
            out[:valid] = self.read_region(key, region).reshape(-1)[t.flat[0]:t.flat[0] + valid]
            return out
        row = int(np.prod([hi - lo for lo, hi in region[1:]], dtype=np.int64))
        first, last = t.flat[0] // row, (t.flat[0] + valid - 1) // row + 1
        rows = self.read_region(key, ((region[0][0] + first, region[0][0] + last),) + tuple(region[1:]))
        out[:valid] = rows.reshape(-1)[t.flat[0] - first * row:t.flat[0] - first * row + valid]
        return out

    def close(self) -> None:
        self._handles.clear()


def _model_dir_metadata(path: str) -> Dict[str, Any]:
    """A model directory read as a step-0 checkpoint holding one whole piece per model tensor."""
    config = read_yaml(os.path.join(path, CONFIG_FILE)) or {}
    tensors = {}
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="np") as fh:
        for key in fh.keys():
            sl = fh.get_slice(key)
            tensors[key] = {"part": "model", "global_shape": list(sl.get_shape()), "group": "dp",
                            "dtype": SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()),   # no tensor read
                            "pieces": [{"file": WEIGHTS_FILE, "axis": None, "index": 0, "count": 1,
                                        "slice_kind": "", "flat": None}]}
    return {"format": FORMAT, "step": 0, "trainer_state": {}, "config": config, "layout": None,
            "tensors": dict(sorted(tensors.items()))}


def load_into(reader: CheckpointReader, tensors: Sequence[LocalTensor], holds_whole_model: bool) -> bool:
    """Copy the checkpoint into this rank's Parameters, resharding to their layout.

    Every model tensor must be in the checkpoint with its global shape; the error lists each
    mismatch. A checkpoint without optimizer state (e.g. converted from a model directory) leaves the
    optimizer fresh; returns whether optimizer state was loaded. `holds_whole_model`: this rank has
    every model tensor (no pipeline stages), so tensors the model lacks are reported too."""
    import mindspore as ms    # as in _FlatRows.flush: off the path of the offline conversions

    model = [t for t in tensors if t.part == "model"]
    saved_model = set(reader.keys("model"))
    missing = sorted(t.key for t in model if t.key not in saved_model)
    unexpected = sorted(saved_model - {t.key for t in model}) if holds_whole_model else []
    problems = ([f"missing from the checkpoint: {missing}"] if missing else []) + \
               ([f"not in the model: {unexpected}"] if unexpected else [])
    problems += [f"shape mismatch: {t.key}: checkpoint {tuple(reader.tensors[t.key]['global_shape'])} vs model "
                 f"{tuple(t.spec.global_shape)}"
                 for t in model if t.key in saved_model
                 and tuple(reader.tensors[t.key]["global_shape"]) != tuple(t.spec.global_shape)]
    if problems:
        raise CheckpointError(f"{reader.path} does not fit the model (was it written for another model "
                              f"config?): " + "; ".join(problems))
    # without saved optimizer state the optimizer stays fresh, but ZeRO masters follow the loaded weights
    with_optimizer = bool(reader.keys("optimizer"))
    wanted = model + [t for t in tensors if t.part == "optimizer" and (with_optimizer or t.fallback)]
    missing = [t.key for t in wanted if t.key not in reader.tensors and t.fallback not in reader.tensors]
    if missing:
        raise CheckpointError(f"{reader.path} lacks optimizer state {missing[:8]}{'...' if len(missing) > 8 else ''} "
                              f"(saved with another optimizer.name?)")
    reader.verify(reader.files_of({t.key if t.key in reader.tensors else t.fallback for t in wanted}))
    for t in wanted:
        value = reader.local_value(t)
        if tuple(value.shape) != tuple(t.param.shape):
            raise CheckpointError(f"{reader.path}: {t.key} resharded to {tuple(value.shape)} but this rank's "
                                  f"tensor is {tuple(t.param.shape)}")
        if isinstance(t.param, ms.Parameter):
            write_in_place(t.param, value)
        else:                           # a ZeRO row piece: staged on the host, flushed below
            t.param.set_data(ms.Tensor(value, dtype=t.param.dtype))
    for t in wanted:
        if hasattr(t.param, "flush"):   # ZeRO rows staged on the host: written back once
            t.param.flush()
    return with_optimizer


# ------------------------------------------------------------------------------------------------
# Offline: consolidate, reshard, model directory -> checkpoint
# ------------------------------------------------------------------------------------------------
def consolidate(src: str, out_dir: str) -> Dict[str, np.ndarray]:
    """Write the model of checkpoint `src` (any layout) as one model directory; returns its state."""
    reader = CheckpointReader(src)
    reader.verify(reader.files_of(reader.keys("model")))
    state = {key: reader.global_tensor(key) for key in reader.keys("model")}
    save_model_dir(out_dir, reader.metadata["config"], state)
    return state


def parse_layout(text: str) -> Dict[str, int]:
    """`dp=4,tp=2,pp=1,ep=1,etp=1,zero=1` (omitted sizes are 1, zero is 0) -> a validated layout dict."""
    sizes = {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1, "zero": 0}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, value = item.partition("=")
        if name not in sizes or not value.strip().isdigit():
            raise ValueError(f"--to-layout: bad item {item!r}; expected e.g. dp=4,tp=2,pp=1,ep=2,zero=1 "
                             f"with names {list(sizes)}")
        sizes[name] = int(value)
    if sizes["zero"] not in (0, 1, 2):
        raise ValueError(f"--to-layout: zero={sizes['zero']} must be 0, 1 or 2")
    world = sizes["dp"] * sizes["tp"] * sizes["pp"]
    try:
        check_layout(Layout(dp=sizes["dp"], tp=sizes["tp"], pp=sizes["pp"], ep=sizes["ep"], etp=sizes["etp"],
                            num_micro_batches=sizes["pp"], zero=sizes["zero"]), world=world)
    except LayoutError as exc:
        raise ValueError(f"--to-layout {text!r}: {exc}") from None
    return {"world_size": world, "dp": sizes["dp"], "tp": sizes["tp"], "pp": sizes["pp"], "ep": sizes["ep"],
            "etp": sizes["etp"], "optimizer_shard": sizes["zero"]}


def _target_tensors(reader: CheckpointReader, layout: Dict[str, int], rank: int) -> List[LocalTensor]:
    """The tensors rank `rank` of `layout` would hold, from the saved tensors' slicing rules."""
    pctx = ParallelContext.build(layout["world_size"], rank, layout["dp"], layout["tp"], layout["pp"], layout["ep"],
                                 layout.get("etp", 1), layout.get("cp", 1))
    zero = layout["optimizer_shard"] > 0
    out = []
    for key, entry in reader.tensors.items():
        if key.startswith(MASTER_PREFIX) and not zero:
            continue                                  # at ZeRO 0 the parameter is its own master
        piece = entry["pieces"][0]
        kind = piece["slice_kind"]
        sliced = piece["axis"] is not None
        count = {"tp": pctx.tp, "ep": pctx.ep, "etp": pctx.etp}.get(kind, piece["count"]) if sliced else 1
        index = {"tp": pctx.tp_rank, "ep": pctx.ep_rank, "etp": pctx.etp_rank}.get(kind, 0) if sliced else 0
        if count > 1 and entry["global_shape"][piece["axis"]] % count:
            raise CheckpointError(f"{key}: dimension {piece['axis']} of {tuple(entry['global_shape'])} cannot be "
                                  f"split into {kind}={count} equal slices; choose a {kind} size that divides it")
        extra = tuple((e[0], pctx.etp_rank, pctx.etp, e[3]) for e in piece.get("extra") or []
                      if e[3] == "etp" and pctx.etp > 1)
        spec = ShardSpec(tuple(entry["global_shape"]), piece["axis"] if count > 1 else None, index, count,
                         kind if count > 1 else "", extra)
        flat = None
        if zero and entry["part"] == "optimizer":
            group = pctx.group(entry["group"])
            size = -(-int(np.prod(spec.local_shape())) // group.size)
            flat = (group.rank_in_group * size, (group.rank_in_group + 1) * size)
        out.append(LocalTensor(key, entry["part"], spec, flat, entry["group"],
                               first_replica(pctx, spec, entry["group"], flat is not None)))
    if zero:   # saved without ZeRO masters: each trainable parameter's master starts as the parameter
        trainable = {k.split(".", 1)[1] for k in reader.keys("optimizer") if "." in k}
        for t in [t for t in out if t.part == "model" and t.key in trainable
                  and MASTER_PREFIX + t.key not in reader.tensors]:
            group = pctx.group(t.group_kind)
            size = -(-int(np.prod(t.spec.local_shape())) // group.size)
            out.append(LocalTensor(MASTER_PREFIX + t.key, "optimizer", t.spec,
                                   (group.rank_in_group * size, (group.rank_in_group + 1) * size), t.group_kind,
                                   first_replica(pctx, t.spec, t.group_kind, True), fallback=t.key))
    return out


def _check_layout_fits_model(src: str, layout: Dict[str, int]) -> None:
    """The target layout must divide the saved model (experts over ep, heads and vocabulary over tp,
    layers over pp): raises CheckpointError listing each problem with the sizes that fit."""
    try:
        shape = ModelShape.of(model_config_from_dict((read_yaml(os.path.join(src, "config.yaml")) or {}).get("model"),
                                                     f"{src}/config.yaml"))
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return                                  # no readable model config: the reader's own checks speak
    target = Layout(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], etp=layout.get("etp", 1),
                    num_micro_batches=layout["pp"], zero=layout["optimizer_shard"])
    problems = layout_problems(target, shape, world=layout["world_size"])
    if problems:
        spec = ",".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "ep", "etp") if layout.get(k, 1) > 1)
        raise CheckpointError(f"--to-layout {spec or 'dp=1'} cannot hold the model of {src}:\n  - "
                              + "\n  - ".join(problems))


def reshard(src: str, out_path: str, layout: Dict[str, int]) -> str:
    """Rewrite checkpoint (or model directory) `src` as the checkpoint `layout` would have saved.

    Loading reshards by itself; this only pre-splits the files. Tensor slicing axes come from the
    saved pieces, so a checkpoint with nothing sliced over tp (or ep) cannot be split over tp (ep)
    here (resume with the new layout directly instead); pipeline stages are assigned by the model,
    so the output has pp = 1 (any saved pp is fine)."""
    reader = CheckpointReader(src)
    _check_layout_fits_model(src, layout)     # before any advice to resume with a size: it must be valid
    saved = reader.metadata.get("layout") or {"tp": 1, "pp": 1, "ep": 1}
    kinds = {p["slice_kind"] for e in reader.tensors.values() for p in e["pieces"] if p["axis"] is not None}
    for kind in ("tp", "ep"):
        if layout[kind] > 1 and kind not in kinds:
            raise CheckpointError(f"{src} has no tensor sliced over {kind} (saved with {kind}={saved.get(kind, 1)}), "
                                  f"so the slicing axes are unknown offline: resume with {kind}={layout[kind]} "
                                  f"directly, the checkpoint is resharded at load")
    if layout["pp"] > 1:
        raise CheckpointError(f"pipeline stages are assigned by the model, so offline conversion writes pp=1 "
                              f"only: resume with pp={layout['pp']} directly (the checkpoint is resharded at load)")
    metadata = {k: v for k, v in reader.metadata.items() if k != "tensors"}
    metadata["layout"] = layout
    root, name = os.path.split(os.path.abspath(out_path))
    writer = CheckpointWriter(root, reader.step, final_name=name)
    per_rank = [_target_tensors(reader, layout, rank) for rank in range(layout["world_size"])]
    whole = whole_parts(layout, per_rank[0])
    for rank, tensors in enumerate(per_rank):
        items = [(t, reader.local_value(t)[:t.valid_count()] if t.flat else reader.local_value(t))
                 for t in tensors if t.writes]
        write_rank_pieces(writer, rank, items, whole)
    config_file = os.path.join(src, "config.yaml")
    return finish_checkpoint(writer, layout["world_size"], metadata, config_file)


# ------------------------------------------------------------------------------------------------
# Command line (tools/convert_ckpt.py; `moetrain convert reshard|consolidate`)
# ------------------------------------------------------------------------------------------------
def main(argv=None, mode: Optional[str] = None) -> int:
    prog = {None: "tools/convert_ckpt.py", "reshard": "moetrain convert reshard",
            "consolidate": "moetrain convert consolidate"}[mode]
    ap = argparse.ArgumentParser(prog=prog, description="Reshard a training checkpoint onto another parallel "
                                 "layout, or consolidate it into one model directory.")
    ap.add_argument("src", help="checkpoint folder (checkpoints/step_NNNNNNNN) or, with --to-layout, a model "
                                "directory (config.yaml + model.safetensors)")
    ap.add_argument("out", help="folder to write (must not exist)")
    if mode is None:
        what = ap.add_mutually_exclusive_group(required=True)
        what.add_argument("--consolidate", action="store_true",
                          help="write config.yaml + model.safetensors (for forward / hf-export)")
        what.add_argument("--to-layout", metavar="SPEC", help="e.g. dp=4,tp=1,ep=1,zero=1")
    elif mode == "reshard":
        ap.add_argument("--to-layout", metavar="SPEC", required=True, help="e.g. dp=4,tp=1,ep=1,zero=1")
    args = ap.parse_args(argv)
    if os.path.exists(args.out):
        raise ValueError(f"{args.out} exists; choose a new output folder")
    if mode == "consolidate" or getattr(args, "consolidate", False):
        state = consolidate(args.src, args.out)
        print(f"wrote {len(state)} tensors ({sum(v.size for v in state.values()):,} values) to {args.out}")
    else:
        layout = parse_layout(args.to_layout)
        path = reshard(args.src, args.out, layout)
        print(f"wrote {path} for {layout['world_size']} ranks (dp={layout['dp']} tp={layout['tp']} "
              f"pp={layout['pp']} ep={layout['ep']} ZeRO-{layout['optimizer_shard']})")
    return 0


def main_reshard(argv=None) -> int:
    return main(argv, "reshard")


def main_consolidate(argv=None) -> int:
    return main(argv, "consolidate")
