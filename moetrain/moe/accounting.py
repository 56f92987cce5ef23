"""The dispatch invariant: every row routed to an expert is computed once or counted as dropped.

Each MoE layer reports, per rank, `dispatch_rows = [dispatched, computed, dropped, gemm_rows]`: the
assignment rows this rank sent into dispatch, the real rows (padding excluded) its experts computed,
the rows it dropped for lack of capacity, and the rows its expert GEMMs ran (padding included).
Within an expert-parallel group every dispatched row lands on exactly one rank, so summed over the world `dispatched == computed + dropped` for every layer, in
every layout (ranks that repeat a stage's values, as pipeline ranks do after their stats are
all-reduced, repeat both sides). Dropless mode drops nothing, so there computed equals routed.

The trainer checks this after every step, before the optimizer applies it, and after evaluation:
the terms are statistics of the step already, and the check is one small host all-reduce.

The same sums give `expert_rows` for `metrics.jsonl` on every layout (`expert_rows_per_copy`): ranks
that repeat a row (tensor-parallel peers that dispatch the same tokens, expert-tensor-parallel peers
that compute the same rows, pipeline ranks after the stats' all-reduce) repeat its dispatch too, so
the GEMM rows over the world divided by that repetition are the rows one copy of the model computed.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

KEY = "dispatch_rows"
LOAD_KEY = "dispatch_load"   # per layer, the rows each expert was sent (sizes the buffers; not logged)


class DispatchInvariantError(RuntimeError):
    """MoE dispatch lost (or invented) rows: the outputs of the step are wrong."""


def check_dispatch_rows(rows: np.ndarray, where: str, layout: str, capacities: Optional[object]) -> None:
    """Raises DispatchInvariantError unless `rows [layers, 4]` (dispatched, computed, dropped, GEMM
    rows; summed over the world) balance for every layer: dispatched == computed + dropped. `where` ("step 12", "evaluation at step 12"), `layout`
    and `capacities` (the dispatch buffers' sizes in force, None for the static bound) go into the
    message."""
    rows = np.asarray(rows, np.float64).reshape(-1, 4)
    for layer, (dispatched, computed, dropped, _) in enumerate(rows):
        if dispatched != computed + dropped:
            lost = dispatched - computed - dropped
            raise DispatchInvariantError(
                f"dispatch invariant broken at {where}: MoE layer {layer} dispatched {dispatched:.0f} rows, its experts "
                f"computed {computed:.0f} and dropped {dropped:.0f} ({lost:+.0f} rows unaccounted; summed over the "
                f"ranks of layout {layout}); dispatch capacities in force: "
                f"{'the static bound' if capacities is None else capacities}. The step's outputs are wrong, so it "
                f"was not applied. This is a moetrain bug: please report this message")


def expert_rows_per_copy(rows: np.ndarray, routed: float) -> float:
    """The expert GEMM rows of one copy of the model, from `rows [layers, 4]` summed over the world and
    the step's `routed` assignments (one copy's): the world's GEMM rows divided by how many times the
    world dispatched each routed row."""
    rows = np.asarray(rows, np.float64).reshape(-1, 4)
    copies = round(rows[:, 0].sum() / routed) if routed else 0
    return float(rows[:, 3].sum() / copies) if copies else 0.0
