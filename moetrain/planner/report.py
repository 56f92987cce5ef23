"""The planner's reports: the plan table (`format_plan`, what `moetrain plan` prints) and the layout
search's candidates and why each lost (`format_search`), with the number formats they share."""
from __future__ import annotations

import json
import re
from typing import Dict, List

from moetrain.devices import GiB
from moetrain.layout import RECOMPUTE_MODES
from moetrain.planner import context
from moetrain.planner.arch import DTYPE_BYTES, FP32, OPTIMIZER_FP32_STATES, attention_flops_per_token
from moetrain.planner.costs import MEMORY_SAFETY, PlanResult


def format_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def format_flops(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}FLOP"
    return f"{n:.0f} FLOP"


def format_bytes(n: float) -> str:
    """Fixed-width bytes: GiB, or MiB / KiB for the tiny models."""
    for unit, scale in (("GiB", GiB), ("MiB", 1024 ** 2)):
        if n >= 0.1 * scale or unit == "MiB" and n >= 0.1 * 1024:
            return f"{n / scale:8.2f} {unit}"
    return f"{n / 1024:8.2f} KiB"


def format_plan(result: PlanResult) -> str:
    r, L, a, job, dev = result, result.layout, result.job.arch, result.job, result.device
    p = r.params
    d = DTYPE_BYTES[job.compute_dtype]
    by_mode = r.stages[r.peak_stage].activations_by_recompute
    states = {2: "m+v", 1: "momentum", 0: "no states"}[OPTIMIZER_FP32_STATES[job.optimizer]]
    rule = "-" * 92
    lines = [f"moetrain plan{': ' + r.source if r.source else ''} on {L.world} x {dev.name} ({dev.description})",
             rule,
             f" model        {getattr(job.model, 'name', '?')}: {a.layers} layers, hidden {a.hidden}, {a.heads} heads "
             f"({a.kv_heads} kv, head_dim {a.head_dim}), ffn {a.ffn}, vocab {a.vocab}, seq {job.seq_length}"
             f"{', tied embeddings' if a.tied else ''}"]
    if a.kv_lora_rank:
        lines.append(f"              MLA: q_lora {a.q_lora_rank or 'none'}, kv_lora {a.kv_lora_rank}, q/k head "
                     f"{a.head_dim - a.rope_dim} + rope {a.rope_dim}, v head {a.v_dim}"
                     + (f"; MTP depth {a.mtp_depth} (one MoE block each, after the stack)" if a.mtp_depth else ""))
    if a.moe_layers:
        shared = f", shared ffn {a.shared_ffn}" if a.shared_ffn else ""
        capacity = f", capacity factor {a.capacity_factor:g}" if a.capacity_factor else ", dropless"
        lines.append(f"              MoE: {len(a.moe_layers)} of {a.layers} layers, {a.experts} experts top-{a.top_k}, "
                     f"expert ffn {a.expert_ffn}{shared}{capacity}")
    lines += [
        f" layout       dp {L.dp} x tp {L.tp} x pp {L.pp}" + (f" x cp {L.cp} ({L.cp_comm})" if L.cp > 1 else "")
        + f" = {L.world} devices; ep {L.ep}"
        + (f" ({a.experts // L.ep} experts/device)" if a.moe_layers else "")
        + (f", etp {L.etp} (1/{L.etp} of each expert's ffn)" if L.etp > 1 else "")
        + f"; ZeRO-{L.zero}; recompute {L.recompute}; sequence parallel {'on' if L.sequence_parallel else 'off'}"
        + (f"; {L.schedule}" if L.pp > 1 else ""),
        f" batch        {job.global_batch_size} sequences x {job.seq_length} = {r.tokens_per_step:,} tokens/step; "
        f"{L.num_micro_batches} micro-batch(es) of {L.micro_batch_size} per dp rank"
        + (f", {job.seq_length // L.cp} tokens of each sequence per cp rank" if L.cp > 1 else "") + f"; {job.compute_dtype} compute",
        rule,
        f" parameters   total {format_count(p.total)} ({p.total:,}; trainable {p.trainable:,}); active per token "
        f"{format_count(p.active)} ({p.active / p.total:.1%}); per device {format_count(r.stages[r.peak_stage].params)}",
        f" FLOPs/token  {format_flops(r.model_flops_per_token)} = 6 x {format_count(p.matmul_active)} active matmul params "
        f"+ 6 (L{' + MTP' if a.mtp_depth else ''}) a (d_qk + d_v) S = {format_flops(attention_flops_per_token(a, job.seq_length))}; "
        f"with recompute "
        f"{format_flops(r.hardware_flops_per_token)}",
        rule,
        f" memory per device, stage {r.peak_stage} of {L.pp} (the most loaded)",
        (f"   weights ({job.param_dtype}{' + fp8 copies' if job.fp8_recipe != 'none' else ''}; Megatron recipe)"
         if job.megatron_memory else
         f"   weights (fp32{', cast to ' + job.compute_dtype + ' per matmul' if d < FP32 else ''})").ljust(56)
        + format_bytes(r.memory["weights"]),
        f"   gradients ({job.grad_dtype if job.megatron_memory else 'fp32'} buffers{', ZeRO-2' if L.zero >= 2 else ''}; "
        f"{job.grad_dtype} on the wire)".ljust(56)
        + format_bytes(r.memory["gradients"]),
        (f"   optimizer ({job.optimizer}: {job.moment_dtype} {states} + fp32 master, ZeRO-{L.zero})"
         if job.megatron_memory else
         f"   optimizer ({job.optimizer}: fp32 {states}{' + master' if L.zero >= 1 else ''}, ZeRO-{L.zero})").ljust(56)
        + format_bytes(r.memory["optimizer"]),
        f"   activations (recompute {L.recompute})".ljust(56) + format_bytes(r.memory["activations"])
        + "    [" + ", ".join(f"{mode} {format_bytes(by_mode[mode]).strip()}" for mode in RECOMPUTE_MODES) + "]",
        *([f"     of which {r.stages[r.peak_stage].in_flight} pipeline input(s) in flight".ljust(56)
           + format_bytes(r.stages[r.peak_stage].in_flight_bytes)] if L.pp > 1 else []),
        *([f"     of which per-parameter gradients before packing".ljust(56)
           + format_bytes(r.stages[r.peak_stage].unpacked_gradients)] if r.stages[r.peak_stage].unpacked_gradients else []),
        f"   runtime (framework, workspace)".ljust(56) + format_bytes(r.memory["runtime"]),
        f"   total".ljust(56) + format_bytes(r.total_memory)
        + f"    of {r.capacity_bytes / GiB:.2f} GiB: {'FITS' if r.fits else 'DOES NOT FIT'} (usable "
        f"{r.usable_bytes / GiB:.2f} GiB = {MEMORY_SAFETY:.0%} of what the runtime leaves)",
        rule,
        f" communication per step per device".ljust(56) + "  volume        time   link",
    ]
    names = {"dp": f"dp gradients ({'all-reduce' if L.zero == 0 else 'ZeRO reduce-scatter + all-gather'})",
             "tp": "tp all-reduces", "sp": "sp all-gather / reduce-scatter", "pp": "pp activations p2p",
             "ep": "ep all-to-all (dispatch + combine)", "cp": context.describe_traffic(L)}
    spans = {"dp": L.tp * context.replicas(L), "tp": L.tp, "sp": L.tp, "pp": L.world,
             "ep": L.etp * L.ep if L.expert_folded else L.tp * L.ep, "cp": context.span(L)}
    for dim in ("dp", "tp", "sp", "pp", "ep") + (("cp",) if L.cp > 1 else ()):
        volume = r.comm_bytes[dim]
        link = "intra-node" if spans[dim] <= dev.devices_per_node else "inter-node"
        lines.append(f"   {names[dim]}".ljust(56) + (f"{format_bytes(volume)} {r.comm_seconds[dim]:9.3f} s   {link}"
                                                         if volume else "       -"))
    lines += [
        rule,
        f" step time    {r.step_seconds:.3f} s = compute {r.compute_seconds:.3f} s + pipeline "
        f"bubble {r.bubble_seconds:.3f} s + exposed communication {r.exposed_comm_seconds:.3f} s",
        *([f" pipeline     {L.schedule}" + (f", {L.chunks} model chunks per stage" if L.chunks > 1 else "")
           + f": bubble {r.bubble_fraction:.1%} of the busiest stage's time at this runtime's pass costs; inputs in "
           f"flight per stage {[st.in_flight for st in r.stages]}"] if L.pp > 1 else []),
        f" throughput   {r.tokens_per_second:,.0f} tokens/s ({r.tokens_per_second / L.world:,.0f} per device); "
        f"MFU {r.mfu:.1%} " + (
            f"(cost model: {dev.sustained(job.compute_dtype) / 1e12:g} TFLOP/s sustained, measured; peak "
            f"{dev.peak(job.compute_dtype) / 1e12:.3g} TFLOP/s measured on this host)" if dev.measured_peak else
            f"(cost model: moetrain/planner/constants.py COST_MODEL on {dev.peak(job.compute_dtype) / 1e12:g} TFLOP/s"
            + (f", fp8 GEMMs at {dev.peak('float8') / 1e12:g}" if job.fp8_recipe != "none" and "float8" in dev.peak_flops
               else "") + ")" if dev.calibrated else
            f"(cost model: {dev.compute_efficiency:.0%} of {dev.peak(job.compute_dtype) / 1e12:g} TFLOP/s sustained)"),
    ]
    detail = r.stages[r.peak_stage].ep_detail
    if detail:
        lines.insert(-1, f" expert a2a   {detail['nodes']} node(s) per ep group; a token reaches at most "
                         f"{detail['max_nodes_per_token']} (node-limited), {detail['remote_nodes_per_token']:.2f} "
                         f"remote on average, sent once each; NVLink {detail['nvlink_seconds'] * L.num_micro_batches:.2f} s, "
                         f"network {detail['network_seconds'] * L.num_micro_batches:.2f} s a step; "
                         f"{job.moe_overlap} hides {r.stages[r.peak_stage].ep_hidden_seconds:.2f} s")
    lines += [f" note         {note}" for note in r.notes]
    return "\n".join(lines)


def format_search(search, show: int = 8) -> str:
    """`search` (a `LayoutSearch`): the chosen layout, then up to `show` candidates of each status."""
    chosen = search.chosen
    lines = [f"layout search: {len(search.candidates)} candidates on {search.world_size} x {search.device.name}",
             f"  chosen       {chosen.layout.describe()}: {chosen.tokens_per_second:,.0f} tokens/s, "
             f"MFU {chosen.mfu:.1%}, {chosen.total_memory / GiB:.2f} GiB of {chosen.capacity_bytes / GiB:.2f}"]
    if search.options:
        job = chosen.job
        lines[1] += f"; overlap={job.moe_overlap} fp8={job.fp8_recipe}"
        lines.insert(1, "  searched     the layout and the priced options (moe_overlap, fp8_recipe, experts folded over "
                        "tp x dp)" + (f"; held at the config's: {', '.join(search.kept)}" if search.kept else ""))
        if search.own is not None:
            rank, own = search.rank_of_own(), search.own
            fitting = len(search.ranking())
            lines.append(f"  config's     {own.layout.describe()} overlap={own.job.moe_overlap} fp8={own.job.fp8_recipe}: "
                         + (f"rank {rank} of {fitting} that fit, {own.tokens_per_second:,.0f} tokens/s"
                            + (f" ({own.tokens_per_second / chosen.tokens_per_second:.1%} of the chosen)" if rank > 1
                               else "") if rank else f"does not fit ({own.total_memory / GiB:.2f} GiB)"))
            layouts = search.best_per_layout()
            at = search.layout_rank_of_own()
            if at:
                best = layouts[at - 1]
                why = []
                if best.job.fp8_recipe != own.job.fp8_recipe:
                    why.append(f"fp8_recipe {best.job.fp8_recipe} (GEMMs at the fp8 peak)")
                if best.job.moe_overlap != own.job.moe_overlap:
                    why.append(f"moe_overlap {best.job.moe_overlap} (the expert all-to-all hidden under compute)")
                lines.append(f"  its layout   rank {at} of {len(layouts)} layouts that fit"
                             + (f"; with {' and '.join(why)} it is predicted {best.tokens_per_second / own.tokens_per_second - 1:+.1%}"
                                if why else " with its own options"))
        lines.append("  top layouts  " + " | ".join(
            f"{r.layout.describe()} overlap={r.job.moe_overlap} fp8={r.job.fp8_recipe}: {r.tokens_per_second:,.0f}"
            for r in search.best_per_layout()[:3]))
    for status in ("slower", "does not fit", "invalid"):
        group = search.with_status(status)
        if status == "slower":
            group.sort(key=lambda c: -c.result.tokens_per_second)
        elif status == "does not fit":
            group.sort(key=lambda c: c.result.total_memory)
        lines.append(f"  {status}: {len(group)}")
        if status == "invalid":       # one line per kind of reason (numbers aside), with an example
            by_kind: Dict[str, List[str]] = {}
            for c in group:
                for reason in c.problems:
                    by_kind.setdefault(re.sub(r"\d+", "#", reason), []).append(reason)
            for reasons in sorted(by_kind.values(), key=len, reverse=True)[:show]:
                text = reasons[0] if len(reasons[0]) <= 120 else reasons[0][:117] + "..."
                lines.append(f"    {len(reasons):5d} x {text}")
            continue
        for c in group[:show]:
            described = c.layout.describe()
            if search.options and c.result is not None:
                described += f" overlap={c.result.job.moe_overlap} fp8={c.result.job.fp8_recipe}"
            lines.append(f"    {described:<58} {c.reason}")
        if len(group) > show:
            lines.append(f"    ... {len(group) - show} more")
    return "\n".join(lines)


def plan_json(result: PlanResult) -> str:
    """`moetrain plan CONFIG --json`: one JSON object whose keys are stable (docs/plan.md,
    "Published runs"): throughput, model TFLOP/s and MFU per device, the step's parts, memory,
    communication and the priced options."""
    r, L, dev, job = result, result.layout, result.device, result.job
    stage = r.stages[r.peak_stage]
    return json.dumps({
        "config": r.source, "device": dev.name, "world": L.world, "layout": L.describe(),
        "tokens_per_step": r.tokens_per_step, "step_seconds": r.step_seconds,
        "tokens_per_s": r.tokens_per_second, "tokens_per_s_per_device": r.tokens_per_second / L.world,
        "model_flops_per_token": r.model_flops_per_token,
        "model_tflops_per_device": r.model_flops_per_token * r.tokens_per_second / L.world / 1e12,
        "mfu": r.mfu, "compute_seconds": r.compute_seconds, "bubble_seconds": r.bubble_seconds,
        "exposed_comm_seconds": r.exposed_comm_seconds, "comm_seconds": r.comm_seconds, "comm_bytes": r.comm_bytes,
        "ep_hidden_seconds": stage.ep_hidden_seconds, "expert_all_to_all": stage.ep_detail,
        "memory": r.memory, "total_memory": r.total_memory, "usable_bytes": r.usable_bytes, "fits": r.fits,
        "options": {"fp8_recipe": job.fp8_recipe, "moe_overlap": job.moe_overlap,
                    "pipeline_backward": job.pipeline_backward,
                    "recompute_modules": list(job.recompute_modules) if job.recompute_modules is not None else None},
    })