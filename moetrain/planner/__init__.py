"""`moetrain plan`: what a training layout costs, before any device is touched, and the layout search.

    result = plan(cfg, world_size=8, device="ascend910b")   # PlanResult: params, FLOPs, memory, comm, time
    print(format_plan(result))
    layout, search = choose_layout(cfg, world_size=8)       # the fastest layout that fits (parallel.mode: auto)

Closed-form arithmetic on the config (docs/plan.md has every formula and its source), in layers:
`arch` (the model's shape, the job, parameter and FLOP counts) < `schedule` (pipeline walks) <
`costs` (memory, communication, step time per stage) < `report` (tables) < `search` (layouts,
`plan`) < `cli` (`moetrain plan`); `dryrun` (`--dry-run`) builds one rank and measures it, the only
part that imports MindSpore. This package's namespace re-exports the public names of all but `dryrun`.
"""
from moetrain.planner.arch import (DISPATCH_ROW_MARGIN, DTYPE_BYTES, FP32, OPTIMIZER_FP32_STATES, Arch, Job,
                                   ParamCount, apply_layout, attention_flops_per_token, count_parameters,
                                   flops_per_token, parameter_counts, plan_problems, validate_plan)
from moetrain.planner.cli import (CPU_CONFIG, device_available, explain_cannot_run_here, load_plan_config,
                                  main)
from moetrain.planner.costs import (MEMORY_SAFETY, PlanResult, StageCost, activation_bytes, dispatch_bytes,
                                    plan_layout, plan_valid_layout, stage_cost)
from moetrain.planner.report import format_bytes, format_count, format_flops, format_plan, format_search
from moetrain.planner.schedule import (chunk_layer_lists, last_stage, pipeline_bubble, pipeline_in_flight,
                                       pipeline_peak)
from moetrain.planner.search import (THROUGHPUT_TIE, Candidate, LayoutSearch, candidate_layouts,
                                     choose_layout, pipeline_schedules, pipeline_splits, plan)

__all__ = ["DISPATCH_ROW_MARGIN", "DTYPE_BYTES", "FP32", "OPTIMIZER_FP32_STATES", "Arch", "Job", "ParamCount",
           "apply_layout", "attention_flops_per_token", "count_parameters", "flops_per_token", "parameter_counts",
           "plan_problems", "validate_plan", "CPU_CONFIG", "device_available", "explain_cannot_run_here",
           "load_plan_config", "main", "MEMORY_SAFETY", "PlanResult", "StageCost", "activation_bytes",
           "dispatch_bytes", "plan_layout", "plan_valid_layout", "stage_cost", "format_bytes", "format_count",
           "format_flops", "format_plan", "format_search", "chunk_layer_lists", "last_stage", "pipeline_bubble",
           "pipeline_in_flight", "pipeline_peak", "THROUGHPUT_TIE", "Candidate", "LayoutSearch",
           "candidate_layouts", "choose_layout", "pipeline_schedules", "pipeline_splits", "plan"]
