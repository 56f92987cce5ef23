"""The pipeline's adaptive dispatch capacities (`moetrain.moe.capacity.StepCapacities`).

First alone, no MindSpore graph: a simulated pp2·ep2 world (stage 0 dense, stage 1 with MoE layers)
steps through random routing counts; every rank must take the same decisions, and after the re-runs
no step may lose a row. Then in training: `configs/deepseek_v3_tiny.yaml` at its depth (MLA, MTP, a
dense first layer) on pp2·dp2·ep2, dropless at the default adaptive capacities, as
`configs/deepseek_v3_671b.yaml` runs (pp16·ep64), for 20 steps in the suite's shared 4-rank job,
against one process."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from moetrain.moe.capacity import StepCapacities, sized

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed import share_runs, shared_reference_dirs, shared_run_dirs, step_records  # noqa: E402

KJV = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "kjv_tiny", "kjv_tiny")
DEEPSEEK = "configs/deepseek_v3_tiny.yaml"
STEPS = 20
RUN = [f"data.path={KJV}_train", "data.eval_path=", f"data.tokenizer={KJV}.model", "model.seq_length=64",
       f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=2", "train.seed=7",
       "train.eval_interval=0", "checkpoint.save_at_end=false", "checkpoint.save_steps=0",
       "logging.tensorboard=false", "logging.progress_bar=false"]
# the buffers start at 1.5x the even share, which this routing outgrows once (one re-run, to (448, 512) a
# pair; two capacity sets, each a compile of both stages: prior 1.0 made three, 63 against 44-50 CPU s a rank)
PP2_EP2 = ["parallel.pipeline_stage=2", "parallel.data_parallel=2", "parallel.expert_parallel=2",
           "parallel.moe_capacity_prior=1.5"]

share_runs(4, __name__, lambda fixture, out_dir: [f"pp2_dp2_ep2:{DEEPSEEK}:" + ",".join(RUN + PP2_EP2)],
           timeout=900, references=lambda fixture: [f"reference:{DEEPSEEK}:" + ",".join(RUN)])

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


@pytest.mark.distributed
@pytest.mark.slow
def test_deepseek_v3_on_pp2_dp2_ep2_at_adaptive_capacities_reproduces_one_process(shared_job_4):
    """Each step's buffers sized from the routing, an overflow re-running the whole step on every
    stage: 20 steps are one process's (losses within 1e-5, grad_norm within 1e-4, expert loads exact
    for 5 steps, within 4 tokens after), every routed row computed (the trainer's dispatch invariant
    held at every step; it stops the run otherwise), and at least one re-run happened."""
    run_dir = shared_run_dirs(shared_job_4, __name__, ["pp2_dp2_ep2"])["pp2_dp2_ep2"]
    reference = step_records(shared_reference_dirs(shared_job_4, __name__, ["reference"])["reference"])
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    for key, rtol in (("loss", 1e-5), ("lm_loss", 1e-5), ("mtp_loss", 1e-5), ("seq_aux_loss", 1e-5),
                      ("z_loss", 1e-5), ("grad_norm", 1e-4)):
        np.testing.assert_allclose([r[key] for r in steps], [r[key] for r in reference], rtol=rtol, err_msg=key)
    for a, b in zip(reference, steps):
        most = 0 if a["step"] <= 5 else 4
        assert np.abs(np.subtract(b["expert_load"], a["expert_load"])).max() <= most, f"step {a['step']}"
    assert np.shape(reference[0]["expert_load"]) == (4, 16)                # 3 MoE layers + the MTP block
    assert all(r["dropped"] == 0 and r["expert_rows"] == r["routed"] for r in steps), \
        [(r["expert_rows"], r["routed"]) for r in steps]
    ranks = [json.load(open(os.path.join(run_dir, f"rank_{r}.json"))) for r in range(4)]
    assert sorted((r["pp_rank"], r["ep_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    capacity = ranks[-1]["capacity"]                   # the last stage: the MTP block's layer and two MoE layers
    assert capacity is not None and capacity["calls"] == STEPS + capacity["reruns"], capacity
    assert capacity["reruns"] >= 1 and all(r["capacity"] == capacity for r in ranks), capacity   # one decision
