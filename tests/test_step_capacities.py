"""The pipeline's adaptive dispatch capacities (`moetrain.moe.capacity.StepCapacities`) alone, no
MindSpore graph: a simulated pp2·ep2 world (stage 0 dense, stage 1 with MoE layers) steps through
random routing counts; every rank must take the same decisions, and after the re-runs no step may
lose a row."""
from __future__ import annotations

import numpy as np
import pytest

from moetrain.moe.capacity import StepCapacities, sized

EP, EXPERTS, TOP_K, TOKENS = 2, 8, 2, 64


class PairDispatcher:
    """The host side of a bucketed all-to-all dispatcher: what StepCapacities reads and sets."""

    def __init__(self, sizes_pairs: bool = True):
        self.sizes_pairs, self.pair_capacity = sizes_pairs, ()

    def capacity_fields(self):
        return ("pair_capacity",) if self.sizes_pairs else ()


def world(sizes_pairs=True):
    """Ranks 0, 1: the dense stage (no dispatchers); ranks 2, 3: one ep group, two MoE layers each."""
    rows = {}
    gather = lambda row: np.stack([rows[r] for r in sorted(rows)])   # noqa: E731 (the world's rows)
    ranks = [StepCapacities([] if r < 2 else [PairDispatcher(sizes_pairs), PairDispatcher(sizes_pairs)],
                            EP, EXPERTS, TOP_K, gather) for r in range(4)]
    return ranks, rows


def lost_rows(loads, capacity):
    """Rows past a destination's capacity (the tail the all-to-all cuts): `loads [layers, E]` of one source."""
    if not capacity:
        return 0
    pairs = np.asarray(loads).reshape(len(loads), EP, -1).sum(-1)
    return int(np.maximum(0, pairs - np.asarray(capacity)).sum())


def step(ranks, rows, loads):
    """One step of every rank with `loads[r]` (a list of [layers, E] per call; empty for the dense
    stage), re-run until no rank overflows; returns (re-runs, rows lost in the accepted run)."""
    reruns = 0
    while True:
        capacity = ranks[2].key()
        lost = sum(lost_rows(call, capacity) for r in (2, 3) for call in loads[r])
        for r, caps in enumerate(ranks):
            rows[r] = caps.local_need(loads[r])
        decisions = {caps.update(rows[r]) for r, caps in enumerate(ranks)}
        assert len(decisions) == 1, "the ranks disagree on re-running the step"
        assert len({caps.key() for caps in ranks}) == 1, [caps.key() for caps in ranks]
        if not decisions.pop():
            return reruns, lost
        reruns += 1
        assert reruns <= 1, "a grown capacity must fit the step it was sized from"


def routing(rng, skew):
    """Two calls (micro-batches) of two layers: TOKENS x TOP_K assignments each, skewed to expert 0."""
    p = np.full(EXPERTS, 1.0)
    p[0] += skew
    return [rng.multinomial(TOKENS * TOP_K, p / p.sum(), size=2).astype(np.float64) for _ in range(2)]


def test_every_rank_sizes_alike_and_no_step_loses_a_row():
    ranks, rows = world()
    rng = np.random.default_rng(0)
    for caps in ranks:
        caps.prime(TOKENS)
    even = TOKENS * TOP_K / EP
    assert ranks[2].key() == (min(sized(2 * even), TOKENS * TOP_K),) * EP      # the prior, at most the bound
    assert all(d.pair_capacity == ranks[2].key() for d in ranks[3].dispatchers)
    total_reruns, shrank, grew = 0, False, False
    for i in range(60):
        skew = 0.0 if i < 20 else (30.0 if i < 40 else 1.0)                     # balanced, a drift, back
        before = ranks[2].key()
        reruns, lost = step(ranks, rows, [[], [], routing(rng, skew), routing(rng, skew)])
        after = ranks[2].key()
        shrank |= any(b < a for a, b in zip(before, after))
        grew |= reruns > 0 and any(b > a for a, b in zip(before, after))
        total_reruns += reruns
        assert lost == 0, f"step {i}: {lost} rows past the capacities {before} in the accepted run"
    assert shrank and grew and total_reruns >= 1, (shrank, grew, total_reruns)
    assert ranks[0].largest == ranks[2].largest and max(ranks[2].largest) >= max(ranks[2].key())


def test_nothing_is_managed_where_no_dispatcher_sizes_pairs():
    """Another dispatcher (all-gather, exact splits) sizes nothing: no re-run, the bound kept."""
    ranks, rows = world(sizes_pairs=False)
    for caps in ranks:
        caps.prime(TOKENS)
    rng = np.random.default_rng(1)
    assert step(ranks, rows, [[], [], routing(rng, 20.0), routing(rng, 20.0)]) == (0, 0)
    assert all(caps.key() == () and caps.managed is False for caps in ranks)


def test_state_round_trip():
    ranks, rows = world()
    for caps in ranks:
        caps.prime(TOKENS)
    step(ranks, rows, [[], [], routing(np.random.default_rng(2), 3.0), routing(np.random.default_rng(3), 3.0)])
    fresh, _ = world()
    assert fresh[2].load_state(ranks[2].state()) and fresh[2].key() == ranks[2].key()
    assert all(d.pair_capacity == ranks[2].key() for d in fresh[2].dispatchers)
    assert not fresh[2].load_state({"step_capacities": True, "n": EP + 1})    # another ep size: the prior
