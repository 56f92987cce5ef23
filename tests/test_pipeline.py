"""Pipeline parallelism: layer split and validation, the 1F1B / GPipe schedules (pairing of link
exchanges, no deadlock, activations in flight), stage numerics against the whole model in one
process (PyNative), the balancing bias reaching compiled stage graphs, and one 2-rank msrun run
(jitted steps, dense GPT, uneven split; in the suite's shared 2-rank job) that reproduces one-process
training (trained beside the job).

Pipelines of MoE models, GPipe, tied embeddings across stages, and pipeline combined with data,
tensor, sequence and expert parallelism, ZeRO-1/2 and checkpoints are tested in
tests/test_parallel_3d.py (one 4-rank and one 8-rank launch against one one-process run)."""
import json
import os

import numpy as np
import pytest

from distributed import share_runs, shared_reference_dirs, shared_run_dirs
from moetrain.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_CFG = os.path.join(ROOT, "configs", "gpt_tiny.yaml")
MOE_CFG = os.path.join(ROOT, "configs", "moe_tiny.yaml")
TINY = ["model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=128",
        "model.seq_length=32", "model.num_layers=4"]
TINY_MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=64",
            "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001"]


# ---------------------------------------------------------------------------------------------
# Split and validation
# ---------------------------------------------------------------------------------------------
def test_config_validation_names_the_fix(tmp_path):
    """Pipeline layouts are checked with every other rule at config load (moetrain.layout)."""
    from moetrain.config import ConfigError

    common = TINY + [f"train.output_dir={tmp_path}", "train.global_batch_size=8", "parallel.pipeline_stage=2"]
    cfg = load_config(GPT_CFG, common + ["train.micro_batch_size=2"])
    assert cfg.num_micro_batches == 4
    # micro_batch_num derives the micro-batch size
    cfg = load_config(GPT_CFG, common + ["parallel.micro_batch_num=4", "parallel.data_parallel=2"])
    assert (cfg.micro_batch_size, cfg.num_micro_batches) == (1, 4)
    # one micro-batch of 8 per step cannot fill 2 stages
    with pytest.raises(ConfigError, match=r"1 micro-batch\(es\) per step cannot keep 2 pipeline stages busy"):
        load_config(GPT_CFG, common)
    with pytest.raises(ConfigError, match="pipeline_layers=\\[3, 2\\] must give 2 stages"):
        load_config(GPT_CFG, common + ["train.micro_batch_size=2", "parallel.pipeline_layers=[3,2]"])


def test_schedule_and_chunk_rules_name_the_fix():
    """Model chunks: interleaving needs pp_interleave_num >= 2 and micro-batches in multiples of the
    stages (Megatron's rule), every chunk a layer; ZB-V is 2 chunks; other schedules one. The
    virtual stages split the layers (pipeline_layers lists them)."""
    from moetrain.layout import Layout, ModelShape, layout_problems, split_layers

    def problems(layers=8, **kw):
        return " ".join(layout_problems(Layout(**{"pp": 2, "num_micro_batches": 4, **kw}), ModelShape(layers=layers)))

    assert problems(schedule="interleaved_1f1b", interleave=2) == ""
    assert problems(schedule="zero_bubble_v") == "" and problems(schedule="zero_bubble_h1") == ""
    assert "needs parallel.pp_interleave_num >= 2" in problems(schedule="interleaved_1f1b")
    assert "must be a multiple of it" in problems(schedule="interleaved_1f1b", interleave=2, num_micro_batches=3)
    assert "model.num_layers (3) < pipeline_stage (2) x model chunks per stage (2)" in problems(
        3, schedule="zero_bubble_v")
    assert "exactly 2 model chunks" in problems(schedule="zero_bubble_v", interleave=3)
    assert "needs pipeline_schedule=interleaved_1f1b" in problems(interleave=2)
    assert "pipeline_schedule must be one of" in problems(schedule="dualpipe")
    assert "cannot be split evenly into 4 virtual stages (pipeline_stage=2 x 2 chunks)" in problems(
        6, schedule="zero_bubble_v")
    assert problems(6, schedule="zero_bubble_v", pipeline_layers=(1, 2, 2, 1)) == ""
    assert split_layers(6, 4, (1, 2, 2, 1), chunks=2) == [(0, 1), (1, 3), (3, 5), (5, 6)]


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------
class _TagStage:
    """A stand-in stage for schedule checks: payloads are tags, no compute."""

    def __init__(self, ops, stage):
        self.ops, self.stage = ops, stage

    def run(self):
        from moetrain.parallel.pipeline import EXCHANGE, Exchange

        seen = []
        for op in self.ops:
            if op.kind != EXCHANGE:
                seen.append((op.kind, op.chunk, op.micro))
                continue
            sent = None if op.send is None else (self.stage, op.send)
            got = yield Exchange(op.peer, op.send, op.recv, sent, ())
            if op.recv is not None:     # what the peer sent: the tensor this stage expects
                assert got == (op.peer, op.recv)
        return seen


# (schedule, model chunks per stage, stage counts, micro-batch counts of a stage count P)
SCHEDULE_CASES = [("1f1b", 1, range(1, 6), lambda P: range(P, P + 5)),
                  ("gpipe", 1, range(1, 6), lambda P: range(P, P + 5)),
                  ("interleaved_1f1b", 2, range(2, 6), lambda P: (P, 2 * P, 3 * P)),
                  ("interleaved_1f1b", 3, range(2, 5), lambda P: (P, 2 * P)),
                  ("zero_bubble_h1", 1, range(1, 6), lambda P: range(P, P + 5)),
                  ("zero_bubble_v", 2, range(1, 6), lambda P: range(P, P + 5))]


def _peak_bound(kind, chunks, stages, stage, micro):
    """The most inputs a stage may hold: 1F1B's P - s (ZB-H1 keeps it), GPipe all, interleaved
    Megatron's warm-up + 1 virtual micro-batches, ZB-V 2P chunk inputs (P whole-stage ones)."""
    if kind in ("1f1b", "zero_bubble_h1"):
        return min(stages - stage, micro)
    if kind == "gpipe":
        return micro
    if kind == "interleaved_1f1b":    # M == P: Megatron runs every forward first
        return micro * chunks if micro == stages else min((stages - stage - 1) * 2 + (chunks - 1) * stages + 1, micro * chunks)
    return 2 * stages


@pytest.mark.parametrize("kind,chunks,stage_counts,micro_counts", SCHEDULE_CASES)
def test_schedules_pair_every_exchange_without_deadlock(kind, chunks, stage_counts, micro_counts):
    """Every stage's list, driven in one process with tags for tensors: both ends of every exchange
    agree on what crosses, nothing deadlocks, every chunk runs forward < backward (< weight pass)
    once per micro-batch, and the inputs held stay within the schedule's bound."""
    from moetrain.parallel.pipeline import SPLIT_BACKWARD, build_schedule, drive_in_process, peak_in_flight

    passes = ("forward", "backward", "weight") if kind in SPLIT_BACKWARD else ("forward", "backward")
    for stages in stage_counts:
        for micro in micro_counts(stages):
            schedules = [build_schedule(kind, stages, s, micro, chunks) for s in range(stages)]
            seen = drive_in_process([_TagStage(ops, s).run() for s, ops in enumerate(schedules)])
            for s, events in enumerate(seen):
                assert sorted(events) == sorted((k, c, m) for k in passes for c in range(chunks)
                                                for m in range(micro)), (kind, stages, micro, s)
                for c in range(chunks):
                    for m in range(micro):
                        order = [events.index((k, c, m)) for k in passes]
                        assert order == sorted(order)
                held = peak_in_flight(schedules[s])
                assert held <= _peak_bound(kind, chunks, stages, s, micro), (kind, stages, micro, s, held)
                if kind == "1f1b":
                    assert held == min(stages - s, micro)
                elif kind == "gpipe":
                    assert held == micro


def test_schedule_bubbles_match_theory():
    """The idle fraction of each schedule's lists at unit pass costs: 1F1B (P-1)/(M+P-1), interleaved
    (P-1)/(vM+P-1) (Megatron's), and ZB-H1 below 1F1B, ZB-V below ZB-H1."""
    from moetrain.parallel.pipeline import schedule_bubble

    for P in (2, 3, 4):
        for M in (P, 2 * P, 4 * P):
            one = schedule_bubble("1f1b", P, M)
            assert one == pytest.approx((P - 1) / (M + P - 1))
            assert schedule_bubble("gpipe", P, M) == pytest.approx(one)
            for v in (2, 3):
                assert schedule_bubble("interleaved_1f1b", P, M, v) == pytest.approx((P - 1) / (v * M + P - 1))
            h1, zbv = schedule_bubble("zero_bubble_h1", P, M), schedule_bubble("zero_bubble_v", P, M, 2)
            assert zbv < h1 < one, (P, M, one, h1, zbv)
    assert schedule_bubble("zero_bubble_v", 4, 16, 2) < 0.045   # backward first; the paper's fixed order: 0.03


def test_unfinishable_orders_are_caught():
    from moetrain.parallel.pipeline import BACKWARD, FORWARD, Op, PipelineError, pair_exchanges

    # stage 1 wants micro-batch 1 first, stage 0 sends 0 first and waits for its gradient
    orders = [[Op(FORWARD, 0), Op(BACKWARD, 0), Op(FORWARD, 1), Op(BACKWARD, 1)],
              [Op(FORWARD, 1), Op(BACKWARD, 1), Op(FORWARD, 0), Op(BACKWARD, 0)]]
    with pytest.raises(PipelineError, match="cannot finish"):
        pair_exchanges("1f1b", 2, 2, 1, orders)


def test_mismatched_schedules_are_caught():
    from moetrain.parallel.pipeline import PipelineError, build_schedule, drive_in_process

    # stage 0 runs 1F1B, stage 1 GPipe: the ends of the link disagree on what crosses it
    runs = [_TagStage(build_schedule("1f1b", 2, 0, 4), 0).run(), _TagStage(build_schedule("gpipe", 2, 1, 4), 1).run()]
    with pytest.raises(PipelineError, match="link 0-1|deadlock"):
        drive_in_process(runs)


# ---------------------------------------------------------------------------------------------
# Stage numerics in one process
# ---------------------------------------------------------------------------------------------
def _tiny_moe_model(tied: bool):
    """A fresh whole model from seed 7, and its config (call again for another identical copy)."""
    import mindspore as ms

    from moetrain.build import build_model

    cfg = load_config(MOE_CFG, TINY + TINY_MOE + ["model.vocab_size=256", f"model.tie_embeddings={str(tied).lower()}"])
    ms.set_seed(7)
    return build_model(cfg), cfg


def _batches(num_micro, batch, seq, vocab, seed=0):
    from mindspore import Tensor

    rng = np.random.default_rng(seed)
    return [(Tensor(rng.integers(0, vocab, (batch, seq)).astype(np.int32)),
             Tensor(rng.integers(0, vocab, (batch, seq)).astype(np.int32))) for _ in range(num_micro)]


def _reference(model, batches):
    """Whole-model gradients summed over micro-batches, and each micro-batch's (loss, stats)."""
    import mindspore as ms

    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda ids, labels: model(ids, labels), None, params, has_aux=True)
    total, outputs = None, []
    for ids, labels in batches:
        (loss, stats), grads = grad_fn(ids, labels)
        total = [g.asnumpy() for g in grads] if total is None else [t + g.asnumpy() for t, g in zip(total, grads)]
        outputs.append((float(loss), {k: v.asnumpy() for k, v in stats.items()}))
    return {p.name: g for p, g in zip(params, total)}, outputs


def _drive_and_compare(kind, ranges, chunks, num_micro, expected_peaks):
    """All stages of a tied-embedding MoE model driven in one process (PyNative) through the real
    executor: the summed gradients of every parameter and each micro-batch's loss and MoE stats
    equal the whole model's. (The jitted path runs in the msrun tests.)"""
    import mindspore as ms

    from moetrain.parallel.pipeline import PipelineExecutor, build_stages, drive_in_process

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    model, cfg = _tiny_moe_model(tied=True)
    batch, seq = 1, 16
    batches = _batches(num_micro, batch, seq, cfg.model.vocab_size)
    ref_grads, ref_outputs = _reference(model, batches)

    stages = build_stages(lambda: _tiny_moe_model(tied=True)[0], ranges, kind=kind, chunks=chunks)   # fresh copies
    executors = []
    for _, stage in sorted(stages.items()):
        cells = stage if chunks > 1 else [stage]
        params = list({id(p): p for c in cells for p in c.trainable_params()}.values())   # ZB-V: one shared embedding
        executors.append(PipelineExecutor(stage, params, kind, num_micro, jit=False))
    scale = ms.Tensor(1.0, ms.float32)
    results = drive_in_process([ex.steps(batches, scale, (batch, seq, cfg.model.hidden_size)) for ex in executors])

    got = {}
    for ex, (grads, _) in zip(executors, results):
        for p, g in zip(ex.params, grads):
            got[p.name] = got.get(p.name, 0) + g.asnumpy()     # the tied embedding: both ends' parts
    assert sorted(got) == sorted(ref_grads)
    for name, ref in ref_grads.items():
        np.testing.assert_allclose(got[name], ref, rtol=2e-4, atol=2e-6, err_msg=name)

    chunk_stats = sorted((ex.chunks[c].vstage, stats[c]) for ex, (_, stats) in zip(executors, results)
                         for c in range(len(ex.chunks)))
    for m, (ref_loss, ref_stats) in enumerate(ref_outputs):
        per_chunk = [stats[m] for _, stats in chunk_stats]      # in virtual-stage (= layer) order
        assert sum(float(s["loss"].asnumpy()) for s in per_chunk) == pytest.approx(ref_loss, rel=1e-5)
        assert float(per_chunk[-1]["lm_loss"].asnumpy()) == pytest.approx(float(ref_stats["lm_loss"]), rel=1e-5)
        for key in ("aux_loss", "z_loss", "dropped", "routed"):
            assert sum(float(s[key].asnumpy()) for s in per_chunk) == pytest.approx(float(ref_stats[key]), rel=1e-5)
        loads = np.concatenate([s["expert_load"].asnumpy() for s in per_chunk if "expert_load" in s])
        np.testing.assert_array_equal(loads, ref_stats["expert_load"])
    assert [ex.peak_in_flight for ex in executors] == expected_peaks


def test_three_stages_in_one_process_match_whole_model():
    """1F1B over three uneven stages; it holds stages - s micro-batches on stage s."""
    _drive_and_compare("1f1b", [(0, 1), (1, 3), (3, 4)], 1, 3, [3, 2, 1])


@pytest.mark.slow
@pytest.mark.parametrize("kind,chunks,peaks", [("interleaved_1f1b", 2, [4, 4]), ("zero_bubble_h1", 1, [2, 1]),
                                               ("zero_bubble_v", 2, [4, 4])])
def test_chunked_and_split_schedules_in_one_process_match_whole_model(kind, chunks, peaks):
    """Interleaved 1F1B (chunk c of stage s: virtual stage 2c + s), ZB-H1 (input- and weight-gradient
    passes apart) and ZB-V (stage 0 holds the first and the last virtual stage, one shared tied
    embedding) on two stages of a 4-layer MoE model: the same gradients and stats as the whole model."""
    ranges = [(0, 1), (1, 2), (2, 3), (3, 4)] if chunks == 2 else [(0, 2), (2, 4)]
    _drive_and_compare(kind, ranges, chunks, 2, peaks)


def test_expert_bias_update_reaches_already_compiled_graphs():
    """Aux-loss-free balancing moves `expert_bias` between steps, after the step's graphs were
    compiled. With `set_data`, a jitted `value_and_grad` step kept reading the old bias (MindSpore
    2.10; a forward-only graph did see it): the balancing never changed the routing of training
    steps, in one process or in a stage. `ops.assign` updates it in place. Checked with the
    trainer's kind of step for the whole model and with a pipeline stage's jitted forward-backward."""
    import mindspore as ms
    from mindspore import Tensor

    from moetrain.parallel.pipeline import PipelineExecutor, build_stages
    from moetrain.build import build_model

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    cfg = load_config(MOE_CFG, TINY + TINY_MOE + ["model.vocab_size=256", "model.moe.bias_update_rate=1.0"])
    ms.set_seed(7)
    model = build_model(cfg)
    ids, labels = _batches(1, 2, 16, 256)[0]
    overloaded = np.zeros((4, 4))
    overloaded[:, 0] = 100.0       # expert 0 of every layer over-loaded: bias -1 for it, +1 for the others

    def forward(input_ids, targets):
        return model(input_ids, targets)

    grad_fn = ms.value_and_grad(forward, None, model.trainable_params(), has_aux=True)

    def train_step(input_ids, targets):     # as Trainer.grad_step: loss, stats and gradients
        (_, stats), grads = grad_fn(input_ids, targets)
        return stats["expert_load"], grads

    step = ms.jit(train_step)
    before = step(ids, labels)[0].asnumpy()
    model.update_expert_bias(overloaded)
    after = step(ids, labels)[0].asnumpy()
    assert before[:, 0].min() > 0 and after[:, 0].max() == 0, (before, after)   # |logits| << 1: the bias decides

    ms.set_seed(7)
    stage = build_stages(lambda: build_model(cfg), [(0, 2), (2, 4)], [1])[1]
    executor = PipelineExecutor(stage, stage.trainable_params(), "1f1b", 2, jit=True)
    hidden = Tensor(np.random.default_rng(1).standard_normal((2, 16, cfg.model.hidden_size)).astype(np.float32))
    scale = Tensor(1.0, ms.float32)
    before = executor.passes[0].loss_full(hidden, labels, scale)[0]["expert_load"].asnumpy()
    stage.model.update_expert_bias(overloaded[2:4])   # the stage's own rows (layers 2 and 3)
    after = executor.passes[0].loss_full(hidden, labels, scale)[0]["expert_load"].asnumpy()
    assert before[:, 0].min() > 0 and after[:, 0].max() == 0, (before, after)


# ---------------------------------------------------------------------------------------------
# msrun: pipeline training reproduces one-process training and its metrics
# ---------------------------------------------------------------------------------------------
KJV = os.path.join(ROOT, "data", "kjv_tiny")
CLIP = 0.05     # far below the gradient norms of these runs (~1): every step is clipped


def lm_overrides(moe: bool, **extra):
    base = {"data.path": f"{KJV}/kjv_tiny_train", "data.eval_path": f"{KJV}/kjv_tiny_eval",
            "data.tokenizer": f"{KJV}/kjv_tiny.model", "model.vocab_size": 2048, "train.steps": 5,
            "train.global_batch_size": 8, "train.micro_batch_size": 2, "train.eval_max_batches": 1,
            "model.num_layers": 2,
            "lr_schedule.warmup_steps": 0, "optimizer.clip_grad_norm": CLIP, "logging.tensorboard": "false",
            "logging.progress_bar": "false", "checkpoint.save_at_end": "false"}
    if moe:
        base["model.moe.capacity_factor"] = 1.0    # drops some tokens: the drop counts are compared too
    base.update(extra)
    return TINY + (TINY_MOE if moe else []) + [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                                for k, v in base.items()]


def step_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


UNEVEN = lm_overrides(False, **{"model.num_layers": 3})
UNEVEN_PP2 = UNEVEN + ["parallel.pipeline_stage=2", "parallel.pipeline_layers=[1,2]"]


def run_spec(name, overrides):
    return f"{name}:{GPT_CFG}:" + ",".join(overrides)


# the pp2 run joins the suite's shared 2-rank msrun job, its one-process reference trains beside it
share_runs(2, __name__, lambda fixture, out_dir: [run_spec("uneven_pp2", UNEVEN_PP2)], timeout=480,
           references=lambda fixture: [run_spec("uneven_single", UNEVEN)])


def rank_files(run_dir, nproc):
    """Every rank's record and parameters (tests/workers/train_runs_worker.py)."""
    return ([json.load(open(os.path.join(run_dir, f"rank_{r}.json"))) for r in range(nproc)],
            [dict(np.load(os.path.join(run_dir, f"rank_{r}.npz"))) for r in range(nproc)])


def assert_same_training(single, piped, keys):
    (steps_a, evals_a), (steps_b, evals_b) = single, piped
    assert [r["step"] for r in steps_b] == [1, 2, 3, 4, 5]
    for key in keys:
        np.testing.assert_allclose([r[key] for r in steps_b], [r[key] for r in steps_a], rtol=1e-4, err_msg=key)
    assert all(r["grad_norm"] > 10 * CLIP for r in steps_a)     # the clip was active on every step
    assert evals_b[-1]["eval_loss"] == pytest.approx(evals_a[-1]["eval_loss"], rel=1e-4)


def assert_same_parameters(single_params, ranks, npz, dp_rank=0):
    """Every parameter after training, from the stage that holds it, equals the one-process value."""
    seen = set()
    for info, params in zip(ranks, npz):
        if info["dp_rank"] != dp_rank:
            continue
        for name, value in params.items():
            np.testing.assert_allclose(value, single_params[name], rtol=1e-3, atol=3e-5, err_msg=name)
            seen.add(name)
    assert seen == set(single_params)


@pytest.mark.distributed
def test_pp2_dense_1f1b_uneven_split_reproduces_one_process(shared_job_2):
    single_dir = shared_reference_dirs(shared_job_2, __name__, ["uneven_single"])["uneven_single"]
    single, single_params = step_records(single_dir), rank_files(single_dir, 1)[1][0]
    piped_dir = shared_run_dirs(shared_job_2, __name__, ["uneven_pp2"])["uneven_pp2"]
    piped, (ranks, npz) = step_records(piped_dir), rank_files(piped_dir, 2)
    assert_same_training(single, piped, ("loss", "lm_loss", "grad_norm"))
    assert_same_parameters(single_params, ranks, npz)
    assert [r["stage_layers"] for r in ranks] == [[0, 1], [1, 3]]
    assert [r["peak_in_flight"] for r in ranks] == [2, 1]           # 1F1B: stages - stage, never more
    # 4 micro-batches of [2, 32, 64] fp32 cross the link each way per step
    assert [r["step_bytes_sent"] for r in ranks] == [4 * 2 * 32 * 64 * 4] * 2


def test_plan_reports_the_schedule_bubble_and_inputs_in_flight():
    """`moetrain plan`: each schedule's idle fraction (its own lists run at this runtime's pass
    costs: `pipeline_bubble`, which at equal costs on every stage is the schedule's own
    `schedule_bubble`), the inputs each stage holds (counted from the lists), stage 0 holding the
    head with ZB-V, and a step time that follows the bubble."""
    from moetrain.parallel.schedules import build_schedule, peak_in_flight, schedule_bubble
    from moetrain.planner import format_plan, load_plan_config, pipeline_bubble, plan

    base = ["parallel.pipeline_stage=4", "parallel.data_parallel=1", "parallel.expert_parallel=1",
            "train.global_batch_size=16", "train.micro_batch_size=1"]
    moe_1b = os.path.join(ROOT, "configs", "moe_1b.yaml")
    results = {}
    for kind, extra in (("1f1b", []), ("interleaved_1f1b", ["parallel.pp_interleave_num=2"]),
                        ("zero_bubble_h1", []), ("zero_bubble_v", [])):
        result = plan(load_plan_config(moe_1b, base + [f"parallel.pipeline_schedule={kind}"] + extra))
        chunks = result.layout.chunks
        equal = (1.0, 1.0, 1.0) if kind in ("zero_bubble_h1", "zero_bubble_v") else (1.0, 2.0, 0.0)
        assert pipeline_bubble(result.layout, [[tuple(c / chunks for c in equal)] * chunks] * 4) == pytest.approx(
            schedule_bubble(kind, 4, 16, chunks, (1.0, 1.0, 1.0)))
        assert result.bubble_fraction == pytest.approx(
            pipeline_bubble(result.layout, [st.pass_costs for st in result.stages]))
        for st in result.stages:          # the passes add up to the stage's compute
            assert sum(map(sum, st.pass_costs)) == pytest.approx(st.compute_seconds_per_micro_batch)
        assert [st.in_flight for st in result.stages] == [
            peak_in_flight(build_schedule(kind, 4, s, 16, chunks)) for s in range(4)]
        pacing = max(result.stages, key=lambda st: st.compute_seconds_per_micro_batch + st.comm_seconds_per_micro_batch)
        busy = 16 * (pacing.compute_seconds_per_micro_batch + pacing.comm_seconds_per_micro_batch)
        assert result.bubble_seconds / (busy + result.bubble_seconds) == pytest.approx(result.bubble_fraction)
        assert result.compute_seconds == pytest.approx(16 * pacing.compute_seconds_per_micro_batch)
        assert f"pipeline     {kind}" in format_plan(result)
        results[kind] = result
    one, inter, zbh1, zbv = (results[k] for k in ("1f1b", "interleaved_1f1b", "zero_bubble_h1", "zero_bubble_v"))
    # the last stage takes its gradients in its forward, without a recompute: lighter than the
    # others, it idles less than the textbook (P - 1) / (M + P - 1) says of the busiest
    assert 0.10 < one.bubble_fraction < 3 / 19
    # ZB-H1 fills its bubble, but its middle stages recompute the forward in B and in W: slower
    assert zbh1.bubble_fraction < one.bubble_fraction and zbh1.step_seconds > one.step_seconds
    assert inter.bubble_fraction < one.bubble_fraction
    # ZB-V: the head (and its logits) sit on stage 0, not stage 3
    assert zbv.stages[0].params > one.stages[0].params and zbv.stages[3].params < one.stages[3].params
