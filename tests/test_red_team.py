"""Red-team file (issue 37): bad inputs and faults that once got through, each with the command that
showed it and the class it must now fall in. It grows with each fix: add the case to CASES and its
test below (`test_every_case_has_its_test` keeps the two in step).

Classes: "refused clearly" (a non-zero exit or an exception with one message saying what, where and
how to fix it, nothing written), "handled" (the run goes on, or ends, as docs/faults.md says).
Trainer cases use the tiny MNIST MLP (tests/conftest.py); the race starts real `moetrain train`
processes."""
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from background import child_only, heavy_tests_in_child, run_patiently, wait_for_background, wait_patiently  # noqa: E402
from moetrain.config import load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the SIGTERM-at-ten-moments trials (~20 real `moetrain train` processes, ~3 min of one core) run in an
# idle-priority child pytest beside the suite (tests/background.py); a test here reads its outcome
heavy_tests_in_child(__name__, os.path.abspath(__file__), "background_child", cwd=ROOT, timeout=2400,
                     reader="test_sigterm_at_ten_random_moments_then_resume_ends_with_the_clean_losses")
MNIST = os.path.join(ROOT, "configs", "mnist_mlp.yaml")
GPT_TINY = os.path.join(ROOT, "configs", "gpt_tiny.yaml")
KJV = os.path.join(ROOT, "data", "kjv_tiny")
ENV = {**os.environ, "GLOG_v": "3",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}

# (case, command that showed it, expected class, test)
CASES = [
    ("two runs into one train.output_dir", "moetrain train moe_tiny.yaml --set train.output_dir=runs/twin & (1.5 s later) "
     "the same with another seed", "refused clearly: the second names the holder (pid, host, since)",
     "test_ten_staggered_starts_into_one_folder_one_trains_and_the_others_are_refused_naming_the_holder"),
    ("a lock left by a killed run", "kill -9 a run, then the same command with --resume",
     "handled: taken over with a warning", "test_a_stale_lock_is_taken_over_and_a_live_or_remote_one_refused"),
    ("a distributed run's folder", "run_distributed.sh --nproc 2 ... into a folder another run holds",
     "refused clearly on every rank; rank 0 locks, every rank sees its lock",
     "test_in_a_job_rank_0_locks_the_folder_and_every_rank_sees_it"),
    ("--overwrite with a config that fails later", "moetrain train ... --overwrite --set checkpoint.load_path=<other model>",
     "refused clearly: the old run stays in place; a refused run leaves nothing behind",
     "test_overwrite_validates_everything_before_moving_the_old_run_aside"),
    ("temporary files of two writers", "two runs writing resolved_config.yaml at once",
     "handled: temporary names carry pid and rank", "test_temporary_files_carry_pid_and_rank"),
    ("hf-import into a training checkpoint", "moetrain convert hf-import HF runs/x/checkpoints/step_00000002",
     "refused clearly, even with --overwrite", "test_hf_import_never_replaces_a_checkpoint_or_an_unasked_folder"),
    ("hf-export over an earlier (sharded) export", "moetrain convert hf-export MODEL HF_SHARDED_DIR",
     "refused clearly without --overwrite; with it, no stale shard index is left",
     "test_hf_export_refuses_a_used_folder_and_overwrite_leaves_no_stale_shards"),
    ("upcycle, consolidate, reshard into a used or checkpoint folder", "moetrain convert upcycle DENSE CKPT_DIR ...",
     "refused clearly", "test_other_model_writers_refuse_used_and_checkpoint_folders"),
    ("preprocess / train_tokenizer over existing outputs",
     "tools/preprocess_data.py --output-prefix EXISTING; tools/train_tokenizer.py --model-prefix EXISTING",
     "refused clearly without --overwrite", "test_preprocess_and_tokenizer_training_refuse_existing_outputs"),
    ("blend index cache overwritten with zeros", "dd of zeros over blend-*.npy, then train",
     "handled: the checksum fails, the cache is rebuilt with a warning",
     "test_a_damaged_blend_index_cache_is_rebuilt_with_a_warning"),
    ("data.cache_dir is a file", "--set data.cache_dir=some_file", "refused clearly",
     "test_a_damaged_blend_index_cache_is_rebuilt_with_a_warning"),
    ("eval data of another tokenizer", "--set data.eval_path=<shards of another tokenizer> --set data.tokenizer=''",
     "refused clearly", "test_eval_data_of_another_tokenizer_is_refused_without_data_tokenizer"),
    ("final save fails under on_save_error: continue", "full disk at the last step",
     "handled: retried once, then exit 74", "test_the_final_checkpoint_is_retried_and_its_failure_fails_the_run"),
    ("--resume past train.steps", "moetrain train ... --resume (checkpoint at step 4) --set train.steps=2",
     "refused clearly (exit 2), nothing written", "test_resume_of_a_finished_run_trains_nothing_and_says_so"),
    ("rollback target saved right after a rejected step", "train.on_nonfinite=skip + a later stop",
     "handled: the newest checkpoint whose step was finite is named",
     "test_the_last_good_checkpoint_is_the_newest_whose_step_was_finite"),
    ("exit codes without a row in docs/faults.md", "run_8p.sh on a machine without Ascend (exit 3)",
     "handled: every code is in the table", "test_every_exit_code_is_in_the_faults_table"),
    ("SIGTERM during set-up or compile", "kill -TERM a `moetrain train` between run.json and its first step, then "
     "the same command with --resume", "handled: exit 75 at any moment (0 once the run is complete); --resume "
     "continues with the clean run's losses, or finds nothing to resume and starts again",
     "test_sigterm_at_ten_random_moments_then_resume_ends_with_the_clean_losses"),
    ("a --set that breaks a check of several keys", "--set parallel.model_parallel=3 (heads, vocabulary); --set "
     "data.path=[0.5, a, -1, b] (blend weights); --set model.num_layers=3 --set parallel.pipeline_stage=2; "
     "--set train.steps=3 --set train.steps=-1", "refused clearly: the message names the --set(s) in force that "
     "caused it, not the config file", "test_checks_of_several_keys_name_the_set_in_force_that_caused_them"),
    ("every CLI entry point on malformed input", "moetrain train/forward/generate/eval/plan/convert *, "
     "tools/preprocess_data.py, train_tokenizer.py, corpus_stats.py, convert_ckpt.py on a missing file, a folder, a "
     "garbage file, a damaged config.yaml, bad option values", "refused clearly: one message, exit 2, no traceback",
     "test_every_cli_entry_point_refuses_malformed_inputs_without_a_traceback"),
    ("tool messages", "corpus_stats.py on a missing / truncated prefix; train_tokenizer.py --vocab-size 3; moetrain "
     "forward on a text file named .npy; convert_ckpt.py --to-layout dp=3,ep=3 of a 4-expert model",
     "refused clearly: the file and the fix, no traceback, no advice that cannot work",
     "test_tool_messages_name_the_file_and_a_fix_that_works"),
    ("a rank stopped with SIGSTOP", "run_distributed.sh --nproc 2 --hang-timeout 60 --collective-timeout 30 (+ "
     "--max-restarts), kill -STOP one rank", "handled: that rank is named from the ranks' own reports, exit 124 "
     "(relaunched), whichever timeout fires first: a collective's, MindSpore's heartbeat, --hang-timeout (msrun: "
     "tests/test_launch_faults.py::test_fault_drill_one_trial_on_dp2, a SIGSTOP trial)",
     "test_a_hang_is_named_from_the_ranks_reports_whichever_timeout_fires_first"),
    ("hf-import of a damaged safetensors or config.json", "safetensors with a garbage header length; "
     "config.json without num_hidden_layers; config.json that is not JSON",
     "refused clearly: one line naming the file (and key)", "test_hf_import_of_damaged_files_names_the_file"),
    ("moetrain plan with more model chunks than layers", "moetrain plan moe_tiny.yaml --set parallel.pipeline_stage=2 "
     "--set parallel.pipeline_schedule=interleaved_1f1b --set parallel.pp_interleave_num=4",
     "refused clearly: the chunk rule once, no spurious 'needs a model made of layers'",
     "test_a_chunk_count_the_layers_cannot_fill_is_said_once"),
    ("moetrain plan --search on a world the layers do not divide", "moetrain plan moe_tiny.yaml --world 3 --search",
     "handled: searched (not refused on the config's inferred dp), pp3 with an uneven split found and fitting",
     "test_search_on_a_world_the_layers_do_not_divide_tries_uneven_pipeline_splits"),
]


def test_every_case_has_its_test():
    names = {name for name in globals() if name.startswith("test_")}
    assert [case for *case, test in CASES if test not in names] == []


def sets_args(sets):
    return [a for s in sets for a in ("--set", s)]


def make_trainer(sets, resume=None, overwrite=False, config=MNIST):
    from moetrain.trainer import Trainer

    return Trainer(load_config(config, sets), resume=resume, overwrite=overwrite)


def losses(run):
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        return [r["loss"] for r in map(json.loads, fh) if "loss" in r]


def steps_of(run):
    from moetrain.checkpoint.manager import list_checkpoints

    return [s for s, _ in list_checkpoints(os.path.join(run, "checkpoints"))]


def sha(path):
    from moetrain.fileio import sha256_of

    return sha256_of(str(path))


# ---------------------------------------------------------------------------------------------
# 1. A run owns its folder
# ---------------------------------------------------------------------------------------------
def test_ten_staggered_starts_into_one_folder_one_trains_and_the_others_are_refused_naming_the_holder(
        tiny_mnist, tmp_path):
    """Ten `moetrain train` processes into one output dir, started 0 to 5 s apart: exactly one
    trains; each of the others exits 2 naming the holder's pid, host and start time, writing
    nothing. The holder, stopped by SIGTERM, saves, exits 75 and releases the folder."""
    run = tmp_path / "twin"
    base = [f"data.path={tiny_mnist}", f"train.output_dir={run}", "model.hidden_size=16", "train.epochs=0",
            "train.steps=200000", "train.global_batch_size=32", "train.eval_batch_size=32",
            "checkpoint.save_steps=0", "logging.tensorboard=false", "logging.progress_bar=false"]
    procs, start = [], time.time()
    try:
        _race(procs, start, base, run, tmp_path)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _race(procs, start, base, run, tmp_path):
    from moetrain.checkpoint.run_dir import LOCK_FILE

    for i in range(10):
        time.sleep(max(0.0, start + i * 5 / 9 - time.time()))        # 0, 0.56, ..., 5 s
        cmd = [sys.executable, "-m", "moetrain.cli", "train", MNIST, *sets_args(base + [f"train.seed={i}"])]
        procs.append(subprocess.Popen(cmd, env=ENV, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = {}
    deadline = time.time() + 90        # the refused ones exit within a second or two of their start
    while time.time() < deadline and len(outputs) < 9:
        for i, proc in enumerate(procs):
            if i not in outputs and proc.poll() is not None:
                outputs[i] = proc.communicate()
        time.sleep(0.2)
    running = [i for i, p in enumerate(procs) if p.poll() is None]
    assert len(running) == 1, f"still running: {running}; exit codes: " + str({i: p.returncode for i, p in enumerate(procs)})
    winner = running[0]
    holder = json.loads((run / LOCK_FILE).read_text())
    assert holder["pid"] == procs[winner].pid and holder["host"] == socket.gethostname()
    for i, (out, err) in outputs.items():
        assert procs[i].returncode == 2, (i, err[-2000:])
        assert "Traceback" not in err and f"is in use by another run: process {procs[winner].pid} on host " \
            f"{socket.gethostname()} (rank 0 of its run, started {holder['since']}" in err, (i, err[-2000:])
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and losses(run)):
        time.sleep(0.1)
    procs[winner].send_signal(signal.SIGTERM)
    out, err = procs[winner].communicate(timeout=120)
    from moetrain.faults import EXIT_PREEMPTED

    assert procs[winner].returncode == EXIT_PREEMPTED, err[-3000:]
    assert not (run / LOCK_FILE).exists()                                    # released at the end
    # everything in the folder is the winner's
    import yaml

    assert yaml.safe_load((run / "resolved_config.yaml").read_text())["train"]["seed"] == winner
    (step,) = steps_of(str(run))
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    assert yaml.safe_load((ckpt / "config.yaml").read_text())["train"]["seed"] == winner
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    assert json.loads((ckpt / "manifest.json").read_text())["run_id"] == run_id
    assert [n for n in os.listdir(run) if "tmp" in n] == []


def test_a_stale_lock_is_taken_over_and_a_live_or_remote_one_refused(tmp_path, capsys):
    from moetrain.checkpoint.run_dir import (LOCK_FILE, OutputDirError, RunLockError, acquire_run_lock,
                                             check_lock_visible, read_lock)

    folder = tmp_path / "run"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"pid": int(dead.stdout), "host": socket.gethostname(), "since": "2026-01-01T00:00:00", "token": "old"}
    (folder / LOCK_FILE).write_text(json.dumps(stale))
    lock = acquire_run_lock(str(folder))                        # the dead process's lock: taken over
    assert f"taking over the stale lock {folder / LOCK_FILE} of process {stale['pid']}" in capsys.readouterr().err
    assert read_lock(str(folder / LOCK_FILE))["pid"] == os.getpid()
    lock.release()
    assert not (folder / LOCK_FILE).exists()

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        held = {"pid": live.pid, "host": socket.gethostname(), "since": "2026-01-02T03:04:05", "token": "live"}
        (folder / LOCK_FILE).write_text(json.dumps(held))
        with pytest.raises(RunLockError, match=rf"in use by another run: process {live.pid} on host "
                                               rf"{re.escape(socket.gethostname())} .*started 2026-01-02T03:04:05"):
            acquire_run_lock(str(folder))
    finally:
        live.kill()
        live.wait()
    remote = {"pid": 1, "host": "another-node-7", "since": "2026-01-02T03:04:05", "token": "remote"}
    (folder / LOCK_FILE).write_text(json.dumps(remote))
    with pytest.raises(RunLockError, match=rf"process 1 on host another-node-7 .*another host.*delete "
                                           rf"{re.escape(str(folder / LOCK_FILE))}"):
        acquire_run_lock(str(folder))
    assert read_lock(str(folder / LOCK_FILE))["token"] == "remote"     # untouched
    # another rank of a job must see rank 0's own lock (its token) in the shared folder
    check_lock_visible(str(folder), "remote", 1, timeout=1)
    with pytest.raises(OutputDirError, match=r"rank 1 on .* does not see rank 0's lock .*it holds process 1 on host "
                                             r"another-node-7.*one folder every rank shares"):
        check_lock_visible(str(folder), "rank-0-token", 1, timeout=0.3)


@pytest.mark.distributed
def test_in_a_job_rank_0_locks_the_folder_and_every_rank_sees_it(tmp_path):
    """Two ranks under the launcher (tests/workers/run_lock_worker.py): a folder another live process
    holds is refused on every rank (rank 0 naming the holder); a free one is locked by rank 0, every
    rank sees that lock before run.json is written at commit, and release removes it."""
    from distributed import run_workers

    from moetrain.checkpoint.run_dir import LOCK_FILE

    held = tmp_path / "held"
    held.mkdir()
    (held / LOCK_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": "pytest",
                                              "since": "2026-01-01T00:00:00"}))
    run = run_workers("tests/workers/run_lock_worker.py", 2, [str(held)], timeout=150, job_dir=str(tmp_path / "job"),
                      env={"PYTHONPATH": ENV["PYTHONPATH"]})
    results = {r["rank"]: r for r in run.json_results()}
    assert sorted(results) == [0, 1], run.report()
    assert f"is in use by another run: process {os.getpid()} on host" in results[0]["held_error"]
    assert "rank(s) [0] refused train.output_dir" in results[1]["held_error"]
    assert not (held / "run.json").exists() and json.loads((held / LOCK_FILE).read_text())["token"] == "pytest"
    for rank in (0, 1):
        assert results[rank]["lock_seen"]["pid"] == results[0]["pid"], results
        assert not results[rank]["run_json_before_commit"] and results[rank]["run_json"] == results[0]["run_id"]
    assert results[0]["run_id"] == results[1]["run_id"] and not results[0]["lock_after_release"]


def test_overwrite_validates_everything_before_moving_the_old_run_aside(mnist_overrides, tmp_path):
    from moetrain.checkpoint.manager import CheckpointError

    small = tmp_path / "small"
    make_trainer(mnist_overrides + [f"train.output_dir={small}", "train.steps=1", "model.hidden_size=16"]).fit()
    weights = str(small / "checkpoints" / "step_00000001")
    run = tmp_path / "run"
    sets = mnist_overrides + [f"train.output_dir={run}", "train.steps=2"]
    make_trainer(sets).fit()
    before = sorted(os.listdir(run))
    old_metrics = (run / "metrics.jsonl").read_text()
    # --overwrite, but the weights to start from are of another model: refused before anything moves
    with pytest.raises(CheckpointError, match=r"mismatching keys: model\.hidden_size"):
        make_trainer(sets + [f"checkpoint.load_path={weights}"], overwrite=True)
    assert sorted(os.listdir(run)) == before and (run / "metrics.jsonl").read_text() == old_metrics
    assert not [n for n in os.listdir(run) if n.startswith("overwritten-")]
    # a refused new run leaves nothing behind: no checkpoints/, logs/, run.json, not even the folder
    fresh = tmp_path / "fresh"
    with pytest.raises(CheckpointError, match=r"mismatching keys"):
        make_trainer(mnist_overrides + [f"train.output_dir={fresh}", f"checkpoint.load_path={weights}"])
    assert not fresh.exists()
    from moetrain import cli                  # also when `moetrain train` refuses the config itself

    assert cli.main(["train", MNIST, *sets_args(mnist_overrides + [f"train.output_dir={fresh}", "train.stepz=3"])]) == 2
    assert not fresh.exists()
    # the same --overwrite with a sound config then moves the old run aside as documented
    make_trainer(sets + ["train.steps=1"], overwrite=True).fit()
    assert len([n for n in os.listdir(run) if n.startswith("overwritten-")]) == 1 and len(losses(str(run))) == 1


def test_temporary_files_carry_pid_and_rank(tmp_path, monkeypatch):
    from moetrain import config as config_module
    from moetrain.checkpoint.run_dir import write_run_file
    from moetrain.fileio import temp_path

    assert temp_path("a/b.yaml", 3) == f"a/b.yaml.tmp-{os.getpid()}-r3"
    monkeypatch.setenv("RANK_ID", "5")
    assert temp_path("x") == f"x.tmp-{os.getpid()}-r5"
    renamed = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (renamed.append(os.path.basename(src)), real(src, dst)))
    config_module.dump_config(load_config(MNIST), str(tmp_path / "resolved_config.yaml"), rank=2)
    write_run_file(str(tmp_path), "abc")
    assert renamed == [f"resolved_config.yaml.tmp-{os.getpid()}-r2", f"run.json.tmp-{os.getpid()}-r5"]


# ---------------------------------------------------------------------------------------------
# 2. Writers never replace what they did not create
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    from test_hf_convert import LLAMA_CONFIG, random_hf_weights, write_hf_checkpoint

    root = tmp_path_factory.mktemp("hf")
    write_hf_checkpoint(root / "hf", LLAMA_CONFIG, random_hf_weights(LLAMA_CONFIG, seed=3))
    return root / "hf"


def fake_checkpoint(folder):
    """A training checkpoint folder as the trainer leaves it (only what the writers look at)."""
    folder.mkdir(parents=True)
    for name in ("metadata.json", "manifest.json", "config.yaml", "model.safetensors"):
        (folder / name).write_text(f"the run's own {name}")
    return {name: sha(folder / name) for name in os.listdir(folder)}


def test_hf_import_never_replaces_a_checkpoint_or_an_unasked_folder(hf_llama, tmp_path, capsys):
    from moetrain.checkpoint.hf import main_import

    ckpt = tmp_path / "runs" / "x" / "checkpoints" / "step_00000002"
    saved = fake_checkpoint(ckpt)
    for extra in ([], ["--overwrite"]):
        assert main_import([str(hf_llama), str(ckpt), *extra]) == 2
        err = capsys.readouterr().err
        assert f"the output '{ckpt}' is a training checkpoint (it holds metadata.json)" in err
    assert {name: sha(ckpt / name) for name in os.listdir(ckpt)} == saved        # untouched
    run_dir = tmp_path / "runs" / "x"
    assert main_import([str(hf_llama), str(run_dir), "--overwrite"]) == 2
    assert "a training run's output directory" in capsys.readouterr().err

    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    assert main_import([str(hf_llama), str(used)]) == 2
    assert "is not empty (notes.txt); choose a new folder, or pass --overwrite" in capsys.readouterr().err
    assert sorted(os.listdir(used)) == ["notes.txt"]
    assert main_import([str(hf_llama), str(used), "--overwrite"]) == 0
    assert sorted(os.listdir(used)) == ["config.yaml", "model.safetensors", "notes.txt"]
    assert main_import([str(hf_llama), str(used)]) == 2                         # an earlier import: asked again
    assert main_import([str(hf_llama), str(tmp_path / "new")]) == 0             # a new folder needs nothing


def test_hf_export_refuses_a_used_folder_and_overwrite_leaves_no_stale_shards(hf_llama, tmp_path, capsys):
    from moetrain.checkpoint.hf import hf_import, main_export
    from test_hf_convert import LLAMA_CONFIG, random_hf_weights, write_hf_checkpoint

    model = tmp_path / "model"
    hf_import(str(hf_llama), str(model))
    sharded = tmp_path / "sharded"
    write_hf_checkpoint(sharded, LLAMA_CONFIG, random_hf_weights(LLAMA_CONFIG, seed=9), shards=2)
    (sharded / "tokenizer.json").write_text("{}")
    before = {n: sha(sharded / n) for n in os.listdir(sharded)}
    assert main_export([str(model), str(sharded)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert {n: sha(sharded / n) for n in os.listdir(sharded)} == before
    assert main_export([str(model), str(sharded), "--overwrite"]) == 0
    assert sorted(os.listdir(sharded)) == ["config.json", "model.safetensors", "tokenizer.json"]  # no old index
    assert main_export([str(model), str(sharded)]) == 2                         # an earlier export: asked again
    ckpt = tmp_path / "checkpoints" / "step_00000004"
    saved = fake_checkpoint(ckpt)
    assert main_export([str(model), str(ckpt), "--overwrite"]) == 2
    assert "is a training checkpoint" in capsys.readouterr().err
    assert {name: sha(ckpt / name) for name in os.listdir(ckpt)} == saved


def test_other_model_writers_refuse_used_and_checkpoint_folders(hf_llama, tmp_path, capsys):
    from moetrain import cli
    from moetrain.checkpoint import upcycle
    from moetrain.checkpoint.hf import hf_import

    dense = tmp_path / "dense"
    hf_import(str(hf_llama), str(dense))
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    args = ["--num-experts", "2", "--top-k", "1"]
    assert upcycle.main([str(dense), str(used), *args]) == 2
    assert "is not empty (notes.txt)" in capsys.readouterr().err
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    saved = fake_checkpoint(ckpt)
    assert upcycle.main([str(dense), str(ckpt), *args, "--overwrite"]) == 2
    assert "is a training checkpoint" in capsys.readouterr().err
    assert upcycle.main([str(dense), str(used), *args, "--overwrite"]) == 0
    assert {name: sha(ckpt / name) for name in os.listdir(ckpt)} == saved
    # consolidate and reshard write only new folders
    for command in (["consolidate", str(ckpt), str(used)], ["reshard", str(ckpt), str(ckpt), "--to-layout", "dp=2"]):
        assert cli.main(["convert", *command]) == 2
        assert "exists; choose a new output folder" in capsys.readouterr().err
    assert {name: sha(ckpt / name) for name in os.listdir(ckpt)} == saved


def _tool(name, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", f"{name}.py"), *args], env=ENV,
                          capture_output=True, text=True, timeout=120)


def test_preprocess_and_tokenizer_training_refuse_existing_outputs(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(open(os.path.join(KJV, "kjv_tiny.txt"), encoding="utf-8").readlines()[:300]))
    prefix = tmp_path / "tok"
    tokenizer = ["--input", str(text), "--model-prefix", str(prefix), "--vocab-size", "300"]
    assert _tool("train_tokenizer", *tokenizer).returncode == 0
    first = sha(str(prefix) + ".model")
    again = _tool("train_tokenizer", *tokenizer)
    assert again.returncode == 2 and "tok.model" in again.stderr and "--overwrite" in again.stderr
    assert "Traceback" not in again.stderr and sha(str(prefix) + ".model") == first
    assert _tool("train_tokenizer", *tokenizer, "--overwrite").returncode == 0

    shards = tmp_path / "shards"
    encode = ["--input", str(text), "--tokenizer", str(prefix) + ".model", "--output-prefix", str(shards),
              "--eval-fraction", "0.1", "--no-progress"]
    assert _tool("preprocess_data", *encode).returncode == 0
    made = {n: sha(tmp_path / n) for n in os.listdir(tmp_path) if n.startswith("shards_")}
    assert len(made) == 6
    again = _tool("preprocess_data", *encode)
    assert again.returncode == 2 and "shards_train.bin" in again.stderr and "--overwrite" in again.stderr
    assert {n: sha(tmp_path / n) for n in made} == made
    assert _tool("preprocess_data", *encode, "--overwrite").returncode == 0
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    fake_checkpoint(ckpt)
    into = _tool("preprocess_data", *encode[:4], "--output-prefix", str(ckpt / "data"), "--overwrite")
    assert into.returncode == 2 and "is a training checkpoint" in into.stderr


# ---------------------------------------------------------------------------------------------
# 3. Caches verify their contents
# ---------------------------------------------------------------------------------------------
def test_a_damaged_blend_index_cache_is_rebuilt_with_a_warning(tmp_path):
    from moetrain.config import load_config as load
    from moetrain.data import DataError, build_sampler
    from moetrain.data.blend import BlendedBatchSampler, build_blended_lm_dataset, parse_blend

    spec = [0.7, os.path.join(KJV, "kjv_tiny_train"), 0.3, os.path.join(KJV, "kjv_tiny_eval")]
    dataset = build_blended_lm_dataset(parse_blend(spec), 64, 2048)
    first = BlendedBatchSampler(dataset, 8, 20, seed=1, cache_dir=str(tmp_path / "cache"))
    good = np.array(first.index)
    assert first.built and good.any()
    header = os.path.getsize(first.index_path) - good.nbytes
    with open(first.index_path, "r+b") as fh:             # zeros over the array, the same size
        fh.seek(header)
        fh.write(np.zeros_like(good).tobytes())
    with pytest.warns(UserWarning, match=r"blend index cache .*blend-.*\.npy cannot be used: its contents do not "
                                         r"match the sha256 .*rebuilding it"):
        again = BlendedBatchSampler(dataset, 8, 20, seed=1, cache_dir=str(tmp_path / "cache"))
    assert again.built and np.array_equal(again.index, good)
    reused = BlendedBatchSampler(dataset, 8, 20, seed=1, cache_dir=str(tmp_path / "cache"))
    assert not reused.built and np.array_equal(reused.index, good)
    # data.cache_dir naming a file: one clear error
    (tmp_path / "a_file").write_text("x")
    cfg = load(GPT_TINY, [f"data.path={spec}", f"data.cache_dir={tmp_path / 'a_file' / 'cache'}", "train.steps=4"])
    from moetrain.data import build_datasets

    with pytest.raises(DataError, match=r"data.cache_dir .*a_file.* is a file; set data.cache_dir to a folder"):
        build_sampler(cfg, build_datasets(cfg)[0])


# ---------------------------------------------------------------------------------------------
# 4. Train and eval data are checked against each other
# ---------------------------------------------------------------------------------------------
def test_eval_data_of_another_tokenizer_is_refused_without_data_tokenizer(tmp_path):
    from moetrain.data import DataError, build_datasets
    from moetrain.data.preprocess import preprocess
    from moetrain.data.tokenizer import train_tokenizer

    text = tmp_path / "corpus.txt"
    text.write_text("".join(open(os.path.join(KJV, "kjv_tiny.txt"), encoding="utf-8").readlines()[:400]))
    other = train_tokenizer([str(text)], str(tmp_path / "other"), 300)
    preprocess([str(text)], other, str(tmp_path / "other_eval"))
    cfg = load_config(GPT_TINY, [f"data.eval_path={tmp_path / 'other_eval'}", "data.tokenizer=''"])
    with pytest.raises(DataError, match=r"data.eval_path .*other_eval' was encoded with another tokenizer than "
                                        r"data.path .*kjv_tiny_train'.*300 tokens\) vs .*kjv_tiny.model.*2048 tokens"):
        build_datasets(cfg)
    # the same tokenizer's shards pass, with or without data.tokenizer
    for tokenizer in ("''", os.path.join(KJV, "kjv_tiny.model")):
        train, evaluation = build_datasets(load_config(GPT_TINY, [f"data.tokenizer={tokenizer}"]))
        assert len(train) and len(evaluation)


# ---------------------------------------------------------------------------------------------
# 5. Exit status tells the truth
# ---------------------------------------------------------------------------------------------
def _fail_saves(monkeypatch, step, times):
    """The next `times` saves of checkpoint `step` fail as on a full disk."""
    from moetrain.checkpoint.manager import CheckpointWriter

    real, left = CheckpointWriter.tensors, [times]

    def tensors(self, filename, arrays):
        if self.name == f"step_{step:08d}" and left[0] > 0:
            left[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, filename, arrays)

    monkeypatch.setattr(CheckpointWriter, "tensors", tensors)


def test_the_final_checkpoint_is_retried_and_its_failure_fails_the_run(mnist_overrides, tmp_path, monkeypatch,
                                                                        capsys):
    from moetrain import cli
    from moetrain.checkpoint.manager import CheckpointSaveError
    from moetrain.faults import EXIT_SAVE_FAILED

    base = mnist_overrides + ["train.steps=3", "checkpoint.save_steps=1", "checkpoint.keep_max=5",
                              "checkpoint.on_save_error=continue"]
    run = tmp_path / "transient"
    _fail_saves(monkeypatch, 3, 1)             # the disk fills once: the retry writes it
    make_trainer(base + [f"train.output_dir={run}"]).fit()
    assert steps_of(str(run)) == [1, 2, 3]
    assert "trying once more" in capsys.readouterr().out
    run = tmp_path / "full"
    _fail_saves(monkeypatch, 3, 2)
    with pytest.raises(CheckpointSaveError, match=r"final checkpoint \(step 3\) could not be written, even on a "
                                                  r"second try: .*No space left on device.*step_00000002 is intact"):
        make_trainer(base + [f"train.output_dir={run}"]).fit()
    assert steps_of(str(run)) == [1, 2]
    run = tmp_path / "cli"
    _fail_saves(monkeypatch, 3, 2)
    assert cli.main(["train", MNIST, *sets_args(base + [f"train.output_dir={run}"])]) == EXIT_SAVE_FAILED
    assert "final checkpoint (step 3) could not be written" in capsys.readouterr().err


def test_resume_of_a_finished_run_trains_nothing_and_says_so(mnist_overrides, tmp_path, capsys):
    from moetrain import cli

    run = tmp_path / "run"
    sets = mnist_overrides + [f"train.output_dir={run}", "train.steps=4", "checkpoint.save_steps=2"]
    make_trainer(sets).fit()
    before = {n: sha(run / n) for n in ("run.json", "metrics.jsonl", "resolved_config.yaml")}
    code = cli.main(["train", MNIST, *sets_args(sets + ["train.steps=2"]), "--resume"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(r"checkpoint error: --resume .*step_00000004: the checkpoint is at step 4 and the run ends at "
                     r"step 2 \(train.steps\): there is nothing to train. To train on, raise train.steps above 4", err)
    assert {n: sha(run / n) for n in before} == before        # nothing was written
    assert cli.main(["train", MNIST, *sets_args(sets + ["train.steps=4"]), "--resume"]) == 2   # equal: nothing either
    assert cli.main(["train", MNIST, *sets_args(sets + ["train.steps=5"]), "--resume"]) == 0
    assert len(losses(str(run))) == 5


def test_the_last_good_checkpoint_is_the_newest_whose_step_was_finite(mnist_overrides, tmp_path):
    from moetrain.checkpoint.run_dir import last_good_checkpoint, read_run_id
    from moetrain.faults import TrainingHalted

    run = tmp_path / "run"
    sets = mnist_overrides + [f"train.output_dir={run}", "train.steps=6", "checkpoint.save_steps=1",
                              "checkpoint.keep_max=6", "train.on_nonfinite=skip", "train.nonfinite_limit=1"]
    trainer = make_trainer(sets)
    real = trainer.faults.guard.diagnose

    def diagnose(loss, grad_norm=None, finite=True):          # steps 2 and 3 are faults
        return "injected fault" if trainer.step + 1 in (2, 3) else real(loss, grad_norm, finite)

    trainer.faults.guard.diagnose = diagnose
    with pytest.raises(TrainingHalted) as info:
        trainer.fit()
    good = str(run / "checkpoints" / "step_00000001")
    assert steps_of(str(run)) == [1, 2]              # step 2 was saved right after its rejected update
    assert f"The last good checkpoint is {good};" in str(info.value), str(info.value)
    assert last_good_checkpoint(str(run), read_run_id(str(run))) == good
    meta = json.loads((run / "checkpoints" / "step_00000002" / "metadata.json").read_text())
    assert meta["trainer_state"]["step_finite"] is False


def test_every_exit_code_is_in_the_faults_table():
    """Every code the trainer (moetrain.faults, cli) and the launcher (launch.py, run_scripts) return
    has a row in docs/faults.md's table."""
    from moetrain import faults

    table = open(os.path.join(ROOT, "docs", "faults.md"), encoding="utf-8").read().split("## Exit codes")[1]
    table = table.split("\n## ")[0]
    rows = set(re.findall(r"^\| (\d+)", table, re.M))
    used = {str(v) for k, v in vars(faults).items() if k.startswith("EXIT_")}
    for path in ("moetrain/cli.py", "moetrain/distributed/launch.py", "run_scripts/run_distributed.sh",
                 "run_scripts/run_8p.sh", "run_scripts/run_multinode.sh"):
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        used |= set(re.findall(r"\breturn (\d+)\b", text)) | set(re.findall(r"\bexit (\d+)\b", text))
        used |= set(re.findall(r"sys\.exit\((\d+)\)", text))
    assert sorted(used - rows, key=int) == []
    assert {"1", "128"} <= rows          # an unexpected error or msrun's own failure; killed by a signal (128 + N)


# ---------------------------------------------------------------------------------------------
# 6. Damaged inputs: one line naming the file
# ---------------------------------------------------------------------------------------------
def test_hf_import_of_damaged_files_names_the_file(hf_llama, tmp_path, capsys):
    from moetrain.checkpoint.hf import main_import

    def broken(name, config=None, weights=None):
        folder = tmp_path / name
        shutil.copytree(hf_llama, folder)
        if config is not None:
            (folder / "config.json").write_text(config)
        if weights is not None:
            (folder / "model.safetensors").write_bytes(weights)
        assert main_import([str(folder), str(tmp_path / f"{name}_out")]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "MemoryError" not in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / f"{name}_out").exists()
        return err, folder

    err, folder = broken("huge", weights=np.array([2 ** 62], "<u8").tobytes() + b"\xff" * 64)
    assert f"{folder / 'model.safetensors'}: not a safetensors file, or truncated: its header length says" in err
    err, folder = broken("binary", weights=np.array([16], "<u8").tobytes() + b"\xff\xfe" * 8 + b"\0" * 32)
    assert f"{folder / 'model.safetensors'}: not a safetensors file: its header is not UTF-8 JSON" in err
    config = json.loads((hf_llama / "config.json").read_text())
    del config["num_hidden_layers"]
    err, folder = broken("no_layers", config=json.dumps(config))
    assert f"{folder / 'config.json'}: the key 'num_hidden_layers' is missing" in err
    err, folder = broken("not_json", config='{"model_type": "llama",')
    assert f"{folder / 'config.json'} is not valid JSON" in err


# ---------------------------------------------------------------------------------------------
# moetrain plan
# ---------------------------------------------------------------------------------------------
MOE_TINY = os.path.join(ROOT, "configs", "moe_tiny.yaml")


def test_a_chunk_count_the_layers_cannot_fill_is_said_once(capsys):
    """Issue 37: a pipeline of a layered model whose chunks outnumber its layers is refused for that,
    without the rule for models that are not made of layers."""
    from moetrain.planner import main

    args = [MOE_TINY, "--set", "parallel.pipeline_stage=2", "--set",
            "parallel.pipeline_schedule=interleaved_1f1b", "--set", "parallel.pp_interleave_num=4",
            "--set", "parallel.micro_batch_num=2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "every chunk needs a layer" in err
    assert "needs a model made of layers" not in err


def test_search_on_a_world_the_layers_do_not_divide_tries_uneven_pipeline_splits(capsys):
    """Issue 37: `--search --world 3` searches (the config's inferred data_parallel of 3 cannot split
    the batch, but the search picks dp itself) and finds pp3 with the layers split 2,1,1 or 1,1,2,
    which validates and fits; moetrain plan of that layout agrees."""
    from moetrain.layout import Layout
    from moetrain.planner import (Job, apply_layout, choose_layout, load_plan_config, main, pipeline_splits, plan,
                                  plan_problems)

    cfg = load_plan_config(MOE_TINY)
    assert main([cfg.source, "--world", "3", "--search"]) == 0
    out = capsys.readouterr().out
    chosen = next(line for line in out.splitlines() if line.split()[:1] == ["chosen"])
    assert chosen.split()[:4] == ["chosen", "dp1", "tp1", "pp3"] and ("layers=2,1,1" in chosen or "layers=1,1,2" in chosen)
    assert "FITS" in out
    settings, search = choose_layout(cfg, 3)
    assert settings["pipeline_stage"] == 3 and sorted(settings["pipeline_layers"]) == [1, 1, 2]
    chosen_cfg = apply_layout(cfg, search.chosen.layout)
    assert plan(chosen_cfg, 3).fits and not plan_problems(Job.of(chosen_cfg), Layout.of(chosen_cfg), 3)
    assert pipeline_splits(Job.of(cfg).arch, 3, 1) == [(2, 1, 1), (1, 1, 2)]
    assert pipeline_splits(Job.of(cfg).arch, 2, 1) == [None]          # even: no list needed


# ---------------------------------------------------------------------------------------------
# 7. --set blame, one error path, tool messages
# ---------------------------------------------------------------------------------------------
def test_checks_of_several_keys_name_the_set_in_force_that_caused_them(tmp_path):
    from moetrain.config import ConfigError

    moe = os.path.join(ROOT, "configs", "moe_tiny.yaml")

    def error(path, *sets):
        with pytest.raises(ConfigError) as info:
            load_config(path, list(sets))
        return str(info.value)

    # layout x heads x vocabulary: the --set that changed one of the keys is named, whatever the check says
    assert error(moe, "parallel.model_parallel=3", "train.seed=4").startswith(
        f"--set parallel.model_parallel=3 (on top of {moe}): the parallel layout cannot run")
    assert error(moe, "model.num_heads=3").startswith(f"--set model.num_heads=3 (on top of {moe}): ")
    # blend weights
    blend = f"data.path=[0.5, {KJV}/kjv_tiny_train, -1, {KJV}/kjv_tiny_eval]"
    assert error(moe, blend).startswith(f"--set {blend} (on top of {moe}): data.path: the weight of")
    # two --sets that fail only together are both named
    assert error(moe, "model.num_layers=3", "parallel.pipeline_stage=2", "train.seed=4").startswith(
        f"--set model.num_layers=3 --set parallel.pipeline_stage=2 (on top of {moe}): the parallel layout")
    # a repeated --set: the last one is in force, and the one named
    assert error(moe, "train.steps=3", "train.steps=-1").startswith(f"--set train.steps=-1 (on top of {moe}): ")
    message = error(moe, "train.steps=-1", "train.steps=3", "train.eval_interval=-2")
    assert message.startswith(f"--set train.eval_interval=-2 (on top of {moe}): key 'train.eval_interval'"), message
    # the file's own error stays the file's, whatever --set rides along
    own = tmp_path / "own.yaml"
    own.write_text(f"base: {moe}\nparallel:\n  model_parallel: 3\n")
    assert error(str(own), "train.seed=4", "model.num_layers=4").startswith(f"{own}: the parallel layout cannot run")


def _tool_cli(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"red_team_{name}", os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cli


def _call(entry, argv, capsys):
    """An entry point called as its script calls it: (exit code, stderr). An exception that escapes is
    what a user would see as a traceback, so it fails the test as one."""
    try:
        code = entry(argv)
    except SystemExit as exc:          # argparse's own usage errors: one line after the usage line, exit 2
        code = exc.code
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    """A 4-expert model directory (the Mixtral golden checkpoint, imported)."""
    from moetrain.checkpoint.hf import hf_import

    out = tmp_path_factory.mktemp("mixtral") / "model"
    hf_import(os.path.join(ROOT, "tests", "golden", "mixtral"), str(out))
    return str(out)


def test_every_cli_entry_point_refuses_malformed_inputs_without_a_traceback(mixtral_dir, tmp_path, capsys):
    """Every command a user runs, on a missing file, a folder, a garbage file, a model folder with a
    damaged config.yaml, and bad option values: a message naming what (and where), exit 2, no
    traceback."""
    from moetrain import cli

    missing, folder, garbage = str(tmp_path / "missing"), str(tmp_path / "folder"), str(tmp_path / "garbage.bin")
    os.mkdir(folder)
    (tmp_path / "garbage.bin").write_bytes(bytes(range(256)) * 2)
    (tmp_path / "text.npy").write_text("not an array\n")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.yaml").write_text("model: [1, 2")
    (damaged / "model.safetensors").write_bytes(b"\xff" * 64)
    ids = os.path.join(ROOT, "tests", "golden", "mixtral", "input_ids.npy")
    out = str(tmp_path / "out")
    tok, txt, shard = os.path.join(KJV, "kjv_tiny.model"), os.path.join(KJV, "kjv_tiny.txt"), os.path.join(KJV, "kjv_tiny_eval")
    preprocess, tokenizer = _tool_cli("preprocess_data"), _tool_cli("train_tokenizer")
    corpus_stats, convert_ckpt = _tool_cli("corpus_stats"), _tool_cli("convert_ckpt")
    bad_paths = (missing, folder, garbage, str(damaged))
    cases = []        # (entry, argv, what the message must name)
    for bad in bad_paths:
        name = bad if bad != str(damaged) else os.path.join(bad, "config.yaml")
        cases += [
            (cli.main, ["train", bad if bad != str(damaged) else os.path.join(bad, "config.yaml")], name),
            (cli.main, ["forward", bad, "--input", ids, "--output", out + ".npy"], bad),
            (cli.main, ["generate", bad, "--prompt", "In the beginning"], bad),
            (cli.main, ["eval", bad, "--data", shard], bad),
            (cli.main, ["convert", "hf-export", bad, out], bad),
            (cli.main, ["convert", "upcycle", bad, out, "--num-experts", "2", "--top-k", "1"], bad),
            (cli.main, ["convert", "reshard", bad, out, "--to-layout", "dp=2"], bad),
            (cli.main, ["convert", "consolidate", bad, out], bad),
            (convert_ckpt, [bad, out, "--consolidate"], bad),
            (corpus_stats, [bad], bad),
            (corpus_stats, [shard, "--reference", bad], bad),
        ]
        if bad != str(damaged):
            cases += [
                (cli.main, ["plan", bad], bad),
                (cli.main, ["convert", "hf-import", bad, out], bad),
                (cli.main, ["forward", mixtral_dir, "--input", bad, "--output", out + ".npy"], bad),
                (preprocess, ["--input", bad, "--tokenizer", tok, "--output-prefix", out], bad),
                (preprocess, ["--input", txt, "--tokenizer", bad, "--output-prefix", out], bad),
                (tokenizer, ["--input", bad, "--model-prefix", out, "--vocab-size", "300"], bad),
            ]
    cases += [        # bad option values
        (cli.main, ["train", MNIST, "--set", "train.steps=abc"], "--set train.steps=abc"),
        (cli.main, ["train", MNIST, "--set", f"data.path={folder}"], folder),
        (cli.main, ["train", MNIST, "--set", f"train.output_dir={tmp_path / 'r'}", "--resume", garbage], garbage),
        (cli.main, ["forward", mixtral_dir, "--input", str(tmp_path / "text.npy"), "--output", out + ".npy"], "text.npy"),
        (cli.main, ["forward", mixtral_dir, "--input", ids, "--output", folder], "--output"),
        (cli.main, ["forward", mixtral_dir, "--input", ids, "--output", out + ".npy", "--batch-size", "0"], "--batch-size"),
        (cli.main, ["plan", MNIST, "--world", "0"], "--world"),
        (cli.main, ["generate", mixtral_dir, "--input", ids, "--max-new-tokens", "-3"], "--max-new-tokens"),
        (cli.main, ["eval", mixtral_dir, "--data", garbage], garbage),
        (cli.main, ["convert", "reshard", mixtral_dir, out, "--to-layout", "dp=x"], "--to-layout"),
        (convert_ckpt, [mixtral_dir, out, "--to-layout", "dp=3,ep=3"], "--to-layout dp=3,ep=3"),
        (preprocess, ["--input", txt, "--tokenizer", tok, "--output-prefix", out, "--eval-fraction", "1.5"],
         "--eval-fraction"),
        (preprocess, ["--input", txt, "--tokenizer", tok, "--output-prefix", out, "--workers", "0"], "--workers"),
        (preprocess, ["--input", txt, "--tokenizer", tok, "--output-prefix", os.path.join(garbage, "x")], garbage),
        (tokenizer, ["--input", txt, "--model-prefix", out, "--vocab-size", "3"], "vocab_size=3"),
        (tokenizer, ["--input", txt, "--model-prefix", out, "--vocab-size", "300", "--character-coverage", "7"],
         "character_coverage"),
        (tokenizer, ["--input", txt, "--model-prefix", os.path.join(garbage, "tok"), "--vocab-size", "300"], garbage),
    ]
    for entry, argv, named in cases:
        code, err = _call(entry, argv, capsys)
        where = f"{getattr(entry, '__module__', entry)} {argv}: exit {code}\n{err[-1500:]}"
        assert code == 2 and "Traceback" not in err, where
        assert named in err, where
    assert not os.path.exists(out) and not os.path.exists(out + ".npy")


def test_tool_messages_name_the_file_and_a_fix_that_works(mixtral_dir, tmp_path, capsys):
    from moetrain import cli

    corpus_stats = _tool_cli("corpus_stats")
    shard = tmp_path / "cut"                   # a truncated token file
    for suffix in (".bin", ".idx.npy", ".json"):
        shutil.copy(os.path.join(KJV, "kjv_tiny_eval" + suffix), str(shard) + suffix)
    with open(str(shard) + ".bin", "r+b") as fh:
        fh.truncate(100)
    code, err = _call(corpus_stats, [str(shard)], capsys)
    assert code == 2 and err.startswith(f"corpus_stats.py: error: corrupted token file '{shard}.bin': 100 bytes") \
        and len(err.strip().splitlines()) == 1, err
    code, err = _call(corpus_stats, [str(tmp_path / "nowhere")], capsys)
    assert code == 2 and err.startswith(f"corpus_stats.py: error: token shard '{tmp_path / 'nowhere'}' is missing"), err

    tokenizer = _tool_cli("train_tokenizer")
    code, err = _call(tokenizer, ["--input", os.path.join(KJV, "kjv_tiny.txt"), "--model-prefix",
                                  str(tmp_path / "tok"), "--vocab-size", "3"], capsys)
    assert code == 2 and "vocab_size=3 is too small: 4 ids are reserved (unk, bos, eos, pad)" in err, err
    assert "INTERNAL" not in err
    few = tmp_path / "few.txt"
    few.write_text("ab ab ab\nba ba\n")
    code, err = _call(tokenizer, ["--input", str(few), "--model-prefix", str(tmp_path / "few"), "--vocab-size", "6"],
                      capsys)
    assert code == 2 and "one per distinct character of the input (3): use a vocab_size of at least 7" in err, err
    assert _call(tokenizer, ["--input", str(few), "--model-prefix", str(tmp_path / "few"), "--vocab-size", "7"],
                 capsys)[0] == 0                                           # the advice works

    text = tmp_path / "ids.npy"
    text.write_text("1 2 3\n")
    code, err = _call(cli.main, ["forward", mixtral_dir, "--input", str(text), "--output", str(tmp_path / "o.npy")],
                      capsys)
    assert code == 2 and f"{text}: not a .npy array file" in err and "np.save" in err, err

    convert_ckpt = _tool_cli("convert_ckpt")
    code, err = _call(convert_ckpt, [mixtral_dir, str(tmp_path / "resharded"), "--to-layout", "dp=3,ep=3"], capsys)
    assert code == 2 and "model.moe.num_experts (4) is not divisible by parallel.expert_parallel (3)" in err, err
    assert "resume with ep=3" not in err
    code, err = _call(convert_ckpt, [mixtral_dir, str(tmp_path / "resharded"), "--to-layout", "dp=2,ep=2"], capsys)
    assert code == 2 and "resume with ep=2 directly" in err, err            # a valid size: that advice stands


# ---------------------------------------------------------------------------------------------
# 8. Hangs are named
# ---------------------------------------------------------------------------------------------
def test_a_hang_is_named_from_the_ranks_reports_whichever_timeout_fires_first(tmp_path, capsys):
    """The launcher's watchdog (moetrain.distributed.launch.Job.wait) on a 2-rank job whose rank 1 is stopped
    (a real SIGSTOPped process stands for it) at step 5 while rank 0 waits for it, for each timeout
    that can fire first: rank 0's collective times out, MindSpore's scheduler gives up on rank 1, msrun
    exits on its own, or --hang-timeout. Each is reported as a hang on rank 1 with exit 124, never as
    a failure of the healthy rank 0 or the scheduler; a plain failure of rank 0 is still rank 0's."""
    from moetrain.distributed import launch

    stopped = subprocess.Popen(["sleep", "120"])
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        for first, stuck_pid in (("collective", stopped.pid), ("scheduler", stopped.pid), ("msrun", stopped.pid),
                                 ("hang", stopped.pid), ("collective", None), ("raised", stopped.pid)):
            job = launch.Job(["x"], 2, log_dir=str(tmp_path / f"{first}-{stuck_pid}"),
                             hang_timeout=5 if first == "hang" else 1800)
            os.makedirs(job.status_dir)
            now = time.time()
            with open(os.path.join(job.status_dir, "progress_0.json"), "w") as fh:
                json.dump({"rank": 0, "step": 5, "phase": "step", "time": now - 30 * (first == "hang"),
                           "pid": os.getpid()}, fh)
            with open(os.path.join(job.status_dir, "progress_1.json"), "w") as fh:
                json.dump({"rank": 1, "step": 5, "phase": "step", "time": now - 30, "pid": stuck_pid}, fh)
            for rank, age in ((0, 0), (1, 30)):                  # rank 0 alive (waiting), rank 1 silent since the stop
                with open(os.path.join(job.status_dir, f"alive_{rank}.json"), "w") as fh:
                    json.dump({"rank": rank, "time": now - age, "pid": os.getpid()}, fh)
            failing = {"collective": 0, "raised": 0, "scheduler": launch.SCHEDULER}.get(first)
            if failing is not None:
                log = "scheduler.log" if failing == launch.SCHEDULER else f"worker_{failing}.log"
                with open(os.path.join(job.log_dir, log), "w") as fh:
                    fh.write("RuntimeError: AllReduce: wait for the peers timed out after 30 s\n" if first != "raised"
                             else "RuntimeError: rank 0 fails on purpose\n")
                with open(os.path.join(job.status_dir, f"rank_{failing}.json"), "w") as fh:
                    json.dump({"rank": failing, "returncode": 1, "finished_at": now}, fh)
            command = ["sh", "-c", "exit 1"] if first == "msrun" else ["sleep", "60"]
            job.proc = subprocess.Popen(command, start_new_session=True)
            if first == "msrun":
                job.proc.wait()
            code = job.wait(poll_interval=0.1)
            err = capsys.readouterr().err
            where = f"{first} (stuck pid {stuck_pid}): exit {code}\n{err}"
            if first == "raised":
                assert code == 1 and "rank 0 exited with code 1" in err and "hangs" not in err, where
                continue
            assert code == 124 and "[moetrain.launch] the job hangs on rank 1 (step 5, " in err, where
            assert ("its process is stopped" if stuck_pid else "no sign of life for 30 s") in err, where
            assert {"collective": "rank 0 gave up waiting for it in a collective", "msrun": "msrun ended with code 1",
                    "scheduler": "MindSpore's scheduler gave up on it",
                    "hang": "no step reported for 5 s (--hang-timeout)"}[first] in err, where
            assert "hangs on rank 0" not in err, where
    finally:
        stopped.kill()
        stopped.wait()


# ---------------------------------------------------------------------------------------------
# 9. SIGTERM at any moment
# ---------------------------------------------------------------------------------------------
SIGTERM_SEED = 37
CPU_LIMIT = 240     # one 400-step MNIST run takes ~10 CPU s: far past it is a runaway


@pytest.mark.background_child
@child_only(__name__)
def test_sigterm_at_ten_seeded_moments(tiny_mnist, tmp_path):
    """Ten `moetrain train` processes, each sent SIGTERM at a seeded moment in one tenth of a clean
    run's lifetime (start-up, MindSpore's import, set-up, compile, steps, the final save, the exit),
    then the documented recovery: the same command with --resume. Each ends with the clean run's
    losses: stopped with 75 and resumed (from its checkpoint, or finding none and starting again), or
    it had finished (0). A signal before moetrain's handler exists (the interpreter's start) kills
    the process before it wrote anything; --resume then starts again too."""
    from moetrain.faults import EXIT_PREEMPTED

    sets = [f"data.path={tiny_mnist}", "model.hidden_size=16", "train.epochs=0", "train.steps=400",
            "train.global_batch_size=32", "train.eval_batch_size=32", "checkpoint.save_steps=0",
            "lr_schedule.warmup_steps=0", "logging.tensorboard=false", "logging.progress_bar=false"]

    def command(out):
        return [sys.executable, "-m", "moetrain.cli", "train", MNIST, *sets_args(sets + [f"train.output_dir={out}"])]

    # a warm start first (MindSpore's files in the page cache), so the clean run's lifetime is the trials'
    # (this child runs at idle priority beside the suite: each process is timed by its own CPU, not the wall)
    run_patiently([sys.executable, "-c", "import moetrain.trainer"], CPU_LIMIT, env=ENV)
    start = time.time()
    clean = run_patiently(command(tmp_path / "clean"), CPU_LIMIT, env=ENV, cwd=str(tmp_path))
    lifetime = time.time() - start
    assert clean.returncode == 0, clean.stderr[-2000:]
    reference = losses(str(tmp_path / "clean"))
    assert len(reference) == 400
    rng = np.random.default_rng(SIGTERM_SEED)
    outcomes = []
    for i in range(10):
        moment = (i + rng.random()) / 10 * lifetime            # one moment in each tenth of the lifetime
        run = tmp_path / f"t{i}"
        proc = subprocess.Popen(command(run), env=ENV, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(moment)
        proc.send_signal(signal.SIGTERM)
        _, err = wait_patiently(proc, CPU_LIMIT)
        where = f"trial {i}: SIGTERM at {moment:.2f} s of {lifetime:.2f}: exit {proc.returncode}\n{err[-2000:]}"
        assert "Traceback" not in err, where
        if proc.returncode == -signal.SIGTERM:             # before moetrain's handler: nothing written
            assert not run.exists(), where
            outcome = "killed at start-up"
        elif proc.returncode == 0:                         # it had finished: complete as it is
            outcome = "finished"
        else:
            assert proc.returncode == EXIT_PREEMPTED, where
            saved = steps_of(str(run)) if run.exists() else []
            if saved:
                assert "the checkpoint is saved. Run the same command with --resume" in err, where
                assert len(losses(str(run))) == saved[-1], where
                outcome = f"stopped at step {saved[-1]}"
            else:
                assert re.search(r"[Nn]othing to resume: run the same command", err), where
                outcome = "stopped in set-up"
            resumed = run_patiently(command(run) + ["--resume"], CPU_LIMIT, env=ENV, cwd=str(tmp_path))
            assert resumed.returncode == 0, where + "\nresume:\n" + resumed.stderr[-2000:]
            if not saved:
                assert f"nothing to resume in {run} (no checkpoint yet): starting again from step 0" in \
                    resumed.stdout + resumed.stderr, where
        if outcome == "killed at start-up":
            again = run_patiently(command(run) + ["--resume"], CPU_LIMIT, env=ENV, cwd=str(tmp_path))
            assert again.returncode == 0 and "starting again from step 0" in again.stdout + again.stderr, \
                where + again.stderr[-2000:]
        assert losses(str(run)) == reference, where      # bitwise: as if never stopped
        assert not (run / ".moetrain.lock").exists(), where
        outcomes.append(f"{moment:.2f}s: {outcome}")
    print("SIGTERM outcomes: " + "; ".join(outcomes))


def test_sigterm_at_ten_random_moments_then_resume_ends_with_the_clean_losses():
    """Reads the outcome of the idle-priority child that ran the ten trials above."""
    done = wait_for_background(__name__)
    tail = done.stdout[-6000:]
    assert done.returncode == 0, tail
    assert "1 passed" in tail and "failed" not in tail, tail
