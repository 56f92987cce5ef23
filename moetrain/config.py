"""One YAML file -> typed, validated dataclasses.

    cfg = load_config("configs/moe_tiny.yaml", overrides=["optimizer.lr=3e-4"])

A config may name a `base:` config (path relative to itself) and override parts of it.
Every key is checked against the dataclasses below (the `model:` section against the
registered model's own config class); a wrong key, type or value raises `ConfigError`
naming the file, the key path, the reason and the nearest valid key.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import difflib
import inspect
import io
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import yaml

from moetrain import registry
from moetrain.data import DataError
from moetrain.data.blend import parse_blend
from moetrain.fileio import temp_path
from moetrain.fileio import read_yaml
from moetrain.layout import Layout, ModelShape, launched_world_size, layout_problems


class ConfigError(ValueError):
    """A config problem, reported before any work starts."""


def choice(default, *choices, help=""):
    """A field restricted to `choices` (checked on load)."""
    return field(default=default, metadata={"choices": tuple(choices), "help": help})


# --------------------------------------------------------------------------------------------
# Sections. Field names are the YAML keys; the ones named in the interface contract
# (model.name, data.path, train.*, optimizer.lr, checkpoint.*, parallel.*) must not change.
# --------------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    type: str = choice("lm", "lm", "mnist", help="dataset kind")
    # training data: MNIST idx folder or token-shard prefix; LM: also a blend, Megatron's
    # [w1, prefix1, w2, prefix2, ...] or {name: [w, prefix], ...} (moetrain/data/blend.py)
    path: Any = ""
    eval_path: Any = ""                # evaluation data (MNIST: same folder, t10k files); a blend: eval_loss/<name>
    seq_length: int = 0                # LM sample length (0: take model.seq_length)
    tokenizer: str = ""                # sentencepiece .model or tokenizer.json the shards were made with
    shuffle: bool = True
    cache_dir: str = ""                # blend index cache ("": beside the first source's shards)
    reset_attention_mask: bool = False  # document ids per token: attention stays inside a document
    reset_position_ids: bool = False    # positions restart at each document


@dataclass
class ParallelConfig:
    data_parallel: int = 0             # 0: the launched world size / (model_parallel x pipeline_stage)
    model_parallel: int = 1            # tensor parallel
    pipeline_stage: int = 1
    context_parallel: int = 1          # ranks each sequence is split over (load-balanced causal chunks)
    cp_comm_type: str = choice("all_gather", "all_gather", "p2p", "a2a")   # how attention crosses that split
    expert_parallel: int = 1           # experts split over this many ranks (up to dp x tp / etp: MoE folding)
    expert_tensor_parallel: int = 1    # ranks each routed expert's FFN is split over (divides model_parallel)
    micro_batch_num: int = 1           # pipeline micro-batches per step (0/1: derived from batch sizes)
    use_seq_parallel: bool = False
    optimizer_shard: int = choice(0, 0, 1, 2, help="0 none, 1 optimizer states, 2 states and gradients")
    recompute: str = choice("none", "none", "full", "selective")
    mode: str = choice("manual", "manual", "auto")
    pipeline_schedule: str = choice("1f1b", "1f1b", "gpipe", "interleaved_1f1b", "zero_bubble_h1", "zero_bubble_v")
    pipeline_layers: Optional[List[int]] = None   # layers per (virtual) stage; None: even split
    pp_interleave_num: int = 1         # model chunks per stage (interleaved_1f1b; zero_bubble_v: 2)
    grad_bucket_mb: float = 25.0       # gradient all-reduce bucket size ("communication fusion")
    grad_reduce_dtype: str = choice("float32", "float32", "float16", "bfloat16")
    moe_token_dispatcher: str = choice("alltoall", "alltoall", "allgather")
    moe_aux_loss_scope: str = choice("micro_batch", "micro_batch", "sequence", "global")
    # dropless dispatch buffers (moetrain/moe/capacity.py): sized from the routing counts, re-run on
    # overflow (adaptive), or the static bound (one graph, larger buffers); the first adaptive sizes
    # are this many times the even share
    moe_capacity: str = choice("adaptive", "adaptive", "bound")
    moe_capacity_prior: float = 2.0
    # how the dropless alltoall dispatcher sizes its exchange (moetrain/moe/ep_dispatcher.py): auto picks
    # exact split sizes on the Ascend path with Ascend's AlltoAllV and host-sized buckets elsewhere
    ep_splits: str = choice("auto", "auto", "exact", "bucketed")
    # For `moetrain plan` (docs/plan.md, "Published runs"): what the priced system does that this
    # trainer does not. moe_overlap: the expert all-to-all hidden under compute (dualpipe:
    # DeepSeek-V3's DualPipe; a2a_overlap: Megatron-Core --overlap-moe-expert-parallel-comm);
    # pipeline_backward: recompute (this trainer: a chunk's backward recomputes its forward) or stash
    # (Megatron / DeepSeek: activations kept from forward to backward); recompute_modules: what
    # recompute selective recomputes, Megatron-Core's --recompute-modules names (None: the attention core)
    moe_overlap: str = choice("none", "none", "a2a_overlap", "dualpipe")
    pipeline_backward: str = choice("recompute", "recompute", "stash")
    recompute_modules: Optional[List[str]] = None
    # fold the experts over tp x dp (etp x ep x edp) even when ep divides dp, as Megatron-Core's MoE
    # parallel folding does (DeepSeek-V3's EP64 on tp2 x dp64: the expert group is 64 contiguous GPUs);
    # without it moetrain folds only when ep does not divide dp. For `moetrain plan` only
    moe_fold_experts: bool = False
    data_parallel_inferred: bool = field(default=False, metadata={"internal": True})


@dataclass
class OptimizerConfig:
    name: str = choice("adamw", "adamw", "adam", "sgd", "momentum", "lamb")
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    momentum: float = 0.9
    clip_grad_norm: float = 0.0        # 0: no clipping
    # the CPU kernels' fused optimizer step (parallel/data_parallel.py): auto/on wherever the kernels
    # serve the optimizer (fp32 AdamW / Adam), off: the plain ops
    fused: str = choice("auto", "auto", "on", "off")


@dataclass
class LRScheduleConfig:
    type: str = choice("constant", "constant", "cosine", "linear")
    warmup_steps: int = 0
    min_lr: float = 0.0
    decay_steps: int = 0               # 0: decay over the whole run (train.steps)


@dataclass
class PrecisionConfig:
    compute_dtype: str = choice("float32", "float32", "float16", "bfloat16")
    loss_scale: str = choice("none", "none", "static", "dynamic")
    initial_loss_scale: float = 65536.0
    scale_window: int = 1000           # finite steps before the dynamic scale grows
    scale_factor: float = 2.0
    # FP8 GEMMs (Megatron-Core --fp8-recipe names), priced by `moetrain plan` at the device's fp8 peak
    fp8_recipe: str = choice("none", "none", "tensorwise", "delayed", "blockwise")
    # How parameters and optimizer moments are stored, for `moetrain plan` (docs/plan.md, "Memory per
    # device"): float32, what this trainer holds; bfloat16, Megatron-Core's and DeepSeek's recipe (bf16
    # parameters, fp32 main gradients, fp32 master weights and moments sharded by the distributed
    # optimizer over dp, experts over their expert-data-parallel group). moment_dtype bfloat16: Adam's
    # m and v in bf16 (DeepSeek-V3 report 3.3.3; Megatron-Core --exp-avg-dtype / --exp-avg-sq-dtype bf16)
    param_dtype: str = choice("float32", "float32", "bfloat16")
    moment_dtype: str = choice("float32", "float32", "bfloat16")


@dataclass
class TrainConfig:
    steps: int = 0                     # optimizer steps; 0: use epochs
    epochs: float = 0.0
    global_batch_size: int = 32
    micro_batch_size: int = 0          # 0: global_batch_size / data_parallel (no accumulation)
    seed: int = 1234
    output_dir: str = "runs/default"
    device: str = choice("cpu", "cpu", "ascend", "gpu")
    device_profile: str = ""           # the part `moetrain plan` prices (gpu_h100, gpu_h800, ...); "": the backend's default
    stop_after: int = 0                # end this invocation after this many steps (time-sliced jobs); 0: run to the end
    jit: bool = True                   # compile the step with ms.jit; false: PyNative, for debugging
    cell_reuse: bool = True            # compile one graph per block class, reused by every layer (modeling.reused_block)
    eval_interval: int = 0             # steps between evaluations; 0: only at the end
    eval_batch_size: int = 0           # 0: micro_batch_size
    eval_max_batches: int = 0          # evaluate the first N x global_batch_size samples (any layout); 0: all
    # numerical faults in runs without a loss scaler (docs/faults.md): a non-finite loss or gradient,
    # or a loss above loss_spike_factor x its running mean (0: no spike test), is skipped, rolled back
    # to the last checkpoint (skipping the batches since), or stops the run; past nonfinite_limit
    # faults the run stops
    on_nonfinite: str = choice("skip", "skip", "rollback", "stop")
    nonfinite_limit: int = 10
    loss_spike_factor: float = 0.0


@dataclass
class CheckpointConfig:
    load_path: str = ""                # start a new run (step 0, fresh optimizer) from these weights: a
                                       # model directory or a training checkpoint of any layout
    save_steps: int = 0                # 0: only at the end of the run
    keep_max: int = 3
    save_at_end: bool = True
    async_save: bool = False
    on_save_error: str = choice("stop", "stop", "continue")   # a failed save (disk full, I/O error)


@dataclass
class LoggingConfig:
    log_interval: int = 10
    progress_bar: bool = True
    tensorboard: bool = True
    profile_steps: Optional[List[int]] = None    # [first, last] steps for mindspore.Profiler


@dataclass
class Config:
    model: Any = None                  # the registered model's config dataclass
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    model_module: str = ""             # a user's families: dotted module, or path of a .py file / package folder
    source: str = field(default="", metadata={"internal": True})

    def to_dict(self) -> Dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("internal"):
                continue
            out[f.name] = _to_plain(getattr(self, f.name))
        return out

    # Derived quantities used by the trainer.
    @property
    def dp(self) -> int:
        return self.parallel.data_parallel

    @property
    def micro_batch_size(self) -> int:
        """train.micro_batch_size; if 0, derived from parallel.micro_batch_num (pipeline micro-batches)."""
        if self.train.micro_batch_size:
            return self.train.micro_batch_size
        return self.train.global_batch_size // (self.dp * max(1, self.parallel.micro_batch_num))

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per optimizer step on one data-parallel rank (gradient accumulation)."""
        return self.train.global_batch_size // (self.dp * self.micro_batch_size)


def _to_plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get("internal")}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def _read_yaml(path: str, chain=()) -> Dict[str, Any]:
    if os.path.isdir(path):
        raise ConfigError(f"{path!r} is a folder, not a config file: name the YAML file (configs live in configs/)")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path!r} (check the path; configs live in configs/)")
    try:
        raw = read_yaml(path) or {}
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base:
        base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
        if os.path.abspath(base_path) in chain:
            raise ConfigError(f"{path}: `base: {base}` makes a cycle of configs")
        base_raw = _read_yaml(base_path, chain + (os.path.abspath(path),))
        # Naming another model replaces the base's model section instead of merging into it.
        new_model = raw.get("model", {}) if isinstance(raw.get("model"), dict) else {}
        if "name" in new_model and new_model["name"] != base_raw.get("model", {}).get("name"):
            base_raw.pop("model", None)
        raw = _deep_merge(base_raw, raw)
    return raw


def _deep_merge(base: Dict, over: Dict) -> Dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_override(raw: Dict, item: str, source: str) -> None:
    """Apply one `key.path=value` override (value parsed as YAML) to the raw config mapping."""
    if "=" not in item:
        raise ConfigError(f"{source}: override {item!r} must look like key.path=value")
    key, text = item.split("=", 1)
    value = yaml.safe_load(text) if text.strip() else ""
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def load_config(path: str, overrides: Sequence[str] = ()) -> Config:
    """Read `path` (following `base:`), apply `--set key=value` overrides, validate."""
    return config_with_overrides(_read_yaml(path), overrides, source=path)


def config_with_overrides(raw: Dict[str, Any], overrides: Sequence[str], source: str) -> Config:
    """Apply `--set key=value` overrides (in order: the last of a key is in force) to the mapping read
    from `source`, then validate. An error that a `--set` caused names that `--set` (`blame_overrides`)."""
    merged = copy.deepcopy(raw)
    for item in overrides:
        apply_override(merged, item, f"{source} (--set)")
    try:
        return config_from_dict(merged, source=source)
    except ConfigError as exc:
        raise blame_overrides(exc, raw, overrides, source) from None


def _override_key(item: str) -> str:
    return item.split("=", 1)[0].strip()


def blame_overrides(exc: ConfigError, raw: Dict[str, Any], overrides: Sequence[str], source: str) -> ConfigError:
    """The error `exc` of `raw` + `overrides`, naming the `--set`(s) that caused it: those in force (not
    replaced by a later `--set` of the same key) without which the config gives another outcome. A
    check of several keys (the layout, heads, blend weights) then names whichever of its keys a
    `--set` changed; an error the file alone causes stays the file's. Without a `--set` means with
    the file's value of its key (an earlier `--set` of the key is replaced too)."""
    in_force = [i for i, item in enumerate(overrides)
                if not any(_override_key(later) == _override_key(item)
                           or _override_key(item).startswith(_override_key(later) + ".")
                           for later in overrides[i + 1:])]
    if not in_force or len(in_force) > 32:       # (each try is a validation: a few ms)
        return exc
    culprits = []
    for i in in_force:      # the config as if no --set had given this key (the file's value)
        key = _override_key(overrides[i])
        trial = copy.deepcopy(raw)
        for item in overrides:
            if not (_override_key(item) == key or _override_key(item).startswith(key + ".")):
                apply_override(trial, item, source)
        try:
            with contextlib.redirect_stderr(io.StringIO()):      # (validation may log, e.g. an inferred dp)
                config_from_dict(trial, source=source)
        except ConfigError as other:
            if str(other) == str(exc):
                continue        # the same error without it: not this --set
        except Exception:        # noqa: BLE001 - another outcome all the same
            pass
        culprits.append(overrides[i])
    if not culprits:
        return exc
    message = str(exc)
    if message.startswith(f"{source}: "):
        message = message[len(source) + 2:]
    return ConfigError(" ".join(f"--set {item}" for item in culprits) + f" (on top of {source}): {message}")


def output_dir_of(path: str, overrides: Sequence[str] = ()) -> Optional[str]:
    """`train.output_dir` as `load_config(path, overrides)` will give it, read without validating the
    config (nor importing the model registry, hence MindSpore); None when the files do not say (the
    default) or cannot be read (load_config then says why)."""
    try:
        raw = _read_yaml(path)
        for item in overrides:
            apply_override(raw, item, path)
    except (ConfigError, OSError, ValueError, AttributeError, TypeError):
        return None
    train = raw.get("train")
    value = train.get("output_dir", TrainConfig.output_dir) if isinstance(train, dict) else TrainConfig.output_dir
    return value if isinstance(value, str) and value else None


def config_from_dict(raw: Dict[str, Any], source: str = "<dict>") -> Config:
    raw = copy.deepcopy(raw)
    if raw.get("model_module"):   # a path is kept absolute, so that a resolved config works from anywhere
        base = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else ""
        raw["model_module"] = registry.import_model_module(raw["model_module"], base)
    model_raw = raw.pop("model", None)
    if not isinstance(model_raw, dict) or "name" not in model_raw:
        raise ConfigError(f"{source}: key 'model.name' is required: name a registered model "
                          f"({', '.join(sorted(registry.registered_models()))})")
    try:
        registry.get_model(model_raw["name"])   # an unknown name fails here, naming the registered ones
    except KeyError as exc:
        raise ConfigError(f"{source}: key 'model.name': {exc.args[0]}") from None
    cfg = _build(Config, raw, "", source)
    cfg.model = model_config_from_dict(model_raw, source)
    cfg.source = source
    if cfg.parallel.data_parallel == 0:
        if cfg.parallel.mode == "auto":     # the layout search sets it for the launched world size
            cfg.parallel.data_parallel = 1
        else:
            infer_data_parallel(cfg, source)
    validate(cfg, source)
    return cfg


WORLD_SIZE_ENV = "MOETRAIN_WORLD_SIZE"   # the launch scripts' planned world size, for checks before msrun starts


def infer_data_parallel(cfg: Config, source: str, world_size: Optional[int] = None) -> None:
    """`parallel.data_parallel: 0` (the default): world size / (model_parallel x pipeline_stage), as
    Megatron-Core and torchtitan do, with the world size as launched (msrun's MS_WORKER_NUM, or
    MOETRAIN_WORLD_SIZE, which run_distributed.sh sets for its checks before msrun starts). Not
    launched (one process, or a tool reading the config): 1. Logged on stderr when above 1."""
    p, t = cfg.parallel, cfg.train
    if world_size is None:
        world_size = next((int(os.environ[v]) for v in (WORLD_SIZE_ENV, "MS_WORKER_NUM", "RANK_SIZE")
                           if os.environ.get(v)), None)
    if world_size is None:
        p.data_parallel, p.data_parallel_inferred = 1, True
        return
    world = world_size
    model_ranks = max(1, p.model_parallel) * max(1, p.pipeline_stage) * max(1, p.context_parallel)
    if world % model_ranks:
        raise ConfigError(f"{source}: key 'parallel.data_parallel' is not set, so it is inferred as world size / "
                          f"(model_parallel x pipeline_stage x context_parallel), but {world} processes are not "
                          f"divisible by {p.model_parallel} x {p.pipeline_stage} x {p.context_parallel}: launch a "
                          f"multiple of {model_ranks} processes")
    dp = world // model_ranks
    if t.global_batch_size % dp:
        fits = [d * model_ranks for d in range(1, t.global_batch_size + 1) if t.global_batch_size % d == 0][:6]
        raise ConfigError(f"{source}: key 'parallel.data_parallel' is not set and would be inferred as {world} "
                          f"processes / (model_parallel x pipeline_stage x context_parallel = {model_ranks}) = {dp}, which "
                          f"cannot split "
                          f"train.global_batch_size={t.global_batch_size}: launch {fits} processes, or set "
                          f"train.global_batch_size to a multiple of {dp}")
    p.data_parallel, p.data_parallel_inferred = dp, True
    if world > 1 and os.environ.get("RANK_ID", "0") == "0":
        print(f"moetrain: parallel.data_parallel inferred from the world size: {world} processes / "
              f"(model_parallel {p.model_parallel} x pipeline_stage {p.pipeline_stage} x context_parallel "
              f"{p.context_parallel}) = {dp}",
              file=sys.stderr, flush=True)


def model_config_from_dict(model_raw: Dict[str, Any], source: str = "<dict>"):
    """The registered model's config dataclass from a `model:` mapping, fully validated."""
    try:
        entry = registry.get_model(model_raw["name"])
    except KeyError as exc:
        raise ConfigError(f"{source}: key 'model.name': {exc.args[0]}") from None
    return _build(entry.config_cls, model_raw, "model", source)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _convert(value, tp, key: str, source: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key, source)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}' must be a mapping of {tp.__name__} keys, got {value!r}")
        return _build(tp, value, key, source)
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: key '{key}' must be a list, got {value!r}")
        return [_convert(v, args[0] if args else Any, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ConfigError(f"{source}: key '{key}' must be of type {_type_name(tp)}, got {value!r} "
                      f"({type(value).__name__})")


def _build(cls, raw: Dict[str, Any], prefix: str, source: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: section '{prefix}' must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = (f"did you mean '{prefix + '.' if prefix else ''}{near[0]}'?" if near
                    else f"valid keys here: {', '.join(fields)}")
            raise ConfigError(f"{source}: unknown key '{path}': {hint}")
        f = fields[key]
        converted = _convert(value, hints[key], path, source)
        choices = f.metadata.get("choices")
        if choices and converted not in choices:
            near = difflib.get_close_matches(str(converted), [str(c) for c in choices], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{source}: key '{path}' = {converted!r} is not one of "
                              f"{', '.join(map(repr, choices))}{hint}")
        kwargs[key] = converted
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: section '{prefix or cls.__name__}': {exc}") from None


def validate(cfg: Config, source: str) -> None:
    def need(ok: bool, key: str, why: str):
        if not ok:
            raise ConfigError(f"{source}: key '{key}': {why}")

    t, p = cfg.train, cfg.parallel
    for key in ("data_parallel", "model_parallel", "pipeline_stage", "context_parallel", "expert_parallel",
                "expert_tensor_parallel", "micro_batch_num"):
        need(getattr(p, key) >= 1, f"parallel.{key}", "must be >= 1")
    need(t.steps >= 0 and t.epochs >= 0, "train.steps", "steps and epochs must be >= 0")
    need(t.steps > 0 or t.epochs > 0, "train.steps", "set train.steps or train.epochs to a positive number")
    need(t.global_batch_size >= 1, "train.global_batch_size", "must be >= 1")
    need(t.micro_batch_size >= 0, "train.micro_batch_size", "must be >= 0")
    need(t.global_batch_size % (cfg.dp * cfg.micro_batch_size or 1) == 0 and cfg.micro_batch_size > 0,
         "train.global_batch_size",
         f"{t.global_batch_size} is not divisible by data_parallel ({cfg.dp}) x micro_batch_size "
         f"({t.micro_batch_size or 'auto'}); pick sizes so that global = dp x micro x accumulation")
    if p.micro_batch_num > 1:
        need(t.micro_batch_size == 0 or cfg.num_micro_batches == p.micro_batch_num, "parallel.micro_batch_num",
             f"{p.micro_batch_num} disagrees with train.global_batch_size / (data_parallel x train.micro_batch_size)"
             f" = {t.global_batch_size} / ({cfg.dp} x {t.micro_batch_size}); set only one of the two")
        need(t.global_batch_size % (cfg.dp * p.micro_batch_num) == 0, "parallel.micro_batch_num",
             f"train.global_batch_size ({t.global_batch_size}) is not divisible by data_parallel ({cfg.dp}) x "
             f"micro_batch_num ({p.micro_batch_num})")
    _check_ranges(cfg, need)
    if p.mode != "auto":   # the layout rules (the world size only when a launcher announced it)
        problems = layout_problems(Layout.of(cfg), ModelShape.of(cfg.model), world=launched_world_size(),
                                   global_batch_size=t.global_batch_size,
                                   seq_length=cfg.data.seq_length or getattr(cfg.model, "seq_length", None))
        if problems:
            raise ConfigError(f"{source}: the parallel layout cannot run:\n  - " + "\n  - ".join(problems))
    _validate_data(cfg.data, source)
    _validate_document_layout(cfg, source)
    need(cfg.optimizer.lr >= 0, "optimizer.lr", "must be >= 0")
    need(cfg.checkpoint.keep_max >= 1, "checkpoint.keep_max", "must be >= 1 (the latest checkpoint is always kept)")
    need(cfg.checkpoint.save_steps >= 0, "checkpoint.save_steps", "must be >= 0 (0: only at the end)")
    need(cfg.logging.log_interval >= 1, "logging.log_interval", "must be >= 1")
    window = cfg.logging.profile_steps
    need(window is None or (len(window) == 2 and 1 <= window[0] <= window[1]), "logging.profile_steps",
         f"must be [first, last] optimizer steps with 1 <= first <= last (e.g. [3, 5]), got {window!r}")
    if cfg.precision.loss_scale != "none":
        need(cfg.precision.initial_loss_scale > 0, "precision.initial_loss_scale", "must be > 0")
    _validate_planned_system(cfg, need)


# Megatron-Core --recompute-modules names that `moetrain plan` prices (parallel.recompute_modules)
RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts")


def _validate_planned_system(cfg: Config, need) -> None:
    """The keys that describe the system `moetrain plan` prices (docs/plan.md, "Published runs"):
    known names. `moetrain plan` accepts every value; `moetrain train` refuses those this trainer does
    not run (`check_trainable`)."""
    p, t = cfg.parallel, cfg.train
    if t.device_profile:
        from moetrain.devices import PROFILES   # pure Python, no MindSpore
        near = difflib.get_close_matches(t.device_profile, list(PROFILES), n=1)
        need(t.device_profile in PROFILES, "train.device_profile",
             f"{t.device_profile!r} is not a device profile" + (f" (did you mean {near[0]!r}?)" if near else "")
             + f"; known: {', '.join(PROFILES)} (moetrain/devices.py), or leave it empty for train.device's default")
    pr = cfg.precision
    need(pr.param_dtype == "float32" or pr.compute_dtype == pr.param_dtype, "precision.param_dtype",
         f"{pr.param_dtype} parameters are Megatron-Core's recipe for {pr.param_dtype} compute, but "
         f"precision.compute_dtype is {pr.compute_dtype}: set precision.compute_dtype={pr.param_dtype} or "
         f"precision.param_dtype=float32")
    modules = p.recompute_modules
    if modules is not None:
        bad = [m for m in modules if m not in RECOMPUTE_MODULES]
        need(not bad, "parallel.recompute_modules",
             f"{bad} not among {', '.join(RECOMPUTE_MODULES)} (Megatron-Core's --recompute-modules names)")
        need(p.recompute == "selective", "parallel.recompute_modules",
             f"lists what recompute selective recomputes, but parallel.recompute is {p.recompute!r}: set "
             f"parallel.recompute=selective or remove parallel.recompute_modules")


# What `moetrain train` does not run (docs/plan.md, "Published runs"): values of the keys that describe
# the system `moetrain plan` prices. Each: key, the value this trainer runs, why any other is refused.
PLANNER_ONLY = (
    ("parallel.moe_overlap", "none", "the trainer does not overlap the expert all-to-all"),
    ("parallel.pipeline_backward", "recompute",
     "the trainer's pipeline recomputes a chunk's forward in its backward (it does not stash activations)"),
    ("precision.fp8_recipe", "none", "the trainer has no FP8 GEMMs"),
    ("parallel.moe_fold_experts", False,
     "the trainer folds the experts over tp x dp only when expert_parallel does not divide data_parallel"),
    ("precision.param_dtype", "float32",
     "the trainer holds fp32 parameters (cast to the compute dtype per matmul), not bf16 ones with fp32 masters"),
    ("precision.moment_dtype", "float32", "the trainer keeps Adam's moments in fp32"),
    ("parallel.recompute_modules", None,
     "the trainer's selective recompute is its own (the attention core); it does not take Megatron-Core's module list"),
)


def trainer_refusal(cfg: Config) -> Optional[str]:
    """The one-line reason `moetrain train` refuses `cfg`, or None: a planner-only value (PLANNER_ONLY,
    on any device: `moetrain plan` accepts and prices them), or a `train.device_profile` of another
    backend than `train.device` (the plan would price a part the run does not use)."""
    for key, default, why in PLANNER_ONLY:
        value = get_key(cfg, key)
        if value != default:
            shown = ("[" + ", ".join(value) + "]" if isinstance(value, (list, tuple))
                     else str(value).lower() if isinstance(value, bool) else value)
            shown_default = str(default).lower() if isinstance(default, bool) else default
            fix = f"set it to {shown_default} to train" if default is not None else "remove it to train"
            return f"{key}={shown} is priced by `moetrain plan` only; {why}; {fix}"
    profile = cfg.train.device_profile
    if profile:
        backend = "gpu" if profile.startswith("gpu") else "ascend" if profile.startswith("ascend") else "cpu"
        if backend != cfg.train.device:
            return (f"train.device_profile={profile} is a {backend} part but train.device is {cfg.train.device}: "
                    f"set train.device={backend} on that machine, or leave train.device_profile empty to train here")
    return None


def check_trainable(cfg: Config, source: str = "") -> None:
    """`moetrain train` (and the Trainer) refuse what `trainer_refusal` names, before any work."""
    why = trainer_refusal(cfg)
    if why:
        raise ConfigError(f"{source or cfg.source}: {why}")


def _validate_data(data: DataConfig, source: str) -> None:
    for key in ("path", "eval_path"):
        value = getattr(data, key)
        if data.type != "lm" and not isinstance(value, str):
            raise ConfigError(f"{source}: key 'data.{key}': a blend of datasets needs data.type lm, got {value!r}")
        try:
            parse_blend(value, f"data.{key}")
        except DataError as exc:
            raise ConfigError(f"{source}: {exc}") from None


def _validate_document_layout(cfg: Config, source: str) -> None:
    """data.reset_attention_mask / reset_position_ids add document_ids and position_ids to every LM
    batch: the model must take them (moetrain/modeling.py, "Packed documents")."""
    keys = [key for key in ("reset_attention_mask", "reset_position_ids") if getattr(cfg.data, key)]
    if not keys:
        return
    if cfg.data.type != "lm":
        raise ConfigError(f"{source}: key 'data.{keys[0]}': packed documents exist only in LM data (data.type lm), "
                          f"got data.type {cfg.data.type!r}; set it to false")
    entry = registry.get_model(cfg.model.name)
    taken = inspect.signature(entry.cls.construct).parameters
    if not {"document_ids", "position_ids"} <= set(taken):
        raise ConfigError(f"{source}: key 'data.{keys[0]}': model {cfg.model.name!r} ({entry.cls.__name__}.construct"
                          f"{inspect.signature(entry.cls.construct)}) does not take document_ids and position_ids; "
                          f"set it to false, or give the model those arguments (moetrain/modeling.py, "
                          f"\"Packed documents\")")


# (key, test, what it must be): counts, sizes and rates that have no meaning below their bound
_RANGES = [
    ("train.seed", lambda v: v >= 0, ">= 0"),
    ("train.stop_after", lambda v: v >= 0, ">= 0 (0: run to the end)"),
    ("train.eval_interval", lambda v: v >= 0, ">= 0 (0: evaluate only at the end)"),
    ("train.eval_batch_size", lambda v: v >= 0, ">= 0 (0: train.micro_batch_size)"),
    ("train.eval_max_batches", lambda v: v >= 0, ">= 0 (global batches of samples; 0: the whole evaluation set)"),
    ("train.nonfinite_limit", lambda v: v >= 0, ">= 0"),
    ("train.loss_spike_factor", lambda v: v == 0 or v > 1, "0 (off) or > 1, e.g. 3"),
    ("data.seq_length", lambda v: v >= 0, ">= 0 (0: model.seq_length)"),
    ("parallel.moe_capacity_prior", lambda v: v > 0, "> 0 (the first dispatch capacities, in multiples of the even share)"),
    ("lr_schedule.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("lr_schedule.decay_steps", lambda v: v >= 0, ">= 0 (0: the whole run)"),
    ("lr_schedule.min_lr", lambda v: v >= 0, ">= 0"),
    ("optimizer.weight_decay", lambda v: v >= 0, ">= 0"),
    ("optimizer.eps", lambda v: v > 0, "> 0"),
    ("optimizer.beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optimizer.beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optimizer.momentum", lambda v: v >= 0, ">= 0"),
    ("optimizer.clip_grad_norm", lambda v: v >= 0, ">= 0 (0: no clipping)"),
    ("precision.scale_window", lambda v: v >= 1, ">= 1"),
    ("precision.scale_factor", lambda v: v > 1, "> 1"),
    ("parallel.grad_bucket_mb", lambda v: v > 0, "> 0"),
]


def _check_ranges(cfg: Config, need) -> None:
    for key, ok, bound in _RANGES:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        need(ok(value), key, f"must be {bound}, got {value!r}")
    model_seq = getattr(cfg.model, "seq_length", None)
    if cfg.data.seq_length and model_seq:
        need(cfg.data.seq_length <= model_seq, "data.seq_length",
             f"{cfg.data.seq_length} is longer than 'model.seq_length' ({model_seq}), the longest sequence the "
             f"model's position tables are built for: lower data.seq_length or raise model.seq_length")


def dump_config(cfg: Config, path: str, rank: int = 0) -> None:
    tmp = temp_path(path, rank)       # pid and rank in the name: two writers never share a temporary file
    with open(tmp, "w") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)
    os.replace(tmp, path)


def get_key(cfg: Config, dotted: str):
    node: Any = cfg
    for part in dotted.split("."):
        if not hasattr(node, part):
            raise ConfigError(f"{cfg.source}: unknown key '{dotted}'")
        node = getattr(node, part)
    return node


def main(argv=None) -> int:
    """`python -m moetrain.config CONFIG [--set k=v ...] [--get key]`: validate, print."""
    ap = argparse.ArgumentParser(prog="python -m moetrain.config")
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--get", help="print one resolved key (e.g. train.output_dir)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        if args.get:
            print(get_key(cfg, args.get))
        else:
            yaml.safe_dump(cfg.to_dict(), sys.stdout, sort_keys=False)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
