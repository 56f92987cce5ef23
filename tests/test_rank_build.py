"""Each rank constructs only its own part (issue 32): initial values independent of the layout, and
a rank of a model several times this machine's memory built within its own bytes."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "moe_tiny.yaml")


def test_keyed_values_of_any_region_are_those_of_the_whole_tensor():
    from moetrain.param_init import keyed_normal
    shape = (6, 10, 70000)          # runs longer than a generation pass on the last axis, and short ones
    whole = keyed_normal(3, "layers.0.moe.experts.w_gate", shape)
    for region in (((2, 4), (0, 10), (0, 70000)), ((0, 6), (5, 10), (0, 70000)), ((1, 5), (0, 10), (35000, 70000)),
                   ((3, 4), (2, 7), (10, 20))):
        part = keyed_normal(3, "layers.0.moe.experts.w_gate", shape, region)
        np.testing.assert_array_equal(part, whole[tuple(slice(lo, hi) for lo, hi in region)])
    assert abs(whole.mean()) < 0.01 and abs(whole.std() - 1) < 0.01
    other = keyed_normal(4, "layers.0.moe.experts.w_gate", shape, ((0, 1), (0, 1), (0, 100)))
    assert not np.array_equal(other, whole[:1, :1, :100])                     # the seed is part of the key
    assert not np.array_equal(keyed_normal(3, "layers.1.moe.experts.w_gate", (100,)), whole[0, 0, :100])   # and the name


LAYOUTS = {
    "tp2": ["parallel.model_parallel=2"],
    "ep4": ["parallel.data_parallel=4", "parallel.expert_parallel=4"],
    "pp2": ["parallel.pipeline_stage=2", "parallel.micro_batch_num=2"],
    "tp2_etp2": ["parallel.model_parallel=2", "parallel.data_parallel=2", "parallel.expert_parallel=2",
                 "parallel.expert_tensor_parallel=2"],
    "pp2_zbv": ["parallel.pipeline_stage=2", "parallel.micro_batch_num=4", "parallel.pipeline_schedule=zero_bubble_v"],
}


@pytest.fixture(scope="module")
def one_process_weights():
    from moetrain.build import build_model, setup_device
    from moetrain.config import load_config
    setup_device("cpu")
    return {p.name: p.asnumpy() for p in build_model(load_config(CONFIG, [])).get_parameters()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rank_slices_concatenate_to_the_one_process_model(layout, one_process_weights, monkeypatch):
    """Every rank of the layout built in turn (fake topology, stand-in collectives): its parameters,
    assembled by their ShardSpecs, equal the one-process model's initial weights exactly, and the
    values each rank generated are exactly the bytes it holds (nothing built for another rank)."""
    from moetrain import param_init
    from moetrain.build import build_model
    from moetrain.config import load_config
    from moetrain.distributed.sharding import assemble, shard_spec
    from moetrain.testing.solo import SoloComm
    from moetrain.distributed.topology import ParallelContext
    from moetrain.layout import check_config_layout
    from moetrain.parallel.parallelize import parallelize

    generated = []
    real = param_init.initial_values
    monkeypatch.setattr(param_init, "initial_values", lambda *a, **k: generated.append(real(*a, **k)) or generated[-1])
    cfg = load_config(CONFIG, LAYOUTS[layout])
    lay = check_config_layout(cfg)
    pieces = {}
    for rank in range(lay.world):
        pctx = ParallelContext.build(lay.world, rank, lay.dp, lay.tp, lay.pp, lay.ep, lay.etp, lay.cp)
        generated.clear()
        with SoloComm():
            pm = parallelize(build_model(cfg, pctx), cfg, pctx, cfg.model.seq_length,
                             rebuild=lambda chunk: build_model(cfg, pctx, chunk))
        held = {id(p): p for p in pm.model.get_parameters()}.values()
        assert not [p.name for p in held if param_init.is_deferred(p)]
        created = [p for p in held if getattr(p, "moetrain_init", None) is not None]
        assert sum(v.nbytes for v in generated) == sum(p.asnumpy().nbytes for p in created)
        for p in held:
            pieces.setdefault(p.name, []).append((shard_spec(p), p.asnumpy()))
    assert sorted(pieces) == sorted(one_process_weights)
    for name, parts in pieces.items():
        np.testing.assert_array_equal(assemble(parts), one_process_weights[name], err_msg=f"{layout}: {name}")


# 72 layers of 128 experts: 29.7 B parameters, 119 GB in fp32 (this machine: 24 GiB); pp8 x ep16
# leaves rank 0 9 layers of 8 experts each and the embedding, 1.3 GB
HUGE = ["model.vocab_size=8192", "model.hidden_size=2048", "model.num_heads=16", "model.num_kv_heads=2",
        "model.num_layers=72", "model.moe.num_experts=128", "model.moe.ffn_hidden_size=512",
        "parallel.pipeline_stage=8", "parallel.data_parallel=16", "parallel.expert_parallel=16",
        "parallel.micro_batch_num=8", "train.global_batch_size=128"]


def machine_memory() -> int:
    with open("/proc/meminfo") as fh:
        return int(next(line for line in fh if line.startswith("MemTotal:")).split()[1]) * 1024


def test_rank0_of_a_model_several_times_this_machine_builds_in_its_own_bytes():
    """Built in a child process: rank 0 of a model over 4x this machine's memory constructs only its
    stage and its experts; its bytes equal the planner's independent count, and the peak resident
    memory is at most 1.3x those bytes above what the process held before the build (the runtime)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "workers", "rank_build_worker.py"), CONFIG, "0",
                          *HUGE], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["whole_params"] * 4 >= 4 * machine_memory()
    assert result["own_bytes"] < 3e9 and not result["deferred_left"]
    assert result["own_bytes"] == result["planned_weight_bytes"]
    assert result["peak_rss"] <= result["rss_before"] + 1.3 * result["own_bytes"], result


def _build_rank(cfg, rank):
    from moetrain.build import build_model
    from moetrain.testing.solo import SoloComm
    from moetrain.distributed.topology import ParallelContext
    from moetrain.layout import check_config_layout
    from moetrain.parallel.parallelize import parallelize
    lay = check_config_layout(cfg)
    pctx = ParallelContext.build(lay.world, rank, lay.dp, lay.tp, lay.pp, lay.ep, lay.etp, lay.cp)
    with SoloComm():
        pm = parallelize(build_model(cfg, pctx), cfg, pctx, cfg.model.seq_length,
                         rebuild=lambda chunk: build_model(cfg, pctx, chunk))
    return pctx, pm, lay


SAVED = ["parallel.model_parallel=2", "parallel.data_parallel=2", "parallel.expert_parallel=2",
         "parallel.optimizer_shard=1"]
LOADED = {"pp2_ep4": ["parallel.pipeline_stage=2", "parallel.data_parallel=4", "parallel.expert_parallel=4",
                      "parallel.micro_batch_num=2"],
          "dp4_ep4_zero2": ["parallel.data_parallel=4", "parallel.expert_parallel=4", "parallel.optimizer_shard=2"]}


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A 4-layer moe_tiny checkpoint as a tp2 x dp2 x ep2, ZeRO-1 run writes it: every rank's pieces
    (tensor slices, expert slices, ZeRO flat ranges of the optimizer state), written rank by rank
    in this process with the trainer's own writer; weights perturbed per rank so a wrong piece shows."""
    from moetrain.checkpoint import distributed as d
    from moetrain.checkpoint.manager import CheckpointWriter
    from moetrain.config import load_config
    cfg = load_config(CONFIG, SAVED)
    root = tmp_path_factory.mktemp("ckpt")
    config_file = os.path.join(root, "resolved_config.yaml")
    with open(config_file, "w") as fh:
        import yaml
        yaml.safe_dump(cfg.to_dict(), fh)
    writer = CheckpointWriter(str(root), 3, final_name="step_00000003")
    world = None
    for rank in range(4):
        pctx, pm, lay = _build_rank(cfg, rank)
        world = lay.world
        tensors = d.local_tensors(pm.model, pm.opt_step, pctx)
        layout = d.layout_of(pctx, pm.opt_step.level)
        items = [(t, d.host_copy(t) + np.float32(0.001 * (1 + len(t.key)))) for t in tensors if t.writes]
        d.write_rank_pieces(writer, rank, items, d.whole_parts(layout, tensors))
    metadata = {"format": d.FORMAT, "step": 3, "run_id": "test", "layout": layout, "trainer_state": {"step": 3},
                "config": cfg.to_dict()}
    return d.finish_checkpoint(writer, world, metadata, config_file)


@pytest.mark.parametrize("target", sorted(LOADED))
def test_loading_onto_another_layout_reads_only_each_ranks_own_pieces(target, saved_checkpoint, monkeypatch):
    """Each rank of another layout loads the checkpoint (as --resume and checkpoint.load_path do:
    `load_into`) while every file read is traced: no read brings in more of a tensor than the rank
    holds of it (a ZeRO flat range: plus at most two rows of its slice), nothing is read whole, and
    the loaded values equal the saved tensors' slices."""
    from moetrain.checkpoint import distributed as d
    from moetrain.config import load_config
    reads = []
    real = d.CheckpointReader._read
    monkeypatch.setattr(d.CheckpointReader, "_read", lambda self, filename, key, box=None: reads.append(
        (key, box, real(self, filename, key, box))) or reads[-1][2])
    cfg = load_config(CONFIG, LOADED[target])
    whole = d.CheckpointReader(saved_checkpoint)
    for rank in range(4):
        pctx, pm, lay = _build_rank(cfg, rank)
        tensors = d.local_tensors(pm.model, pm.opt_step, pctx)
        reads.clear()
        d.load_into(d.CheckpointReader(saved_checkpoint), tensors, holds_whole_model=lay.pp == 1)
        assert reads and all(box is not None for _, box, _ in reads)      # slice reads only
        own = {}
        for t in tensors:
            key = t.key if t.key in whole.tensors else t.fallback
            row = int(np.prod(t.spec.local_shape()[1:], dtype=np.int64)) if t.spec.local_shape() else 1
            own[key] = max(own.get(key, 0), int(np.prod(t.local_shape)) + (2 * row if t.flat else 0))
        read = {}
        for key, _, value in reads:
            read[key] = read.get(key, 0) + value.size
        over = {k: (n, own.get(k)) for k, n in read.items() if n > own.get(k, 0)}
        assert not over, f"rank {rank} read beyond what it holds: {over}"
        for t in tensors:                   # model and optimizer state: the saved tensors' slices
            key = t.key if t.key in whole.tensors else t.fallback
            expected = t.spec.slice_of(whole.global_tensor(key))
            if t.flat:
                expected = np.concatenate([expected.reshape(-1), np.zeros(t.flat[1], expected.dtype)])[t.flat[0]:t.flat[1]]
            np.testing.assert_array_equal(t.param.asnumpy().reshape(expected.shape), expected,
                                          err_msg=f"rank {rank}: {t.key}")


CHUNKED = {"interleaved_1f1b": ["parallel.pipeline_schedule=interleaved_1f1b", "parallel.pp_interleave_num=2"],
           "zero_bubble_v": ["parallel.pipeline_schedule=zero_bubble_v"]}
DEEPSEEK = os.path.join(ROOT, "configs", "deepseek_v3_tiny.yaml")


@pytest.mark.parametrize("schedule", sorted(CHUNKED))
def test_each_chunk_is_built_once_and_nothing_outside_the_stage(schedule, monkeypatch):
    """Interleaved 1F1B and ZB-V put two model chunks on each of 2 stages of DeepSeek-V3 tiny (a
    dense first layer, MTP: the head reads the embedding). Every parameter each rank constructs
    (`param_init.parameter`, recorded) is constructed once and is one the rank's stage holds: no
    chunk built twice, no layer of another chunk, no embedding, head or MTP layer built and cut.
    ZB-V's stage 0 holds the first and last virtual stages: one embedding, shared."""
    import sys as _sys

    from moetrain import param_init
    from moetrain.config import load_config
    from moetrain.parallel.pipeline import chunk_layer_ranges

    created = []
    real = param_init.parameter

    def recording(shape, name, *args, **kwargs):
        param = real(shape, name, *args, **kwargs)
        created.append(param)
        return param

    for module in list(_sys.modules.values()):     # every `from moetrain.param_init import parameter`
        if getattr(module, "parameter", None) is real:
            monkeypatch.setattr(module, "parameter", recording)
    cfg = load_config(DEEPSEEK, ["parallel.pipeline_stage=2", "parallel.micro_batch_num=4", *CHUNKED[schedule]])
    for rank in range(2):
        created.clear()
        pctx, pm, _ = _build_rank(cfg, rank)
        held = {id(p): p for p in pm.model.get_parameters()}
        names = [p.name for p in created]
        assert len(names) == len(set(names)), f"rank {rank}: built twice: {sorted(n for n in set(names) if names.count(n) > 1)[:5]}"
        dropped = [p.name for p in created if id(p) not in held]
        assert not dropped, f"rank {rank}: built and cut: {dropped[:5]}"
        assert {p.name for p in held.values() if getattr(p, "moetrain_init", None) is not None} == set(names)
        layers = {int(n.split(".")[1]) for n in names if n.startswith("layers.")}
        ranges = chunk_layer_ranges(cfg, 2, rank)
        assert layers == {i for start, end in ranges for i in range(start, end)} and len(ranges) == 2
        assert ("embed.weight" in names) == (rank == 0 or schedule == "interleaved_1f1b")   # first, or MTP's
        assert any(n.startswith("mtp.") for n in names) == (rank == (0 if schedule == "zero_bubble_v" else 1))


def test_a_stage_of_only_dense_layers_builds_under_expert_parallelism():
    """DeepSeek-V3's first layers are dense: stage 0 of deepseek_v3_tiny on pp 4 holds layer 0 only,
    dense, while ep 2 applies to the model's MoE layers. Its rank is built (the ep / aux-scope check
    looks at the model, not the stage)."""
    from moetrain.build import build_model
    from moetrain.config import load_config
    from moetrain.distributed.topology import ParallelContext
    from moetrain.layout import check_config_layout
    from moetrain.parallel.expert_parallel import parallelize_moe
    from moetrain.testing.solo import SoloComm

    cfg = load_config(os.path.join(ROOT, "configs", "deepseek_v3_tiny.yaml"),
                      ["parallel.pipeline_stage=4", "parallel.micro_batch_num=4", "parallel.data_parallel=2",
                       "parallel.expert_parallel=2", "train.global_batch_size=16", "train.micro_batch_size=2"])
    lay = check_config_layout(cfg)
    pctx = ParallelContext.build(lay.world, 0, lay.dp, lay.tp, lay.pp, lay.ep, lay.etp, lay.cp)
    with SoloComm():
        assert parallelize_moe(build_model(cfg, pctx), cfg.parallel, pctx) == 0
