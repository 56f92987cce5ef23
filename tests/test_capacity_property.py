"""Property test of the dropless capacity controller alone (no MindSpore): thousands of random
routing-count sequences over ep sizes, depths, top-k and drifts, each dispatched in simulation under
the capacities the controller sets, with its re-runs, as `AdaptiveStep` drives it.

The simulation follows what the compiled step does (moetrain/moe/ep_dispatcher.py):
- a source's rows to destination j are one run sorted by local expert, cut at `pair_capacity[j]`
  (the tail of the run, i.e. its last experts' rows, is what an overflow loses);
- in the capacity layout a local expert keeps at most `expert_capacity` of the rows it received;
- the blocks share ONE compiled graph (`ms.lazy_inline`, moetrain.modeling.reused_block), in which
  the capacities are constants: every layer runs with the capacities the first layer's dispatcher
  held when the graph was built, whatever the others hold.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from background import child_only, heavy_tests_in_child, wait_for_background  # noqa: E402
from moetrain.moe.capacity import CapacityController, DroplessSizing  # noqa: E402

# the 1,500 simulated runs (~25 s of one core) go to an idle-priority child beside the suite
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
heavy_tests_in_child(__name__, os.path.abspath(__file__), "background_child", cwd=ROOT, timeout=2400,
                     reader="test_the_property_holds_in_the_background_child")


class SimDispatcher(DroplessSizing):
    """The host side of a bucketed all-to-all dispatcher (the real sizing rules, inherited)."""

    def __init__(self, ep: int, num_experts: int, top_k: int, layout: str):
        self.n, self.num_experts, self.top_k, self.layout = ep, num_experts, top_k, layout
        self.capacity_factor, self.sizes_pairs = 0.0, ep > 1
        self.pair_capacity, self.expert_capacity = (), 0


def computed_rows(loads: np.ndarray, ep: int, pair_capacity, expert_capacity: int) -> int:
    """Rows the experts compute for `loads [groups, ep, layers, E]` (each ep group's ranks, every
    layer run with the same capacities; 0 / (): the bound, which nothing exceeds)."""
    groups, _, layers, experts = loads.shape
    per_pair = loads.reshape(groups, ep, layers, ep, experts // ep)       # [g, source, layer, destination, L]
    if pair_capacity:
        before = np.cumsum(per_pair, -1) - per_pair                        # rows ahead in the run
        cap = np.asarray(pair_capacity).reshape(1, 1, 1, ep, 1)
        per_pair = np.clip(cap - before, 0, per_pair)
    received = per_pair.sum(1)                                             # [g, layer, destination, L]
    if expert_capacity:
        received = np.minimum(received, expert_capacity)
    return int(received.sum())


def routing_counts(rng, world: int, layers: int, experts: int, top_k: int, tokens: int, logits) -> np.ndarray:
    """`[world, layers, E]` assignments per expert: each token picks the top_k distinct experts of
    `logits [layers, E]` plus uniform noise (cheaper than Gumbel noise; any noise does here)."""
    noise = rng.random((world, layers, tokens, experts), dtype=np.float32) * np.float32(3.0)
    scores = logits[None, :, None, :].astype(np.float32) + noise
    picks = np.argpartition(-scores, top_k - 1, -1)[..., :top_k]
    offset = np.arange(world * layers).reshape(world, layers, 1, 1) * experts
    counts = np.bincount((picks + offset).reshape(-1), minlength=world * layers * experts)
    return counts.reshape(world, layers, experts).astype(np.float64)


def run_sequence(rng, ep: int, dp: int, layers: int, experts: int, top_k: int, tokens: int, layout: str,
                 drift: float, steps: int):
    """One run: returns (rows lost in accepted passes, most re-runs of one call, capacity sets seen)."""
    world = ep * dp
    dispatchers = [SimDispatcher(ep, experts, top_k, layout) for _ in range(layers)]
    controller = CapacityController(dispatchers, [list(range(g * ep, (g + 1) * ep)) for g in range(dp)])
    controller.prime(tokens, prior=float(rng.choice([0.5, 1.0, 2.0, 4.0])))
    logits = rng.normal(0, 1.0, (layers, experts))
    direction = rng.normal(0, 1.0, (layers, experts))
    lost, most_reruns, sets = 0, 0, set()
    for step in range(steps):
        loads = routing_counts(rng, world, layers, experts, top_k, tokens, logits + drift * step * direction)
        reruns = 0
        while True:
            graph = dispatchers[0]                                         # the shared graph's constants
            sets.add((graph.pair_capacity, graph.expert_capacity))
            computed = computed_rows(loads.reshape(dp, ep, layers, experts), ep, graph.pair_capacity,
                                     graph.expert_capacity)
            if not controller.update(loads):
                lost += int(loads.sum()) - computed                        # the pass the step keeps
                break
            reruns += 1
        most_reruns = max(most_reruns, reruns)
    return lost, most_reruns, sets


CASES = [  # ep, dp, layers, experts, top_k, tokens, layout
    (2, 1, 4, 8, 2, 64, "rows"),
    (4, 1, 4, 8, 2, 32, "rows"),
    (4, 2, 6, 16, 4, 32, "capacity"),
    (8, 1, 3, 16, 1, 48, "rows"),
    (2, 2, 4, 8, 2, 48, "capacity"),
    (1, 2, 4, 8, 2, 64, "capacity"),       # no ep: the expert buffer of the bmm layout alone
]


@pytest.mark.background_child
@child_only(__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ep{c[0]}dp{c[1]}L{c[2]}E{c[3]}k{c[4]}{c[6]}")
def test_no_row_lost_bounded_reruns_and_capacity_sets(case):
    ep, dp, layers, experts, top_k, tokens, layout = case
    rng = np.random.default_rng(hash(case) % 2 ** 32)
    steps, runs = 24, 250
    for run in range(runs):
        drift = float(rng.choice([0.0, 0.02, 0.1, 0.3]))
        lost, reruns, sets = run_sequence(rng, ep, dp, layers, experts, top_k, tokens, layout, drift, steps)
        where = f"run {run} (drift {drift})"
        assert lost == 0, f"{where}: {lost} rows lost after the re-runs"
        # an overflow grows past the need, so the re-run fits: one re-run per call at most
        assert reruns <= 1, f"{where}: {reruns} re-runs of one call"
        # a buffer element is sized, then grows or shrinks rarely (by >= GROWTH, hysteresis): a few
        # capacity sets a run, whatever the depth (per-layer sets would multiply with the layers)
        elements = (ep > 1) * ep + (layout == "capacity")
        assert len(sets) <= 4 + 2 * elements, f"{where}: {len(sets)} capacity sets in {steps} steps"


def test_the_property_holds_in_the_background_child():
    """Reads the outcome of the child that ran the simulations above (every case passed)."""
    done = wait_for_background(__name__)
    tail = done.stdout[-4000:]
    assert done.returncode == 0, tail
    assert f"{len(CASES)} passed" in tail and "failed" not in tail, tail
