"""How many query rows `TiledAttention` (moetrain/parallel/context_parallel.py) attends at a time:
pure Python (no MindSpore), so that the cell and the planner (moetrain/planner/context.py) share one
rule.

A step is one tile of query rows against one key chunk of c keys. On the CPU its cost is mostly per
op, not per element (measured, moe_tiny's attention at seq 2048: 64-row steps took 1.5-2.1x the CPU
time of whole-chunk steps, docs/context_parallel.md), so a tile is as large as fits: the whole chunk,
halved while the step's working set, `WORKING_COPIES` fp32 `[lanes, rows, c]` tensors (lanes =
micro-batch x query heads on the rank; the scores, exponentials, probabilities and their gradients
alive at the peak of a step, forward or backward), is over `TILE_BYTES`, but never below
`MIN_TILE_ROWS` (the earlier fixed tile). It depends only on c and the lanes, equal on every cp rank,
so every rank runs the same steps (the load balance)."""
from __future__ import annotations

TILE_BYTES = 8 * 2 ** 20    # bound on one step's working set (one layer, one step at a time)
WORKING_COPIES = 7          # fp32 step-sized tensors live at a step's peak (fitted to the dry run: docs/context_parallel.md)
MIN_TILE_ROWS = 64          # the floor (the fixed tile before): a larger model's steps stay this size


def step_bytes(rows: int, chunk: int, lanes: float) -> float:
    """One step's working set: `WORKING_COPIES` fp32 `[lanes, rows, chunk]` tensors."""
    return WORKING_COPIES * 4 * lanes * rows * chunk


def tile_rows(chunk: int, lanes: float) -> int:
    """The query rows of a tile for chunks of `chunk` rows (and keys) and `lanes` = batch x query
    heads: the chunk, halved (rounding up) while `step_bytes` is over `TILE_BYTES`, at least
    min(chunk, `MIN_TILE_ROWS`)."""
    rows = chunk
    while rows > MIN_TILE_ROWS and step_bytes(rows, chunk, lanes) > TILE_BYTES:
        rows = (rows + 1) // 2
    return max(rows, min(chunk, MIN_TILE_ROWS))
