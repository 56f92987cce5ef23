"""Model registry: `@register_model("name", config=ConfigDataclass)` and lookup by `model.name`.

A model is a `mindspore.nn.Cell` built as `ModelClass(cfg)` whose `construct(*batch)`
returns `(loss, stats)`: `loss` is the fp32 scalar that is differentiated, `stats` a dict of
tensors the trainer logs (e.g. `lm_loss`, `aux_loss`, `expert_load`, `correct`). What a model
exposes for pipeline parallelism and how its stats combine: moetrain/modeling.py.
"""
from __future__ import annotations

import difflib
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Type


@dataclass(frozen=True)
class ModelEntry:
    name: str
    cls: type
    config_cls: type


_MODELS: Dict[str, ModelEntry] = {}
_ZOO_LOADED = False


def register_model(name: str, config: Type) -> Callable[[type], type]:
    """Register a model class under `name`; `config` is the dataclass of its `model.*` keys."""

    def wrap(cls: type) -> type:
        if name in _MODELS and _MODELS[name].cls is not cls:
            raise ValueError(f"model name {name!r} is registered twice "
                             f"({_MODELS[name].cls.__module__} and {cls.__module__})")
        _MODELS[name] = ModelEntry(name, cls, config)
        cls.registered_name = name
        return cls

    return wrap


def _load_zoo() -> None:
    """Import every module of the `models` package so their decorators run. Discovery by name, as
    for a user's `model_module`: the zoo sits above moetrain's layers, which never import it."""
    global _ZOO_LOADED
    if _ZOO_LOADED:
        return
    _ZOO_LOADED = True
    models = importlib.import_module("models")
    for info in pkgutil.iter_modules(models.__path__):
        importlib.import_module(f"models.{info.name}")


def import_model_module(module: Optional[str]) -> None:
    """Import a user's module (config key `model_module`) that registers more models."""
    if module:
        importlib.import_module(module)


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
