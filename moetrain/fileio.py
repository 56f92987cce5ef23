"""File helpers shared by the data and checkpoint code: checksums, temporary names, and the
check every offline writer makes before it writes a folder (docs/faults.md, "Writers")."""
from __future__ import annotations

import glob
import hashlib
import os
from typing import Optional, Sequence

import yaml


def sha256_of(path: str) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_yaml(path: str):
    """The YAML document in file `path` (None when empty); a file that is not UTF-8 YAML is a
    ValueError naming it (PyYAML's own errors name no file the user gave, and are no ValueError)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a YAML text file: byte 0x{exc.object[exc.start]:02x} at offset {exc.start} "
                         f"is not UTF-8; give the YAML file (or rewrite this one)") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{path}: not valid YAML{at}: {problem}; fix the file (or rewrite it)") from None


def file_in_the_way(path: str) -> Optional[str]:
    """The nearest existing ancestor of folder `path` (or `path` itself) when it is a file, so that
    the folder cannot be created; None when the folder exists or can be made."""
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return probe if probe and not os.path.isdir(probe) else None


def temp_path(path: str, rank: Optional[int] = None) -> str:
    """A temporary name for writing `path` before renaming it into place: it carries this process's
    pid and its rank (`rank`, else $RANK_ID as msrun sets it, else 0), so two processes, or two ranks
    on two hosts of a shared filesystem, never write the same temporary file."""
    if rank is None:
        try:
            rank = int(os.environ.get("RANK_ID", "0") or 0)
        except ValueError:
            rank = 0
    return f"{path}.tmp-{os.getpid()}-r{rank}"


class OutputExistsError(ValueError):
    """An offline writer's target holds files it did not create (or is a training checkpoint)."""


# files that make a folder a training checkpoint or a run's output directory
_CHECKPOINT_MARKERS = ("metadata.json", "manifest.json")
_RUN_MARKERS = ("run.json", "checkpoints")


def training_folder_kind(path: str) -> Optional[str]:
    """Why `path` is part of a training run and must not be written by an offline tool: a
    checkpoint folder (metadata.json or manifest.json), a run's output directory (run.json,
    checkpoints/); None otherwise."""
    for name in _CHECKPOINT_MARKERS:
        if os.path.isfile(os.path.join(path, name)):
            return f"a training checkpoint (it holds {name})"
    for name in _RUN_MARKERS:
        if os.path.exists(os.path.join(path, name)):
            return f"a training run's output directory (it holds {name})"
    return None


def check_output_folder(path: str, overwrite: bool, what: str) -> None:
    """Before an offline tool (`what`, e.g. "moetrain convert hf-import") writes folder `path`:
    refuse a file, a training checkpoint or run folder (always: the run would lose its checkpoint),
    and a folder that already holds files unless `overwrite`. Raises OutputExistsError."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputExistsError(f"{what}: the output {path!r} is a file; give a folder path")
    if not os.path.isdir(path):
        return
    kind = training_folder_kind(path)
    if kind:
        raise OutputExistsError(f"{what}: the output {path!r} is {kind}; writing into it would replace the run's "
                                f"files (even with --overwrite). Choose a new output folder")
    present = sorted(os.listdir(path))
    if present and not overwrite:
        shown = ", ".join(present[:5]) + (f", ... ({len(present)} entries)" if len(present) > 5 else "")
        raise OutputExistsError(f"{what}: the output folder {path!r} is not empty ({shown}); choose a new folder, "
                                f"or pass --overwrite to replace what the output consists of")


def check_output_files(paths: Sequence[str], overwrite: bool, what: str) -> None:
    """Before a tool writes the files `paths` (e.g. token shards PREFIX.bin/.idx.npy/.json):
    refuse when one exists unless `overwrite`, and always when their folder is a training
    checkpoint or run folder. Raises OutputExistsError."""
    for folder in sorted({os.path.dirname(os.path.abspath(p)) for p in paths}):
        kind = training_folder_kind(folder) if os.path.isdir(folder) else None
        if kind:
            raise OutputExistsError(f"{what}: the output folder {folder!r} is {kind}; choose another output path")
    existing = [p for p in paths if os.path.lexists(p)]
    if existing and not overwrite:
        raise OutputExistsError(f"{what}: {', '.join(existing)} already exist(s); choose another output path, or "
                                f"pass --overwrite to replace them")


def hf_weight_files(folder: str) -> Sequence[str]:
    """The Hugging Face weight files of a folder (the shard index and every *.safetensors)."""
    found = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    index = os.path.join(folder, "model.safetensors.index.json")
    return found + ([index] if os.path.isfile(index) else [])
