"""`moetrain plan CONFIG --dry-run [--rank R] [--json]`: rank R's part of the real job, built at full
width on this CPU in one process, one training step run, its memory measured and set against the
plan of the same job.

    result = dry_run(cfg, rank=0)              # DryRun: planned / measured bytes per category
    print(format_dry_run(result))              # or result.to_json()

What runs: rank R's part of the model is built (`build_model(cfg, pctx)`: its stage's layers,
parameters deferred, then generated as its slices) and handed to the trainer's own
`moetrain.parallel.parallelize.parallelize` with rank R's view of the world
(`ParallelContext.build(world, R, dp, tp, pp, ep)`): the same tensor / sequence slicing, expert
split and dispatcher, pipeline cut, optimizer and ZeRO flat buffers as training. The collectives
are replaced by `moetrain.testing.solo.SoloComm` (shape-correct local stand-ins, no other ranks).
Then this rank's step runner (`runner.train_step`: gradient accumulation, or the pipeline
schedule) runs forward and backward on random tokens, and the optimizer step once.

What is adapted, and said so in the output: the device is this CPU, and bfloat16 runs as it trains on
the CPU (docs/precision.md): fp32 GEMMs on bf16 values, the SwiGLU activations stored as 2-byte bf16
containers and the other bf16 values in fp32 tensors, as the planner books a CPU bf16 job
(`moetrain.planner.costs.stage_cost`; `planned` and `planned_full` alike); the sequence may be shortened
(`seq_length`) and the micro-batches per step limited (`micro_batches`: enough to reach the
schedule's peak: 2 without pipeline, pp with it); `layers` builds the first layers only (same
pattern of dense and MoE layers); the planned figures are always those of the job that ran, and
`planned_full` is the plan of the config as written. Without `seq_length` and `layers`, a job
whose plan exceeds `DEFAULT_BUDGET` is shortened (`fitting_defaults`): the fewest layers that
include a MoE layer, then the sequence halved until it fits (moe_1b: 2 layers, 256 tokens).

How each category is measured (independently of the planner's formulas):
  weights           nbytes of every Parameter this rank's model holds (after slicing / the cut)
  gradients         nbytes of the flat gradient buffers the step runner returns: what lives
                    between micro-batches (ZeRO-2: this rank's rows)
  optimizer         nbytes of the optimizer's state Parameters (moments; ZeRO: the fp32 master rows)
  activations       the step's peak of MindSpore's memory pool above its level before the step,
                    less the gradient buffers held at that peak (the CPU profiler's
                    `cpu_ms_memory_record`, every pool allocation and free; the pool holds every
                    tensor a kernel creates, not Parameters, which live in host memory). It is
                    everything transient in a step: saved activations, backward temporaries, the
                    per-parameter gradients before they are packed, workspaces. The buffers are
                    held at the peak when earlier micro-batches' gradients accumulate in them
                    through a later one's forward and backward; with one micro-batch nothing is
                    subtracted. The config's `parallel.recompute` is in effect (marked by
                    `parallelize`, as in training). Without recompute the peak is at the start of
                    the backward (every layer's saved activations); with `full`, or where the
                    activations are small beside the parameters, at the end of the backward: every
                    per-parameter gradient live while its packed copy is filled, the copy the
                    step then returns. The plan books that peak too and shows the per-parameter
                    gradients' part of it apart (`detail.planned_unpacked_gradients`; the pool
                    record has sizes, not names, so the measurement is not split).
  dispatch_buffers  nbytes of the token-row buffers of one MoE layer, measured in PyNative on this
                    rank's first MoE layer with the step's micro-batch shape and the largest
                    capacities any of the step's calls ran with (the first's: the prior): the rows
                    its experts read and write plus what the expert-parallel exchanges send and
                    receive, times this rank's MoE layers. Part of `activations` where they are live at the
                    peak; shown apart because routing imbalance and padding land there.
"""
from __future__ import annotations

import contextlib
import copy
import glob
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

import mindspore as ms

from moetrain.build import build_model, setup_device
from moetrain.testing.solo import SoloComm
from moetrain.distributed.topology import ParallelContext
from moetrain.layout import Layout, check_config_layout
from moetrain.moe.layer import moe_layers
from moetrain.parallel.parallelize import parallelize
from moetrain.planner.arch import Job
from moetrain.planner.costs import plan_layout
from moetrain.planner.report import format_bytes

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "dispatch_buffers")
STATIC = ("weights", "gradients", "optimizer")
STATIC_BOUND, ACTIVATION_BOUND = 0.10, 0.25     # planned vs measured (issue 18)
PIPELINE_FREE_MICRO_BATCHES = 2
DEFAULT_BUDGET = 2 * 2 ** 30        # planned bytes of a dry run shortened by default (the code may take ~6x: padded ep dispatch)
MIN_DEFAULT_SEQ = 128     # without a pipeline: the second micro-batch also holds the first's gradients


@dataclass
class DryRun:
    source: str
    rank: int
    describe: str                    # the rank's coordinates
    layout: object                   # moetrain.layout.Layout of the run that was measured
    seq_length: int                  # tokens per sequence as run
    full_seq_length: int             # ... in the config
    micro_batches: int               # as run (the config's: layout of `plan`)
    layers: int                      # as built
    full_layers: int
    compute_dtype: str               # as run
    planned: Dict[str, float]
    measured: Dict[str, float]
    planned_full: Dict[str, float] = field(default_factory=dict)   # the config as written (all layers, full sequence)
    notes: List[str] = field(default_factory=list)
    detail: Dict[str, float] = field(default_factory=dict)   # peak RSS, times, optimizer-step transient

    def to_json(self) -> str:
        return json.dumps({"config": self.source, "rank": self.rank, "seq_length": self.seq_length,
                           "full_seq_length": self.full_seq_length, "layers": self.layers,
                           "full_layers": self.full_layers, "micro_batches": self.micro_batches,
                           "compute_dtype": self.compute_dtype,
                           "planned": {k: int(round(v)) for k, v in self.planned.items()},
                           "measured": {k: int(round(v)) for k, v in self.measured.items()},
                           "planned_full_config": {k: int(round(v)) for k, v in self.planned_full.items()},
                           "detail": self.detail, "notes": self.notes})


# ---------------------------------------------------------------------------------------------
# Memory measurement
# ---------------------------------------------------------------------------------------------
class PoolRecorder:
    """Every allocation and free of MindSpore's device memory pool (CPU included) inside the block,
    from the profiler's memory record: `peak_above_start` = the most the pool held above what it
    held when the block began. The record holds every allocation since the process's first profile
    (measured: a second recorder's file repeats the first's), so only records stamped after this
    block began count."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="moetrain_dryrun_")
        self.start = self.peak = None      # the pool's level at the first record, its most
        self.since = 0                     # wall-clock ns the block began (the records' timestamps)

    def __enter__(self) -> "PoolRecorder":
        self.since = time.time_ns()
        self.profiler = ms.profiler.profile(profile_memory=True,
                                            on_trace_ready=ms.profiler.tensorboard_trace_handler(self.folder))
        with _quiet():
            self.profiler.start()
        return self

    def __exit__(self, *exc) -> None:
        with _quiet():      # the profiler prints its parsing progress to stdout
            self.profiler.stop()
        records = sorted(glob.glob(os.path.join(self.folder, "*", "FRAMEWORK", "cpu_ms_memory_record_*.txt")))
        if records:     # streamed: memory independent of the record's length (np.loadtxt built every row)
            with open(records[-1]) as fh:
                next(fh, None)
                for line in fh:
                    stamp, level = line.split(",", 2)[:2]
                    if int(stamp) < self.since:         # an earlier recorder's
                        continue
                    level = int(level)
                    if self.start is None:
                        self.start = self.peak = level
                    elif level > self.peak:
                        self.peak = level
        shutil.rmtree(self.folder, ignore_errors=True)
        if not exc[0] and self.start is None:
            raise RuntimeError("the MindSpore profiler wrote no memory record (cpu_ms_memory_record); the dry run "
                               "cannot measure activations with this MindSpore build")

    @property
    def peak_above_start(self) -> int:
        return 0 if self.start is None else int(self.peak - self.start)


@contextlib.contextmanager
def _quiet():
    """Standard output and error of this process (C++ included) to /dev/null inside the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [null]:
            os.close(fd)


def rss_bytes() -> Dict[str, int]:
    """Current and peak resident memory of this process (VmRSS, VmHWM)."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def nbytes(tensors) -> int:
    return sum(int(np.prod(t.shape, dtype=np.int64)) * t.itemsize for t in tensors)


# ---------------------------------------------------------------------------------------------
# The config as run
# ---------------------------------------------------------------------------------------------
def dry_run_config(cfg, seq_length: Optional[int] = None, micro_batches: Optional[int] = None,
                   layers: Optional[int] = None):
    """`(config to run, notes)`: a copy of `cfg` adapted to one CPU process (see the module notes)."""
    run = copy.deepcopy(cfg)
    notes = []
    layout = Layout.of(cfg)
    full_seq = cfg.data.seq_length or cfg.model.seq_length
    if "bfloat16" in (run.precision.compute_dtype, run.parallel.grad_reduce_dtype):
        notes.append("bfloat16 runs as on this CPU in training (docs/precision.md): fp32 GEMMs on bf16 values, "
                     "the SwiGLU activations (MLP and routed experts) stored in 2 bytes, the other bf16 values "
                     "and the gradients' collectives in fp32 tensors; the plan books them so")
    if seq_length and seq_length != full_seq:
        if not 1 <= seq_length <= cfg.model.seq_length:
            raise ValueError(f"--seq {seq_length}: must be in [1, model.seq_length={cfg.model.seq_length}]")
        run.data.seq_length = seq_length
        notes.append(f"sequence shortened to {seq_length} tokens (config: {full_seq}); planned figures are "
                     f"for the same shortened job")
    wanted = micro_batches or (max(layout.pp, 2) if layout.pp > 1 else PIPELINE_FREE_MICRO_BATCHES)
    count = min(layout.num_micro_batches, wanted)
    if count != layout.num_micro_batches:
        notes.append(f"{count} of the step's {layout.num_micro_batches} micro-batches run (enough for the "
                     f"schedule's peak: later ones repeat it)")
    run.train.micro_batch_size = layout.micro_batch_size
    run.train.global_batch_size = layout.dp * layout.micro_batch_size * count
    run.parallel.micro_batch_num = count
    if layers and layers != cfg.model.num_layers:
        if not layout.pp <= layers <= cfg.model.num_layers:
            raise ValueError(f"--layers {layers}: must be in [pipeline stages={layout.pp}, "
                             f"model.num_layers={cfg.model.num_layers}]")
        run.model.num_layers = layers
        run.parallel.pipeline_layers = None
        notes.append(f"{layers} of {cfg.model.num_layers} layers built at full width (the same dense / MoE "
                     f"pattern from the start); planned figures are for the same shortened model, "
                     f"'full config' is the plan of the config as written")
    return run, notes


def fitting_defaults(cfg, rank: int = 0):
    """`(seq_length, layers)` for a dry run of `cfg` on this machine when the user gives neither:
    `(None, None)` when the whole job's plan fits in `DEFAULT_BUDGET`; else the fewest leading
    layers that include a MoE layer (and one per pipeline stage), then the sequence halved down to
    `MIN_DEFAULT_SEQ` until the plan fits."""
    def planned(seq, layers):
        run = dry_run_config(cfg, seq, layers=layers)[0]
        layout = Layout.of(run)
        stages = plan_layout(Job.of(run), layout, "cpu", layout.world).stages
        stage = stages[min(rank // max(1, layout.world // layout.pp), len(stages) - 1)]
        return sum(stage.memory[k] for k in CATEGORIES[:4])

    seq = cfg.data.seq_length or cfg.model.seq_length
    if planned(None, None) <= DEFAULT_BUDGET:
        return None, None
    moe = list(getattr(cfg.model, "moe_layers", []) or [])
    layers = max(Layout.of(cfg).pp, (moe[0] + 1) if moe else 1)
    while seq > MIN_DEFAULT_SEQ and planned(seq, layers) > DEFAULT_BUDGET:
        seq //= 2
    return seq, layers


# ---------------------------------------------------------------------------------------------
# The dry run
# ---------------------------------------------------------------------------------------------
def _random_batches(cfg, layout, seq_length: int, count: int):
    rng = np.random.default_rng(cfg.train.seed)
    shape = (layout.micro_batch_size, seq_length)
    vocab = cfg.model.vocab_size
    return [(rng.integers(0, vocab, shape).astype(np.int32), rng.integers(0, vocab, shape).astype(np.int32))
            for _ in range(count)]


def measure_dispatch(model, solo, micro_batch_size: int, seq_length: int, hidden: int) -> Dict[str, int]:
    """Token-row buffer bytes of this rank's first MoE layer on one micro-batch (PyNative): the rows
    its experts read and write, and what its expert-parallel exchanges send and receive."""
    layers = moe_layers(model)
    if not layers:
        return {"per_layer": 0, "layers": 0, "expert_rows": 0, "exchanged": 0}
    layer = layers[0]
    seen = []
    handle = layer.experts.register_forward_hook(lambda cell, inputs, output: seen.append(
        (nbytes(inputs[:1]), nbytes([output]), int(inputs[0].shape[0]) * int(np.prod(inputs[0].shape[1:-1])))))
    start = len(solo.calls())
    x = ms.Tensor(np.random.default_rng(0).standard_normal((micro_batch_size, seq_length, hidden)).astype(np.float32))
    try:
        layer(x)
    finally:
        handle.remove()
    exchanged = sum(i + o for op, kind, i, o in solo.calls()[start:] if kind == "ep" and op != "all_reduce")
    expert_in, expert_out, rows = seen[0] if seen else (0, 0, 0)
    return {"per_layer": expert_in + expert_out + exchanged, "layers": len(layers), "expert_rows": rows,
            "exchanged": exchanged}


def dry_run(cfg, rank: int = 0, seq_length: Optional[int] = None, micro_batches: Optional[int] = None,
            layers: Optional[int] = None) -> DryRun:
    """Build rank `rank` of `cfg`'s job, run one step, measure it, plan the same job (module notes)."""
    shortened = []
    if seq_length is None and layers is None:
        seq_length, layers = fitting_defaults(cfg, rank)
        if layers is not None:
            shortened.append(f"shortened by default to fit this machine (plan over {DEFAULT_BUDGET / 2 ** 30:g} GiB): "
                             f"--layers {layers} --seq {seq_length}; pass --layers / --seq to choose")
    run, notes = dry_run_config(cfg, seq_length, micro_batches, layers)
    notes = shortened + notes
    layout = check_config_layout(run)
    if not 0 <= rank < layout.world:
        raise ValueError(f"--rank {rank}: the layout {layout.describe()} has ranks 0..{layout.world - 1}")
    seq = run.data.seq_length or run.model.seq_length
    pctx = ParallelContext.build(layout.world, rank, layout.dp, layout.tp, layout.pp, layout.ep, layout.etp, layout.cp)
    # the plans first: a config the planner rejects fails before the step
    stage = pctx.pp_rank
    cost = plan_layout(Job.of(run), Layout.of(run), "cpu", layout.world, source=cfg.source).stages[stage]
    full_run = dry_run_config(cfg)[0]         # the config as written
    full = plan_layout(Job.of(full_run), Layout.of(full_run), "cpu", layout.world, source=cfg.source).stages[stage]
    planned, planned_full = ({**{k: c.memory[k] for k in CATEGORIES[:4]}, "dispatch_buffers": c.dispatch_bytes}
                             for c in (cost, full))
    setup_device("cpu")
    detail = {"planned_unpacked_gradients": cost.unpacked_gradients}   # part of planned activations
    started = time.perf_counter()
    with SoloComm() as solo:
        ms.set_seed(run.train.seed)
        # `rebuild`: the further model chunks of a stage (interleaved 1F1B, ZB-V), as the trainer builds them
        parallel = parallelize(build_model(run, pctx), run, pctx, seq,
                               rebuild=lambda chunk: build_model(run, pctx, chunk))
        detail["build_s"] = time.perf_counter() - started
        measured = {"weights": nbytes(parallel.model.get_parameters()),
                    "optimizer": nbytes(parallel.opt_step.state_parameters())}
        batches = _random_batches(run, layout, seq, layout.num_micro_batches)
        rss_before = rss_bytes()["VmRSS"]
        started = time.perf_counter()
        with PoolRecorder() as step_pool:
            grads, _ = parallel.runner.train_step(batches, ms.Tensor(1.0, ms.float32))
        detail["step_s"] = time.perf_counter() - started
        measured["gradients"] = nbytes(grads)
        held = measured["gradients"] if layout.num_micro_batches > 1 else 0   # at the peak: see the docstring
        measured["activations"] = step_pool.peak_above_start - held
        with PoolRecorder() as optimizer_pool:
            parallel.opt_step(grads, 1e-4, 1, 1.0 / (layout.num_micro_batches * layout.dp * layout.cp))
        detail["optimizer_step_transient"] = optimizer_pool.peak_above_start
        # the dispatch buffers at their largest in the step: each capacity the largest any call ran
        # with (moetrain/moe/capacity.py: the first call runs the prior's, later ones are sized from
        # the routed counts, shrink or grow; the pipeline's per step). A MoE
        # layer's input: this rank's sequence shard under sequence parallelism (it gathers the
        # rest), 1/cp of it under context parallelism
        largest = getattr(parallel.runner, "capacities_largest", lambda: None)()
        if largest:
            for moe in moe_layers(parallel.model):
                for key, value in largest.items():
                    setattr(moe.dispatcher, key, tuple(value) if isinstance(value, list) else value)
            detail["capacities_largest"] = largest
        dispatch = measure_dispatch(parallel.model, solo, layout.micro_batch_size,
                                    seq // layout.cp // (layout.tp if layout.sequence_parallel else 1),
                                    run.model.hidden_size)
    measured["dispatch_buffers"] = dispatch["per_layer"] * dispatch["layers"]
    detail.update(rss_before_step=rss_before, peak_rss=rss_bytes()["VmHWM"],
                  max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  expert_rows_per_layer=dispatch["expert_rows"], exchanged_per_layer=dispatch["exchanged"],
                  routed_rows_per_layer=layout.micro_batch_size * seq * getattr(getattr(run.model, "moe", None),
                                                                                "top_k", 0))

    measured = {k: float(measured[k]) for k in CATEGORIES}
    return DryRun(source=cfg.source, rank=rank, describe=pctx.describe(), layout=layout, seq_length=seq,
                  full_seq_length=cfg.data.seq_length or cfg.model.seq_length, micro_batches=layout.num_micro_batches,
                  layers=run.model.num_layers, full_layers=cfg.model.num_layers, compute_dtype=run.precision.compute_dtype,
                  planned=planned, measured=measured, planned_full=planned_full, notes=notes, detail=detail)


def format_dry_run(r: DryRun) -> str:
    lines = [f"moetrain plan --dry-run: {r.source or 'config'}, {r.describe}",
             f"  ran: {r.layers} layers, {r.micro_batches} micro-batch(es) of {r.layout.micro_batch_size} x "
             f"{r.seq_length} tokens, {r.compute_dtype} compute, {r.layout.describe()}"]
    lines += [f"  note: {note}" for note in r.notes]
    lines.append(f"  {'category':<20}{'planned':>14}{'measured':>14}{'measured/planned':>18}{'full config':>16}")
    for key in CATEGORIES:
        p, m = r.planned[key], r.measured[key]
        ratio = f"{m / p:.3f}" if p else "-"
        lines.append(f"  {key:<20}{format_bytes(p):>14}{format_bytes(m):>14}{ratio:>18}{format_bytes(r.planned_full.get(key, 0)):>16}")
    static_p = sum(r.planned[k] for k in STATIC)
    static_m = sum(r.measured[k] for k in STATIC)
    if r.detail.get("planned_unpacked_gradients"):
        lines.append(f"  {'  of which per-parameter gradients before packing (planned)':<66}"
                     f"{format_bytes(r.detail['planned_unpacked_gradients']).strip()}")
    lines.append(f"  {'static (w+g+o)':<20}{format_bytes(static_p):>14}{format_bytes(static_m):>14}{static_m / static_p:>18.3f}")
    lines.append(f"  step {r.detail.get('step_s', 0):.1f} s, peak RSS {format_bytes(r.detail.get('peak_rss', 0)).strip()}; "
                 f"bounds (issue 18): static within {STATIC_BOUND:.0%}, activations within {ACTIVATION_BOUND:.0%}")
    return "\n".join(lines)
