"""Process topology: who is who in a dp x tp x pp x cp job, with the experts folded over tp x dp.

Rank layout (Megatron order tp-cp-dp-pp, tensor-parallel ranks adjacent so they share a node):

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Context parallelism (cp, moetrain/parallel/context_parallel.py) splits every sequence over the cp
ranks of one data-parallel rank: they read the same samples and hold the same weights, so for the
weights they are data-parallel replicas. As in Megatron-Core (its data-parallel group "with context
parallel"), the `dp` group then spans dp x cp ranks: the dense-gradient all-reduce, the replicas a
checkpoint writes once, the step values reduced over; `dp_rank` / `dp` stay the data coordinates
(which samples a rank reads). With cp = 1 everything below is as before.

Experts (MoE parallel folding, Megatron-Core's expert_tensor_parallel / MindFormers' keys): the
tp x dp ranks of a stage also hold the experts as etp x ep x edp. A rank's expert coordinates:

    lane = tp_rank % etp                          its etp rank: which FFN column/row slice of each expert
    u    = tp_rank // etp + (tp / etp) * dp_rank   which token slice it dispatches (tp ranks hold the same
                                                  tokens: each of the tp / etp slices goes to one rank)
    ep_rank = u % ep,  edp_rank = u // ep          ep over adjacent ranks first (Megatron's order): within
                                                  a lane, global rank = lane + etp * u, so the group orders agree

Folding is on when etp > 1 or ep does not divide dp x cp (`Layout.expert_folded`). Without it (etp 1, ep
dividing dp: the layout before folding) lane = tp_rank and u = dp_rank: the experts are replicated
over tp, every tp rank runs all of its dp rank's tokens, and ep / edp are carved out of dp as before.
With cp > 1 the data-parallel rank in these formulas is the dp x cp rank `cp_rank + cp * dp_rank`
(Megatron-Core's MoE parallel folding of ep over dp x cp: the cp ranks of a sequence hold different
tokens, so for the experts they are data-parallel ranks like any other; folding is judged on dp x cp).

Groups (kind -> members of this rank's group):

    world      every rank
    tp         same (dp, cp, pp)             tensor-parallel collectives
    dp         same (tp, pp)                 dense-gradient all-reduce (dp x cp ranks, see above)
    cp         same (tp, dp, pp)             the ranks holding one sequence (context parallel)
    pp         same (dp, cp, tp)             all pipeline stages of one model replica
    ep         same (pp, lane, u // ep)      expert all-to-all
    edp        same (pp, lane, ep_rank)      expert-gradient all-reduce (the replicas of the same experts)
    etp        same (pp, dp, u)              one expert's FFN split column/row-wise (folded; else trivial)
    tp_tokens  same (pp, dp, lane)           the tp ranks whose token slices make up the dp rank's tokens
    embedding  first and last stage of the same (dp, cp, tp)   tied embeddings
    pp_next / pp_prev   this stage and its neighbour       point-to-point activations

A group of one rank is never created and every communication op on it is the identity.
`ParallelContext.build` is pure Python (any rank's view can be computed anywhere, for tests);
`init_parallel` starts MindSpore's communication and creates the groups this rank belongs to.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from moetrain import compat
from moetrain.layout import Layout, LayoutError, check_layout
from moetrain.layout import launched_world_size as announced_world_size

# Kinds in the order groups are created; every rank walks this order identically.
GROUP_KINDS = ("world", "tp", "dp", "cp", "pp", "ep", "edp", "etp", "tp_tokens", "embedding", "pp_next", "pp_prev")
# the byte-counter bucket of each kind that has none of its own (comm.COUNTER_KINDS)
_BUCKETS = {"pp_next": "pp", "pp_prev": "pp", "etp": "tp", "tp_tokens": "tp"}


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
    etp: int = 1
    cp: int = 1

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build(cls, world_size: int, rank: int, dp: int, tp: int = 1, pp: int = 1, ep: int = 1,
              etp: int = 1, cp: int = 1) -> "ParallelContext":
        """Pure layout computation (no MindSpore): coordinates and member lists of every group."""
        # the sizes only (micro-batches are not the topology's concern)
        layout = Layout(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, num_micro_batches=pp, cp=cp)
        check_layout(layout, world=world_size)
        if not 0 <= rank < world_size:
            raise LayoutError(f"rank {rank} is outside the world of {world_size} ranks")
        folded = layout.expert_folded

        def coords(r: int) -> Tuple[int, int, int, int, int, int]:
            """(tp_rank, dp x cp rank, pp_rank, lane, u, cp_rank) of global rank r (module docstring);
            the dp x cp rank is cp_rank + cp * dp_rank."""
            t, rest = r % tp, r // tp
            c, rest = rest % cp, rest // cp
            d, p = rest % dp, rest // dp
            x = c + cp * d
            return (t, x, p, t % etp, t // etp + (tp // etp) * x, c) if folded else (t, x, p, t, x, c)

        t0, x0, p0, lane0, u0, c0 = coords(rank)
        every = [coords(r) for r in range(world_size)]

        def where(keep) -> Tuple[int, ...]:
            return tuple(r for r, c in enumerate(every) if keep(*c))

        members = {
            "world": tuple(range(world_size)),
            "tp": where(lambda t, x, p, lane, u, c: (x, p) == (x0, p0)),
            "dp": where(lambda t, x, p, lane, u, c: (t, p) == (t0, p0)),
            "cp": where(lambda t, x, p, lane, u, c: (t, x // cp, p) == (t0, x0 // cp, p0)),
            "pp": where(lambda t, x, p, lane, u, c: (t, x) == (t0, x0)),
            "ep": where(lambda t, x, p, lane, u, c: (p, lane, u // ep) == (p0, lane0, u0 // ep)),
            "edp": where(lambda t, x, p, lane, u, c: (p, lane, u % ep) == (p0, lane0, u0 % ep)),
            "etp": where(lambda t, x, p, lane, u, c: folded and (p, x, u) == (p0, x0, u0)) or (rank,),
            "tp_tokens": where(lambda t, x, p, lane, u, c: folded and (p, x, lane) == (p0, x0, lane0)) or (rank,),
            "embedding": where(lambda t, x, p, lane, u, c: (t, x) == (t0, x0) and p in (0, pp - 1))
                         if p0 in (0, pp - 1) else (rank,),
            "pp_next": where(lambda t, x, p, lane, u, c: (t, x) == (t0, x0) and p in (p0, p0 + 1))
                       if p0 + 1 < pp else (rank,),
            "pp_prev": where(lambda t, x, p, lane, u, c: (t, x) == (t0, x0) and p in (p0 - 1, p0))
                       if p0 > 0 else (rank,),
        }
        groups = {}
        for kind in GROUP_KINDS:
            member_ranks = members[kind]
            groups[kind] = Group(_BUCKETS.get(kind, kind), member_ranks, member_ranks.index(rank),
                                 communicator_name(member_ranks))
        return cls(world_size, rank, dp, tp, pp, ep, groups, etp, cp)

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
        """Which slice of the global batch this rank reads (the cp ranks of one dp rank read the same)."""
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def dp_cp(self) -> int:
        """Ranks holding replicas of the dense weights (the `dp` group): gradients and step values are
        reduced over them, dp x cp."""
        return self.dp * self.cp

    @property
    def expert_folded(self) -> bool:
        return Layout(dp=self.dp, tp=self.tp, ep=self.ep, etp=self.etp, cp=self.cp).expert_folded

    @property
    def token_slices(self) -> int:
        """Slices of its tokens a tp group dispatches, one per `tp_tokens` rank (1: not folded)."""
        return self.group("tp_tokens").size

    @property
    def etp_rank(self) -> int:
        return self.group("etp").rank_in_group

    @property
    def ep_rank(self) -> int:
        return self.group("ep").rank_in_group

    @property
    def edp(self) -> int:
        return self.group("edp").size

    @property
    def edp_rank(self) -> int:
        return self.group("edp").rank_in_group

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
                f"pp {self.pp_rank}/{self.pp} ep {self.ep_rank}/{self.ep} edp {self.edp_rank}/{self.edp}"
                + (f" etp {self.etp_rank}/{self.etp}" if self.etp > 1 else "")
                + (f" cp {self.cp_rank}/{self.cp}" if self.cp > 1 else ""))

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


HOST_BLOCKING_RUN = "MS_DEV_HOST_BLOCKING_RUN"


def cpu_ops_on_calling_thread() -> None:
    """On the CPU, run PyNative ops on the thread that calls them (`MS_DEV_HOST_BLOCKING_RUN=1`,
    MindSpore's documented switch for single-threaded dispatch) instead of handing them to a queue
    thread: MindSpore waits for that queue in a busy loop (`AsyncRQueue::Wait`), and on a CPU host
    the spinning thread takes a core the work needs. Two costs, both measured on 2 cores: a rank
    waiting in a collective burnt a core the other ranks needed (10 s in an AllReduce = 10 s of CPU;
    a jitted graph waits without spinning), and in one process every host read (loss, stats) spun
    beside the kernels' threads (benchmarks/bench.py, MoE: 2,611-2,863 -> 3,084-3,098 tokens/s). The same
    kernels run in the same order, so values are unchanged. MindSpore reads the variable at the
    process's first PyNative op: call before any. Accelerators keep the asynchronous dispatch; a
    value the user set is kept."""
    # MindSpore imported only here and in init_parallel: ParallelContext stays pure Python for the
    # planner and the checkpoint conversions, which never start it
    import mindspore as ms

    if ms.get_context("device_target") == "CPU":
        os.environ.setdefault(HOST_BLOCKING_RUN, "1")


def cpu_world_only_problem(ctx: ParallelContext, installed: Optional[Tuple[int, int, int]] = None) -> Optional[str]:
    """One line saying why this layout cannot run on this MindSpore's CPU backend, or None: MindSpore
    2.7 runs CPU collectives only in the world group (moetrain/compat.py, `cpu_subgroup_collectives`),
    so every group must be one rank or all of them. Pure Python (tests call it with any version)."""
    needed = ctx.communicators_to_create()
    if not needed or compat.cpu_subgroup_collectives(installed):
        return None
    kinds = [kind for kind in GROUP_KINDS if ctx.groups[kind].name == needed[0][0]]
    version = ".".join(map(str, installed)) if installed else compat.mindspore_version_string()
    return (f"MindSpore {version} runs CPU collectives only over all {ctx.world_size} ranks, but the layout "
            f"dp={ctx.dp} tp={ctx.tp} pp={ctx.pp} ep={ctx.ep} etp={ctx.etp} needs smaller groups (the "
            f"{'/'.join(kinds)} group of ranks {list(needed[0][1])}): on CPU use mindspore>=2.8, or a layout "
            f"whose groups span one rank or all (e.g. parallel.data_parallel={ctx.world_size}, with "
            f"parallel.expert_parallel 1 or {ctx.world_size}); Ascend and GPU are not affected")


def init_parallel(dp: Optional[int] = None, tp: int = 1, pp: int = 1, ep: int = 1, *, etp: int = 1,
                  cp: int = 1, verbose: bool = True) -> ParallelContext:
    """Start MindSpore communication when launched with several processes and create every group.

    ``dp=None`` takes the rest of the world (world / (tp * pp * cp)). Call after selecting the device
    (``ms.set_device``); all ranks must call it with the same sizes.
    """
    world = launched_world_size()
    if dp is None:
        if world % (tp * pp * cp):
            sizes = f"tp*pp = {tp}*{pp}" if cp == 1 else f"tp*pp*cp = {tp}*{pp}*{cp}"
            raise LayoutError(f"world size {world} is not divisible by {sizes}; cannot derive dp")
        dp = world // (tp * pp * cp)
    if world == 1:
        if dp * tp * pp * cp != 1:
            cp_text = f" cp={cp}" if cp > 1 else ""
            raise LayoutError(f"layout dp={dp} tp={tp} pp={pp}{cp_text} needs {dp * tp * pp * cp} processes but this "
                              f"one was not started by msrun (MS_WORKER_NUM is unset): launch with "
                              f"run_scripts/run_distributed.sh --nproc {dp * tp * pp * cp} CONFIG")
        return ParallelContext.single()

    from mindspore.communication import GlobalComm, create_group, get_group_size, get_rank, init  # (see above)

    cpu_ops_on_calling_thread()
    if not GlobalComm.INITED:
        init()
    real_world, rank = get_group_size(), get_rank()
    if real_world != world:
        raise LayoutError(f"the launcher announced {world} processes but the communicator has {real_world}")
    from moetrain.testing import contract   # imports MindSpore: as above, kept off ParallelContext's users

    ctx = ParallelContext.build(world, rank, dp, tp, pp, ep, etp, cp).with_world_name(GlobalComm.WORLD_COMM_GROUP)
    import mindspore as ms   # as above: kept off ParallelContext's users

    problem = cpu_world_only_problem(ctx) if ms.get_context("device_target") == "CPU" else None
    if problem:                  # before any group or work: the first collective would fail (2.7)
        raise LayoutError(problem)
    contract.register_group(GlobalComm.WORLD_COMM_GROUP, range(world))   # the contract backend's registry
    for name, ranks in ctx.communicators_to_create():
        create_group(name, list(ranks))
        contract.register_group(name, ranks)
    if verbose and rank == 0:     # (the trainer's line adds the comm backend: moetrain.distributed.comm.describe_backend)
        cp_text = f" cp={cp}" if cp > 1 else ""
        print(f"moetrain.distributed: {world} ranks, dp={dp} tp={tp} pp={pp}{cp_text} ep={ep} etp={etp}", flush=True)
    return ctx
