"""Rank layout, groups and layout validation of moetrain.distributed.topology (pure Python)."""
import itertools

import pytest

from moetrain.distributed.topology import GROUP_KINDS, ParallelContext, init_parallel, launched_world_size
from moetrain.layout import LayoutError

LAYOUTS = [  # dp, tp, pp, ep, etp: before folding (etp 1, ep dividing dp), then folded
    (1, 1, 1, 1, 1), (4, 1, 1, 2, 1), (2, 2, 2, 1, 1), (4, 2, 2, 2, 1), (2, 1, 4, 2, 1), (8, 1, 1, 4, 1),
    (1, 4, 2, 1, 1),
    (1, 2, 1, 2, 1), (2, 2, 1, 2, 2), (2, 2, 1, 1, 2), (2, 4, 1, 4, 2), (1, 2, 2, 2, 1), (2, 2, 1, 4, 1),
    (2, 4, 2, 2, 2),
]


def naive_coordinates(dp, tp, pp, ep, etp=1):
    """rank -> coordinates by enumerating the Megatron order (tp fastest, then dp, then pp), and the
    experts by Megatron-Core's expert rank generator over each stage's tp x dp ranks (etp fastest,
    then ep, then edp) when folded; before folding ep is carved out of dp, experts replicated over tp."""
    folded = etp > 1 or dp % ep
    coords, rank = {}, 0
    for p in range(pp):
        for local in range(dp * tp):
            d, t = divmod(local, tp)
            if folded:
                lane, ep_rank, ep_block = local % etp, (local // etp) % ep, local // (etp * ep)
                etp_block, tokens = local // etp, lane
            else:
                lane, ep_rank, ep_block, etp_block, tokens = t, d % ep, d // ep, rank, rank
            coords[rank] = {"tp": t, "dp": d, "pp": p, "ep": ep_rank, "ep_block": ep_block, "lane": lane,
                            "etp_block": etp_block, "tokens": tokens}
            rank += 1
    return coords


def naive_members(kind, rank, coords, pp):
    """Members of `rank`'s group of `kind`: the ranks that share the coordinates the kind fixes."""
    me = coords[rank]
    same = {"tp": ("dp", "pp"), "dp": ("tp", "pp"), "cp": ("tp", "dp", "pp"), "pp": ("dp", "tp"),
            "ep": ("lane", "pp", "ep_block"), "edp": ("lane", "pp", "ep"), "etp": ("pp", "etp_block"),
            "tp_tokens": ("pp", "dp", "tokens")}
    if kind == "world":
        return tuple(sorted(coords))
    if kind in same:
        return tuple(sorted(r for r, c in coords.items() if all(c[k] == me[k] for k in same[kind])))
    if kind == "embedding":
        if me["pp"] not in (0, pp - 1):
            return (rank,)
        return tuple(sorted(r for r, c in coords.items()
                            if c["dp"] == me["dp"] and c["tp"] == me["tp"] and c["pp"] in (0, pp - 1)))
    step = 1 if kind == "pp_next" else -1
    if not 0 <= me["pp"] + step < pp:
        return (rank,)
    return tuple(sorted(r for r, c in coords.items() if c["dp"] == me["dp"] and c["tp"] == me["tp"]
                        and c["pp"] in (me["pp"], me["pp"] + step)))


@pytest.mark.parametrize("dp, tp, pp, ep, etp", LAYOUTS)
def test_coordinates_and_groups_match_a_naive_enumeration(dp, tp, pp, ep, etp):
    world = dp * tp * pp
    coords = naive_coordinates(dp, tp, pp, ep, etp)
    folded = etp > 1 or dp % ep
    for rank in range(world):
        ctx = ParallelContext.build(world, rank, dp, tp, pp, ep, etp)
        c = coords[rank]
        assert (ctx.tp_rank, ctx.dp_rank, ctx.pp_rank, ctx.ep_rank) == (c["tp"], c["dp"], c["pp"], c["ep"])
        assert ctx.edp_rank == c["ep_block"] and ctx.edp == (dp * tp // (etp * ep) if folded else dp // ep)
        assert ctx.etp_rank == (c["lane"] if folded else 0) and ctx.expert_folded == bool(folded)
        assert ctx.token_slices == (tp // etp if folded else 1)
        assert ctx.is_first_stage == (c["pp"] == 0) and ctx.is_last_stage == (c["pp"] == pp - 1)
        for kind in GROUP_KINDS:
            group = ctx.group(kind)
            assert group.ranks == naive_members(kind, rank, coords, pp), (kind, rank)
            assert group.ranks[group.rank_in_group] == rank
            assert group.kind == {"pp_next": "pp", "pp_prev": "pp", "etp": "tp", "tp_tokens": "tp"}.get(kind, kind)


@pytest.mark.parametrize("dp, tp, pp, ep, etp", [l for l in LAYOUTS if l[4] > 1 or l[0] % l[3]])
def test_folded_expert_groups_cover_each_stage_as_etp_x_ep_x_edp(dp, tp, pp, ep, etp):
    """Every stage's tp x dp ranks are etp x ep x edp: each (etp rank, ep rank) pair, i.e. each slice of
    the experts, sits on exactly edp ranks, and those are its edp group; an etp group holds the same
    tokens (one dp rank) and a tp_tokens group's slices make up one dp rank's tokens once each."""
    world = dp * tp * pp
    ctxs = [ParallelContext.build(world, r, dp, tp, pp, ep, etp) for r in range(world)]
    for stage in range(pp):
        mine = [c for c in ctxs if c.pp_rank == stage]
        holders = {}
        for c in mine:
            holders.setdefault((c.etp_rank, c.ep_rank), []).append(c.rank)
        assert len(holders) == etp * ep and {len(v) for v in holders.values()} == {dp * tp // (etp * ep)}
        for c in mine:
            assert c.group("edp").ranks == tuple(holders[(c.etp_rank, c.ep_rank)])
            assert {ctxs[r].dp_rank for r in c.group("etp").ranks} == {c.dp_rank}
            assert c.group("etp").size == etp and c.group("tp_tokens").size == tp // etp
            assert set(c.group("tp_tokens").ranks) | set(c.group("etp").ranks) <= set(c.group("tp").ranks)


def test_megatron_formula_on_a_16_rank_layout():
    # dp=4 tp=2 pp=2 ep=2: rank 13 = tp 1 + 2 * (dp 2 + 4 * pp 1)
    ctx = ParallelContext.build(16, 13, dp=4, tp=2, pp=2, ep=2)
    assert (ctx.tp_rank, ctx.dp_rank, ctx.pp_rank, ctx.ep_rank, ctx.edp_rank) == (1, 2, 1, 0, 1)
    assert ctx.group("etp").is_trivial and ctx.group("tp_tokens").is_trivial   # not folded
    assert ctx.group("tp").ranks == (12, 13)
    assert ctx.group("dp").ranks == (9, 11, 13, 15)
    assert ctx.group("pp").ranks == (5, 13)
    assert ctx.group("ep").ranks == (13, 15)          # dp ranks 2, 3
    assert ctx.group("edp").ranks == (9, 13)          # dp ranks 0, 2 (ep_rank 0)
    assert ctx.group("embedding").ranks == (5, 13)    # first and last stage
    assert ctx.group("pp_prev").ranks == (5, 13) and ctx.group("pp_next").is_trivial


def test_folded_groups_of_tp2_dp2_etp2_ep2_and_of_ep_spanning_tp():
    # tp2 dp2 etp2 ep2: each expert split over the tp pair; ep over the dp ranks; no expert replica
    ctx = ParallelContext.build(4, 1, dp=2, tp=2, ep=2, etp=2)
    assert ctx.group("etp").ranks == (0, 1) and ctx.group("ep").ranks == (1, 3) and ctx.group("edp").is_trivial
    assert ctx.group("tp_tokens").is_trivial and (ctx.etp_rank, ctx.ep_rank) == (1, 0)
    # tp2 dp2 etp2 ep1: the etp>1, ep=1 case: expert gradients reduced over edp = the dp ranks, not over tp
    ctx = ParallelContext.build(4, 1, dp=2, tp=2, ep=1, etp=2)
    assert ctx.group("edp").ranks == (1, 3) and ctx.group("etp").ranks == (0, 1)
    # tp2 dp1 ep2: ep spans the tp pair, each dispatching half the tokens
    ctx = ParallelContext.build(2, 1, dp=1, tp=2, ep=2)
    assert ctx.group("ep").ranks == (0, 1) and ctx.group("tp_tokens").ranks == (0, 1) and ctx.ep_rank == 1
    assert ctx.group("etp").is_trivial and ctx.group("edp").is_trivial
    # tp2 dp2 ep2 etp1 stays the layout before folding: ep over dp, experts replicated over tp
    ctx = ParallelContext.build(4, 1, dp=2, tp=2, ep=2)
    assert not ctx.expert_folded and ctx.group("ep").ranks == (1, 3) and ctx.group("tp_tokens").is_trivial


@pytest.mark.parametrize("dp, tp, pp, ep, etp", LAYOUTS)
def test_groups_of_a_kind_partition_the_world(dp, tp, pp, ep, etp):
    world = dp * tp * pp
    ctxs = [ParallelContext.build(world, r, dp, tp, pp, ep, etp) for r in range(world)]
    edp = dp * tp // (etp * ep) if etp > 1 or dp % ep else dp // ep
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("ep", ep), ("edp", edp)):
        groups = {c.group(kind).ranks for c in ctxs}
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(world)), kind
        assert {len(g) for g in groups} == {size}, kind


@pytest.mark.parametrize("dp, tp, pp, ep, etp", LAYOUTS)
def test_communicator_creation_is_consistent_across_ranks(dp, tp, pp, ep, etp):
    world = dp * tp * pp
    plans = {r: ParallelContext.build(world, r, dp, tp, pp, ep, etp).communicators_to_create()
             for r in range(world)}
    members_of = {}
    for rank, plan in plans.items():
        names = [name for name, _ in plan]
        assert len(names) == len(set(names)), "a communicator is created twice"
        for name, ranks in plan:
            assert rank in ranks and 1 < len(ranks) < world
            assert members_of.setdefault(name, ranks) == ranks, "one name, two member lists"
    for name, ranks in members_of.items():   # every member creates it ...
        assert all(name in dict(plans[r]) for r in ranks)
    for a, b in itertools.combinations(range(world), 2):   # ... and shared ones in the same order
        order_a = [n for n, _ in plans[a] if n in dict(plans[b])]
        order_b = [n for n, _ in plans[b] if n in dict(plans[a])]
        assert order_a == order_b, (a, b)


def test_world_spanning_groups_use_the_world_communicator():
    ctx = ParallelContext.build(4, 1, dp=4, tp=1, pp=1, ep=4).with_world_name("mccl_world_group")
    assert ctx.group("dp").name == ctx.group("ep").name == ctx.group("world").name == "mccl_world_group"
    assert ctx.group("tp").name != "mccl_world_group"   # trivial
    assert ctx.communicators_to_create() == []


def test_single_process_context():
    ctx = ParallelContext.single()
    assert (ctx.world_size, ctx.rank, ctx.dp, ctx.dp_rank) == (1, 0, 1, 0)
    assert all(ctx.group(k).is_trivial and ctx.group(k).ranks == (0,) for k in GROUP_KINDS)
    with pytest.raises(KeyError, match="unknown group kind 'mp'"):
        ctx.group("mp")


def test_init_parallel_without_a_launcher(monkeypatch):
    for var in ("MS_WORKER_NUM", "RANK_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert launched_world_size() == 1
    assert init_parallel(dp=1).world_size == 1
    assert init_parallel().dp == 1
    with pytest.raises(LayoutError, match=r"needs 4 processes but this one was not started by msrun.*--nproc 4"):
        init_parallel(dp=2, tp=2)
    monkeypatch.setenv("MS_WORKER_NUM", "6")
    assert launched_world_size() == 6
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by tp\*pp = 4\*1"):
        init_parallel(tp=4)
