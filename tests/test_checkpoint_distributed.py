"""Sharded checkpoints: exact resume, resharding onto other layouts, consolidation, faults.

Multi-process cases train with msrun in TWO jobs (tests/workers/train_runs_worker.py runs several
trainings one after another in one job; an msrun launch costs ~15 s before any work):
- 2 ranks: the tiny MNIST MLP on dp2 with ZeRO-1 straight for 2N steps (the reference), and N steps
  then resumed in the same folder (`--resume` without a folder); the same straight/split/resume chain
  for a MoE LM on dp2 x ep2; N steps of a GPT on pp2.
- 4 ranks (after the first job): the dp2 checkpoint resumed on dp4 with ZeRO-2; N steps of a GPT
  on dp2 x tp2, then resumed on dp4.
One-process resumes run in pytest's process (the pp2 GPT's uninterrupted one-process run trains
beside the 2-rank job); so does `moetrain generate` from the dp2 x ep2 run's final checkpoint (no
launch of its own). The kill -9 test launches `moetrain train` as the CLI
runs it (tests/workers/ckpt_train.py). Tensor/expert-parallel layouts with ZeRO are also covered with
hand-marked shards on virtual ranks (one process).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from distributed import (kill_leftovers, launcher_command, new_job_dir, run_workers, share_runs,
                         shared_reference_dirs, shared_run_dirs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST_CFG = os.path.join(ROOT, "configs", "mnist_mlp.yaml")
WORKER = "tests/workers/ckpt_train.py"
STEPS, HALF = 8, 4


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def mnist_sets(data, output_dir, *extra):
    return [f"data.path={data}", f"train.output_dir={output_dir}", "model.hidden_size=32", "train.epochs=0",
            f"train.steps={STEPS}", "train.global_batch_size=32", "train.eval_batch_size=32",
            "lr_schedule.warmup_steps=0", "optimizer.clip_grad_norm=0.5", "optimizer.weight_decay=0.01",
            "checkpoint.save_steps=0", "logging.tensorboard=false", "logging.progress_bar=false", *extra]


def train_args(config, sets, resume=None, dump_state=False):
    args = (["--dump-state"] if dump_state else []) + [config] + [a for s in sets for a in ("--set", s)]
    if resume is not None:
        args += ["--resume", resume] if resume else ["--resume"]
    return args


# msrun jobs run PyNative: half the CPU time of compiling these tiny steps (in-process runs use jit)
PYNATIVE = "train.jit=false"


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r["loss"] for r in map(json.loads, fh) if "loss" in r]


def checkpoint(run_dir, step):
    return os.path.join(run_dir, "checkpoints", f"step_{step:08d}")


def make_trainer(sets, resume=None, config=MNIST_CFG):
    from moetrain.config import load_config
    from moetrain.trainer import Trainer

    return Trainer(load_config(config, sets), resume=resume)


def trainer_state(trainer):
    """Model tensors by Parameter name, and this rank's optimizer tensors by checkpoint key
    (`adam_m.<name>`, `zero_master.<name>`: at ZeRO the parameter's range of its flat row)."""
    state = {p.name: p.asnumpy().copy() for p in trainer.model.get_parameters()}
    for key, _, _, _, flat_range, holder in trainer.opt_step.checkpoint_pieces():
        values = holder.asnumpy()
        state[key] = values.copy() if flat_range is None else values.reshape(-1)[flat_range[0]:flat_range[1]].copy()
    return state


# ---------------------------------------------------------------------------------------------
# msrun runs shared by the tests below
# ---------------------------------------------------------------------------------------------
def run_spec(name, config, sets):
    """One run of tests/workers/train_runs_worker.py; its folder is the job's out/NAME (the worker
    sets train.output_dir), a later spec with the same NAME and `resume=` continues that folder."""
    return f"{name}:{config}:{','.join(sets)}"


MOE_CFG = os.path.join(ROOT, "configs", "moe_tiny.yaml")
GPT_CFG = os.path.join(ROOT, "configs", "gpt_tiny.yaml")
DP2_ZERO1 = ["parallel.data_parallel=2", "parallel.optimizer_shard=1", PYNATIVE]
DP2_EP2_ZERO1 = ["parallel.data_parallel=2", "parallel.expert_parallel=2", "parallel.optimizer_shard=1", PYNATIVE]
PP2_COMMON = [PYNATIVE, "train.micro_batch_size=2", "model.tie_embeddings=true"]   # 4 micro-batches
WORLD2_RUNS = ("dp2_straight", "dp2_split", "ep2_straight", "ep2_split", "pp2_half")
WORLD4_RUNS = ("dp4", "tp2_half", "tp2_to_dp4")


def world2_specs(fixture, out_dir):
    """`dp2_straight` trains 2N steps; `dp2_split` trains N (stop_after, saves at N), then resumes in
    its folder to 2N; the same for `ep2_*` (MoE LM); `pp2_half` trains N of a GPT on two stages."""
    data = fixture("tiny_mnist")
    return [run_spec(*run) for run in [
        ("dp2_straight", MNIST_CFG, mnist_sets(data, "", *DP2_ZERO1)),
        ("dp2_split", MNIST_CFG, mnist_sets(data, "", *DP2_ZERO1, f"train.stop_after={HALF}")),
        ("dp2_split", MNIST_CFG, mnist_sets(data, "", *DP2_ZERO1, "resume=")),
        ("ep2_straight", MOE_CFG, lm_sets("moe_gpt", "", *DP2_EP2_ZERO1)),
        ("ep2_split", MOE_CFG, lm_sets("moe_gpt", "", *DP2_EP2_ZERO1, f"train.stop_after={LM_HALF}")),
        ("ep2_split", MOE_CFG, lm_sets("moe_gpt", "", *DP2_EP2_ZERO1, "resume=")),
        ("pp2_half", GPT_CFG, lm_sets("gpt", "", *PP2_COMMON, "parallel.pipeline_stage=2",
                                      f"train.stop_after={LM_HALF}")),
    ]]


def world4_specs(fixture, out_dir):
    """`dp4` resumes the dp2 checkpoint at N on dp4 with ZeRO-2; `tp2_half` trains N steps of a GPT on
    dp2 x tp2; `tp2_to_dp4` resumes that on dp4."""
    dp2_split = shared_run_dirs(fixture("shared_job_2"), __name__, ["dp2_split"])["dp2_split"]
    tp2_half = shared_run_dirs(out_dir, __name__, ["tp2_half"])["tp2_half"]
    return [run_spec(*run) for run in [
        ("dp4", MNIST_CFG, mnist_sets(fixture("tiny_mnist"), "", "parallel.data_parallel=4",
                                      "parallel.optimizer_shard=2", PYNATIVE, f"resume={checkpoint(dp2_split, HALF)}")),
        ("tp2_half", GPT_CFG, lm_sets("gpt", "", "parallel.data_parallel=2", "parallel.model_parallel=2",
                                      "parallel.optimizer_shard=1", PYNATIVE, f"train.stop_after={LM_HALF}")),
        ("tp2_to_dp4", GPT_CFG, lm_sets("gpt", "", "parallel.data_parallel=4", PYNATIVE,
                                        f"resume={checkpoint(tp2_half, LM_HALF)}")),
    ]]


# every 2-rank run of this file joins the suite's shared 2-rank msrun job, every 4-rank run the 4-rank
# job (after the 2-rank one: dp4 resumes the dp2 checkpoint); tests/distributed.py: share_runs
share_runs(2, __name__, world2_specs, timeout=900, references=lambda fixture: [
    run_spec("pp2_straight", GPT_CFG, lm_sets("gpt", "", *PP2_COMMON))])     # pp2_half's layout-free reference
share_runs(4, __name__, world4_specs, timeout=900)


@pytest.fixture(scope="module")
def world2_runs(shared_job_2, tiny_mnist, tmp_path_factory):
    base = tmp_path_factory.mktemp("world2")
    dirs = {**shared_run_dirs(shared_job_2, __name__, WORLD2_RUNS),
            **shared_reference_dirs(shared_job_2, __name__, ["pp2_straight"])}
    saved = str(base / "dp2_saved_at_half")     # kept apart: tests below resume from it or damage copies
    shutil.copytree(checkpoint(dirs["dp2_split"], HALF), saved)
    ep2_saved = str(base / "ep2_saved_at_half")
    shutil.copytree(checkpoint(dirs["ep2_split"], LM_HALF), ep2_saved)
    straight = dirs["dp2_straight"]
    return {**dirs, "straight": straight, "saved": saved, "ep2_saved": ep2_saved, "data": tiny_mnist,
            "zero1": DP2_ZERO1,
            "final_states": [dict(np.load(os.path.join(straight, f"rank_{r}.npz"))) for r in range(2)]}


@pytest.fixture(scope="module")
def dp2_runs(world2_runs):
    return world2_runs


@pytest.fixture(scope="module")
def world4_runs(shared_job_4):
    return shared_run_dirs(shared_job_4, __name__, WORLD4_RUNS)


@pytest.mark.distributed
def test_dp2_zero1_resume_at_n_matches_uninterrupted_run_exactly(dp2_runs, tmp_path):
    from moetrain.checkpoint.distributed import CheckpointReader

    reader = CheckpointReader(dp2_runs["saved"])
    assert reader.metadata["layout"] == {"world_size": 2, "dp": 2, "tp": 1, "pp": 1, "ep": 1, "etp": 1,
                                          "optimizer_shard": 1}
    assert reader.trainer_state["step"] == HALF and reader.trainer_state["consumed_samples"] == HALF * 32
    weight = reader.tensors["hidden.0.weight"]                      # a replica: written once, by rank 0
    assert [p["file"] for p in weight["pieces"]] == ["model.safetensors"]
    moment = reader.tensors["adam_m.hidden.0.weight"]               # ZeRO-1 halves, one per rank
    assert [(p["file"], p["flat"]) for p in moment["pieces"]] == [
        ("optimizer-rank00000.safetensors", [0, 32 * 784 // 2]),
        ("optimizer-rank00001.safetensors", [32 * 784 // 2, 32 * 784])]
    assert "zero_master.hidden.0.weight" in reader.tensors
    assert sorted(os.listdir(dp2_runs["saved"])) == ["config.yaml", "manifest.json", "metadata.json",
                                                     "model.safetensors", "optimizer-rank00000.safetensors",
                                                     "optimizer-rank00001.safetensors"]

    reference = losses(dp2_runs["straight"])     # dp2_split: N steps, then `--resume` in its folder
    assert len(reference) == STEPS
    assert losses(dp2_runs["dp2_split"]) == reference    # bitwise: same layout, same reduction order


@pytest.mark.distributed
def test_dp2_checkpoint_resumes_on_dp4_zero2_and_on_one_process(dp2_runs, world4_runs, tmp_path):
    reference = losses(dp2_runs["straight"])[HALF:]
    np.testing.assert_allclose(losses(world4_runs["dp4"]), reference, rtol=1e-5)

    one = str(tmp_path / "one")
    trainer = make_trainer(mnist_sets(dp2_runs["data"], one), resume=dp2_runs["saved"])
    assert trainer.step == HALF and trainer.opt_step.level == 0
    trainer.fit()
    np.testing.assert_allclose(losses(one), reference, rtol=1e-5)
    final = dp2_runs["final_states"][0]
    for name, value in trainer_state(trainer).items():
        if name in final:
            np.testing.assert_allclose(value, final[name], rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.distributed
def test_consolidated_dp_checkpoint_equals_the_trained_model_state_bitwise(dp2_runs, tmp_path):
    from moetrain.checkpoint.distributed import CheckpointReader, consolidate
    from moetrain.checkpoint.model_dir import load_model, load_model_dir

    final = checkpoint(dp2_runs["straight"], STEPS)
    out = str(tmp_path / "model")
    consolidate(final, out)
    config, state = load_model_dir(out)
    assert config["model"]["name"] == "mnist_mlp" and config["parallel"]["data_parallel"] == 2
    in_memory = dp2_runs["final_states"]           # every Parameter of each rank at the end of training
    assert sorted(state) == sorted(in_memory[0])
    reader = CheckpointReader(final)
    for name, value in state.items():
        for rank_state in in_memory:
            np.testing.assert_array_equal(value, rank_state[name], err_msg=name)
        np.testing.assert_array_equal(value, reader.global_tensor("zero_master." + name), err_msg=name)
    model, _ = load_model(out)                     # what `moetrain forward` / `hf-export` read
    for name, param in model.parameters_and_names():
        np.testing.assert_array_equal(param.asnumpy(), state[name])


@pytest.mark.distributed
def test_offline_reshard_to_dp4_zero2_keeps_every_tensor(dp2_runs, tmp_path):
    from moetrain.checkpoint.distributed import CheckpointReader

    out = str(tmp_path / "dp4z2")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_ckpt.py"), dp2_runs["saved"], out,
                           "--to-layout", "dp=4,zero=2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    source, converted = CheckpointReader(dp2_runs["saved"]), CheckpointReader(out)
    assert converted.metadata["layout"]["dp"] == 4 and converted.step == HALF
    assert sorted(converted.keys()) == sorted(source.keys())
    for key in source.keys():
        np.testing.assert_array_equal(converted.global_tensor(key), source.global_tensor(key), err_msg=key)
    n = 32 * 784
    assert [(p["file"], p["flat"]) for p in converted.tensors["adam_v.hidden.0.weight"]["pieces"]] == [
        (f"optimizer-rank{r:05d}.safetensors", [r * n // 4, (r + 1) * n // 4]) for r in range(4)]
    # the converted and the original checkpoint load identically on one process
    sets = mnist_sets(dp2_runs["data"], str(tmp_path / "run"))
    a, b = trainer_state(make_trainer(sets, resume=out)), trainer_state(make_trainer(sets, resume=dp2_runs["saved"]))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.distributed
def test_model_directory_becomes_initial_weights_for_any_layout(dp2_runs, tmp_path):
    from moetrain.checkpoint.distributed import CheckpointReader, consolidate, parse_layout, reshard

    model_dir = str(tmp_path / "model")
    state = consolidate(dp2_runs["saved"], model_dir)
    init = reshard(model_dir, str(tmp_path / "init"), parse_layout("dp=2,zero=1"))
    reader = CheckpointReader(init)
    assert reader.step == 0 and reader.keys("optimizer") == []
    trainer = make_trainer(mnist_sets(dp2_runs["data"], str(tmp_path / "run"), "parallel.optimizer_shard=1"),
                           resume=init)
    assert trainer.step == 0
    loaded = trainer_state(trainer)
    for name, value in state.items():
        np.testing.assert_array_equal(loaded[name], value)
        np.testing.assert_array_equal(loaded["zero_master." + name], value.reshape(-1))   # masters follow
        np.testing.assert_array_equal(loaded["adam_m." + name], 0)                         # fresh optimizer


@pytest.mark.distributed
def test_damaged_or_missing_shard_is_refused_naming_the_file(dp2_runs, tmp_path):
    from moetrain.checkpoint.manager import CheckpointError

    sets = mnist_sets(dp2_runs["data"], str(tmp_path / "run"), "parallel.optimizer_shard=1")
    damaged = str(tmp_path / "damaged")
    shutil.copytree(dp2_runs["saved"], damaged)
    with open(os.path.join(damaged, "optimizer-rank00001.safetensors"), "r+b") as fh:
        fh.seek(-4, os.SEEK_END)
        fh.write(b"\x00bad")
    with pytest.raises(CheckpointError, match=r"damaged \(checksum mismatch\): .*optimizer-rank00001\.safetensors"):
        make_trainer(sets, resume=damaged)
    missing = str(tmp_path / "missing")
    shutil.copytree(dp2_runs["saved"], missing)
    os.remove(os.path.join(missing, "optimizer-rank00000.safetensors"))
    with pytest.raises(CheckpointError, match=r"file missing: .*optimizer-rank00000\.safetensors"):
        make_trainer(sets, resume=missing)


@pytest.mark.distributed
def test_checkpoint_of_another_model_is_refused_with_the_mismatching_keys(dp2_runs, tmp_path):
    from moetrain.checkpoint.distributed import CheckpointReader, load_into
    from moetrain.checkpoint.manager import CheckpointError

    sets = mnist_sets(dp2_runs["data"], str(tmp_path / "run"), "model.hidden_size=16")
    with pytest.raises(CheckpointError, match=r"mismatching keys: model\.hidden_size \(checkpoint 32, config 16\)"):
        make_trainer(sets, resume=dp2_runs["saved"])
    trainer = make_trainer(sets)                  # the weights themselves are checked too
    with pytest.raises(CheckpointError, match=r"shape mismatch: hidden\.0\.weight: checkpoint \(32, 784\) vs "
                                              r"model \(16, 784\)"):
        load_into(CheckpointReader(dp2_runs["saved"]), trainer._checkpoint_tensors(), holds_whole_model=True)


@pytest.mark.distributed
def test_kill_9_of_one_rank_then_the_same_command_with_resume(dp2_runs):
    job = new_job_dir()
    out, run_dir = os.path.join(job, "out"), os.path.join(job, "run")
    os.makedirs(out)
    args = train_args(MNIST_CFG, mnist_sets(dp2_runs["data"], run_dir, *dp2_runs["zero1"],
                                            "checkpoint.save_steps=1", "checkpoint.keep_max=2"))
    proc = subprocess.Popen(launcher_command(WORKER, 2, job, args, timeout=240), cwd=job, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while not os.path.isfile(os.path.join(checkpoint(run_dir, 2), "manifest.json")):
            assert proc.poll() is None and time.time() < deadline, "the job ended before its second checkpoint"
            time.sleep(0.02)
        with open(os.path.join(out, "pid_rank1")) as fh:
            os.kill(int(fh.read()), signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_leftovers(job)
    from moetrain.checkpoint.manager import list_checkpoints

    complete = [step for step, _ in list_checkpoints(os.path.join(run_dir, "checkpoints"))]
    assert complete and complete[-1] < STEPS, f"rank 1 was killed after the run finished ({complete})"
    run_workers(WORKER, 2, args + ["--resume"], timeout=240, job_dir=job).check()
    assert losses(run_dir) == losses(dp2_runs["straight"])


# ---------------------------------------------------------------------------------------------
# one process
# ---------------------------------------------------------------------------------------------
def test_async_save_writes_the_state_of_the_save_step_while_training_goes_on(tiny_mnist, tmp_path):
    from moetrain.checkpoint.distributed import CheckpointReader

    trainer = make_trainer(mnist_sets(tiny_mnist, str(tmp_path / "run"), "checkpoint.async_save=true"))
    for _ in range(2):
        trainer.train_step()
    expected = {p.name: p.asnumpy().copy() for p in trainer.model.get_parameters()}
    start = time.perf_counter()
    path = trainer.save()
    returned_after = time.perf_counter() - start
    trainer.train_step()                          # changes every weight while the thread writes
    trainer.wait_for_checkpoint()
    reader = CheckpointReader(path)
    assert reader.step == 2
    for name, value in expected.items():
        np.testing.assert_array_equal(reader.global_tensor(name), value, err_msg=name)
    print(f"async save returned after {returned_after * 1e3:.1f} ms")


class _VirtualRank:
    """One rank of a tp2 x dp2 x ep2 layout built in this process: no communication is needed to
    build an `OptimizerStep` or to describe, save and load its tensors."""

    def __init__(self, layout, rank, values, marks):
        import mindspore as ms
        from mindspore import Parameter, Tensor, nn

        from moetrain.config import OptimizerConfig, ParallelConfig
        from moetrain.parallel.data_parallel import OptimizerStep
        from moetrain.distributed.sharding import ShardSpec, mark_role, mark_shard
        from moetrain.distributed.topology import ParallelContext

        dp, tp, ep, zero = layout
        self.pctx = ParallelContext.build(dp * tp, rank, dp, tp, 1, ep)
        coordinate = {"tp": self.pctx.tp_rank, "ep": self.pctx.ep_rank}
        self.model = nn.Cell()
        self.specs = {}
        for i, (name, value) in enumerate(values.items()):
            axis, kind = marks.get(name, (None, ""))
            count = {"tp": tp, "ep": ep}.get(kind, 1)
            spec = ShardSpec(value.shape, axis if count > 1 else None, coordinate.get(kind, 0), count,
                             kind if count > 1 else "")
            param = Parameter(Tensor(spec.slice_of(value)), name=name, requires_grad=name != "moe.expert_bias")
            if spec.axis is not None:
                mark_shard(param, value.shape, spec.axis, spec.index, spec.count, spec.group_kind)
            if ".experts." in name:
                mark_role(param, expert=True)
            setattr(self.model, f"p{i}", param)
            self.specs[name] = spec
        trainable = [p for p in self.model.get_parameters() if p.requires_grad]
        self.opt_step = OptimizerStep(trainable, OptimizerConfig(name="adamw"), ParallelConfig(optimizer_shard=zero),
                                      self.pctx, 0.0, jit=False)
        self.ms = ms

    def tensors(self):
        from moetrain.checkpoint.distributed import local_tensors

        return local_tensors(self.model, self.opt_step, self.pctx)


def _expected_local(global_value, spec, flat):
    """This rank's value computed directly with numpy: the slice, then the padded ZeRO range."""
    value = np.split(global_value, spec.count, axis=spec.axis)[spec.index] if spec.axis is not None else global_value
    if flat is None:
        return value
    padded = np.concatenate([value.reshape(-1), np.zeros(max(0, flat[1] - value.size), value.dtype)])
    return padded[flat[0]:flat[1]]


def test_hand_marked_tp_ep_shards_with_zero_reshard_onto_other_layouts(tmp_path):
    from moetrain.checkpoint.distributed import (CheckpointReader, FORMAT, finish_checkpoint,
                                                 host_copy, layout_of, load_into, parse_layout, reshard, whole_parts,
                                                 write_rank_pieces)
    from moetrain.checkpoint.manager import CheckpointWriter

    rng = np.random.default_rng(0)
    values = {"attn.wq.weight": rng.standard_normal((4, 6)).astype(np.float32),         # tp-sliced rows
              "attn.wo.weight": rng.standard_normal((6, 4)).astype(np.float32),         # tp-sliced columns
              "norm.weight": rng.standard_normal(5).astype(np.float32),                 # replicated
              "moe.experts.w_up": rng.standard_normal((4, 3, 5)).astype(np.float32),    # ep-sliced experts
              "moe.expert_bias": rng.standard_normal(4).astype(np.float32)}             # not trained
    marks = {"attn.wq.weight": (0, "tp"), "attn.wo.weight": (1, "tp"), "moe.experts.w_up": (0, "ep")}
    moments = {f"adam_{m}.{k}": rng.standard_normal(v.shape).astype(np.float32)
               for m in "mv" for k, v in values.items() if k != "moe.expert_bias"}

    saved_layout = (2, 2, 2, 1)                   # dp, tp, ep, ZeRO level
    ranks = [_VirtualRank(saved_layout, r, values, marks) for r in range(4)]
    for vr in ranks:                              # give the optimizer state known values
        for t in vr.tensors():
            if t.part == "optimizer" and not t.key.startswith("zero_master."):
                t.param.set_data(vr.ms.Tensor(_expected_local(moments[t.key], t.spec, t.flat)))
                if hasattr(t.param, "flush"):     # a ZeRO row piece: staged, then written once
                    t.param.flush()
    root = str(tmp_path / "ckpts")
    os.makedirs(root)
    config_file = str(tmp_path / "config.yaml")
    with open(config_file, "w") as fh:
        fh.write("model: {name: hand_marked}\n")
    writers = [CheckpointWriter(root, 7, suffix="virtual", create=r == 0) for r in range(4)]
    for vr, writer in zip(ranks, writers):
        tensors = vr.tensors()
        layout = layout_of(vr.pctx, 1)
        write_rank_pieces(writer, vr.pctx.rank, [(t, host_copy(t)) for t in tensors if t.writes],
                          whole_parts(layout, tensors))
    path = finish_checkpoint(writers[0], 4, {"format": FORMAT, "step": 7, "layout": layout,
                                             "trainer_state": {}, "config": {}}, config_file)

    reader = CheckpointReader(path)
    pieces = {k: [(p["file"], p["index"], p["flat"]) for p in e["pieces"]] for k, e in reader.tensors.items()}
    assert pieces["norm.weight"] == [("model-rank00000.safetensors", 0, None)]           # written once
    assert pieces["attn.wq.weight"] == [("model-rank00000.safetensors", 0, None),        # dp replicas dropped
                                        ("model-rank00001.safetensors", 1, None)]
    assert pieces["moe.experts.w_up"] == [("model-rank00000.safetensors", 0, None),      # ep0 on dp0, ep1 on dp1
                                          ("model-rank00002.safetensors", 1, None)]
    assert pieces["adam_m.norm.weight"] == [("optimizer-rank00000.safetensors", 0, [0, 3]),
                                            ("optimizer-rank00002.safetensors", 0, [3, 5])]
    for key, value in {**values, **moments}.items():
        np.testing.assert_array_equal(reader.global_tensor(key), value, err_msg=key)

    # resume on other layouts: one process without ZeRO, dp3 ZeRO-2 with tp1, tp2 on one dp rank
    for layout in [(1, 1, 1, 0), (3, 1, 1, 2), (1, 2, 1, 1)]:
        dp, tp = layout[0], layout[1]
        for rank in range(dp * tp):
            vr = _VirtualRank(layout, rank, {k: np.zeros_like(v) for k, v in values.items()}, marks)
            tensors = vr.tensors()
            load_into(CheckpointReader(path), tensors, holds_whole_model=True)
            for t in tensors:
                source = values.get(t.key) if t.part == "model" else (
                    values[t.key[len("zero_master."):]] if t.key.startswith("zero_master.") else moments[t.key])
                np.testing.assert_array_equal(t.param.asnumpy(), _expected_local(source, t.spec, t.flat),
                                              err_msg=f"{layout} rank {rank}: {t.key}")

    # offline: to tp4 (a new slicing of the tp tensors) and back to one file per part
    tp4 = reshard(path, str(tmp_path / "tp4"), parse_layout("tp=4,zero=1"))
    converted = CheckpointReader(tp4)
    assert [p["index"] for p in converted.tensors["attn.wo.weight"]["pieces"]] == [0, 1, 2, 3]
    one = CheckpointReader(reshard(tp4, str(tmp_path / "one"), parse_layout("dp=1")))
    assert {p["file"] for e in one.tensors.values() for p in e["pieces"]} == {"model.safetensors",
                                                                              "optimizer.safetensors"}
    assert not any(k.startswith("zero_master.") for k in one.keys())
    for reader_ in (converted, one):
        for key, value in {**values, **moments}.items():
            np.testing.assert_array_equal(reader_.global_tensor(key), value, err_msg=key)
    with pytest.raises(Exception, match="no tensor sliced over ep"):
        reshard(tp4, str(tmp_path / "ep2"), parse_layout("dp=2,ep=2"))


# ---------------------------------------------------------------------------------------------
# language models on expert-, tensor- and pipeline-parallel layouts
# ---------------------------------------------------------------------------------------------
LM_DATA = os.path.join(ROOT, "data", "kjv_tiny")
LM_STEPS, LM_HALF = 4, 2         # the tiny LMs step slower than the MLP under msrun: fewer steps


def lm_sets(name, output_dir, *extra):
    model = [f"model.name={name}", "model.vocab_size=2048", "model.hidden_size=32", "model.num_layers=2",
             "model.num_heads=2", "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.seq_length=16"]
    if name == "moe_gpt":
        # a capacity buffer keeps the expert-parallel exchange shapes fixed: PyNative reuses its ops
        model += ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=32",
                  "model.moe.bias_update_rate=0.01", "model.moe.capacity_factor=1.0"]
    return model + [f"data.path={LM_DATA}/kjv_tiny_train", "data.eval_path=", f"data.tokenizer={LM_DATA}/kjv_tiny.model",
                    f"train.output_dir={output_dir}", f"train.steps={LM_STEPS}", "train.global_batch_size=8",
                    "train.eval_interval=0", "lr_schedule.warmup_steps=0", "checkpoint.save_steps=0",
                    "logging.tensorboard=false", "logging.progress_bar=false", *extra]


@pytest.mark.slow
@pytest.mark.distributed
def test_dp2_ep2_zero1_resume_at_n_is_exact_and_resumes_on_one_process(world2_runs, tmp_path):
    straight, split, saved = world2_runs["ep2_straight"], world2_runs["ep2_split"], world2_runs["ep2_saved"]
    assert len(losses(straight)) == LM_STEPS
    assert losses(split) == losses(straight)       # N steps, then `--resume` in its folder: bitwise
    with open(os.path.join(saved, "metadata.json")) as fh:
        tensors = json.load(fh)["tensors"]
    experts = tensors["layers.0.moe.experts.w_up"]["pieces"]
    assert [(p["slice_kind"], p["index"], p["count"]) for p in experts] == [("ep", 0, 2), ("ep", 1, 2)]
    assert "layers.0.moe.expert_bias" in tensors
    # onto one process (ep1): micro-batches of 4 are the samples each dp rank had
    one = str(tmp_path / "one")
    make_trainer(lm_sets("moe_gpt", one, PYNATIVE, "train.micro_batch_size=4"), resume=saved, config=MOE_CFG).fit()
    np.testing.assert_allclose(losses(one), losses(straight)[LM_HALF:], rtol=1e-5)


@pytest.mark.distributed
def test_generate_from_the_dp2_ep2_checkpoint_equals_its_one_process_consolidation(world2_runs, tmp_path):
    """`moetrain generate` on the checkpoint the dp2 x ep2 run saved at its end (each rank wrote its own
    experts) gives, greedy and token for token, what it gives from the checkpoint's one-process
    consolidation, and both equal a model built from the parameters the two ranks held in memory."""
    from moetrain.checkpoint.distributed import consolidate
    from moetrain.checkpoint.model_dir import build_model_from_dict, load_model_dir, load_model_state
    from moetrain.cli import main
    from moetrain.data.tokenizer import load_tokenizer
    from moetrain.generate import generate

    run = world2_runs["ep2_straight"]
    saved = checkpoint(run, LM_STEPS)
    consolidate(saved, str(tmp_path / "model"))
    prompts = ["And God said", "In the beginning God created"]       # unequal lengths: one batch
    args = [a for p in prompts for a in ("--prompt", p)] + ["--max-new-tokens", "8", "--temperature", "0",
                                                             "--eos-id", "-1"]
    assert main(["generate", saved, *args, "--output", str(tmp_path / "ckpt.npy")]) == 0
    assert main(["generate", str(tmp_path / "model"), *args, "--output", str(tmp_path / "model.npy")]) == 0
    from_checkpoint, from_consolidated = np.load(tmp_path / "ckpt.npy"), np.load(tmp_path / "model.npy")
    np.testing.assert_array_equal(from_checkpoint, from_consolidated)

    ranks = [(json.load(open(os.path.join(run, f"rank_{r}.json")))["shards"], np.load(os.path.join(run, f"rank_{r}.npz")))
             for r in range(2)]
    assert ranks[1][0]["layers.0.moe.experts.w_up"][1:] == [0, 1, 2, "ep"]    # rank 1: experts 2-3 of 4

    def held(name):     # the ranks' own tensors: ep slices joined in slice order (not through the reader)
        axis = ranks[0][0][name][1]
        slices = sorted(((shards[name][2], params[name]) for shards, params in ranks), key=lambda s: s[0])
        return ranks[0][1][name] if axis is None else np.concatenate([value for _, value in slices], axis)

    config, state = load_model_dir(str(tmp_path / "model"))
    assert sorted(ranks[0][1].files) == sorted(state)
    _, loaded = load_model_dir(saved)      # what `moetrain generate` loads: bitwise the ranks' tensors (at 4
    for name, value in loaded.items():     # steps the experts' share of the logits is too small for the
        np.testing.assert_array_equal(value, held(name), err_msg=name)   # tokens alone to see their order)
    model = build_model_from_dict(config["model"])
    load_model_state(model, {name: held(name) for name in state}, strict=True)
    tokenizer = load_tokenizer(os.path.join(LM_DATA, "kjv_tiny.model"))
    encoded = [tokenizer.encode(text) for text in prompts]
    for row, (prompt, new) in enumerate(zip(encoded, generate(model, encoded, 8, temperature=0.0))):
        np.testing.assert_array_equal(from_checkpoint[row, :len(prompt) + 8], prompt + list(new), err_msg=prompts[row])
        assert not from_checkpoint[row, len(prompt) + 8:].any()          # right padding (no EOS id: 0)


@pytest.mark.slow
@pytest.mark.distributed
def test_dp2_tp2_checkpoint_resumes_on_dp4_and_on_one_process(world4_runs, tmp_path):
    straight = str(tmp_path / "straight")               # the uninterrupted reference, on one process
    make_trainer(lm_sets("gpt", straight, PYNATIVE), config=GPT_CFG).fit()
    reference = losses(straight)
    half = world4_runs["tp2_half"]
    np.testing.assert_allclose(losses(half), reference[:LM_HALF], rtol=1e-5)
    saved = checkpoint(half, LM_HALF)
    assert any(p["slice_kind"] == "tp" for e in json.load(open(os.path.join(saved, "metadata.json")))["tensors"].values()
               for p in e["pieces"])
    np.testing.assert_allclose(losses(world4_runs["tp2_to_dp4"]), reference[LM_HALF:], rtol=1e-5)
    one = str(tmp_path / "one")
    make_trainer(lm_sets("gpt", one, PYNATIVE), resume=saved, config=GPT_CFG).fit()
    np.testing.assert_allclose(losses(one), reference[LM_HALF:], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_checkpoint_resumes_on_one_process_and_consolidates(world2_runs, tmp_path):
    from moetrain.checkpoint.distributed import CheckpointReader, consolidate
    from moetrain.checkpoint.model_dir import model_state

    straight = world2_runs["pp2_straight"]        # one process, beside the shared job
    saved = checkpoint(world2_runs["pp2_half"], LM_HALF)
    reader = CheckpointReader(saved)
    assert reader.metadata["layout"]["pp"] == 2
    assert {p["file"] for e in reader.tensors.values() if e["part"] == "model" for p in e["pieces"]} == {
        "model-rank00000.safetensors", "model-rank00001.safetensors"}           # each stage wrote its layers
    one = str(tmp_path / "one")
    trainer = make_trainer(lm_sets("gpt", one, *PP2_COMMON), resume=saved, config=GPT_CFG)
    loaded = {name: value.copy() for name, value in model_state(trainer.model).items()}   # before fit()
    trainer.fit()
    np.testing.assert_allclose(losses(one), losses(straight)[LM_HALF:], rtol=1e-5)
    state = consolidate(saved, str(tmp_path / "model"))
    assert sorted(state) == sorted(loaded)
    for name, value in state.items():
        np.testing.assert_array_equal(value, loaded[name], err_msg=name)


def test_expert_pieces_cut_over_ep_and_etp_reassemble_and_a_missing_one_is_named():
    """An expert tensor of a folded layout is cut along two axes (ep: experts, etp: FFN columns):
    its four pieces reassemble into the global tensor, and coverage names the missing (ep, etp) pair."""
    from moetrain.checkpoint.distributed import coverage_problems
    from moetrain.distributed.sharding import ShardSpec, assemble

    value = np.arange(4 * 3 * 6, dtype=np.float32).reshape(4, 3, 6)          # [E, H, F]
    specs = [ShardSpec(value.shape, 0, ep, 2, "ep", ((2, etp, 2, "etp"),)) for ep in range(2) for etp in range(2)]
    pieces = [(s, s.slice_of(value)) for s in specs]
    assert all(p.shape == (2, 3, 3) == s.local_shape() for s, p in pieces)
    np.testing.assert_array_equal(pieces[3][1], value[2:, :, 3:])            # ep 1, etp 1
    np.testing.assert_array_equal(assemble(pieces), value)
    saved = {"global_shape": [4, 3, 6], "pieces": [
        {"axis": 0, "index": ep, "count": 2, "extra": [[2, etp, 2, "etp"]], "flat": None}
        for ep, etp in ((0, 0), (0, 1), (1, 0))]}
    assert coverage_problems("w_up", saved) == ["w_up: slice [1, 1] of [2, 2] along axes [0, 2] is missing"]
