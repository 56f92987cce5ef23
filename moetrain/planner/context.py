"""Context parallelism's terms in the cost model (`parallel.context_parallel: cp`,
docs/context_parallel.md "Planner"), kept apart from costs.py, which calls them in a few places:

    local_tokens(L, tokens)          each rank holds 1/cp of a micro-batch's tokens: activations,
                                     matmul and attention work, the MoE rows all scale by 1/cp
    replicas(L)                      dense-weight replicas, dp x cp: ZeRO shards and the gradient
                                     all-reduce span them (Megatron-Core's dp group "with cp")
    add_held_kv(...)                 what the split attention keeps per layer beside the local
                                     activations: the other ranks' K|V blocks (all_gather, MLA's ring;
                                     the ring keeps none) and the blockwise path's merged output and
                                     log-sum-exp (all_gather / p2p; it keeps no probabilities: each step
                                     recomputes them in its backward); Ulysses' replicated K/V heads
                                     when n_kv / tp < cp; the running layer's transients
    traffic_per_micro_batch(...)     bytes the cp group moves per device and micro-batch
    span(L)                          ranks one cp group spans (link placement: tp innermost)

Attention work per token stays that of the whole sequence (2 S a (d_qk + d_v)): the load-balanced
chunks give every rank the same share of the causal pairs. Traffic, per layer and pass (forward,
backward; + one forward under full recompute), with K|V the keys and values of the local tokens:

    all_gather, p2p (ring)   (cp - 1) x K|V_local = (cp - 1) / cp of the sequence's K|V
                             (the backward sends dK|dV back the same way), i.e. Megatron's ring
                             2 (cp - 1) / cp of the KV per layer per pass counted as K and V of
                             one head group each; the ring's backward (`RingAttention`, as
                             Megatron's) sends K|V round again beside the dK|dV sums: twice the
                             forward's bytes; MLA (all_gather, p2p): its compressed latent and
                             shared RoPE key instead (fp32, kv_lora_rank + rope_dim a token), once
                             each way
    a2a (Ulysses)            four all-to-alls (q, k, v, o), each (cp - 1) / cp of its local tensor
                             (k and v of max(n_kv / tp, cp) heads: fewer are replicated first)

On the CPU the collectives are derived from AllReduce (moetrain/distributed/comm.py): the all-gather
moves 2x, an all-to-all 2 cp x, a ring step (AlltoAllV over a [cp, cp, block] buffer) 2 cp x of the
native bytes. Overlap assumption: none. moetrain runs the ring's steps in the order the graph gives
them (no double buffering), so the cp traffic is costed on the critical path like tp's; Megatron
overlaps each step with the block before, which this model does not credit.
"""
from __future__ import annotations

from moetrain.layout import Layout, ulysses_degrees
from moetrain.parallel.tiling import step_bytes, tile_rows

OVERLAP = 0.0        # fraction of the cp traffic hidden behind the attention blocks (none: see above)


def local_tokens(L: Layout, tokens: int) -> int:
    """Tokens of one micro-batch that one rank holds."""
    return tokens // L.cp


def replicas(L: Layout) -> int:
    """Ranks holding the same dense weights: dp x cp (ZeRO and the gradient sync span them)."""
    return L.dp * L.cp


def span(L: Layout) -> int:
    """Consecutive ranks a cp group spans (rank order tp-cp-dp-pp)."""
    return L.tp * L.cp


def kv_bytes_per_token(arch, dtype_bytes: int, tp: int) -> float:
    """K and V of one token as attention receives them on one tp rank (MLA: expanded per head, as
    its `attend` gets them)."""
    kv_heads = arch.heads if arch.kv_lora_rank else arch.kv_heads
    return dtype_bytes * kv_heads * (arch.head_dim + arch.v_dim) / tp


def crossing_bytes_per_token(arch, L: Layout, dtype_bytes: int) -> float:
    """What crosses the split per token and tp rank: MLA under all_gather or p2p sends its normed
    latent and rotated shared key (fp32: kv_lora_rank + rope_dim values, whole on every tp rank) and
    expands them after; everything else its K|V (`kv_bytes_per_token`)."""
    if arch.kv_lora_rank and L.cp_comm in ("all_gather", "p2p"):
        return 4 * (arch.kv_lora_rank + arch.rope_dim)
    return kv_bytes_per_token(arch, dtype_bytes, L.tp)


def ulysses_kv_heads(arch, L: Layout) -> float:
    """K/V heads one tp rank sends through Ulysses' all-to-all: its n_kv / tp, or cp when it has fewer
    (each replicated cp / n_kv times, so every rank gets the one its query heads read)."""
    kv_heads = (arch.heads if arch.kv_lora_rank else arch.kv_heads) / L.tp
    return max(kv_heads, L.cp)


def held_kv_bytes(arch, L: Layout, tokens: int, dtype_bytes: int) -> float:
    """Bytes one layer keeps for backward beyond the local activations: the K|V of the other cp - 1
    ranks (all_gather gathers them; MLA's all_gather and ring expand the gathered latent into the same
    K|V, kept alike; the ring of K|V keeps none, `ring_in_cell`); Ulysses keeps the whole sequence of
    1/cp of the heads, the local tensors' size (counted already), plus, with fewer K/V heads than
    ranks, its replicas: one whole K/V head a rank against the n_kv / cp counted."""
    if L.cp == 1:
        return 0.0
    if L.cp_comm == "a2a":
        kv_heads = (arch.heads if arch.kv_lora_rank else arch.kv_heads) / L.tp
        extra = ulysses_kv_heads(arch, L) - kv_heads
        return tokens * dtype_bytes * extra * (arch.head_dim + arch.v_dim)
    if ring_in_cell(arch, L):                  # the ring's backward passes the blocks round again
        return 0.0
    return (L.cp - 1) * tokens * kv_bytes_per_token(arch, dtype_bytes, L.tp)


def ring_in_cell(arch, L: Layout) -> bool:
    """p2p as Megatron-Core runs it (`RingAttention`): the blocks pass round inside one cell, whose
    backward keeps only the local K|V and passes them round again with the dK|dV sums. MLA's ring
    still passes its compressed keys to every rank and expands them there (kept: `held_kv_bytes`)."""
    return L.cp > 1 and L.cp_comm == "p2p" and not arch.kv_lora_rank


RING_BLOCKS = 4      # local K|V-sized fp32 tensors the ring's layer holds at once (see ring_working_bytes)


def ring_working_bytes(arch, L: Layout, tokens: int) -> float:
    """The transient of the layer whose ring attention runs: about `RING_BLOCKS` fp32 tensors of the
    local K|V's size (the K|V in hand and the next, the dK|dV sums held and arriving; one layer's ring
    under ms.jit measured 2.0-6.3 of them with q, dq and the output, docs/context_parallel.md), beside
    one step's working set."""
    if not ring_in_cell(arch, L):
        return 0.0
    return RING_BLOCKS * tokens * kv_bytes_per_token(arch, 4, L.tp)




def block_output_bytes(arch, L: Layout, tokens: int) -> float:
    """What the blockwise attention (all_gather / p2p) of one layer keeps for its backward beside
    q, k, v and the layer's output: its one `TiledAttention` cell's merged output (fp32) and
    log-sum-exp (fp64) of the l local rows, `[l, heads, dv]` and `[l, heads]`: O(S/cp·dv), no
    probabilities and no per-block outputs (each step recomputes them in the backward)."""
    if L.cp == 1 or L.cp_comm == "a2a":
        return 0.0
    return tokens * arch.heads / L.tp * (4 * arch.v_dim + 8)


def block_working_bytes(arch, L: Layout, tokens: int, micro_batch_size: int) -> float:
    """The transient of the layer whose blockwise attention runs (forward or backward): one step's
    working set (`tiling.step_bytes`: its scores, exponentials, probabilities and their gradients; a
    step is a tile of `tiling.tile_rows` rows against one key chunk, c = S / (2 cp) = l / 2 keys),
    one layer and one step at a time."""
    if L.cp == 1 or L.cp_comm == "a2a":
        return 0.0
    chunk = tokens // micro_batch_size // 2
    lanes = micro_batch_size * arch.heads / L.tp
    return step_bytes(tile_rows(chunk, lanes), chunk, lanes)


def add_held_kv(by_mode, arch, L: Layout, tokens: int, dtype_bytes: int, layers: int) -> dict:
    """`by_mode` (activations per recompute mode) with what the split attention holds per layer: the
    other ranks' K|V and the blockwise path's merged output and log-sum-exp (no probabilities:
    `activation_bytes` counts none for it), and the one layer's tile transient. Under full recompute
    only the layer being recomputed holds them."""
    held = held_kv_bytes(arch, L, tokens, dtype_bytes) + block_output_bytes(arch, L, tokens)
    working = block_working_bytes(arch, L, tokens, L.micro_batch_size) + ring_working_bytes(arch, L, tokens)
    return {mode: value + held * (1 if mode == "full" else layers) + working for mode, value in by_mode.items()}


def traffic_per_micro_batch(arch, L: Layout, tokens: int, dtype_bytes: int, layers: int,
                            emulated: bool) -> float:
    """Bytes one device sends over the cp group per micro-batch (`tokens`: its local tokens)."""
    if L.cp == 1 or not layers:
        return 0.0
    passes = 2 + (L.recompute == "full")
    if L.cp_comm == "a2a":
        q = arch.heads * arch.head_dim
        o = arch.heads * arch.v_dim
        kv = ulysses_kv_heads(arch, L) * L.tp * (arch.head_dim + arch.v_dim)      # replicas included
        per_pass = (L.cp - 1) / L.cp * tokens * dtype_bytes * (q + kv + o) / L.tp
        factor = 2 * L.cp if emulated else 1
    else:
        per_pass = (L.cp - 1) * tokens * crossing_bytes_per_token(arch, L, dtype_bytes)
        factor = (2 if L.cp_comm == "all_gather" else 2 * L.cp) if emulated else 1
        if ring_in_cell(arch, L):   # the backward passes K|V round again beside the dK|dV sums
            passes += 1
    return layers * passes * per_pass * factor * (1 - OVERLAP)


def describe_traffic(L: Layout) -> str:
    """The report's name for the cp traffic."""
    what = {"a2a": "Ulysses all-to-all of q, k, v, o", "p2p": "ring K|V p2p", "all_gather": "K|V all-gather"}
    return f"cp {what.get(L.cp_comm, L.cp_comm)} (not overlapped)"


def search_degrees(job, ranks: int):
    """`(cp, cp_comm)` pairs the layout search tries on `ranks` = world / (tp x pp) devices: cp 1, and
    each cp > 1 dividing them that cuts the sequence into 2 cp equal chunks, with the K|V all-gather
    (the ring moves the same bytes natively and holds the same blocks, more bytes on the CPU) and,
    where the heads allow it (`layout.ulysses_degrees`), Ulysses (a2a)."""
    arch, seq = job.arch, job.seq_length
    tried = [(1, "all_gather")]
    for cp in range(2, ranks + 1):
        if ranks % cp or seq % (2 * cp):
            continue
        tried.append((cp, "all_gather"))
        kv_heads = arch.heads if arch.kv_lora_rank else arch.kv_heads
        if cp in ulysses_degrees(arch.heads, kv_heads):
            tried.append((cp, "a2a"))
    return tried
