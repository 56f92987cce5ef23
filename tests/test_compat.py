"""The supported MindSpore range (moetrain/compat.py): the declared bounds agree with pyproject.toml and
CI, the version gate refuses an older MindSpore in one line before any work, every version check goes
through compat, the oneDNN library each version bundles, and tests/oldest_subset.txt names tests that
exist. None of this imports MindSpore."""
import os
import re
import warnings

import pytest

from moetrain import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_version_reads_releases_posts_and_candidates():
    assert compat.parse_version("2.10.0") == (2, 10, 0)
    assert compat.parse_version("2.7.1.post1") == (2, 7, 1)
    assert compat.parse_version("2.8.0rc1") == (2, 8, 0)
    assert compat.parse_version("2.11") == (2, 11, 0)
    assert compat.parse_version("2.9.0") < compat.parse_version("2.10.0")   # numbers, not strings
    with pytest.raises(ValueError, match="not a version"):
        compat.parse_version("dev")


def test_pyproject_declares_compat_range():
    """pyproject.toml's mindspore requirement is exactly [OLDEST, FIRST_UNSUPPORTED), and the installed
    MindSpore (which the suite runs on) lies in it."""
    with open(os.path.join(ROOT, "pyproject.toml")) as fh:
        requirements = re.findall(r'"mindspore([^"]*)"', fh.read())
    assert requirements == [f">={compat.OLDEST},<{compat.FIRST_UNSUPPORTED}"], requirements
    installed = compat.mindspore_version()
    assert compat.parse_version(compat.OLDEST) <= installed < compat.parse_version(compat.FIRST_UNSUPPORTED)


def test_ci_runs_the_oldest_subset_on_compat_oldest():
    """.ci/run's second stage installs compat.OLDEST (read from the module, not repeated) and runs the
    subset file."""
    with open(os.path.join(ROOT, ".ci", "run")) as fh:
        ci = fh.read()
    assert "from moetrain.compat import OLDEST" in ci and '"mindspore==$oldest"' in ci, ci
    assert "tests/oldest_subset.txt" in ci, ci


@pytest.mark.parametrize("version", ["2.7.0", "2.7.1.post1", "2.8.0", "2.9.0", "2.10.0"])
def test_supported_versions_pass_the_gate_silently(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.unsupported_mindspore(version) is None


def test_an_older_mindspore_is_refused_in_one_line_naming_the_fix():
    message = compat.unsupported_mindspore("2.6.0")
    assert message is not None and "\n" not in message
    assert "mindspore 2.6.0" in message and compat.OLDEST in message and "pip install" in message, message


def test_a_newer_mindspore_only_warns():
    with pytest.warns(RuntimeWarning, match="newer than the releases moetrain is tested on"):
        assert compat.unsupported_mindspore("2.11.0") is None


def test_cli_stops_before_any_work_on_an_older_mindspore(monkeypatch, capsys, tmp_path):
    from moetrain import cli

    started = []
    monkeypatch.setattr(compat, "mindspore_version_string", lambda: "2.6.0")
    monkeypatch.setattr(cli, "_train", lambda args: started.append(args) or 0)   # no real run, whatever happens
    code = cli.main(["train", os.path.join(ROOT, "configs", "moe_tiny.yaml"),
                     "--set", f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 3 and not started, err                 # faults.EXIT_CANNOT_RUN, before the command ran
    assert err.startswith("moetrain: error: mindspore 2.6.0") and "\n" not in err, err


def test_onednn_library_by_version(tmp_path):
    """2.7 and 2.8 bundle libdnnl.so.2, 2.9 and later libdnnl.so.3; a build that bundles the other one
    links that; a build without either is named."""
    with pytest.raises(FileNotFoundError, match=r"libdnnl\.so\.2 not found in"):
        compat.onednn_library(str(tmp_path), (2, 8, 0))
    with pytest.raises(FileNotFoundError, match=r"libdnnl\.so\.3 not found in"):
        compat.onednn_library(str(tmp_path), (2, 10, 0))
    (tmp_path / "libdnnl.so.2").write_text("")
    assert compat.onednn_library(str(tmp_path), (2, 7, 0)) == "libdnnl.so.2"
    assert compat.onednn_library(str(tmp_path), (2, 10, 0)) == "libdnnl.so.2"     # the one there is
    (tmp_path / "libdnnl.so.3").write_text("")
    assert compat.onednn_library(str(tmp_path), (2, 8, 0)) == "libdnnl.so.2"
    assert compat.onednn_library(str(tmp_path), (2, 9, 0)) == "libdnnl.so.3"
    assert compat.onednn_library(str(tmp_path), (2, 10, 0)) == "libdnnl.so.3"


def test_cpu_subgroup_collectives_from_2_8():
    assert not compat.cpu_subgroup_collectives((2, 7, 2))
    assert compat.cpu_subgroup_collectives((2, 8, 0)) and compat.cpu_subgroup_collectives((2, 10, 0))


def test_the_installed_mindspore_bundles_the_library_compat_names():
    import importlib.util

    lib_dir = os.path.join(os.path.dirname(importlib.util.find_spec("mindspore").origin), "lib")
    name = compat.onednn_library(lib_dir)
    assert os.path.isfile(os.path.join(lib_dir, name))


def test_kernels_without_onednn_raise_kernel_build_error(monkeypatch, tmp_path):
    """The kernel builder turns a missing oneDNN into its own error, which `available()` reports as
    the one fallback warning (tests/test_kernels.py: the fallback itself)."""
    from moetrain import kernels

    monkeypatch.setattr(kernels, "_mindspore_lib_dir", lambda: str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/true")
    with pytest.raises(kernels.KernelBuildError, match=r"libdnnl\.so\.\d not found in"):
        kernels.library_path.__wrapped__()


VERSION_CHECK = re.compile(r"(mindspore|\bms)\.__version__|version\(\s*[\"']mindspore|get_version\(\)")


def test_every_mindspore_version_check_goes_through_compat():
    offenders = []
    for top in ("moetrain", "models", "tools", "benchmarks", "run_scripts"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith((".py", ".sh")) and path != os.path.join(ROOT, "moetrain", "compat.py"):
                    with open(path, errors="replace") as fh:
                        offenders += [f"{os.path.relpath(path, ROOT)}:{n}" for n, line in enumerate(fh, 1)
                                      if VERSION_CHECK.search(line)]
    assert not offenders, f"check the MindSpore version through moetrain.compat instead: {offenders}"


def test_oldest_subset_names_tests_that_exist():
    """Each line of tests/oldest_subset.txt (but comments) is a test file, or FILE::TEST of a test
    defined there: a renamed test must not silently leave the subset."""
    with open(os.path.join(ROOT, "tests", "oldest_subset.txt")) as fh:
        entries = [line.strip() for line in fh if line.strip() and not line.startswith("#")]
    assert entries
    for entry in entries:
        assert not any(c.isspace() for c in entry) and "[" not in entry, entry
        path, _, test = entry.partition("::")
        with open(os.path.join(ROOT, path)) as fh:
            source = fh.read()
        if test:
            assert re.search(rf"^def {re.escape(test.split('[')[0])}\(", source, re.M), entry


def test_layouts_needing_cpu_sub_groups_are_refused_on_2_7_only():
    """MindSpore 2.7's CPU AllReduce takes only the world group: init_parallel refuses, in one line
    naming the group and the fix, a layout with smaller groups; groups of one rank or all pass."""
    from moetrain.distributed.topology import ParallelContext, cpu_world_only_problem

    carved = ParallelContext.build(4, 0, dp=4, ep=2)                 # ep groups {0,1} {2,3}
    message = cpu_world_only_problem(carved, (2, 7, 0))
    assert message is not None and "\n" not in message
    assert "ep" in message and "ranks [0, 1]" in message and "mindspore>=2.8" in message, message
    assert cpu_world_only_problem(carved, (2, 8, 0)) is None
    assert cpu_world_only_problem(ParallelContext.build(4, 0, dp=2, pp=2), (2, 7, 0)) is not None
    for world_only in (ParallelContext.build(4, 0, dp=4, ep=4), ParallelContext.build(2, 1, dp=1, pp=2),
                       ParallelContext.build(2, 0, dp=1, tp=2), ParallelContext.build(2, 0, dp=2, ep=2)):
        assert cpu_world_only_problem(world_only, (2, 7, 0)) is None
