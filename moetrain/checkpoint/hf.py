"""Hugging Face interchange, driven by each model family's format (`moetrain.family.HFFormat`, in
its folder: `models/<family>/hf.py`; Llama/Mistral, Mixtral, Qwen3-MoE and DeepSeek-V3 ship).

    moetrain convert hf-import HF_DIR OUT_DIR                       # -> model directory
    moetrain convert hf-export CKPT_DIR OUT_DIR [--layout fused]    # -> config.json + model.safetensors

HF side: `config.json` plus `*.safetensors` (one file, or shards listed in
`model.safetensors.index.json`; F32/F16/BF16, and FP8 block-quantized weights with
`weight_scale_inv`, see `hf_io.py`). Import picks the family whose format reads config.json's
`model_type`, translates the config and maps every tensor; it consumes every tensor or fails naming
the leftovers. Routed experts are read in both HF layouts (`per_expert`, `fused`; export writes the
one asked for). Tensors become fp32 exactly, so export after import reproduces the HF tensors bit for
bit (in fp32). Optional layers a checkpoint lacks (the family's `HFFormat.missing_layers`, e.g.
DeepSeek-V3's multi-token prediction) are left out or initialised fresh.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
from safetensors.numpy import save_file

from moetrain.checkpoint.hf_io import HFSource, load_hf_weights, read_safetensors  # noqa: F401  (re-exported)
from moetrain.checkpoint.model_dir import build_config_from_dict, build_model_from_dict, load_model_dir
from moetrain.checkpoint.model_files import WEIGHTS_FILE, Fp32SafetensorsWriter, write_config
from moetrain.config import TrainConfig
from moetrain.family import Family, TensorMap, family_of
from moetrain.fileio import check_output_folder, hf_weight_files, temp_path
from moetrain.param_init import initial_values, is_deferred
from moetrain.registry import import_model_module, model_module_of, registered_models

LAYOUTS = ("per_expert", "fused")

# HF tensors that carry no weights (old checkpoints saved the RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _write_atomic_json(path: str, obj) -> None:
    tmp = temp_path(path)
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def _not_the_source(src: str, out_dir: str, what: str) -> None:
    if os.path.realpath(src) == os.path.realpath(out_dir):
        raise ValueError(f"moetrain convert {what}: the output folder {out_dir!r} is the input folder; choose a new one")


def read_hf_config(hf_dir: str) -> Dict[str, Any]:
    """config.json of an HF checkpoint folder; a missing or broken file is a ValueError naming it."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{hf_dir!r} is not a Hugging Face checkpoint: config.json is missing")
    try:
        with open(config_path, encoding="utf-8") as fh:
            hf_config = json.load(fh)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON ({exc}); re-download or fix it") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{config_path} holds a {type(hf_config).__name__}, not a JSON object of config keys")
    return hf_config


# ----------------------------------------------------------------------------------------------
# Configs and tensors, through the family's format
# ----------------------------------------------------------------------------------------------
def hf_formats() -> Dict[str, Family]:
    """{config.json model_type: the family whose format reads it}, over the registered families."""
    return {model_type: entry.family for entry in registered_models().values() if entry.family.hf is not None
            for model_type in entry.family.hf.model_types}


def hf_config_to_model_dict(hf: Dict[str, Any]) -> Dict[str, Any]:
    """HF config.json -> complete moetrain `model:` section (validated)."""
    model_type = hf.get("model_type")
    formats = hf_formats()
    if model_type not in formats:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; hf-import reads "
                         f"{sorted(formats)}")
    model = formats[model_type].hf.to_model(hf)
    try:
        cfg = build_config_from_dict(model)
    except ValueError as exc:
        raise ValueError(f"config.json describes a model moetrain cannot build: {exc}") from None
    return dataclasses.asdict(cfg)


def _family_with_format(cfg) -> Family:
    family = family_of(cfg)
    if family is None or family.hf is None:
        known = sorted(e.name for e in registered_models().values() if e.family.hf is not None)
        raise ValueError(f"model.name {cfg.name!r} has no Hugging Face format; hf-export handles {known}")
    return family


def model_dict_to_hf_config(model: Dict[str, Any]) -> Dict[str, Any]:
    """moetrain `model:` section -> HF config.json of its family."""
    cfg = build_config_from_dict(model)
    return _family_with_format(cfg).hf.to_hf(cfg)


def tensor_maps(model: Dict[str, Any], fused_layers=lambda hf_prefix: False) -> Tuple[List[TensorMap], Dict[str, str]]:
    """`(maps, copies)` for the `model:` section: every moetrain tensor's HF counterpart; `copies`:
    HF tensors that duplicate a moetrain tensor (DeepSeek MTP embedding/head), HF name -> ours.
    `fused_layers(hf_layer_prefix)` says which layers use the fused expert layout."""
    cfg = build_config_from_dict(model)
    return _family_with_format(cfg).hf.tensor_maps(model, cfg, fused_layers)


def _import_plan(hf, model: Dict[str, Any]) -> Tuple[List[TensorMap], Dict[str, List[str]]]:
    """`(maps, copies)` to import `hf` (a name -> array dict or an `HFSource`) as the `model:` section
    `model`; `copies`: ours -> the HF copies of it the checkpoint holds. Every name is checked here,
    before any tensor is read: a tensor the model needs and the checkpoint lacks, or one it has no
    place for, is a ValueError naming it."""
    maps, copies = tensor_maps(model, lambda prefix: prefix + "mlp.experts.gate_up_proj" in hf)
    copies.update(_family_with_format(build_config_from_dict(model)).hf.import_copies(model))
    for m in maps:
        absent = [n for n in m.theirs if n not in hf]
        if absent:
            layers = f" with {model['num_layers']} layers" if "num_layers" in model else ""
            raise ValueError(f"the HF checkpoint has no tensor {absent[0]!r} (needed for a {model['name']} model"
                             f"{layers}, as config.json describes it)")
    held: Dict[str, List[str]] = {}
    for name, ours in copies.items():
        if name in hf:   # published checkpoints carry these copies; they must equal the shared tensor
            held.setdefault(ours, []).append(name)
    used = {n for m in maps for n in m.theirs} | {n for names in held.values() for n in names}
    unused = sorted(n for n in set(hf.keys()) - used if not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise ValueError(f"the HF checkpoint has tensors this {model['name']} model has no place for: "
                         f"{unused[:10]}{' ...' if len(unused) > 10 else ''} (another architecture, or a config.json "
                         f"that does not describe these weights?)")
    return maps, held


def _convert(hf, model: Dict[str, Any], emit: Callable[[str, np.ndarray], None], streamed: bool) -> None:
    """Convert `hf` (dict or `HFSource`) for the `model:` section `model`, handing each moetrain tensor
    (fp32, contiguous) to `emit(name, array)` as soon as it is made. `streamed`: one map part at a time
    (`TensorMap.import_parts`: the HF tensors of one target, or of the few targets one HF tensor feeds),
    so no more than those sources and one target are alive; otherwise whole maps."""
    maps, copies = _import_plan(hf, model)
    fmt = _family_with_format(build_config_from_dict(model)).hf
    for m in maps:
        for part in (m.import_parts() if streamed else (m,)):
            sources = [hf.get(n) for n in part.theirs]
            outputs = part.to_ours(*sources)
            del sources
            for name, value in zip(part.ours, outputs):
                value = np.ascontiguousarray(value, dtype=np.float32)
                for copy in copies.get(name, ()):
                    theirs = hf.get(copy)
                    if theirs.shape != value.shape or not np.array_equal(theirs, value):
                        raise ValueError(f"the HF checkpoint's {copy!r} differs from the main model's {name} counterpart; "
                                         f"moetrain shares it ({fmt.copy_reason(copy)})")
                    del theirs
                emit(name, value)
                del value
            del outputs


def hf_to_state(hf: Dict[str, np.ndarray], model: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """HF tensors -> moetrain state for the `model:` section `model` (from hf_config_to_model_dict),
    all in memory (`hf_import` streams instead)."""
    state: Dict[str, np.ndarray] = {}
    _convert(hf, model, state.__setitem__, streamed=False)
    return state


def state_to_hf(state: Dict[str, np.ndarray], model: Dict[str, Any], layout: str = "per_expert"):
    """moetrain state -> HF tensors (the inverse of `hf_to_state`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    maps, copies = tensor_maps(model, lambda prefix: layout == "fused")
    hf = {}
    for m in maps:
        hf.update(zip(m.theirs, m.to_theirs(*(state[n] for n in m.ours))))
    hf.update({name: state[ours] for name, ours in copies.items()})
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in hf.items()}


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------
def _fresh_values(param) -> np.ndarray:
    """A freshly initialised tensor of a deferred model: its keyed initial values (`moetrain.param_init`,
    `train.seed`'s default, as a fresh run's) generated alone, or its data if it was built eagerly."""
    if is_deferred(param):
        return initial_values(param, TrainConfig.seed)
    return param.asnumpy()


def hf_import(hf_dir: str, out_dir: str, init_missing_layers: bool = False,
              log: Callable[[str], None] = print, overwrite: bool = False) -> Dict[str, Any]:
    """HF checkpoint directory -> moetrain model directory; returns the `model:` section.

    Streams: the shard headers are read first (every name is checked against the model's, built
    deferred: shapes, no memory), then each moetrain tensor is made from its few HF tensors and
    written to its place in the output (`Fp32SafetensorsWriter`), so the peak is one map part's
    sources and target (`TensorMap.import_parts`), never the model. Shapes are checked as each is made.
    Optional layers that config.json describes but the checkpoint lacks (the family says which,
    `HFFormat.missing_layers`: DeepSeek-V3's MTP layers, which transformers' `save_pretrained` never
    writes) are left out, or with `init_missing_layers` initialised fresh (keyed, one tensor at a
    time) for training; either way one line says so.
    `out_dir` must be new or empty (with `overwrite`, a folder of files to replace), never a training
    checkpoint or run folder (`moetrain.fileio.check_output_folder`)."""
    _not_the_source(hf_dir, out_dir, "hf-import")
    check_output_folder(out_dir, overwrite, "moetrain convert hf-import")
    hf_config = read_hf_config(hf_dir)
    config_path = os.path.join(hf_dir, "config.json")
    try:
        model = hf_config_to_model_dict(hf_config)
    except KeyError as exc:
        raise ValueError(f"{config_path}: the key {exc.args[0]!r} is missing "
                         f"(model_type {hf_config.get('model_type')!r} needs it); the file is incomplete or not a "
                         f"transformers config") from None
    except ValueError as exc:     # name the file read, not just "config.json"
        message = str(exc)
        raise ValueError(config_path + message[len("config.json"):] if message.startswith("config.json")
                         else message) from None
    hf = HFSource(hf_dir, hf_config.get("quantization_config"))
    missing = _family_with_format(build_config_from_dict(model)).hf.missing_layers(model, hf.keys())
    held = missing.held if missing else model
    if missing and not init_missing_layers:
        model = held
    maps, _ = _import_plan(hf, held)
    params = dict(build_model_from_dict(model, deferred=True).parameters_and_names())
    fresh = [name for name in params if missing and init_missing_layers and name.startswith(missing.prefixes)]
    made = {n for m in maps for n in m.ours} | set(fresh)
    if set(params) != made:
        raise ValueError(f"the checkpoint does not fit the model (was it written for another model config?); "
                         f"missing from the checkpoint: {sorted(set(params) - made)}; "
                         f"not in the model: {sorted(made - set(params))}")

    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, WEIGHTS_FILE)
    writer = Fp32SafetensorsWriter(temp_path(weights), {n: p.shape for n, p in params.items()}, {"format": "np"})

    def emit(name: str, value: np.ndarray) -> None:
        if value.shape != writer.shape(name):
            raise ValueError(f"the checkpoint does not fit the model (was it written for another model config?); "
                             f"shape mismatches: {name}: checkpoint {value.shape} vs model {writer.shape(name)}")
        writer.write(name, value)

    try:
        _convert(hf, held, emit, streamed=True)
        for name in fresh:
            writer.write(name, _fresh_values(params[name]))
        writer.close()
    except BaseException:
        writer.abort()
        if created and not os.listdir(out_dir):
            os.rmdir(out_dir)
        raise
    os.replace(writer.path, weights)
    source = model_module_of(model["name"])   # a family registered by a user's model_module: load it again
    write_config(out_dir, {"model": model, **({"model_module": source} if source else {})})
    if missing and init_missing_layers:
        log(f"moetrain convert hf-import: {missing.what}; the missing layers are initialised fresh "
            f"(--init-missing-layers)")
    elif missing:
        log(f"moetrain convert hf-import: {missing.what}; imported without the missing layers "
            f"(--init-missing-layers initialises them fresh instead)")
    return model


def hf_export(model_dir: str, out_dir: str, layout: str = "per_expert", overwrite: bool = False) -> Dict[str, Any]:
    """moetrain model directory (or training checkpoint) -> HF config.json + model.safetensors.

    `out_dir` must be new or empty; with `overwrite` its config.json is replaced and every HF weight
    file already there (other *.safetensors, model.safetensors.index.json) removed, so a reader that
    follows an old shard index never loads the old weights. Never a training checkpoint or run folder."""
    _not_the_source(model_dir, out_dir, "hf-export")
    check_output_folder(out_dir, overwrite, "moetrain convert hf-export")
    config_dict, state = load_model_dir(model_dir)
    import_model_module(config_dict.get("model_module"))
    model = dataclasses.asdict(build_config_from_dict(config_dict["model"]))
    hf_config = model_dict_to_hf_config(model)
    tensors = state_to_hf(state, model, layout)
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, "model.safetensors")
    stale = [p for p in hf_weight_files(out_dir) if os.path.abspath(p) != os.path.abspath(weights)]
    tmp = temp_path(weights)
    save_file(tensors, tmp, metadata={"format": "pt"})   # transformers requires "pt"
    for path in stale:     # an earlier export's shards and index: readers would follow them
        os.remove(path)
    os.replace(tmp, weights)
    _write_atomic_json(os.path.join(out_dir, "config.json"), hf_config)
    if stale:
        print(f"moetrain convert hf-export: --overwrite: removed the earlier weight files of {out_dir}: "
              f"{', '.join(os.path.basename(p) for p in stale)}")
    return hf_config


def _run(fn, argv) -> int:
    try:
        fn(argv)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"moetrain convert: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, MemoryError) as exc:
        print(f"moetrain convert: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


def main_import(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain convert hf-import",
                                 description="Hugging Face checkpoint (a model_type some registered family reads) -> moetrain model directory")
    ap.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    ap.add_argument("out_dir", help="model directory to write (config.yaml + model.safetensors)")
    ap.add_argument("--init-missing-layers", "--init-missing-mtp", dest="init_missing_layers", action="store_true",
                    help="optional layers config.json describes but the checkpoint lacks (DeepSeek-V3's multi-token "
                         "prediction: transformers' save_pretrained writes none) are initialised fresh instead of left out")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into an OUT_DIR that already holds files, replacing config.yaml and model.safetensors "
                         "(never a training checkpoint or run folder)")

    def go(args):
        args = ap.parse_args(args)
        model = hf_import(args.hf_dir, args.out_dir, init_missing_layers=args.init_missing_layers, overwrite=args.overwrite)
        print(f"wrote {args.out_dir}: model {model['name']}, {model['num_layers']} layers")

    return _run(go, argv)


def main_export(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain convert hf-export",
                                 description="moetrain model directory -> Hugging Face checkpoint in its family's format")
    ap.add_argument("ckpt_dir", help="model directory or training checkpoint folder")
    ap.add_argument("out_dir", help="folder to write config.json and model.safetensors to")
    ap.add_argument("--layout", choices=LAYOUTS, default="per_expert",
                    help="routed-expert tensors: per_expert (published checkpoints, the default) or fused (transformers 5 in memory)")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into an out_dir that already holds files: config.json and model.safetensors are "
                         "replaced and other HF weight files there (shards, index) removed; never a training "
                         "checkpoint or run folder")

    def go(args):
        args = ap.parse_args(args)
        hf_config = hf_export(args.ckpt_dir, args.out_dir, args.layout, overwrite=args.overwrite)
        print(f"wrote {args.out_dir}: {hf_config['architectures'][0]} ({args.layout} layout)")

    return _run(go, argv)


if __name__ == "__main__":   # python -m moetrain.checkpoint.hf {hf-import,hf-export} ...
    commands = {"hf-import": main_import, "hf-export": main_export}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python -m moetrain.checkpoint.hf {{{','.join(commands)}}} ...")
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
