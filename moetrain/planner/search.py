"""The layout search (the counterpart of MindSpore's AUTO_PARALLEL cost-model search): every layout
of a world size worth costing, the fastest that fits (`choose_layout`, what `parallel.mode: auto`
trains), and `plan(cfg)`, the plan of the layout a config names or the search picks."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from moetrain.devices import GiB, DeviceProfile, get_device
from moetrain.layout import RECOMPUTE_MODES, Layout, LayoutError, divisors
from moetrain.parallel import schedules
from moetrain.planner.arch import Arch, Job, plan_problems
from moetrain.planner.costs import PlanResult, plan_layout, plan_valid_layout
from moetrain.planner.report import format_search

THROUGHPUT_TIE = 0.005      # layouts within 0.5 % of the best throughput count as equally fast


def _device_of(cfg, device) -> DeviceProfile:
    """`--device`, else train.device_profile, else train.device's default part."""
    if device is not None:
        return get_device(device)
    return get_device(getattr(cfg.train, "device_profile", "") or cfg.train.device)


def plan(cfg, world_size: Optional[int] = None, device=None) -> PlanResult:
    """Plan the layout `cfg` names (or, with `parallel.mode: auto`, the one `choose_layout` picks)
    on `world_size` devices (default: dp x tp x pp of the config) of `device` (default: train.device)."""
    if cfg.parallel.mode == "auto":
        world = world_size or cfg.parallel.data_parallel * cfg.parallel.model_parallel * cfg.parallel.pipeline_stage
        return choose_layout(cfg, world, device)[1].chosen
    return plan_layout(Job.of(cfg), Layout.of(cfg), _device_of(cfg, device), world_size, source=cfg.source)


@dataclass
class Candidate:
    layout: Layout
    status: str                  # chosen | invalid | does not fit | slower
    reason: str
    result: Optional[PlanResult] = None
    problems: List[str] = field(default_factory=list)     # of an invalid candidate


@dataclass
class LayoutSearch:
    world_size: int
    device: DeviceProfile
    chosen: PlanResult
    candidates: List[Candidate]

    def with_status(self, status: str) -> List[Candidate]:
        return [c for c in self.candidates if c.status == status]

    def __str__(self) -> str:
        return format_search(self)


def pipeline_schedules(arch: Arch, pp: int, num_micro_batches: int) -> List[Tuple[str, int]]:
    """`(schedule, pp_interleave_num)` pairs the search tries: 1F1B, and with pipeline stages
    ZB-H1, plus, where the layers split evenly into 2·pp virtual stages, ZB-V (two chunks in a V)
    and interleaved 1F1B of two chunks a stage if the micro-batches come in groups of pp
    (moetrain/layout.py)."""
    if pp == 1:
        return [("1f1b", 1)]
    tried = [("1f1b", 1), ("zero_bubble_h1", 1)]
    if arch.layers % (2 * pp) == 0:
        tried += [("interleaved_1f1b", 2)] if num_micro_batches % pp == 0 else []
        tried += [("zero_bubble_v", 1)]
    return tried


def pipeline_splits(arch: Arch, pp: int, interleave: int) -> List[Optional[Tuple[int, ...]]]:
    """The `pipeline_layers` the search tries: None (an even split) where the layers divide into the
    stages; otherwise, for one model chunk a stage, the two most even uneven splits (each stage
    floor or ceil of layers / pp), the extra layers on the first stages or on the last (the cost
    model weighs them against the embedding on the first stage and the head on the last)."""
    if pp == 1 or arch.layers % (pp * interleave) == 0 or interleave > 1 or arch.layers < pp:
        return [None]            # (where no split can work, the layout rules say why)
    base, extra = divmod(arch.layers, pp)
    first = (base + 1,) * extra + (base,) * (pp - extra)
    return [first, first[::-1]]


def candidate_layouts(job: Job, world_size: int) -> List[Layout]:
    """Every dp x tp x pp = world, ep, micro-batching, ZeRO level, recompute, sequence-parallel,
    pipeline-schedule and layer-split combination worth costing (ZeRO levels are all the same
    layout when dp = 1)."""
    arch = job.arch
    layouts = []
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            eps = divisors(world_size) if arch.moe_layers else [1]
            per_rank = job.global_batch_size // dp if job.global_batch_size % dp == 0 else 1
            etps = divisors(tp) if arch.moe_layers else [1]
            for etp, ep, count, zero, recompute, sp in itertools.product(
                    etps, eps, divisors(per_rank), (0, 1, 2) if dp > 1 else (0,),
                    RECOMPUTE_MODES, (False, True) if tp > 1 else (False,)):
                if (dp * tp // etp) % ep:      # ep up to dp x tp / etp (MoE folding, moetrain/layout.py)
                    continue
                for schedule, interleave in pipeline_schedules(arch, pp, count):
                    for split in pipeline_splits(arch, pp, interleave):
                        layouts.append(Layout(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp,
                                              micro_batch_size=max(1, per_rank // count), num_micro_batches=count,
                                              zero=zero, recompute=recompute, sequence_parallel=sp,
                                              schedule=schedule, interleave=interleave, pipeline_layers=split))
    return layouts


def _tie_key(result: PlanResult):
    L = result.layout
    return (result.total_comm_bytes, L.zero, RECOMPUTE_MODES.index(L.recompute), L.tp, L.pp,
            L.sequence_parallel, -L.micro_batch_size, L.ep, L.etp, L.chunks, L.schedule in schedules.SPLIT_BACKWARD)


def choose_layout(cfg, world_size: int, device=None) -> Tuple[Dict[str, object], LayoutSearch]:
    """The fastest valid layout of `cfg`'s model and batch on `world_size` devices that fits in
    memory (ties within 0.5 %: less communication, then the simpler layout). Returns its
    `parallel.*` settings (apply them with `apply_layout`, which also sets train.micro_batch_size)
    and the search report, which lists every rejected candidate and why."""
    device = _device_of(cfg, device)
    job = Job.of(cfg)
    candidates, fitting = [], []
    for layout in candidate_layouts(job, world_size):
        problems = plan_problems(job, layout, world_size)
        if problems:
            candidates.append(Candidate(layout, "invalid", " | ".join(problems), problems=problems))
            continue
        result = plan_valid_layout(job, layout, device, source=cfg.source)
        if not result.fits:
            need = result.total_memory - device.runtime_bytes
            candidates.append(Candidate(layout, "does not fit", f"{need / GiB:.2f} GiB > "
                                        f"{result.usable_bytes / GiB:.2f} GiB usable", result))
            continue
        fitting.append(result)
    if not fitting:
        unfit = [c for c in candidates if c.result is not None]
        if not unfit:
            raise LayoutError(f"no layout of {world_size} devices is valid for this model and batch; e.g. "
                              f"{candidates[0].layout.describe()}: {candidates[0].reason}")
        smallest = min(unfit, key=lambda c: c.result.total_memory)
        raise LayoutError(f"no layout of {world_size} x {device.name} fits in memory; the smallest, "
                          f"{smallest.layout.describe()}, needs {smallest.reason}: use more devices, a smaller "
                          f"micro-batch or sequence, or a smaller model")
    best_speed = max(r.tokens_per_second for r in fitting)
    near = [r for r in fitting if r.tokens_per_second >= best_speed * (1 - THROUGHPUT_TIE)]
    chosen = min(near, key=_tie_key)
    tied = {id(r) for r in near}
    for result in fitting:
        if result is chosen:
            candidates.append(Candidate(result.layout, "chosen", "fastest that fits", result))
        elif id(result) in tied:
            candidates.append(Candidate(result.layout, "slower", f"as fast within {THROUGHPUT_TIE:.1%} "
                                        f"({result.tokens_per_second:,.0f} tokens/s) but more communication or "
                                        f"a more complex layout", result))
        else:
            candidates.append(Candidate(result.layout, "slower", f"{result.tokens_per_second:,.0f} tokens/s < "
                                        f"{chosen.tokens_per_second:,.0f}", result))
    return chosen.layout.parallel_settings(), LayoutSearch(world_size, device, chosen, candidates)
