"""Process topology: who is who in a dp x tp x pp job with experts carved out of dp.

Rank layout (Megatron order, tensor-parallel ranks adjacent so they share a node):

    global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Expert parallelism splits each data-parallel group: ``ep_rank = dp_rank % ep``. The ``ep`` group
holds ``ep`` consecutive dp ranks (they exchange tokens in AllToAll); the ``edp`` group (expert
data parallel, size ``dp / ep``) holds the dp ranks with the same ``ep_rank``, i.e. the replicas of
the same experts, which all-reduce expert gradients.

Groups (kind -> members of this rank's group):

    world      every rank
    tp         same (dp, pp)                 tensor-parallel collectives
    dp         same (tp, pp)                 dense-gradient all-reduce
    pp         same (dp, tp)                 all pipeline stages of one model replica
    ep         same (tp, pp, dp_rank // ep)  expert all-to-all
    edp        same (tp, pp, ep_rank)        expert-gradient all-reduce
    embedding  first and last stage of the same (dp, tp)   tied embeddings
    pp_next / pp_prev   this stage and its neighbour       point-to-point activations

A group of one rank is never created and every communication op on it is the identity.
`ParallelContext.build` is pure Python (any rank's view can be computed anywhere, for tests);
`init_parallel` starts MindSpore's communication and creates the groups this rank belongs to.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from moetrain.layout import Layout, LayoutError, check_layout
from moetrain.layout import launched_world_size as announced_world_size

# Kinds in the order groups are created; every rank walks this order identically.
GROUP_KINDS = ("world", "tp", "dp", "pp", "ep", "edp", "embedding", "pp_next", "pp_prev")


@dataclass(frozen=True)
class Group:
    """A communication group as seen by one rank.

    ``ranks`` are global ranks in ascending order; ``rank_in_group`` is this rank's index in them.
    ``kind`` is the byte-counter bucket (``pp_next``/``pp_prev`` count as ``pp``). ``name`` is the
    MindSpore communicator name; groups with the same members share one communicator.
    """

    kind: str
    ranks: Tuple[int, ...]
    rank_in_group: int
    name: str

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_trivial(self) -> bool:
        return len(self.ranks) == 1

    def global_rank(self, rank_in_group: int) -> int:
        return self.ranks[rank_in_group]


def single_group(kind: str, rank: int = 0) -> Group:
    return Group(kind, (rank,), 0, f"single_{rank}")


def communicator_name(ranks: Sequence[int]) -> str:
    """Deterministic name from the member list, so every member derives the same one."""
    joined = "_".join(str(r) for r in ranks)
    if len(joined) <= 96:
        return f"moe_g{joined}"
    return f"moe_h{hashlib.sha1(joined.encode()).hexdigest()[:20]}_n{len(ranks)}"


def global_rank_of(dp_rank: int, tp_rank: int, pp_rank: int, dp: int, tp: int) -> int:
    return tp_rank + tp * (dp_rank + dp * pp_rank)


@dataclass(frozen=True, eq=False)   # hashed by identity: `groups` is a dict
class ParallelContext:
    """This rank's coordinates and groups. Build with `ParallelContext.build` or `init_parallel`."""

    world_size: int
    rank: int
    dp: int
    tp: int
    pp: int
    ep: int
    groups: Dict[str, Group] = field(repr=False)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build(cls, world_size: int, rank: int, dp: int, tp: int = 1, pp: int = 1, ep: int = 1) -> "ParallelContext":
        """Pure layout computation (no MindSpore): coordinates and member lists of every group."""
        # the sizes only (micro-batches are not the topology's concern)
        check_layout(Layout(dp=dp, tp=tp, pp=pp, ep=ep, num_micro_batches=pp), world=world_size)
        if not 0 <= rank < world_size:
            raise LayoutError(f"rank {rank} is outside the world of {world_size} ranks")
        tp_rank, rest = rank % tp, rank // tp
        dp_rank, pp_rank = rest % dp, rest // dp
        ep_rank, ep_block = dp_rank % ep, dp_rank // ep

        def ranks(dps=(dp_rank,), tps=(tp_rank,), pps=(pp_rank,)) -> Tuple[int, ...]:
            return tuple(sorted(global_rank_of(d, t, p, dp, tp) for p in pps for d in dps for t in tps))

        members = {
            "world": tuple(range(world_size)),
            "tp": ranks(tps=range(tp)),
            "dp": ranks(dps=range(dp)),
            "pp": ranks(pps=range(pp)),
            "ep": ranks(dps=range(ep_block * ep, ep_block * ep + ep)),
            "edp": ranks(dps=range(ep_rank, dp, ep)),
            "embedding": ranks(pps=sorted({0, pp - 1})) if pp_rank in (0, pp - 1) else (rank,),
            "pp_next": ranks(pps=(pp_rank, pp_rank + 1)) if pp_rank + 1 < pp else (rank,),
            "pp_prev": ranks(pps=(pp_rank - 1, pp_rank)) if pp_rank > 0 else (rank,),
        }
        groups = {}
        for kind in GROUP_KINDS:
            member_ranks = members[kind]
            bucket = "pp" if kind in ("pp_next", "pp_prev") else kind
            groups[kind] = Group(bucket, member_ranks, member_ranks.index(rank), communicator_name(member_ranks))
        return cls(world_size, rank, dp, tp, pp, ep, groups)

    @classmethod
    def single(cls) -> "ParallelContext":
        """One process, no `init()`: every group is trivial and every op the identity."""
        return cls.build(1, 0, 1, 1, 1, 1)

    # ---- coordinates --------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def group(self, kind: str) -> Group:
        if kind not in self.groups:
            raise KeyError(f"unknown group kind {kind!r}; known: {list(GROUP_KINDS)}")
        return self.groups[kind]

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: dp {self.dp_rank}/{self.dp} tp {self.tp_rank}/{self.tp} "
                f"pp {self.pp_rank}/{self.pp} ep {self.ep_rank}/{self.ep} edp {self.edp_rank}/{self.edp}")

    # ---- communicators ------------------------------------------------------------------
    def communicators_to_create(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(name, ranks) this rank must create, in the deterministic order all ranks follow.

        The world group exists after `init()`; trivial groups never get a communicator; a member list
        shared by several kinds (e.g. dp and edp when ep == 1) is created once.
        """
        seen, order = set(), []
        for kind in GROUP_KINDS:
            g = self.groups[kind]
            if g.is_trivial or g.size == self.world_size or g.name in seen:
                continue
            seen.add(g.name)
            order.append((g.name, g.ranks))
        return order

    def with_world_name(self, world_name: str) -> "ParallelContext":
        """Point groups spanning all ranks at the backend's world communicator (no create_group)."""
        groups = {k: (dataclasses.replace(g, name=world_name) if g.size == self.world_size and not g.is_trivial
                      else g) for k, g in self.groups.items()}
        return dataclasses.replace(self, groups=groups)


def launched_world_size() -> int:
    """World size announced by the launcher (see `moetrain.layout.launched_world_size`); 1 otherwise."""
    return announced_world_size() or 1


def init_parallel(dp: Optional[int] = None, tp: int = 1, pp: int = 1, ep: int = 1, *,
                  verbose: bool = True) -> ParallelContext:
    """Start MindSpore communication when launched with several processes and create every group.

    ``dp=None`` takes the rest of the world (world / (tp * pp)). Call after selecting the device
    (``ms.set_device``); all ranks must call it with the same sizes.
    """
    world = launched_world_size()
    if dp is None:
        if world % (tp * pp):
            raise LayoutError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}; cannot derive dp")
        dp = world // (tp * pp)
    if world == 1:
        if dp * tp * pp != 1:
            raise LayoutError(f"layout dp={dp} tp={tp} pp={pp} needs {dp * tp * pp} processes but this one was "
                              f"not started by msrun (MS_WORKER_NUM is unset): launch with "
                              f"run_scripts/run_distributed.sh --nproc {dp * tp * pp} CONFIG")
        return ParallelContext.single()

    from mindspore.communication import GlobalComm, create_group, get_group_size, get_rank, init

    if not GlobalComm.INITED:
        init()
    real_world, rank = get_group_size(), get_rank()
    if real_world != world:
        raise LayoutError(f"the launcher announced {world} processes but the communicator has {real_world}")
    ctx = ParallelContext.build(world, rank, dp, tp, pp, ep).with_world_name(GlobalComm.WORLD_COMM_GROUP)
    for name, ranks in ctx.communicators_to_create():
        create_group(name, list(ranks))
    if verbose and rank == 0:
        print(f"moetrain.dist: {world} ranks, dp={dp} tp={tp} pp={pp} ep={ep}", flush=True)
    return ctx
