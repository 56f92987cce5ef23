"""Model construction and device set-up, shared by the trainer and the planner's dry run (which builds
one rank of a layout the way training does, without importing the trainer)."""
from __future__ import annotations

import mindspore as ms

from moetrain.distributed.topology import cpu_ops_on_calling_thread
from moetrain.modeling import set_cell_reuse
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


def build_model(cfg):
    """The whole model of `cfg` (every rank builds it from the same seed, then keeps its part);
    the model config takes `precision.compute_dtype`."""
    if hasattr(cfg.model, "compute_dtype"):
        cfg.model.compute_dtype = cfg.precision.compute_dtype
    set_cell_reuse(cfg.train.cell_reuse)
    return get_model(cfg.model.name).cls(cfg.model)
