"""The graph-model command line as an operator uses it, every command a subprocess: `nesa-node graph plan` writes a
plan, a bootstrap and one `nesa-node run --graph-plan` per stage serve it, `nesa-node graph infer --compare`
matches the single-process forward; mistakes print one `error: [code] ...` line with exit status 2."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from nesa_node.devtools.launcher import ProcessGroup
from nesa_node.graph.plan import GraphPlan

pytestmark = pytest.mark.cli

FACTORY = "nesa_node.graph.models:unet_tiny"
STAGES = 3


def nesa_node(*args: str, cwd, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nesa_node.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout_s,
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ["), result.stderr
    return lines[0]


def test_plan_serve_and_infer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the stage processes read plan.json from the current folder, as in the README
    planned = nesa_node("graph", "plan", "--graph-model", FACTORY, "--stages", str(STAGES), "--out", "plan.json",
                        cwd=tmp_path)  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    key = re.search(r"DHT key (graph-\S+)", planned.stdout).group(1)
    plan = GraphPlan.load(tmp_path / "plan.json")
    assert plan.dht_prefix == key and plan.stages == STAGES and plan.assignment
    assert len(re.findall(r"^ +\d+ +\d+ +\d", planned.stdout, flags=re.MULTILINE)) == STAGES  # a row per stage

    with ProcessGroup(str(tmp_path)) as group:
        bootstrap = group.wait_address(*group.start("boot", ["dht"]), timeout_s=60)
        stages = [
            group.start(f"stage{index}", ["run", "--graph-plan", "plan.json", "--stage", str(index),
                                          "--initial-peers", *bootstrap])
            for index in range(STAGES)
        ]  # fmt: skip
        for process, address_file in stages:
            group.wait_address(process, address_file, timeout_s=60)
            assert f"(key {key})" in group.log_path(process).read_text()  # one pipeline: one DHT key

        inferred = nesa_node("graph", "infer", "--graph-plan", "plan.json", "--initial-peers", *bootstrap,
                             "--compare", "--seed", "1", cwd=tmp_path)  # fmt: skip
        assert inferred.returncode == 0, (inferred.stdout, inferred.stderr)
        assert "output 0: shape (2, 3, 32, 32), float32" in inferred.stdout
        assert re.search(r"forward through the swarm: [\d.]+ ms", inferred.stdout)
        difference = float(re.search(r"single-process forward: (\S+)", inferred.stdout).group(1))
        assert difference <= 1e-5

        # another solver's plan has another DHT key: nobody serves it, and the error names the missing stages
        other = nesa_node("graph", "plan", "--graph-model", FACTORY, "--stages", str(STAGES), "--solver", "uniform",
                          "--out", "uniform.json", cwd=tmp_path)  # fmt: skip
        assert other.returncode == 0, other.stderr
        unserved = nesa_node("graph", "infer", "--graph-plan", "uniform.json", "--initial-peers", *bootstrap,
                             "--wait-s", "1", cwd=tmp_path)  # fmt: skip
        line = one_error_line(unserved)
        assert line.startswith("error: [no_route]") and "stages 0, 1, 2 of uniform.json" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["graph", "infer", "--graph-plan", "missing.json", "--initial-peers", "/ip4/127.0.0.1/tcp/1"],
         "error: [model_load] no plan file 'missing.json'"),
        (["graph", "plan", "--graph-model", "nesa_node.graph.models:no_such_model", "--stages", "2"],
         "error: [model_load] cannot load graph model"),
        (["graph", "plan", "--graph-model", FACTORY, "--stages", "0"], "error: [usage] argument --stages"),
    ],
    ids=["missing-plan-file", "bad-factory", "zero-stages"],
)  # fmt: skip
def test_mistakes_print_one_error_line(tmp_path, args, expected):
    assert one_error_line(nesa_node(*args, cwd=tmp_path)).startswith(expected)
    assert not (tmp_path / "plan.json").exists()


def test_help_names_the_solvers(tmp_path):
    result = nesa_node("graph", "plan", "--help", cwd=tmp_path)
    assert result.returncode == 0
    for solver in ("dp", "brkga", "uniform"):
        assert f"\n  {solver} " in result.stdout
