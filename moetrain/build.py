"""Model construction and device set-up, shared by the trainer and the planner's dry run (which builds
one rank of a layout the way training does, without importing the trainer)."""
from __future__ import annotations

import contextlib

import mindspore as ms

from moetrain.distributed.topology import cpu_ops_on_calling_thread
from moetrain.modeling import building_part, set_cell_reuse
from moetrain.parallel.pipeline import chunk_parts
from moetrain.param_init import deferred_parameters, materialize
from moetrain.registry import get_model


def setup_device(device: str) -> None:
    """PyNative mode on `train.device` (cpu, ascend, gpu); the CPU ops run on the calling thread."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    target = {"cpu": "CPU", "ascend": "Ascend", "gpu": "GPU"}[device]
    try:
        ms.set_device(target)
    except RuntimeError:  # the runtime already started (an earlier trainer in this process)
        if ms.get_context("device_target") != target:
            raise
    cpu_ops_on_calling_thread()


def build_model(cfg, pctx=None, chunk: int = 0):
    """The model of `cfg`; the model config takes `precision.compute_dtype`.

    Without `pctx`: the whole model, materialized. With a parallel context: only what this rank
    constructs, its parameters deferred (shapes, no memory; `moetrain.param_init`): with pp > 1 model
    chunk `chunk` of its pipeline stage, built once: its blocks, named as in the whole model, and the
    embedding and head cells only if its virtual stage keeps them (`chunk_parts`; the other stages'
    layers and cells are never built). `moetrain.parallel.parallelize` records the tp / ep / etp
    slicing, cuts the stage and then materializes each parameter as exactly its slice. Either way a
    parameter's initial values are a function of `train.seed`, its full name and the index, so
    every layout starts from the one-process model."""
    if hasattr(cfg.model, "compute_dtype"):
        cfg.model.compute_dtype = cfg.precision.compute_dtype
    set_cell_reuse(cfg.train.cell_reuse)
    cls = get_model(cfg.model.name).cls
    if pctx is None:
        with deferred_parameters():
            model = cls(cfg.model)
        materialize([model], cfg.train.seed)
        return model
    part = contextlib.nullcontext()
    if pctx.pp > 1 and hasattr(cfg.model, "num_layers"):
        part = building_part(chunk_parts(cfg, pctx.pp, pctx.pp_rank)[chunk])
    with deferred_parameters(), part:
        return cls(cfg.model)
