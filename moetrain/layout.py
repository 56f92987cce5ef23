"""The parallel layout of a job and every rule it must satisfy, in one place.

    Layout.of(cfg)                    dp, tp, pp, cp, ep, etp, micro-batches, ZeRO, recompute, sp, schedule, split
    layout_problems(layout, ...)      every reason it cannot run, each naming the keys and a fix
    check_layout(layout, ...)         raises LayoutError listing them
    split_layers(layers, pp, split)   the layer range of every pipeline stage

Used by config loading (the rules that need no world size, and the world size when the launcher
announced it), the planner (every candidate of its search), process-group setup (one process
included), resharding and the launcher's pre-flight, so a layout that cannot run stops the job
before any worker starts. Pure Python: no MindSpore import.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from moetrain.family import family_of

RECOMPUTE_MODES = ("none", "selective", "full")
# the pipeline schedules (moetrain/parallel/schedules.py builds their instruction lists)
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble_h1", "zero_bubble_v")
# parallel.cp_comm_type: how attention crosses the context-parallel split (Megatron-Core's names;
# moetrain/parallel/context_parallel.py)
CP_COMM_TYPES = ("all_gather", "p2p", "a2a")
WORLD_SIZE_ENVS = ("MOETRAIN_WORLD_SIZE", "MS_WORKER_NUM", "RANK_SIZE")   # the launch script's, msrun's, rank table's


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message says what, the numbers and how to fix it."""


def divisors(n: int) -> List[int]:
    return list(_divisors(n))


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> Tuple[int, ...]:
    # the layout search asks for the divisors of vocabularies and batch sizes thousands of times
    if n < 1:
        return ()
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def world_fix(world: int, model_ranks: int, global_batch_size: Optional[int] = None, cp: int = 1) -> str:
    """How to fit a layout to `world` processes: a data_parallel only if it can split the batch.
    `model_ranks`: the ranks of one model replica (model_parallel x pipeline_stage x context_parallel `cp`)."""
    if world % model_ranks:
        cp_text = " x context_parallel" if cp > 1 else ""
        return f"model_parallel x pipeline_stage{cp_text} ({model_ranks}) must divide {world}"
    dp = world // model_ranks
    if global_batch_size is None or global_batch_size % dp == 0:
        return f"set parallel.data_parallel={dp} (or leave it unset to infer it)"
    return (f"data_parallel would have to be {dp}, which cannot split train.global_batch_size ({global_batch_size}): "
            f"use a world size of {[d * model_ranks for d in divisors(global_batch_size)][:6]}, or a global "
            f"batch that is a multiple of {dp}")


def launched_world_size() -> Optional[int]:
    """The world size the launcher announced (run_distributed.sh, msrun, a rank table); None when this
    process was not launched as part of a job."""
    value = next((os.environ[v] for v in WORLD_SIZE_ENVS if os.environ.get(v)), None)
    return int(value) if value else None


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that parallel layouts must divide; None where the model has no such part
    (the MNIST MLP has no heads or layers to split)."""

    layers: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    vocab: Optional[int] = None
    ffn: Optional[int] = None               # the dense FFN width, None when every layer is MoE
    experts: int = 0                        # 0: no MoE layers
    shared_ffn: int = 0
    expert_ffn: int = 0                     # a routed expert's FFN width (split over expert_tensor_parallel)
    mtp_depth: int = 0                      # multi-token-prediction modules (DeepSeek-V3)

    @classmethod
    def of(cls, model_cfg) -> "ModelShape":
        """The sizes of a registered family's model config (`moetrain.family.Family.shape`); a family
        that declares none has nothing to split."""
        family = family_of(model_cfg)
        return family.shape(model_cfg) if family is not None and family.shape is not None else cls()


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    micro_batch_size: int = 1                 # sequences per micro-batch per data-parallel rank
    num_micro_batches: int = 1                # per optimizer step (accumulation = pipeline micro-batches)
    zero: int = 0                             # 0 none, 1 optimizer states, 2 + gradients
    recompute: str = "none"
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    pipeline_layers: Optional[Tuple[int, ...]] = None
    etp: int = 1                              # expert tensor parallel: ranks each routed expert's FFN is split over
    interleave: int = 1                       # parallel.pp_interleave_num: model chunks per stage
    cp: int = 1                               # context parallel: ranks each sequence is split over
    cp_comm: str = "all_gather"               # parallel.cp_comm_type: how attention crosses the split
    # -- planner-only rule (issue 33; `moetrain plan` prices it, the trainer refuses it): fold the
    # experts over tp x dp even when ep divides dp, as Megatron-Core does (parallel.moe_fold_experts)
    fold_experts: bool = False

    @property
    def chunks(self) -> int:
        """Model chunks on every pipeline stage: pp_interleave_num for interleaved 1F1B, two for ZB-V
        (its V shape), one otherwise."""
        return 2 if self.schedule == "zero_bubble_v" else self.interleave

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_folded(self) -> bool:
        """MoE parallel folding: the experts live on the tp x dp ranks of a stage as etp x ep x edp
        (each tp rank dispatches its own slice of the tokens). Otherwise (etp 1 and ep dividing dp, the
        layout before folding) the experts are replicated over tp and ep is carved out of dp. With
        context parallelism the data-parallel ranks are the dp x cp ones (their tokens differ too)."""
        return self.fold_experts or self.etp > 1 or (self.dp * self.cp) % max(1, self.ep) != 0

    @property
    def token_slices(self) -> int:
        """Slices a tp group's (identical) tokens are cut into before dispatch: tp / etp when folded."""
        return self.tp // self.etp if self.expert_folded and self.tp % self.etp == 0 else 1

    @classmethod
    def of(cls, cfg) -> "Layout":
        p, t = cfg.parallel, cfg.train
        dp = max(1, p.data_parallel)
        if t.micro_batch_size:
            micro = t.micro_batch_size
            count = max(1, t.global_batch_size // (dp * micro))
        elif p.micro_batch_num > 1:
            count = p.micro_batch_num
            micro = max(1, t.global_batch_size // (dp * count))
        else:
            count, micro = 1, max(1, t.global_batch_size // dp)
        return cls(dp=dp, tp=p.model_parallel, pp=p.pipeline_stage, ep=p.expert_parallel,
                   etp=p.expert_tensor_parallel, micro_batch_size=micro,
                   num_micro_batches=count, zero=p.optimizer_shard, recompute=p.recompute,
                   sequence_parallel=p.use_seq_parallel, schedule=p.pipeline_schedule,
                   pipeline_layers=tuple(p.pipeline_layers) if p.pipeline_layers else None,
                   interleave=p.pp_interleave_num, cp=p.context_parallel, cp_comm=p.cp_comm_type,
                   fold_experts=getattr(p, "moe_fold_experts", False))

    def parallel_settings(self) -> Dict[str, object]:
        """The `parallel.*` keys of this layout (mode: manual, so the trainer runs it as is)."""
        return {"data_parallel": self.dp, "model_parallel": self.tp, "pipeline_stage": self.pp,
                "expert_parallel": self.ep, "expert_tensor_parallel": self.etp,
                "micro_batch_num": self.num_micro_batches,
                "use_seq_parallel": self.sequence_parallel, "optimizer_shard": self.zero,
                "recompute": self.recompute, "mode": "manual", "pipeline_schedule": self.schedule,
                "pipeline_layers": list(self.pipeline_layers) if self.pipeline_layers else None,
                "pp_interleave_num": self.interleave, "context_parallel": self.cp,
                "cp_comm_type": self.cp_comm}

    def describe(self) -> str:
        sp = " sp" if self.sequence_parallel else ""
        etp = f" etp{self.etp}" if self.etp > 1 else ""
        etp += " folded" if self.fold_experts else ""
        schedule = f" {self.schedule}" if self.pp > 1 and self.schedule != "1f1b" else ""
        schedule += f" v{self.chunks}" if self.pp > 1 and self.chunks > 1 else ""
        schedule += f" layers={','.join(map(str, self.pipeline_layers))}" if self.pp > 1 and self.pipeline_layers else ""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return (f"dp{self.dp} tp{self.tp}{sp} pp{self.pp}{schedule}{cp} ep{self.ep}{etp} zero{self.zero} "
                f"recompute={self.recompute} micro={self.micro_batch_size}x{self.num_micro_batches}")


def layout_problems(layout: Layout, shape: Optional[ModelShape] = None, *, world: Optional[int] = None,
                    global_batch_size: Optional[int] = None, seq_length: Optional[int] = None) -> List[str]:
    """Every reason `layout` cannot run (empty when it can), each naming the keys and a fix. Rules
    that need what is not given (the world size, the model's sizes, the batch) are skipped."""
    L, m = layout, shape or ModelShape()
    problems: List[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    for key, value in (("data_parallel", L.dp), ("model_parallel", L.tp), ("pipeline_stage", L.pp),
                       ("context_parallel", L.cp), ("expert_parallel", L.ep), ("expert_tensor_parallel", L.etp),
                       ("micro_batch_num", L.num_micro_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"parallel.{key} must be an integer >= 1, got {value!r}")
    if problems:
        return problems
    if world is not None:
        cp = f" x context_parallel ({L.cp})" if L.cp > 1 else ""
        need(L.world == world,
             f"data_parallel ({L.dp}) x model_parallel ({L.tp}) x pipeline_stage ({L.pp}){cp} = {L.world} processes, "
             f"but {world} {'were' if world > 1 else 'was'} launched: "
             + world_fix(world, L.tp * L.pp * L.cp, global_batch_size, L.cp)
             + f", or launch {L.world} processes (run_scripts/run_distributed.sh --nproc {L.world} CONFIG)")
    problems += context_parallel_problems(L, shape, seq_length)
    need(L.tp % L.etp == 0, f"parallel.expert_tensor_parallel ({L.etp}) must divide model_parallel ({L.tp}): the "
         f"ranks splitting one expert hold the same tokens, i.e. are tensor-parallel ranks; use one of "
         f"{divisors(L.tp)}")
    expert_ranks = (L.dp * L.cp * L.tp // L.etp if L.tp % L.etp == 0 else L.dp * L.cp)
    cp_text = f" x context_parallel ({L.cp})" if L.cp > 1 else ""
    need(expert_ranks % L.ep == 0, f"parallel.expert_parallel ({L.ep}) must divide data_parallel ({L.dp}){cp_text} x "
         f"model_parallel ({L.tp}) / expert_tensor_parallel ({L.etp}) = {expert_ranks}: the experts of a stage "
         f"live on its tp x dp{' x cp' if L.cp > 1 else ''} ranks as etp x ep x edp; use one of {divisors(expert_ranks)}")
    if m.experts:
        need(m.experts % L.ep == 0, f"model.moe.num_experts ({m.experts}) is not divisible by "
             f"parallel.expert_parallel ({L.ep}): every rank must hold as many experts; use one of "
             f"{[e for e in divisors(m.experts) if expert_ranks % e == 0]}")
        need(m.shared_ffn % L.tp == 0, f"the shared-expert FFN width ({m.shared_ffn}) is not divisible by "
             f"parallel.model_parallel ({L.tp}) (shared experts are split column/row-wise)")
        if m.expert_ffn:
            need(m.expert_ffn % L.etp == 0, f"model.moe.ffn_hidden_size ({m.expert_ffn}) is not divisible by "
                 f"parallel.expert_tensor_parallel ({L.etp}) (each routed expert is split column/row-wise); "
                 f"choose expert_tensor_parallel in {[d for d in divisors(m.expert_ffn) if L.tp % d == 0]}")
        if seq_length and L.token_slices > 1:   # a rank's tokens: 1/cp of each sequence
            tokens = seq_length // L.cp * L.micro_batch_size
            cp_text = " / context_parallel" if L.cp > 1 else ""
            need(tokens % L.token_slices == 0, f"a micro-batch's {tokens} tokens (micro_batch_size x seq_length"
                 f"{cp_text}) "
                 f"cannot be cut into model_parallel / expert_tensor_parallel = {L.token_slices} equal slices, "
                 f"one per tensor-parallel rank dispatching to the experts; change the micro-batch size or "
                 f"expert_tensor_parallel")
    elif shape is not None:
        need(L.ep == 1, f"parallel.expert_parallel ({L.ep}) > 1 needs a MoE model; set it to 1")
        need(L.etp == 1, f"parallel.expert_tensor_parallel ({L.etp}) > 1 needs a MoE model; set it to 1")
    for key, value, why in (("model.num_heads", m.heads, "each tensor-parallel rank owns whole heads"),
                            ("model.num_kv_heads", m.kv_heads, "each tensor-parallel rank owns whole K/V heads"),
                            ("model.vocab_size", m.vocab, "the embedding and LM head are split by vocabulary; "
                                                          "or pad the vocabulary"),
                            ("model.ffn_hidden_size", m.ffn, "the dense MLP is split column/row-wise")):
        if value is not None:
            need(value % L.tp == 0, f"{key} ({value}) is not divisible by parallel.model_parallel ({L.tp}) ({why}); "
                 f"choose model_parallel in {divisors(value)}")
    if L.sequence_parallel:
        need(L.tp > 1, "parallel.use_seq_parallel needs model_parallel > 1 (it splits along the sequence what "
             "tensor parallelism replicates); set it to false")
        if seq_length:
            need(seq_length % L.tp == 0, f"the sequence length ({seq_length}) is not divisible by "
                 f"parallel.model_parallel ({L.tp}), which sequence parallelism needs")
        need(not m.mtp_depth, f"parallel.use_seq_parallel with multi-token prediction (model.mtp_depth="
             f"{m.mtp_depth}): an MTP depth k reads the first S-k-1 positions of the whole sequence, which the "
             f"sequence-parallel split does not hold; set use_seq_parallel=false (tensor parallelism without it "
             f"splits MTP as it splits the layers) or model.mtp_depth=0")
    chunk_problems = schedule_problems(L, m.layers)
    problems += chunk_problems
    if m.layers is not None:
        if not chunk_problems:       # (a chunk count that does not fit the layers is said once, above)
            try:
                split_layers(m.layers, L.pp * L.chunks, L.pipeline_layers, chunks=L.chunks)
            except LayoutError as exc:
                problems.append(str(exc))
    elif shape is not None and L.pp > 1:
        problems.append(f"parallel.pipeline_stage ({L.pp}) > 1 needs a model made of layers (model.num_layers); "
                        f"set it to 1")
    need(L.pp == 1 or L.num_micro_batches >= L.pp,
         f"{L.num_micro_batches} micro-batch(es) per step cannot keep {L.pp} pipeline stages busy: need "
         f"parallel.micro_batch_num >= pipeline_stage (raise train.global_batch_size or lower "
         f"train.micro_batch_size)")
    if global_batch_size is not None:
        need(L.micro_batch_size >= 1 and L.dp * L.micro_batch_size * L.num_micro_batches == global_batch_size,
             f"train.global_batch_size ({global_batch_size}) != data_parallel ({L.dp}) x micro-batch size "
             f"({L.micro_batch_size}) x micro-batches ({L.num_micro_batches}); pick sizes so that "
             f"global = dp x micro x accumulation")
    need(L.zero in (0, 1, 2), f"parallel.optimizer_shard must be 0, 1 or 2, got {L.zero}")
    need(L.recompute in RECOMPUTE_MODES, f"parallel.recompute must be one of {RECOMPUTE_MODES}, got {L.recompute!r}")
    return problems


def context_parallel_problems(L: Layout, shape: Optional[ModelShape], seq_length: Optional[int]) -> List[str]:
    """The rules of `parallel.context_parallel` (moetrain/parallel/context_parallel.py): the sequence
    cut into 2·cp chunks, and, for a model (`shape` given: config loading, the trainer, the planner),
    the combinations that do not run yet, refused by name rather than run wrong
    (docs/context_parallel.md lists what runs). The process groups themselves (distributed/topology.py)
    are general, so they are built and tested for any composition."""
    if L.cp == 1:
        return []
    if L.cp_comm not in CP_COMM_TYPES:
        return [f"parallel.cp_comm_type must be one of {CP_COMM_TYPES}, got {L.cp_comm!r}"]
    problems = []
    not_yet = "is not supported with parallel.context_parallel > 1 yet (docs/context_parallel.md)"
    if seq_length:
        need_chunks = 2 * L.cp
        if seq_length % need_chunks:
            fits = divisors(seq_length // 2)[:8] if seq_length % 2 == 0 else [1]
            problems.append(
                f"the sequence length ({seq_length}, model.seq_length / data.seq_length) is not divisible by "
                f"2 x parallel.context_parallel = {need_chunks}: each of the {L.cp} ranks holds two of "
                f"{need_chunks} equal chunks (load-balanced causal split); choose context_parallel in "
                f"{fits} or a sequence length that is a multiple of {need_chunks}")
    if shape is None:
        return problems
    if L.cp_comm == "a2a":
        problems += ulysses_problems(L, shape)
    if shape.layers is None or shape.heads is None:
        problems.append("parallel.context_parallel > 1 splits the sequences of a language model; this model "
                        "has no attention layers (model.num_layers / num_heads): set it to 1")
    if shape.mtp_depth:   # depth k counts positions below S-k-1: the first chunk of rank cp-1 must hold one
        if seq_length and not seq_length % (2 * L.cp) and shape.mtp_depth >= (L.cp + 1) * seq_length // (2 * L.cp):
            problems.append(f"model.mtp_depth ({shape.mtp_depth}) must be below (context_parallel + 1) x "
                            f"seq_length / (2 x context_parallel) = {(L.cp + 1) * seq_length // (2 * L.cp)}: "
                            f"every cp rank needs a position that each depth predicts from; lower mtp_depth or "
                            f"context_parallel")
    return problems


def ulysses_degrees(heads: int, kv_heads: Optional[int]) -> List[int]:
    """The cp degrees Ulysses (`cp_comm_type: a2a`) runs at with `heads` query and `kv_heads` K/V heads
    on a tensor-parallel rank: cp divides the query heads, and divides the K/V heads or is a multiple
    of them (fewer K/V heads than ranks: each replicated cp / n_kv times before the all-to-all, as
    Megatron-Core and DeepSpeed-Ulysses do; moetrain/parallel/context_parallel.py)."""
    kv = kv_heads or heads
    return [c for c in divisors(heads) if kv % c == 0 or c % kv == 0]


def ulysses_problems(L: Layout, shape: ModelShape) -> List[str]:
    """Ulysses' head rule (`ulysses_degrees`) on one tensor-parallel rank's heads (num_heads / tp)."""
    heads, kv = shape.heads, shape.kv_heads or shape.heads
    if heads is None or heads % L.tp or kv % L.tp:   # no heads, or the tensor-parallel rule says it
        return []
    local, local_kv = heads // L.tp, kv // L.tp
    if L.cp in ulysses_degrees(local, local_kv):
        return []
    per_rank = f" / parallel.model_parallel ({L.tp}) = {local} a tensor-parallel rank" if L.tp > 1 else ""
    fix = f"use cp_comm_type=all_gather or p2p, or context_parallel in {ulysses_degrees(local, local_kv)}"
    if local % L.cp:
        return [f"model.num_heads ({heads}){per_rank} is not divisible by parallel.context_parallel ({L.cp}), "
                f"which cp_comm_type=a2a (Ulysses) needs: each rank attends over 1/cp of the query heads; {fix}"]
    per_rank = f" / parallel.model_parallel ({L.tp}) = {local_kv} a tensor-parallel rank" if L.tp > 1 else ""
    return [f"model.num_kv_heads ({kv}){per_rank} neither divides nor is divisible by parallel.context_parallel "
            f"({L.cp}), which cp_comm_type=a2a (Ulysses) needs: each rank gets 1/cp of the K/V heads, or with "
            f"fewer K/V heads than ranks the one its query heads read, replicated; {fix}"]


def schedule_problems(L: Layout, layers: Optional[int]) -> List[str]:
    """The rules of the pipeline schedule and its model chunks (moetrain/parallel/pipeline.py)."""
    if L.schedule not in SCHEDULES:
        return [f"parallel.pipeline_schedule must be one of {SCHEDULES}, got {L.schedule!r}"]
    if not isinstance(L.interleave, int) or isinstance(L.interleave, bool) or L.interleave < 1:
        return [f"parallel.pp_interleave_num must be an integer >= 1, got {L.interleave!r}"]
    problems = []
    if L.schedule == "interleaved_1f1b":
        if L.interleave < 2:
            problems.append("parallel.pipeline_schedule=interleaved_1f1b needs parallel.pp_interleave_num >= 2 "
                            "(model chunks per stage); with one chunk use 1f1b")
        if L.pp > 1 and L.num_micro_batches % L.pp:
            problems.append(f"interleaved 1F1B runs micro-batches in groups of pipeline_stage ({L.pp}): "
                            f"micro_batch_num ({L.num_micro_batches}) must be a multiple of it (Megatron's rule)")
    elif L.schedule == "zero_bubble_v":
        if L.interleave not in (1, 2):
            problems.append(f"parallel.pipeline_schedule=zero_bubble_v holds exactly 2 model chunks per stage (a V); "
                            f"parallel.pp_interleave_num={L.interleave}: leave it unset or set 2")
    elif L.interleave > 1:
        problems.append(f"parallel.pp_interleave_num={L.interleave} needs pipeline_schedule=interleaved_1f1b "
                        f"(or zero_bubble_v, 2 chunks); {L.schedule} runs one chunk per stage")
    if L.chunks > 1 and L.pp < 2:
        problems.append(f"parallel.pipeline_schedule={L.schedule} places model chunks on pipeline stages: it needs "
                        f"pipeline_stage >= 2")
    if layers is not None and L.pp > 1 and layers < L.pp * L.chunks:
        problems.append(f"model.num_layers ({layers}) < pipeline_stage ({L.pp}) x model chunks per stage "
                        f"({L.chunks}): every chunk needs a layer; lower pp_interleave_num or pipeline_stage")
    return problems


def check_layout(layout: Layout, shape: Optional[ModelShape] = None, **known) -> None:
    """Raise LayoutError listing every problem of `layout` (see `layout_problems`)."""
    problems = layout_problems(layout, shape, **known)
    if problems:
        raise LayoutError(f"layout {layout.describe()} cannot run:\n  - " + "\n  - ".join(problems))


def check_config_layout(cfg, world: Optional[int] = None) -> Layout:
    """The layout of a config, checked against its model, batch and (when known) the world size."""
    layout = Layout.of(cfg)
    check_layout(layout, ModelShape.of(cfg.model), world=world, global_batch_size=cfg.train.global_batch_size,
                 seq_length=cfg.data.seq_length or getattr(cfg.model, "seq_length", None))
    return layout


def split_layers(num_layers: int, num_stages: int, layers_per_stage: Optional[Sequence[int]] = None,
                 chunks: int = 1) -> List[Tuple[int, int]]:
    """`[(start, end), ...]`: the layer range of every stage (even split, or `layers_per_stage`). With
    several model chunks per stage, `num_stages` counts virtual stages (pipeline_stage x chunks) and
    `layers_per_stage` lists them in virtual-stage order."""
    if num_stages < 1:
        raise LayoutError(f"parallel.pipeline_stage must be >= 1, got {num_stages}")
    stages = (f"parallel.pipeline_stage={num_stages}" if chunks == 1 else
              f"{num_stages} virtual stages (pipeline_stage={num_stages // chunks} x {chunks} chunks)")
    if layers_per_stage:
        sizes = [int(n) for n in layers_per_stage]
        if len(sizes) != num_stages or min(sizes) < 1 or sum(sizes) != num_layers:
            raise LayoutError(
                f"parallel.pipeline_layers={list(layers_per_stage)} must give {num_stages} stages "
                f"({stages}) of >= 1 layers summing to model.num_layers={num_layers}; "
                f"it has {len(sizes)} entries summing to {sum(sizes)}")
    else:
        if num_layers % num_stages:
            raise LayoutError(
                f"model.num_layers={num_layers} cannot be split evenly into {stages} stages: choose "
                f"a stage count in {divisors(num_layers)} or list the layers of each stage in "
                f"parallel.pipeline_layers")
        sizes = [num_layers // num_stages] * num_stages
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [(bounds[s], bounds[s + 1]) for s in range(num_stages)]
