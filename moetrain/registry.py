"""Model registry: `register_family(Family(...))` (or the short `@register_model("name", config=...)`)
and lookup by `model.name`.

A model is a `mindspore.nn.Cell` built as `ModelClass(cfg)` whose `construct(*batch)`
returns `(loss, stats)`: `loss` is the fp32 scalar that is differentiated, `stats` a dict of
tensors the trainer logs (e.g. `lm_loss`, `aux_loss`, `expert_load`, `correct`). What a model
exposes for pipeline parallelism and how its stats combine: moetrain/modeling.py; what else a
family declares (parallel plans, planner shape, Hugging Face format): moetrain/family.py.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import pkgutil
import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Type

from moetrain.family import FAMILY_ATTRIBUTE, Family


@dataclass(frozen=True)
class ModelEntry:
    name: str
    cls: type
    config_cls: type
    family: Family


_MODELS: Dict[str, ModelEntry] = {}
_ZOO_LOADED = False
_SOURCES: Dict[str, str] = {}   # family name -> the model_module that registered it ("": the zoo)


def register_family(family: Family) -> Family:
    """Register a model family (`moetrain.family.Family`) under `family.name`; returns it. The spec
    is set on its config and model classes (`moetrain.family.family_of` reads it back)."""
    name, cls = family.name, family.model
    if name in _MODELS and _MODELS[name].cls is not cls:
        raise ValueError(f"model name {name!r} is registered twice "
                         f"({_MODELS[name].cls.__module__} and {cls.__module__})")
    _MODELS[name] = ModelEntry(name, cls, family.config, family)
    cls.registered_name = name
    setattr(cls, FAMILY_ATTRIBUTE, family)
    setattr(family.config, FAMILY_ATTRIBUTE, family)
    return family


def register_model(name: str, config: Type) -> Callable[[type], type]:
    """Register a model class under `name`; `config` is the dataclass of its `model.*` keys. A family
    with nothing more to declare (no tensor-parallel plan, planner shape or HF format)."""

    def wrap(cls: type) -> type:
        register_family(Family(name, config, cls))
        return cls

    return wrap


def replace_family(name: str, **changes) -> Family:
    """Re-register the family `name` with some fields changed (`dataclasses.replace`)."""
    return register_family(dataclasses.replace(get_model(name).family, **changes))


def _load_zoo() -> None:
    """Import every module of the `moetrain.models` package (the repository's `models/` folder) so
    their decorators run. Discovery by name, as
    for a user's `model_module`: the zoo sits above moetrain's layers, which never import it."""
    global _ZOO_LOADED
    if _ZOO_LOADED:
        return
    _ZOO_LOADED = True
    zoo = importlib.import_module("moetrain.models")
    for info in pkgutil.iter_modules(zoo.__path__):
        importlib.import_module(f"moetrain.models.{info.name}")


def import_model_module(module: Optional[str], base: str = "") -> str:
    """Import a user's families (config key `model_module`): a dotted module name on `sys.path`, or
    the path of a `.py` file or of a package folder (relative paths from `base`, the folder of the
    config that names it, else the working directory). A path is imported under a name of its own, so
    msrun workers that load the same config find it without any PYTHONPATH. Returns `module` with a
    path made absolute."""
    if not module:
        return ""
    _load_zoo()
    before = set(_MODELS)
    if not _is_path(module):
        importlib.import_module(module)
        _record(module, before)
        return module
    path = os.path.abspath(os.path.join(base, os.path.expanduser(module)))
    init = os.path.join(path, "__init__.py") if os.path.isdir(path) else path
    if not os.path.isfile(init):
        raise ModuleNotFoundError(f"model_module {module!r}: {init} does not exist (give a dotted module name, or "
                                  f"the path of a .py file or of a package folder)")
    name = "moetrain_family_" + "_".join(filter(None, re.split(r"\W+", os.path.splitext(path)[0])))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[path] if os.path.isdir(path) else None)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules[name]
            raise
    _record(path, before)
    return path


def _is_path(module: str) -> bool:
    return module.endswith(".py") or os.sep in module or module.startswith((".", "~"))


def _record(source: str, before) -> None:
    """Note which `model_module` registered the families new since `before` (saved with converted models)."""
    for name in set(_MODELS) - set(before):
        _SOURCES[name] = source


def model_module_of(name: str) -> str:
    """The `model_module` that registered family `name` ("" for the zoo's)."""
    return _SOURCES.get(name, "")


def get_model(name: str) -> ModelEntry:
    _load_zoo()
    if name not in _MODELS:
        near = difflib.get_close_matches(name, list(_MODELS), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise KeyError(f"unknown model {name!r}{hint} Registered: {sorted(_MODELS)}")
    return _MODELS[name]


def registered_models() -> Dict[str, ModelEntry]:
    _load_zoo()
    return dict(_MODELS)
