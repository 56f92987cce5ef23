"""The layout search (the counterpart of MindSpore's AUTO_PARALLEL cost-model search): every layout
of a world size worth costing, the fastest that fits (`choose_layout`, what `parallel.mode: auto`
trains), and `plan(cfg)`, the plan of the layout a config names or the search picks."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from moetrain.devices import GiB, DeviceProfile, get_device
from moetrain.layout import RECOMPUTE_MODES, Layout, LayoutError, divisors
from moetrain.parallel import schedules
from moetrain.planner import context
from moetrain.planner.arch import Arch, Job, plan_problems
from moetrain.planner.costs import PlanResult, plan_layout, plan_valid_layout
from moetrain.planner.report import format_search

THROUGHPUT_TIE = 0.005      # layouts within 0.5 % of the best throughput count as equally fast
OPTIONS_ON = 16             # `--search` tries the priced options on this many of the fastest layouts


def _device_of(cfg, device) -> DeviceProfile:
    """`--device`, else train.device_profile, else train.device's default part."""
    if device is not None:
        return get_device(device)
    return get_device(getattr(cfg.train, "device_profile", "") or cfg.train.device)


def plan(cfg, world_size: Optional[int] = None, device=None) -> PlanResult:
    """Plan the layout `cfg` names (or, with `parallel.mode: auto`, the one `choose_layout` picks)
    on `world_size` devices (default: dp x tp x pp of the config) of `device` (default: train.device)."""
    if cfg.parallel.mode == "auto":
        world = world_size or (cfg.parallel.data_parallel * cfg.parallel.model_parallel * cfg.parallel.pipeline_stage
                               * cfg.parallel.context_parallel)
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
    options: bool = False                # the priced options were searched too (moetrain plan --search)
    kept: Tuple[str, ...] = ()           # layout keys held at the config's values (--keep)
    own: Optional[PlanResult] = None     # the config's own layout and options, when searched

    def ranking(self) -> List[PlanResult]:
        """Every layout that fits, fastest first (the chosen one first among its ties)."""
        fitting = [c.result for c in self.candidates if c.status in ("chosen", "slower")]
        return sorted(fitting, key=lambda r: (r is not self.chosen, -r.tokens_per_second))

    def best_per_layout(self) -> List[PlanResult]:
        """The fastest priced options of each layout that fits, layouts fastest first: the ranking of
        layouts (`--search` also tries moe_overlap / fp8_recipe on each)."""
        best: Dict[Layout, PlanResult] = {}
        for r in self.ranking():
            if r.layout not in best:
                best[r.layout] = r
        return list(best.values())

    def layout_rank_of_own(self) -> Optional[int]:
        """Where the config's own layout (with the options the search finds best for it) ranks among
        the layouts that fit; None if it does not fit with any."""
        if self.own is None:
            return None
        for i, r in enumerate(self.best_per_layout(), 1):
            if r.layout == self.own.layout:
                return i
        return None

    def rank_of_own(self) -> Optional[int]:
        """Where the config's own layout ranks among those that fit (1: fastest), None if it does not fit."""
        for i, r in enumerate(self.ranking(), 1):
            if r is self.own:
                return i
        return None

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


# what `--keep` may hold at the config's value (moetrain plan CONFIG --search --keep tp,pp,...): Layout fields
KEEPABLE = {"tp": ("tp",), "pp": ("pp",), "ep": ("ep", "etp"), "zero": ("zero",), "recompute": ("recompute",),
            "micro": ("micro_batch_size", "num_micro_batches"), "sp": ("sequence_parallel",),
            "schedule": ("schedule", "interleave", "pipeline_layers"), "fold": ("fold_experts",),
            "cp": ("cp", "cp_comm")}


def candidate_layouts(job: Job, world_size: int, keep: Optional[Layout] = None, kept: Tuple[str, ...] = (),
                      fold: bool = False) -> List[Layout]:
    """Every dp x tp x pp x cp = world (cp: `context.search_degrees`), ep, micro-batching, ZeRO level,
    recompute, sequence-parallel, pipeline-schedule and layer-split combination worth costing (ZeRO
    levels are all the same layout when dp x cp = 1). `kept` (names of KEEPABLE) hold those fields at `keep`'s values (the
    config's layout); `fold`: also each layout with its experts folded over tp x dp where moetrain
    would carve ep out of dp (parallel.moe_fold_experts, Megatron-Core's folding)."""
    arch = job.arch

    def held(name, values):
        return [getattr(keep, KEEPABLE[name][0])] if name in kept else values
    layouts = []
    for tp in held("tp", divisors(world_size)):
        if world_size % tp:
            continue
        for pp in held("pp", divisors(world_size // tp)):
            if (world_size // tp) % pp:
                continue
            cps = context.search_degrees(job, world_size // (tp * pp))
            if "cp" in kept:
                cps = [(keep.cp, keep.cp_comm)]
            for cp, cp_comm in cps:
                if (world_size // (tp * pp)) % cp:
                    continue
                dp = world_size // (tp * pp * cp)
                eps = divisors(world_size) if arch.moe_layers else [1]
                per_rank = job.global_batch_size // dp if job.global_batch_size % dp == 0 else 1
                etps = divisors(tp) if arch.moe_layers else [1]
                counts = divisors(per_rank)
                if "micro" in kept:
                    counts = [c for c in counts if per_rank // c == keep.micro_batch_size]
                if "ep" in kept:
                    eps, etps = [keep.ep], [keep.etp]
                for etp, ep, count, zero, recompute, sp in itertools.product(
                        etps, eps, counts, held("zero", [0, 1, 2] if dp * cp > 1 else [0]),
                        held("recompute", list(RECOMPUTE_MODES)), held("sp", [False, True] if tp > 1 else [False])):
                    if (dp * cp * tp // etp) % ep:      # ep up to dp x cp x tp / etp (MoE folding, moetrain/layout.py)
                        continue
                    schedules_tried = ([(keep.schedule, keep.interleave)] if "schedule" in kept
                                       else pipeline_schedules(arch, pp, count))
                    for schedule, interleave in schedules_tried:
                        splits = [keep.pipeline_layers] if "schedule" in kept else pipeline_splits(arch, pp, interleave)
                        for split in splits:
                            layout = Layout(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp,
                                            micro_batch_size=max(1, per_rank // count), num_micro_batches=count,
                                            zero=zero, recompute=recompute, sequence_parallel=sp,
                                            schedule=schedule, interleave=interleave, pipeline_layers=split,
                                            cp=cp, cp_comm=cp_comm)
                            folds = held("fold", [False, True] if fold else [False])
                            if ep == 1 or etp > 1 or (dp * cp) % ep or tp == 1:
                                folds = [False]           # folded already, or nothing to fold
                            layouts += [dataclasses.replace(layout, fold_experts=f) for f in folds]
    return layouts


def job_variants(job: Job, device: DeviceProfile, arch: Arch) -> List[Job]:
    """The priced options `moetrain plan --search` also tries (never `parallel.mode: auto`, which
    trains what it picks): the expert all-to-all's overlap on MoE models, and where the device has
    an fp8 peak and the compute is 16-bit, FP8 GEMMs (the config's recipe, else tensorwise). Only on
    calibrated profiles (gpu_h100, gpu_h800: moetrain/planner/constants.py prices the options);
    elsewhere the config's own options alone."""
    if not device.calibrated:
        return [job]
    overlaps = ["none", "a2a_overlap", "dualpipe"] if arch.moe_layers else ["none"]
    recipes = ["none"]
    if "float8" in device.peak_flops and job.compute_dtype in ("bfloat16", "float16"):
        recipes.append(job.fp8_recipe if job.fp8_recipe != "none" else "tensorwise")
    return [dataclasses.replace(job, moe_overlap=o, fp8_recipe=r) for o in overlaps for r in recipes]


def _priced_options(job: Job) -> str:
    return f"overlap={job.moe_overlap} fp8={job.fp8_recipe}"


def _tie_key(result: PlanResult):
    L = result.layout
    return (result.total_comm_bytes, L.cp, L.zero, RECOMPUTE_MODES.index(L.recompute), L.tp, L.pp,
            L.sequence_parallel, -L.micro_batch_size, L.ep, L.etp, L.chunks, L.schedule in schedules.SPLIT_BACKWARD)


def choose_layout(cfg, world_size: int, device=None, options: bool = False,
                  keep: Tuple[str, ...] = ()) -> Tuple[Dict[str, object], LayoutSearch]:
    """The fastest valid layout of `cfg`'s model and batch on `world_size` devices that fits in
    memory (ties within 0.5 %: less communication, then the simpler layout). Returns its
    `parallel.*` settings (apply them with `apply_layout`, which also sets train.micro_batch_size)
    and the search report, which lists every rejected candidate and why.

    `options` (`moetrain plan --search`, not `parallel.mode: auto`): the priced system is searched
    too (`job_variants`: moe_overlap, fp8_recipe; experts folded over tp x dp), and the config's own
    layout and options are always a candidate, so the report can say where it ranks. `keep`: names
    of KEEPABLE held at the config's values (a smaller search, said in the report)."""
    device = _device_of(cfg, device)
    base = Job.of(cfg)
    unknown = [k for k in keep if k not in KEEPABLE]
    if unknown:
        raise LayoutError(f"--keep {','.join(unknown)}: not a layout key the search can hold; use some of "
                          f"{','.join(KEEPABLE)}")
    own = Layout.of(cfg)
    candidates, fitting = [], []
    own_result = None
    seen = set()

    def cost(job: Job, layout: Layout) -> None:
        nonlocal own_result
        if (job.moe_overlap, job.fp8_recipe, layout) in seen:
            return
        seen.add((job.moe_overlap, job.fp8_recipe, layout))
        problems = plan_problems(job, layout, world_size)
        if problems:
            candidates.append(Candidate(layout, "invalid", " | ".join(problems), problems=problems))
            return
        result = plan_valid_layout(job, layout, device, source=cfg.source)
        if options and job == base and layout == own:
            own_result = result
        if not result.fits:
            need = result.total_memory - device.runtime_bytes
            candidates.append(Candidate(layout, "does not fit", f"{need / GiB:.2f} GiB > "
                                        f"{result.usable_bytes / GiB:.2f} GiB usable", result))
            return
        fitting.append(result)

    for layout in candidate_layouts(base, world_size, own, tuple(keep), fold=options):
        cost(base, layout)
    if options:
        # the priced options on the OPTIONS_ON fastest layouts of the config's options, and on the config's
        # own layout (always a candidate, also where the search would not generate it, e.g. its uneven split)
        if own.world == world_size:
            cost(base, own)
        best = sorted(fitting, key=lambda r: -r.tokens_per_second)[:OPTIONS_ON]
        for layout in [r.layout for r in best] + ([own] if own.world == world_size else []):
            for job in job_variants(base, device, base.arch):
                if ((job.moe_overlap != "a2a_overlap" or layout.ep > 1)        # nothing to overlap at ep 1
                        and (job.moe_overlap != "dualpipe"
                             or (layout.pp > 1 and layout.pp % 2 == 0 and layout.chunks == 1))):
                    cost(job, layout)
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
    search = LayoutSearch(world_size, device, chosen, candidates, options=options, kept=tuple(keep),
                          own=own_result)
    return chosen.layout.parallel_settings(), search
