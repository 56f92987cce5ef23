"""Step runners: one optimizer step's micro-batches through the model, the same interface with and
without a pipeline (`moetrain.parallel.pipeline.Pipeline` is the other runner).

    grads, values = runner.train_step(batches, scale)   batches: this dp rank's micro-batches (numpy);
                                                        grads: the optimizer's flat buffers, summed
                                                        over micro-batches; values: the step's loss
                                                        and stats for the whole model on this rank
    loss, stats = runner.evaluate(batch)                one evaluation batch
    runner.update_expert_bias(expert_load)              aux-loss-free balancing from the global load
    runner.capacity_state() / load_capacity_state(s)    the MoE dispatch capacities a checkpoint keeps
    runner.capacities_in_force()                        those the last call ran with (None: unmanaged)

Jitted functions return tuples, never dicts: a dict output becomes Python-executed graph nodes whose
side effects make MindSpore 2.10's compile time exponential in depth (docs/performance.md).
"""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

import mindspore as ms

from moetrain.modeling import SUM, StatSpec
from moetrain.moe.capacity import adaptive_steps
from moetrain.moe.layer import moe_layers
from moetrain.parallel.data_parallel import accumulate


def reduce_micro_batches(losses: Sequence[float], stats: Sequence[Dict], specs: Dict[str, StatSpec]) -> Dict:
    """The step's values on this rank: the mean loss, each stat summed (counts) or averaged over the
    micro-batches as its spec says."""
    values = {"loss": float(np.mean([float(loss) for loss in losses]))}
    for key in stats[0]:
        arrays = [np.asarray(s[key], np.float64) for s in stats]
        values[key] = np.sum(arrays, 0) if key in specs and specs[key].reduce == SUM else np.mean(arrays, 0)
    return values


def as_tensors(batch):
    return tuple(b if isinstance(b, ms.Tensor) else ms.Tensor(b) for b in batch)


class MicroBatchRunner:
    """Gradient accumulation over micro-batches on the whole (tensor/expert-parallel) model."""

    def __init__(self, model, opt_step, specs: Dict[str, StatSpec], jit: bool, pctx=None,
                 capacity: str = "adaptive", capacity_prior: float = 2.0):
        """`pctx`: the parallel context; with it, dropless MoE dispatch buffers are sized from the
        routing counts and a micro-batch that overflowed one is run again (`moetrain.moe.capacity`;
        `capacity`, `capacity_prior`: `parallel.moe_capacity`, `parallel.moe_capacity_prior`)."""
        self.model, self.specs = model, specs
        self.grad_bytes_held = 0     # bytes of the gradient buffers kept between micro-batches (measured)

        def forward(scale, *batch):
            loss, stats = model(*batch)
            return loss * scale, loss, stats

        grad_fn = ms.value_and_grad(forward, None, opt_step.params, has_aux=True)
        # a bound method, not the object: once opt_step's own jitted methods have run, MindSpore 2.10
        # resolves the object as a function when a graph using it is compiled again (measured)
        flatten = opt_step.flatten

        def grad_step(scale, *batch):
            (_, loss, stats), grads = grad_fn(scale, *batch)
            return loss, tuple(stats.keys()), tuple(stats.values()), flatten(grads)

        def evaluate(*batch):
            loss, stats = model(*batch)
            return loss, tuple(stats.keys()), tuple(stats.values())

        wrap = ms.jit if jit else (lambda fn: fn)
        self._accumulate = wrap(accumulate)
        if pctx is None:
            self._grad_step, self._evaluate = wrap(grad_step), wrap(evaluate)
        else:
            self._grad_step, self._evaluate = adaptive_steps([layer.dispatcher for layer in moe_layers(model)], pctx, wrap,
                                                             grad_step, evaluate, policy=capacity,
                                                             prior=capacity_prior)

    def train_step(self, batches, scale):
        grads, losses, stats = None, [], []
        for batch in batches:
            loss, keys, values, micro = self._grad_step(scale, *as_tensors(batch))
            grads = micro if grads is None else self._accumulate(ms.mutable(grads), ms.mutable(micro))
            self.grad_bytes_held = sum(int(np.prod(g.shape)) * g.itemsize for g in grads)
            losses.append(loss)
            stats.append({k: v.asnumpy() for k, v in zip(keys, values)})
        return grads, reduce_micro_batches(losses, stats, self.specs)

    def evaluate(self, batch):
        loss, keys, values = self._evaluate(*as_tensors(batch))
        return float(loss), {k: v.asnumpy() for k, v in zip(keys, values)}

    def capacity_state(self):
        """The MoE dispatch capacities and their sizing history (None when nothing sizes them)."""
        controller = getattr(self._grad_step, "controller", None)
        return None if controller is None else controller.state()

    def capacities_in_force(self):
        """The capacities the last call ran with (None when nothing sizes them)."""
        controller = getattr(self._grad_step, "controller", None)
        return None if controller is None else {f: np.asarray(v).tolist() for f, v in controller.in_force.items()}

    def capacities_largest(self):
        """Element-wise the largest capacities any call ran with: the dispatch buffers' peak
        (None when nothing sizes them)."""
        controller = getattr(self._grad_step, "controller", None)
        return None if controller is None else {f: np.asarray(v).tolist() for f, v in controller.largest.items()}

    def load_capacity_state(self, state) -> None:
        controller = getattr(self._grad_step, "controller", None)
        if controller is not None and state:
            controller.load_state(state)

    def update_expert_bias(self, expert_load) -> None:
        if hasattr(self.model, "update_expert_bias"):
            self.model.update_expert_bias(np.asarray(expert_load))
