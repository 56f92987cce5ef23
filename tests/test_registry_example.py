"""Follows README "Adding a model" step by step: the code and YAML are taken from the README."""
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_blocks(lang):
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## Adding a model", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def test_readme_model_example_trains(tiny_mnist, tmp_path, monkeypatch):
    from moetrain import cli, registry

    (tmp_path / "my_models.py").write_text(readme_blocks("python")[0])
    config = readme_blocks("yaml")[0].replace("base: configs/", f"base: {ROOT}/configs/")
    (tmp_path / "my_model.yaml").write_text(config)
    command = readme_blocks("bash")[0].split()
    assert command[:2] == ["moetrain", "train"]
    out = tmp_path / "run"
    argv = command[1:] + ["--set", f"data.path={tiny_mnist}", "--set", f"train.output_dir={out}",
                          "--set", "logging.tensorboard=false", "--set", "train.global_batch_size=32",
                          "--set", "lr_schedule.warmup_steps=0", "--set", "optimizer.lr=0.01"]
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 0
    assert "softmax_regression" in registry.registered_models()
    records = [json.loads(l) for l in open(out / "metrics.jsonl")]
    train = [r for r in records if "loss" in r]
    assert len(train) == 256 // 32                      # one epoch of the 256-sample set
    assert train[-1]["loss"] < train[0]["loss"]
    assert [r for r in records if "eval_accuracy" in r][-1]["eval_accuracy"] > 0.5
    assert registry.model_module_of("softmax_regression") == str(tmp_path / "my_models.py")   # found by path
