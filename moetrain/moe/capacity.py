"""Load-proportional static buffers for dropless MoE dispatch: bucketed capacities, chosen on the host
from the routing counts, with a re-run of the micro-batch when one overflows.

Inside `ms.jit` every buffer has a static shape, yet how many rows an expert-parallel rank sends to
another (or an expert receives) is known only once the router has run. A dropless dispatcher
therefore sizes its buffers with Python ints ("capacities", read when the graph is built):

    AllToAllDispatcher   pair_capacity    per destination j: rows every source sends j (C_j); bucketed
                                          splits only (exact splits on Ascend size nothing)
    (bmm experts only)   expert_capacity  rows one local expert computes ([L, C_e, H])
    AllGatherDispatcher  expert_capacity  (bmm experts only)
    SortDispatcher       expert_capacity  (bmm experts only)

Unset (0 / `()`) means the bound (`T min(k, L)` per pair, `ep T` per expert): exact for any routing, and what a
dispatcher uses when nobody manages it (tests, `parallel.moe_capacity: bound`). `AdaptiveStep`
manages them for the trainer's step and evaluation functions (`StepCapacities`, at the end, for the
pipeline schedule, which can re-run only a whole step):

1. Run the micro-batch with the current capacities (a graph compiled once per set of capacities;
   graphs are kept, so a set seen before costs nothing). Before any counts are seen they are
   `parallel.moe_capacity_prior` (default PRIOR = 2) times the even share, sized, at most the bound.
2. Every rank's `dispatch_load` (assignments per expert, per layer, of every row the layer
   exchanged: `expert_load` plus any positions it does not count; already a stat of the step) is
   all-gathered over the world on the host: one small collective per micro-batch. From these
   counts every rank computes the same rows each buffer needed (`needed_capacity`).
3. If a buffer was too small, the rows past it were not exchanged: the outputs are wrong, so the
   micro-batch is run again (all ranks together) with that capacity grown to `sized(needed)`
   (the need plus two standard deviations of a count, bucketed), and by at least GROWTH.
   Dropless stays exact under any routing.
4. Otherwise the capacities shrink when the largest need over the last `WINDOW` micro-batches
   fits a bucket below `SHRINK * capacity` (hysteresis against recompiling back and forth).

`bucket` rounds up to `m 2^e` with `m` in 8..15 (at most 12.5 % padding; 8 sizes per doubling),
which bounds how many graphs a run compiles. Costs: one compile per new capacity set; a re-run
per overflow; one host sync and a `[world, layers, E]` all-gather per micro-batch.
"""
from __future__ import annotations

import math
import sys
from collections import OrderedDict
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
from mindspore import Tensor

from moetrain.distributed import comm
from moetrain.distributed.topology import ParallelContext
from moetrain.moe.sizing import SPREAD, bucket, sized  # noqa: F401  (SPREAD, bucket: this module's API too)
from moetrain.moe.sizing import bucketed as _bucketed, sized_array as _sized


PRIOR = 2.0          # before any counts: capacities for PRIOR x the even share (parallel.moe_capacity_prior)
GROWTH = 1.5         # an overflowing capacity grows at least this much (few recompiles while routing drifts)
SHRINK = 1 / 1.5     # shrink only to a bucket below SHRINK * current capacity
WINDOW = 16          # micro-batches whose largest need decides a shrink


def resized(now, need, recent, bound):
    """(grow, new) for capacities `now` (0: ran at the bound) after a call that needed `need` rows,
    `recent` the largest need of the last WINDOW calls: unsized ones sized to the need, overflowing
    ones grown to `sized(need)` and by at least GROWTH, the others shrunk when `sized(recent)` is below
    SHRINK x now; never past `bound` (past it nothing overflows). `grow`: where the call overflowed."""
    grow = (now > 0) & (need > now)
    new = np.where(now == 0, _sized(need), now)                  # ran at the bound: size it
    new = np.where(grow, np.maximum(_sized(need), _bucketed(GROWTH * now)), new)
    new = np.where((now > 0) & ~grow & (_sized(recent) < SHRINK * now), _sized(recent), new)
    return grow, np.minimum(new, bound)


class DroplessSizing:
    """The host-side sizing rules of a dropless dispatcher's static buffers (pure numpy, shared by the
    dispatchers and by tests that simulate them). Needs `num_experts`, `top_k`, `capacity_factor`,
    `layout` ("rows" / "capacity"), `n` (ep group size, 1 without expert parallelism) and
    `sizes_pairs` (True for the bucketed all-to-all, whose per-destination runs are padded).

    pair_capacity    per destination j, the rows every source sends j
    expert_capacity  rows per local expert in the capacity layout `[L, C_e, H]`

    `loads [n, E]` are the assignments per expert of each rank of one ep group, in group order."""
    n = 1
    sizes_pairs = False

    def capacity_fields(self) -> Tuple[str, ...]:
        if self.capacity_factor > 0:                 # fixed GShard capacities: nothing to size
            return ()
        return (("pair_capacity",) if self.sizes_pairs else ()) + (
            ("expert_capacity",) if self.layout == "capacity" else ())

    def needed_capacity(self, loads: np.ndarray) -> Dict[str, object]:
        """Rows each buffer needs for the routing `loads`."""
        needs = self.needed_capacities(np.asarray(loads)[None])
        return {"pair_capacity": tuple(int(c) for c in needs["pair_capacity"]),
                "expert_capacity": int(needs["expert_capacity"])}

    def needed_capacities(self, loads: np.ndarray) -> Dict[str, np.ndarray]:
        """The largest need over calls, `loads [calls, n, E]` (e.g. every layer of every ep group)."""
        loads = np.asarray(loads).reshape(-1, self.n, self.num_experts)
        pairs = loads.reshape(loads.shape[0], self.n, self.n, -1).sum(-1)      # [call, source, destination]
        return {"pair_capacity": np.maximum(1, pairs.max((0, 1))).astype(np.int64),
                "expert_capacity": np.int64(loads.sum(1).max())}            # the most any expert receives

    def capacity_bound(self, loads: np.ndarray) -> Dict[str, object]:
        """The capacities past which no routing can overflow (T from `loads`: every rank routes T k;
        a token picks k distinct experts, so a pair carries at most `T min(k, L)` rows). `loads`:
        `[n, E]`, or `[calls, n, E]` for the largest bound over calls."""
        num_tokens = int(np.asarray(loads).reshape(-1, self.num_experts).sum(-1).max()) // self.top_k
        return {"expert_capacity": self.n * num_tokens,
                "pair_capacity": (num_tokens * min(self.top_k, self.num_experts // self.n),) * self.n}


class CapacityController:
    """Host-side sizing of the capacities of `dispatchers` (one per MoE layer, in the order of the
    rows of the `expert_load` stat) for a world whose ep groups are `ep_groups` (lists of ranks).
    A capacity is an int, or a tuple of ints sized element by element (e.g. one per destination).

    Every layer gets the SAME capacities: the largest need of any layer. The blocks of a model are
    compiled once and the graph reused for every layer (`moetrain.modeling.reused_block`), and the
    capacities are Python ints baked into that graph: per-layer capacities would run every layer
    with the first layer's, and lose rows wherever a later layer needs more (issue 30). One set
    also bounds the graphs a run compiles independently of its depth."""

    def __init__(self, dispatchers: Sequence, ep_groups: Sequence[Sequence[int]], prior: float = PRIOR):
        if not prior > 0:
            raise ValueError(f"parallel.moe_capacity_prior: must be > 0 (the first capacities, in multiples "
                             f"of the even share of rows), got {prior!r}")
        self.prior = float(prior)
        self.dispatchers = list(dispatchers)
        self.ep_groups = [list(g) for g in ep_groups]
        shapes = {(d.num_experts, d.top_k, tuple(d.capacity_fields()), getattr(d, "n", 1)) for d in self.dispatchers}
        if len(shapes) != 1:
            raise ValueError(f"CapacityController: the MoE layers' dispatchers differ in (experts, top_k, capacity "
                             f"fields, ep size): {sorted(shapes)}; one capacity set serves them all")
        self.fields: Tuple[str, ...] = tuple(self.dispatchers[0].capacity_fields())
        self.history: Dict[str, List[np.ndarray]] = {f: [] for f in self.fields}
        self.changes: List[str] = []
        self.in_force: Dict[str, object] = {}     # the capacities the last call ran with
        self.largest: Dict[str, object] = {}      # element-wise the largest in force in any call: the
                                                  # buffers' peak (the first calls run the prior's)

    def _set(self, field: str, value) -> None:
        for dispatcher in self.dispatchers:
            setattr(dispatcher, field, value)

    def note_largest(self) -> None:
        """Folds `in_force` into `largest` (element-wise maximum)."""
        for field, value in self.in_force.items():
            seen = self.largest.get(field)
            self.largest[field] = value if seen is None else _capacity(np.maximum(np.asarray(seen), np.asarray(value)))

    def capacity(self, field: str):
        return getattr(self.dispatchers[0], field)

    def prime(self, num_tokens: int, prior: float = 0.0) -> None:
        """Capacities for calls of `num_tokens` tokens a rank before any counts are seen: `prior`
        (default: the controller's) times the even share (every expert `T k / E` rows from every
        rank), sized, at most the bound."""
        prior = prior or self.prior
        group, dispatcher = len(self.ep_groups[0]), self.dispatchers[0]
        even = np.full((group, dispatcher.num_experts), num_tokens * dispatcher.top_k / dispatcher.num_experts)
        needs, bounds = dispatcher.needed_capacity(even), dispatcher.capacity_bound(even)
        for field in self.fields:
            if not self.capacity(field):
                value = np.minimum(_sized(np.ceil(prior * np.asarray(needs[field]))), bounds[field])
                self._set(field, _capacity(value))

    def state(self) -> Dict:
        """What a checkpoint keeps so that a resumed run sizes its buffers exactly as the run that saved
        it would have (a buffer's size changes the order of sums in the expert GEMMs: last bits)."""
        return {"ep_groups": self.ep_groups, "layers": len(self.dispatchers), "tied": True,
                "capacities": {f: _plain(self.capacity(f)) for f in self.fields},
                "history": {f: [_plain(n) for n in needs] for f, needs in self.history.items()}}

    def load_state(self, state: Dict) -> bool:
        """Restores `state()` when it was saved on the same ep groups and MoE layers (capacities are
        per destination rank: another layout starts from the prior). True when restored. States of
        per-layer capacities (before issue 30) are not restored: they may hold the undersized sets."""
        if (not state or not state.get("tied") or state.get("ep_groups") != self.ep_groups
                or state.get("layers") != len(self.dispatchers)
                or sorted(state.get("capacities", {})) != sorted(self.fields)):
            return False
        for field, value in state["capacities"].items():
            self._set(field, tuple(value) if isinstance(value, list) else value)
        self.history = {f: [np.asarray(n, np.int64) for n in needs] for f, needs in state["history"].items()}
        return True

    def key(self) -> Tuple:
        """The capacity set in force; checks that every layer holds it (the graph is shared)."""
        key = tuple(self.capacity(f) for f in self.fields)
        for layer, dispatcher in enumerate(self.dispatchers):
            own = tuple(getattr(dispatcher, f) for f in self.fields)
            if own != key:
                raise RuntimeError(f"CapacityController: MoE layer {layer} holds capacities {own}, layer 0 {key}: "
                                   f"the layers share one compiled graph, so they must share capacities")
        return key

    def needed(self, loads: np.ndarray) -> Dict[str, np.ndarray]:
        """Rows each buffer needed: the maximum over layers and ep groups. `loads [world, layers, E]`."""
        if loads.ndim != 3 or loads.shape[1] != len(self.dispatchers):
            raise ValueError(f"expert_load of every rank must be [world, {len(self.dispatchers)} MoE layers, E], "
                             f"got {loads.shape}")
        needs = self.dispatchers[0].needed_capacities(self._per_call(loads))
        return {f: needs[f] for f in self.fields}

    def bounds(self, loads: np.ndarray) -> Dict[str, np.ndarray]:
        """The capacities past which nothing can overflow (every layer routes the same tokens)."""
        bound = self.dispatchers[0].capacity_bound(self._per_call(loads))
        return {f: np.asarray(bound[f], np.int64) for f in self.fields}

    def _per_call(self, loads: np.ndarray) -> np.ndarray:
        """`[world, layers, E]` -> `[groups * layers, ep, E]`: each ep group's loads of each layer."""
        grouped = loads[np.asarray(self.ep_groups)]                  # [groups, ep, layers, E]
        return grouped.transpose(0, 2, 1, 3).reshape(-1, grouped.shape[1], grouped.shape[3])

    def update(self, loads: np.ndarray) -> bool:
        """Checks the last call against its counts and resizes. True when a buffer overflowed, i.e.
        the call must be run again (with the grown capacities now set)."""
        overflow = False
        needs, bounds = self.needed(loads), self.bounds(loads)
        for field, need in needs.items():
            history = self.history[field]
            history.append(need)
            del history[:-WINDOW]
            current = self.capacity(field)
            now = np.broadcast_to(np.asarray(current or 0, np.int64), need.shape)
            grow, new = resized(now, need, np.max(history, axis=0), bounds[field])
            if (new != now).any():
                value = _capacity(new)
                why = "overflow" if grow.any() else ("sized" if (now == 0).all() else "shrink")
                self.changes.append(f"{field} {current or 'bound'} -> {value} ({why})")
                self._set(field, value)
            overflow |= bool(grow.any())
        return overflow


def _capacity(value: np.ndarray):
    """A capacity as the dispatchers hold it: an int, or a tuple of ints."""
    return tuple(int(v) for v in value) if np.ndim(value) else int(value)


def _plain(value):
    """A capacity or a need as JSON: an int or a list of ints."""
    return np.asarray(value, np.int64).tolist()


class AdaptiveStep:
    """`fn(*args)` (returning `(loss, stat_keys, stat_values, ...)`) with capacities managed by
    `controller`: compiled with `wrap` once per capacity set, re-run when a buffer overflowed.
    `gather(load [layers, E]) -> [world, layers, E]` collects every rank's counts. At most
    `max_graphs` compiled graphs are kept (least recently used dropped): a long run whose loads
    drift would otherwise hold a graph for every capacity set it ever met."""

    def __init__(self, fn: Callable, wrap: Callable, controller: CapacityController,
                 gather: Callable[[np.ndarray], np.ndarray], log: Callable[[str], None] = print,
                 max_graphs: int = 8):
        self.fn, self.wrap, self.controller, self.gather, self.log = fn, wrap, controller, gather, log
        self.compiled: "OrderedDict[Tuple[int, ...], Callable]" = OrderedDict()
        self.max_graphs = max_graphs
        self.calls = self.reruns = 0

    def __call__(self, *args):
        if self.calls == 0 and not any(self.controller.key()):
            tokens = tokens_per_call(args)
            if tokens:
                self.controller.prime(tokens)
        while True:
            key = self.controller.key()
            if key not in self.compiled:
                self.compiled[key] = self.wrap(self.fn)   # a new jit wrapper compiles a new graph
                if len(self.compiled) > self.max_graphs:
                    self.compiled.popitem(last=False)
            self.compiled.move_to_end(key)
            self.controller.in_force = dict(zip(self.controller.fields, key))
            self.controller.note_largest()
            out = self.compiled[key](*args)
            self.calls += 1
            keys, values = out[1], out[2]
            # every row each layer dispatched (`dispatch_load`): `expert_load` leaves out positions a
            # layer exchanges but does not count (DeepSeek-V3's MTP under context parallelism)
            key = next((k for k in ("dispatch_load", "expert_load") if k in keys), None)
            if key is None:
                raise ValueError(f"AdaptiveStep: the step's stats {tuple(keys)} lack 'dispatch_load' and "
                                 f"'expert_load', which size the MoE dispatch buffers")
            load = values[list(keys).index(key)].asnumpy().astype(np.float64)
            rerun = self.controller.update(self.gather(load.reshape(len(self.controller.dispatchers), -1)))
            if self.controller.changes:
                self.log("moetrain: MoE dispatch capacities: " + "; ".join(self.controller.changes)
                         + ("; re-running the micro-batch" if rerun else ""))
                self.controller.changes.clear()
            if not rerun:
                return out
            self.reruns += 1
            # drop the discarded result before the re-run: held through it, its gradients (the
            # packed buffers of a training step) stayed live beside the re-run's own (measured:
            # moe_1b, 4 layers, 445 MiB more at the step's peak)
            del out, keys, values


def tokens_per_call(args) -> int:
    """Tokens one call routes per MoE layer: the size of its first integer argument of rank >= 2
    (the token ids `[B, S]` of the trainer's step functions); 0 when there is none."""
    for arg in args:
        shape, dtype = getattr(arg, "shape", ()), str(getattr(arg, "dtype", ""))
        if len(shape) >= 2 and "Int" in dtype:
            return int(np.prod(shape))
    return 0


POLICIES = ("adaptive", "bound")   # parallel.moe_capacity


def adaptive_steps(dispatchers: Sequence, pctx, wrap: Callable, *fns: Callable, policy: str = "adaptive",
                   prior: float = PRIOR) -> Tuple[Callable, ...]:
    """`fns` wrapped with `wrap` (e.g. `ms.jit`), as `AdaptiveStep`s sharing one controller when
    the model's MoE `dispatchers` (one per MoE layer) are dropless with capacities to manage;
    plainly otherwise. The pipeline
    schedule (pp > 1) runs its stages itself and sizes them per step (`StepCapacities`). `policy` "bound"
    (`parallel.moe_capacity: bound`) keeps the bound everywhere: one graph, no re-runs, no host
    sync, larger buffers (runs too short for sizing to pay off); `prior`: the first capacities in
    multiples of the even share (`parallel.moe_capacity_prior`)."""
    if policy not in POLICIES:
        raise ValueError(f"parallel.moe_capacity: {policy!r} is not one of {POLICIES}")
    if (pctx.pp > 1 or policy == "bound"
            or not any(getattr(d, "capacity_fields", lambda: ())() for d in dispatchers)):
        return tuple(wrap(fn) for fn in fns)
    controller = CapacityController(dispatchers, ep_groups_of(pctx), prior)
    gather = _world_gather(pctx)
    # stderr: stdout carries what a command prints for machines (`moetrain plan --dry-run --json`)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if pctx.rank == 0 else (lambda line: None)
    return tuple(AdaptiveStep(fn, wrap, controller, gather, log) for fn in fns)


def ep_groups_of(pctx) -> List[List[int]]:
    """The distinct ep groups of the world (lists of global ranks)."""
    groups = {ParallelContext.build(pctx.world_size, r, pctx.dp, pctx.tp, pctx.pp, pctx.ep, pctx.etp, pctx.cp
                                    ).group("ep").ranks for r in range(pctx.world_size)}
    return [list(g) for g in sorted(groups)]


def _world_gather(pctx) -> Callable[[np.ndarray], np.ndarray]:
    world = pctx.group("world")
    if world.size == 1:
        return lambda load: load[None]
    def gather(load: np.ndarray) -> np.ndarray:
        rows = comm.all_gather(Tensor(load[None].astype(np.float32)), world).asnumpy()
        return rows.astype(np.float64)
    return gather


class StepCapacities:
    """Adaptive `pair_capacity` for a runner that can re-run only a whole step: the pipeline schedule,
    where a micro-batch's passes are spread over the stages and every backward recomputes its
    forward, so the capacities may not change within a step (a backward's recompute must fit where
    its forward did). The sizing rules are `CapacityController`'s for the bucketed all-to-all:

    1. A step runs with the capacities in force (primed before the first step: `prior` times the
       even share, sized, at most the bound; one compiled set of passes per capacity set).
    2. After it every rank all-gathers over the world one small row: per destination j the most
       rows it sent j in any of its calls and MoE layers (from `dispatch_load`), the most tokens
       a call routed (the bound), and whether it holds pair-sized dispatchers (a dense stage holds
       none, and takes part all the same).
    3. A destination that needed more than its capacity overflowed: the outputs of the step are
       wrong, so every rank grows it (`sized(need)`, at least GROWTH) and runs the step again.
       Otherwise the capacities shrink when the largest need of the last WINDOW steps fits a bucket
       below SHRINK * capacity.

    Every MoE layer of the world holds the same set (the largest need of any layer, any ep group):
    one compiled graph per block, as `CapacityController` explains. `expert_capacity` (the bmm
    layout's) is not sized here: those dispatchers keep the bound."""

    def __init__(self, dispatchers: Sequence, n: int, num_experts: int, top_k: int,
                 gather: Callable[[np.ndarray], np.ndarray], prior: float = PRIOR):
        if not prior > 0:
            raise ValueError(f"parallel.moe_capacity_prior: must be > 0 (the first capacities, in multiples "
                             f"of the even share of rows), got {prior!r}")
        self.dispatchers = [d for d in dispatchers if "pair_capacity" in d.capacity_fields()]
        self.n, self.num_experts, self.top_k, self.prior = int(n), int(num_experts), int(top_k), float(prior)
        self.gather = gather
        self.capacity: Tuple[int, ...] = ()      # () = the bound
        self.largest: Tuple[int, ...] = ()
        self.history: List[np.ndarray] = []
        self.changes: List[str] = []
        self.managed = None                      # whether any rank sizes pairs: known after the first step
        self.steps = self.reruns = 0

    def _set(self, value: Tuple[int, ...]) -> None:
        self.capacity = value
        for dispatcher in self.dispatchers:
            dispatcher.pair_capacity = value
        if value:
            self.largest = value if not self.largest else _capacity(np.maximum(self.largest, value))

    def key(self) -> Tuple[int, ...]:
        return self.capacity

    def prime(self, num_tokens: int) -> None:
        """The first capacities, for calls of `num_tokens` tokens a rank (before any counts)."""
        if not self.capacity and self.managed is not False:
            even = num_tokens * self.top_k / self.n
            bound = num_tokens * min(self.top_k, self.num_experts // self.n)
            self._set(_capacity(np.minimum(_sized(np.full(self.n, np.ceil(self.prior * even))), bound)))

    def local_need(self, loads: Sequence[np.ndarray]) -> np.ndarray:
        """This rank's row for the gather from `loads`, its calls' `dispatch_load` `[layers, E]`:
        `[n]` the most rows sent to each destination in one call of one layer, the most tokens a call
        routed, and 1 if this rank holds pair-sized dispatchers."""
        row = np.zeros(self.n + 2, np.float64)
        for load in loads:
            load = np.asarray(load, np.float64).reshape(-1, self.num_experts)
            if load.size:
                pairs = load.reshape(load.shape[0], self.n, -1).sum(-1)
                row[:self.n] = np.maximum(row[:self.n], pairs.max(0))
                row[self.n] = max(row[self.n], float(load.sum(-1).max()) / self.top_k)
        row[self.n + 1] = 1.0 if self.dispatchers else 0.0
        return row

    def update(self, row: np.ndarray) -> bool:
        """Gathers every rank's `local_need` row and resizes; True when a destination overflowed,
        i.e. the step must be run again (with the grown capacities now set)."""
        rows = np.asarray(self.gather(np.asarray(row, np.float64)), np.float64).reshape(-1, self.n + 2)
        self.managed = bool(rows[:, self.n + 1].max() > 0)
        if not self.managed:           # nobody sizes pairs (another dispatcher): nothing to manage
            if self.capacity:
                self._set(())
            return False
        need = np.maximum(1, rows[:, :self.n].max(0)).astype(np.int64)
        bound = np.full(self.n, int(rows[:, self.n].max()) * min(self.top_k, self.num_experts // self.n), np.int64)
        self.history.append(need)
        del self.history[:-WINDOW]
        current = self.capacity
        now = np.asarray(current or (0,) * self.n, np.int64)
        grow, new = resized(now, need, np.max(self.history, axis=0), bound)
        if (new != now).any():
            value = _capacity(new)
            why = "overflow" if grow.any() else ("sized" if (now == 0).all() else "shrink")
            self.changes.append(f"pair_capacity {current or 'bound'} -> {value} ({why})")
            self._set(value)
        return bool(grow.any())

    def state(self) -> Dict:
        """What a checkpoint keeps (see `CapacityController.state`)."""
        return {"step_capacities": True, "n": self.n, "capacity": list(self.capacity),
                "history": [_plain(h) for h in self.history]}

    def load_state(self, state: Dict) -> bool:
        if not state or not state.get("step_capacities") or state.get("n") != self.n:
            return False
        self._set(tuple(int(c) for c in state["capacity"]))
        self.history = [np.asarray(h, np.int64) for h in state["history"]]
        return True


def world_gather(pctx) -> Callable[[np.ndarray], np.ndarray]:
    """`gather(row [...]) -> [world, ...]`: every rank's row, over the world (float64 in and out)."""
    return _world_gather(pctx)
