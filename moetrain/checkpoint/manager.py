"""Training checkpoints: written atomically, verified on load, the last K kept.

One checkpoint is a folder `<output_dir>/checkpoints/step_00000100/`; what the files in it hold
(every rank's shards, metadata.json) is described in `moetrain.checkpoint.distributed`.
`manifest.json` (sha256 and size of every other file) is written last.

Everything is written into a hidden temporary folder that is renamed into place only when
complete, so a crash mid-write leaves the previous checkpoint as the latest complete one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
from safetensors.numpy import save_file

from moetrain.fileio import sha256_of

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    pass


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
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, os.path.join(self.tmp, filename))

    def json(self, filename: str, obj) -> None:
        with open(os.path.join(self.tmp, filename), "w") as fh:
            json.dump(obj, fh, indent=1)

    def copy(self, filename: str, src: str) -> None:
        shutil.copyfile(src, os.path.join(self.tmp, filename))

    def commit(self, known: Optional[Dict[str, dict]] = None) -> str:
        """Write the manifest of every file in the folder and publish it. `known`: checksums the
        writing ranks computed already (`{file: {"sha256", "bytes"}}`), so they are not read again."""
        known = known or {}
        files = sorted(f for f in os.listdir(self.tmp) if f != MANIFEST)  # every rank's files
        manifest = {f: known.get(f) or {"sha256": sha256_of(os.path.join(self.tmp, f)),
                                        "bytes": os.path.getsize(os.path.join(self.tmp, f))} for f in files}
        with open(os.path.join(self.tmp, MANIFEST), "w") as fh:
            json.dump({"files": manifest}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        final = os.path.join(self.root, self.name)
        if os.path.exists(final):  # re-saving a step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(self.tmp, final)
        _fsync_dir(self.root)
        return final


def list_checkpoints(root: str) -> List[Tuple[int, str]]:
    """Complete checkpoints (those with a manifest) under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append((int(match.group(1)), path))
        elif name.startswith(".tmp-step_"):
            warnings.warn(f"skipping incomplete checkpoint {path} (a save was interrupted)")
    return sorted(found)


def latest_checkpoint(root: str) -> Optional[str]:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def prune_checkpoints(root: str, keep_max: int) -> None:
    for _, path in list_checkpoints(root)[:-keep_max]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):  # leftovers of interrupted saves
        if name.startswith(".tmp-step_"):
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


def resolve_resume_path(resume: str, default_root: str) -> str:
    """`--resume` with no value: latest in the run's checkpoints; a run folder or a checkpoint."""
    candidates = [resume] if resume else [default_root]
    for base in candidates:
        if os.path.isfile(os.path.join(base, MANIFEST)):
            return base
        for root in (os.path.join(base, "checkpoints"), base):
            latest = latest_checkpoint(root)
            if latest:
                return latest
    raise CheckpointError(f"--resume: no complete checkpoint found in {candidates[0]!r}")
