"""What a model family declares, in one place: its config and model classes, how it is split (the
tensor/sequence-parallel plan and recompute policies), the sizes a layout must divide, the planner's
shape numbers and its Hugging Face format.

A family's folder (`models/<family>/`, or a user's module named by the config key `model_module`)
builds one `Family` and registers it (`moetrain.registry.register_family`). The framework reads the
spec (`family_of`) and keeps no table keyed by family name. Pure declarations (numpy, no MindSpore),
so every layer may read them; `moetrain.parallel.tensor_parallel` applies the styles.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Container, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np


# ---------------------------------------------------------------------------------------------
# Tensor-parallel styles: what a plan entry does to the module it names (torchtitan's ParallelStyle).
# A plan is {module path pattern: style or tuple of styles}; `*` stands for one path component.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColwiseParallel:
    """Linear -> ColumnParallelLinear whose input the parent module already brought into the region."""


@dataclass(frozen=True)
class RowwiseParallel:
    """Linear -> RowParallelLinear; `sequence=False` keeps the plain all-reduce under SP (a region
    nested in a whole-sequence module, e.g. shared experts inside the MoE layer)."""
    sequence: bool = True


@dataclass(frozen=True)
class VocabParallel:
    """Embedding -> VocabParallelEmbedding; CrossEntropy -> VocabParallelCrossEntropy."""


@dataclass(frozen=True)
class RegionInput:
    """The module's input enters the region (torchtitan's PrepareModuleInput)."""
    sequence: bool = True


@dataclass(frozen=True)
class RegionOutput:
    """The module's output enters the region (torchtitan's PrepareModuleOutput)."""


@dataclass(frozen=True)
class SequenceParallel:
    """A module of the residual stream (a norm): with SP it runs on this rank's sequence chunk and
    its parameters get their gradients summed over tp; without SP it is simply replicated."""


@dataclass(frozen=True)
class HeadShared:
    """A module kept whole inside a tensor-parallel region whose output feeds only this rank's heads
    (MLA's latent projections and norms, per-head q/k norms): its gradient is summed over tp."""


@dataclass(frozen=True)
class WholeSequence:
    """Replicated over tp; with SP it gathers the whole sequence first (the MoE layer)."""


Style = Union[ColwiseParallel, RowwiseParallel, VocabParallel, RegionInput, RegionOutput, SequenceParallel,
              HeadShared, WholeSequence]


# ---------------------------------------------------------------------------------------------
# Hugging Face tensors: one table of (moetrain names <-> HF names, conversion both ways) per model
# ---------------------------------------------------------------------------------------------
@dataclass
class TensorMap:
    """`ours` tensors <-> `theirs` tensors; `to_ours(*theirs) -> tuple(ours)`, `to_theirs(*ours) -> tuple(theirs)`.

    `parts`: optionally the same import as smaller maps of disjoint `ours` (each reading only its own
    HF tensors), so that hf-import, which streams one map at a time, holds one of them and not the
    whole group (the per-expert gate, up and down banks of a layer are three parts)."""
    ours: Tuple[str, ...]
    theirs: Tuple[str, ...]
    to_ours: Callable = lambda *arrays: arrays
    to_theirs: Callable = lambda *arrays: arrays
    parts: Tuple["TensorMap", ...] = ()

    def import_parts(self) -> Tuple["TensorMap", ...]:
        return self.parts or (self,)


def rename(ours: str, theirs: str) -> TensorMap:
    """One tensor under another name, unchanged."""
    return TensorMap((ours,), (theirs,))


def experts_per_expert(ours: str, theirs: str, num_experts: int, names: Tuple[str, str, str]) -> TensorMap:
    """`w_gate, w_up [E, H, F]`, `w_down [E, F, H]` <-> `{theirs}{j}.{gate,up,down name}.weight` `[out, in]`."""
    hf_names = tuple(f"{theirs}{j}.{name}.weight" for name in names for j in range(num_experts))

    def to_ours(*arrays):
        return tuple(np.stack([a.T for a in arrays[k * num_experts:(k + 1) * num_experts]]) for k in range(3))

    def to_theirs(*stacked):
        return tuple(w[j].T for w in stacked for j in range(num_experts))

    def bank(*arrays):
        return (np.stack([a.T for a in arrays]),)

    ours_names = tuple(f"{ours}{n}" for n in ("w_gate", "w_up", "w_down"))
    parts = tuple(TensorMap((ours_names[k],), hf_names[k * num_experts:(k + 1) * num_experts], bank)
                  for k in range(3))
    return TensorMap(ours_names, hf_names, to_ours, to_theirs, parts)


def experts_fused(ours: str, theirs: str, ffn: int) -> TensorMap:
    """`w_gate, w_up, w_down` <-> `gate_up_proj [E, 2F, H]` (gate rows first), `down_proj [E, H, F]`."""
    def to_ours(gate_up, down):
        return gate_up[:, :ffn].transpose(0, 2, 1), gate_up[:, ffn:].transpose(0, 2, 1), down.transpose(0, 2, 1)

    def to_theirs(w_gate, w_up, w_down):
        return np.concatenate([w_gate.transpose(0, 2, 1), w_up.transpose(0, 2, 1)], axis=1), w_down.transpose(0, 2, 1)

    names = tuple(f"{ours}{n}" for n in ("w_gate", "w_up", "w_down"))
    parts = (TensorMap(names[:2], (f"{theirs}gate_up_proj",),
                       lambda gate_up: (gate_up[:, :ffn].transpose(0, 2, 1), gate_up[:, ffn:].transpose(0, 2, 1))),
             TensorMap(names[2:], (f"{theirs}down_proj",), lambda down: (down.transpose(0, 2, 1),)))
    return TensorMap(names, (f"{theirs}gate_up_proj", f"{theirs}down_proj"), to_ours, to_theirs, parts)


def unbiased_routing(ours: str, num_experts: int, family: str) -> TensorMap:
    """`expert_bias` of a format whose routing has none: zeros on import, must be zero on export."""
    def to_theirs(bias):
        if np.any(bias != 0):
            raise ValueError(f"{ours} is non-zero (aux-loss-free balancing): {family} routing has no expert "
                             f"bias, so the exported model would choose different experts")
        return ()

    return TensorMap((ours,), (), lambda: (np.zeros(num_experts, np.float32),), to_theirs)


@dataclass(frozen=True)
class HFFormat:
    """A family's Hugging Face format, both ways (`moetrain/checkpoint/hf.py` drives it).

    `model_types`: the config.json `model_type`s import reads as this family. `to_model(hf)`:
    config.json -> the complete `model:` section (a ValueError starting "config.json: " for what it
    cannot express). `to_hf(cfg)`: the built model config -> config.json. `tensor_maps(model,
    fused_layers)` -> `(maps, copies)`: every moetrain tensor's HF counterpart for the `model:` section,
    and HF tensors that duplicate one of ours (HF name -> ours; export writes them, import checks
    them); `fused_layers(hf_layer_prefix)` says which layers hold routed experts in the fused layout.
    `import_copies(model)`: more copies import accepts but export does not write (a tied head some
    writers keep). `copy_reason(hf_name)`: why moetrain shares such a tensor, for the error.
    `missing_layers(model, hf_names)`: the layers config.json describes that the checkpoint lacks, as
    a `MissingLayers` (None: nothing missing, or nothing the family can leave out)."""
    model_types: Tuple[str, ...]
    to_model: Callable[[Dict[str, Any]], Dict[str, Any]]
    to_hf: Callable[[Any], Dict[str, Any]]
    tensor_maps: Callable[..., Tuple[List[TensorMap], Dict[str, str]]]
    import_copies: Callable[[Dict[str, Any]], Dict[str, str]] = lambda model: {}
    copy_reason: Callable[[str], str] = lambda name: "the checkpoint repeats a tensor moetrain keeps once"
    missing_layers: Callable[[Dict[str, Any], Container[str]], Optional["MissingLayers"]] = lambda model, names: None


@dataclass(frozen=True)
class MissingLayers:
    """Optional layers a checkpoint's config.json describes but its tensors lack (DeepSeek-V3's MTP
    layers: transformers' `save_pretrained` writes none). Import leaves them out (`held`: the `model:`
    section of what the checkpoint holds) or initialises them fresh (`prefixes`: the moetrain tensor
    names of the missing layers start with one of them). `what`: the one line import prints says it."""
    held: Dict[str, Any]
    prefixes: Tuple[str, ...]
    what: str


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """Everything the framework knows about one model family.

    * `config`, `model`: the dataclass of the `model:` keys and the `nn.Cell` built as `model(cfg)`;
      the model class also carries the pipeline pieces and the generation cache (`moetrain/modeling.py`,
      `new_cache` / `decode`), which need no declaration here;
    * `tp_plan`: {module path pattern: style(s)} for tensor + sequence parallelism (None: no tp);
    * `recompute`: {policy ("full", "selective"): module path patterns};
    * `shape(cfg)`: the `moetrain.layout.ModelShape` a layout must divide (None: nothing to split);
    * `arch(cfg)`: the planner's shape numbers, the fields of `moetrain.planner.arch.Arch` (None: the
      planner cannot model it);
    * `hf`: the Hugging Face format (None: no interchange);
    * `upcycle`: dense -> MoE upcycling (`moetrain convert upcycle`), None: not offered."""
    name: str
    config: type
    model: type
    tp_plan: Optional[Mapping[str, Union[Style, Tuple[Style, ...]]]] = None
    recompute: Mapping[str, Sequence[str]] = field(default_factory=dict)
    shape: Optional[Callable[[Any], Any]] = None
    arch: Optional[Callable[[Any], Dict[str, Any]]] = None
    hf: Optional[HFFormat] = None
    upcycle: Optional["Upcycling"] = None


@dataclass(frozen=True)
class Upcycling:
    """How a dense family becomes a MoE one with the same forward: `section(dense model dict,
    num_experts, top_k, granularity)` -> the MoE `model:` dict; `state(dense tensors, moe model dict,
    num_experts, granularity, seed)` -> the MoE tensors."""
    section: Callable[..., Dict[str, Any]]
    state: Callable[..., Dict[str, np.ndarray]]


FAMILY_ATTRIBUTE = "moetrain_family"   # set on the registered config and model classes


def family_of(obj) -> Optional[Family]:
    """The family of a model config or model (instance or class) registered with
    `moetrain.registry.register_family`; None for anything else (a subclass registered under no
    name of its own included)."""
    cls = obj if isinstance(obj, type) else type(obj)
    spec = cls.__dict__.get(FAMILY_ATTRIBUTE)
    return spec if isinstance(spec, Family) else None
