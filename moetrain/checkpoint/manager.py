"""Training checkpoints: written atomically, verified on load, the last K kept.

One checkpoint is a folder `<output_dir>/checkpoints/step_00000100/`; what the files in it hold
(every rank's shards, metadata.json) is described in `moetrain.checkpoint.distributed`.
`manifest.json` (sha256 and size of every other file) is written last.

Everything is written into a hidden temporary folder that is renamed into place only when
complete, so a crash mid-write leaves the previous checkpoint as the latest complete one. Re-saving
a step renames the old folder aside before the new one moves in, and deletes it only after.

Every checkpoint records the identity of its run (`run_id`, also in `<output_dir>/run.json`, see
`moetrain.checkpoint.run_dir`): pruning deletes only the current run's checkpoints, and a resume
without a path picks only checkpoints of the run recorded in the output directory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save_file

from moetrain.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE
from moetrain.errors import register_expected
from moetrain.fileio import sha256_of

MANIFEST = "manifest.json"
METADATA = "metadata.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_OLD_STEP_DIR = re.compile(r"^\.old-step_(\d{8})-\d+$")   # a replaced folder, deleted once its successor is in place


@register_expected
class CheckpointError(RuntimeError):
    pass


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error); the previous checkpoints are untouched."""


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


class CheckpointWriter:
    """Collects the files of one checkpoint in a temporary folder, then publishes it."""

    def __init__(self, root: str, step: int, suffix: Optional[str] = None, create: bool = True,
                 final_name: Optional[str] = None):
        """`suffix` names the temporary folder (default: this pid); in a multi-process save every rank
        uses the same suffix, rank 0 creates the folder (`create`) and commits after a barrier.
        `final_name` replaces `step_NNNNNNNN` (offline conversions writing to a chosen folder)."""
        self.root = root
        self.name = final_name or f"step_{step:08d}"
        self.tmp = os.path.join(root, f".tmp-{self.name}-{suffix or os.getpid()}")
        if create:
            if os.path.exists(self.tmp):
                shutil.rmtree(self.tmp)
            os.makedirs(self.tmp)

    def tensors(self, filename: str, arrays: Dict[str, np.ndarray]) -> None:
        path = os.path.join(self.tmp, filename)
        try:
            save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, path)
        except SafetensorError as exc:      # safetensors' own I/O errors carry no path
            raise CheckpointSaveError(f"cannot write {path}: {exc}") from exc

    def json(self, filename: str, obj) -> None:
        with open(os.path.join(self.tmp, filename), "w") as fh:
            json.dump(obj, fh, indent=1)

    def copy(self, filename: str, src: str) -> None:
        shutil.copyfile(src, os.path.join(self.tmp, filename))

    def commit(self, known: Optional[Dict[str, dict]] = None, run_id: Optional[str] = None) -> str:
        """Write the manifest of every file in the folder and publish it. `known`: checksums the
        writing ranks computed already (`{file: {"sha256", "bytes"}}`), so they are not read again.
        `run_id` is recorded in the manifest (pruning and resume read it from there)."""
        known = known or {}
        files = sorted(f for f in os.listdir(self.tmp) if f != MANIFEST)  # every rank's files
        manifest = {f: known.get(f) or {"sha256": sha256_of(os.path.join(self.tmp, f)),
                                        "bytes": os.path.getsize(os.path.join(self.tmp, f))} for f in files}
        with open(os.path.join(self.tmp, MANIFEST), "w") as fh:
            json.dump({"files": manifest, "run_id": run_id}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        final = os.path.join(self.root, self.name)
        old = None
        if os.path.exists(final):  # re-saving a step (e.g. after a resume): the old copy goes last
            old = os.path.join(self.root, f".old-{self.name}-{os.getpid()}")
            os.rename(final, old)
        os.rename(self.tmp, final)
        _fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final


def _step_folders(root: str, warn: bool = True) -> List[Tuple[int, str, bool]]:
    """(step, path, complete) of every checkpoint folder under `root`, oldest first. A folder
    renamed aside while its step was re-saved stands for that step if the new one never arrived."""
    if not os.path.isdir(root):
        return []
    found, old = {}, {}
    for name in os.listdir(root):
        path = os.path.join(root, name)
        match, old_match = _STEP_DIR.match(name), _OLD_STEP_DIR.match(name)
        if match:
            found[int(match.group(1))] = (path, os.path.isfile(os.path.join(path, MANIFEST)))
        elif old_match and os.path.isfile(os.path.join(path, MANIFEST)):
            old[int(old_match.group(1))] = path
        elif name.startswith(".tmp-step_") and warn:
            warnings.warn(f"skipping incomplete checkpoint {path} (a save was interrupted)")
    for step, path in old.items():
        if step not in found or not found[step][1]:
            found[step] = (path, True)
    return sorted((step, path, complete) for step, (path, complete) in found.items())


def list_checkpoints(root: str) -> List[Tuple[int, str]]:
    """Complete checkpoints (those with a manifest) under `root`, oldest first."""
    return [(step, path) for step, path, complete in _step_folders(root) if complete]


def holds_checkpoint_folders(root: str) -> bool:
    """Whether `root` holds any `step_*` checkpoint folder, complete or not (a resume has something to
    choose from, or to refuse)."""
    return bool(_step_folders(root, warn=False))


def latest_checkpoint(root: str) -> Optional[str]:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def run_id_in(json_file: str) -> Optional[str]:
    """The `run_id` a JSON file records (None: no file, unreadable, or none recorded)."""
    try:
        with open(json_file) as fh:
            return json.load(fh).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def checkpoint_run_id(path: str) -> Optional[str]:
    """The run a checkpoint belongs to (None: unreadable, or written before runs had an identity)."""
    return run_id_in(os.path.join(path, MANIFEST))


def same_run(path: str, run_id: Optional[str]) -> bool:
    """Whether checkpoint `path` belongs to run `run_id` (any run when `run_id` is None; a
    checkpoint without an identity, from before runs had one, belongs to whichever run holds it)."""
    saved = checkpoint_run_id(path)
    return run_id is None or saved is None or saved == run_id


def latest_of_run(root: str, run_id: Optional[str]) -> Optional[str]:
    """The newest complete checkpoint of run `run_id` under `root`."""
    found = [path for _, path in list_checkpoints(root) if same_run(path, run_id)]
    return found[-1] if found else None


def prune_checkpoints(root: str, keep_max: int, run_id: Optional[str] = None,
                      upto_step: Optional[int] = None) -> None:
    """Keep the newest `keep_max` complete checkpoints of run `run_id` up to `upto_step` (the one
    just saved); delete its older ones. Other runs' checkpoints, newer steps (left by an earlier
    attempt that went further; replaced when training reaches them) and damaged folders are left
    alone. Leftovers of interrupted saves go, and so does a replaced folder once its successor is in place."""
    mine = [(step, path) for step, path in list_checkpoints(root)
            if same_run(path, run_id) and (upto_step is None or step <= upto_step)]
    for _, path in mine[:-keep_max]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):
        old = _OLD_STEP_DIR.match(name)
        successor = os.path.join(root, f"step_{old.group(1)}") if old else None
        if name.startswith(".tmp-step_") or (successor and os.path.isfile(os.path.join(successor, MANIFEST))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def read_manifest(path: str) -> Dict[str, dict]:
    """`{file: {"sha256", "bytes"}}` of a complete checkpoint; raise CheckpointError if incomplete."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{path} is not a complete checkpoint: {MANIFEST} is missing "
                              f"(the save was interrupted; resume from an earlier step)")
    try:
        with open(manifest_path) as fh:
            return json.load(fh)["files"]
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{manifest_path} is damaged: {exc}") from None


def verify_files(path: str, manifest: Dict[str, dict], names: Iterable[str]) -> None:
    """Check the named files against the manifest; raise CheckpointError naming the bad file."""
    for name in names:
        file_path = os.path.join(path, name)
        info = manifest.get(name)
        if info is None:
            raise CheckpointError(f"{file_path} is not listed in {os.path.join(path, MANIFEST)} "
                                  f"(the checkpoint is inconsistent; resume from an earlier one)")
        if not os.path.isfile(file_path):
            raise CheckpointError(f"checkpoint file missing: {file_path}; resume from an earlier checkpoint")
        if os.path.getsize(file_path) != info["bytes"] or sha256_of(file_path) != info["sha256"]:
            raise CheckpointError(f"checkpoint file damaged (checksum mismatch): {file_path}; "
                                  f"resume from an earlier checkpoint")


def verify_checkpoint(path: str) -> Dict[str, dict]:
    """Check every file of a checkpoint against its manifest; returns the manifest."""
    manifest = read_manifest(path)
    verify_files(path, manifest, manifest)
    return manifest


def checkpoint_problem(path: str) -> Optional[str]:
    """Why checkpoint `path` cannot be resumed from: its manifest or metadata.json missing or
    damaged (None: both sound; the weight files are verified when they are read)."""
    try:
        manifest = read_manifest(path)
        if METADATA not in manifest:
            return f"{METADATA} is not listed in its {MANIFEST}"
        verify_files(path, manifest, [METADATA])
        with open(os.path.join(path, METADATA)) as fh:
            json.load(fh)["step"]
    except CheckpointError as exc:
        return str(exc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{os.path.join(path, METADATA)} is unreadable: {exc}"
    return None


def _is_checkpoint_folder(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, METADATA))
            or bool(_STEP_DIR.match(os.path.basename(os.path.normpath(path)))))


def newest_usable(root: str, run_id: Optional[str] = None, below_step: Optional[int] = None) -> Optional[str]:
    """The newest checkpoint under `root` of run `run_id` (any run if None) that `checkpoint_problem`
    accepts; each newer one passed over is named in a warning."""
    for step, path, complete in reversed(_step_folders(root)):
        if below_step is not None and step >= below_step:
            continue
        if not complete:
            warnings.warn(f"skipping checkpoint {path}: {MANIFEST} is missing (an interrupted save or a damaged "
                          f"folder); trying the next older one")
            continue
        if not same_run(path, run_id):
            warnings.warn(f"skipping checkpoint {path}: it belongs to run {checkpoint_run_id(path)}, not to the "
                          f"run {run_id} recorded in the output directory's run.json")
            continue
        problem = checkpoint_problem(path)
        if problem:
            warnings.warn(f"skipping checkpoint {path}: {problem}; trying the next older one")
            continue
        return path
    return None


def resolve_resume_path(resume: str, default_root: str, run_id: Optional[str] = None) -> str:
    """`--resume` with no value: the newest sound checkpoint of the run in `default_root` (a run's
    output directory); with a value: that checkpoint folder, model directory, or run folder.
    Newer checkpoints that are damaged or of another run are skipped with a warning."""
    base = resume or default_root
    if resume and _is_checkpoint_folder(base):
        problem = checkpoint_problem(base) if os.path.isdir(base) else f"{base} does not exist"
        if problem:
            parent = os.path.dirname(os.path.normpath(base))
            match = _STEP_DIR.match(os.path.basename(os.path.normpath(base)))
            older = newest_usable(parent, None, int(match.group(1))) if match else None
            hint = f"; resume from the next older complete checkpoint instead: --resume {older}" if older else ""
            raise CheckpointError(f"--resume {base}: cannot resume from this checkpoint: {problem}{hint}")
        return base
    if resume and os.path.isfile(os.path.join(base, WEIGHTS_FILE)) and os.path.isfile(os.path.join(base, CONFIG_FILE)):
        return base          # a model directory: initial weights, step 0
    for root in (os.path.join(base, "checkpoints"), base):
        if _step_folders(root, warn=False):
            chosen = newest_usable(root, run_id)
            if chosen:
                return chosen
            raise CheckpointError(f"--resume: no usable checkpoint in {root} (the warnings above say why each "
                                  f"was skipped)")
    raise CheckpointError(f"--resume: no complete checkpoint found in {base!r}")
