import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from nesa_node.cli import build_parser


def test_import_is_light():
    code = (
        "import sys, nesa_node; heavy = [m for m in ('torch', 'hivemind', 'transformers', 'bitsandbytes', 'gudhi', 'peft')"
        " if m in sys.modules]; print(heavy)"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


HEAVY = ("torch", "hivemind", "transformers", "bitsandbytes", "gudhi", "peft")


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["run", "--help"], ["graph", "plan", "--help"], ["finetune", "--help"], ["run", "--blocks", "0:x"]],
)
def test_help_and_argument_errors_import_nothing_heavy(argv):
    """An operator's `--help` or typo is answered before torch, transformers or hivemind load (seconds each)."""
    code = (
        "import sys\nfrom nesa_node.cli import build_parser\n"
        f"try:\n    build_parser().parse_args({argv!r})\nexcept SystemExit:\n    pass\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stderr.strip().splitlines()[-1] == "[]"


def test_every_command_has_help(capsys):
    parser = build_parser()
    for command in (["run"], ["dht"], ["generate"], ["status"], ["demo"], ["model", "init-tiny"]):
        try:
            parser.parse_args([*command, "--help"])
        except SystemExit as exit_:
            assert exit_.code == 0
        assert "usage: nesa-node" in capsys.readouterr().out


def test_init_tiny_writes_a_loadable_model(tmp_path):
    from nesa_node.cli import main

    assert main(["model", "init-tiny", str(tmp_path / "m"), "--arch", "qwen2", "--layers", "3", "--hidden", "32"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 3
    assert tokenizer.decode(tokenizer("hello swarm").input_ids) == "hello swarm"


def test_bad_block_range_is_a_usage_error(capsys):
    parser = build_parser()
    try:
        parser.parse_args(["run", "--model", "m", "--blocks", "5:2"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "START < END" in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [("--port", "70000"), ("--lane-port", "-1"), ("--lane-port", "http")])
def test_bad_port_is_a_usage_error(capsys, option, value):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["run", "--model", "m", "--blocks", "0:2", option, value])
    assert exit_.value.code == 2
    assert "TCP port" in capsys.readouterr().err


def test_no_assert_in_package_code():
    """Asserts vanish under `python -O`: input from peers and users is checked with typed errors instead."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sources = [
        path
        for folder in ("nesa_node", "compression", "routing", "sharding", "topology")
        for path in (root / folder).rglob("*.py")
    ]
    assert len(sources) > 20
    found = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in sources
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Assert)
    ]
    assert found == []


def test_run_options_come_from_the_node_config_and_keep_its_defaults():
    """Every field of the node's config sections is a `run` option, and parsing no option gives the defaults."""
    import dataclasses

    from nesa_node.cli.options import config_from_args
    from nesa_node.server.config import ComputeConfig, LimitsConfig, NetworkConfig, RebalanceConfig

    sections = (NetworkConfig, LimitsConfig, ComputeConfig, RebalanceConfig)
    defaults = build_parser().parse_args(["run", "--model", "m", "--blocks", "0:2"])
    for section in sections:
        assert config_from_args(section, defaults) == section()
    args = build_parser().parse_args(
        ["run", "--model", "m", "--blocks", "0:2", "--max-queued-steps", "3", "--no-lane", "--session-timeout", "5"]
        + ["--compression", "none", "fp16", "--no-measure", "--rebalance", "off", "--identity", "key"]
    )
    assert config_from_args(LimitsConfig, args) == LimitsConfig(max_queued_steps=3, session_timeout_s=5.0)
    assert config_from_args(NetworkConfig, args) == NetworkConfig(lane_port=None, identity_path="key")
    assert config_from_args(ComputeConfig, args) == ComputeConfig(codecs=("none", "fp16"), measure_throughput=False)
    assert config_from_args(RebalanceConfig, args) == RebalanceConfig(trigger="off")
    flags = {action.dest for action in build_parser()._subparsers._group_actions[0].choices["run"]._actions}
    for section in sections:
        assert {item.name for item in dataclasses.fields(section)} <= flags


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--max-queued-steps", "0", "a whole number above 0"),
        ("--session-timeout", "inf", "a finite number above 0"),
        ("--max-cache-share-per-peer", "1.5", "a fraction in (0, 1]"),
        ("--inject-delay-ms", "-1", "a finite number of 0 or more"),
    ],
)
def test_bad_run_option_values_are_usage_errors(capsys, option, value, message):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["run", "--model", "m", "--blocks", "0:2", option, value])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_what_the_readme_commands_write_is_ignored_by_git():
    """Identity keys are private; address files, the tiny model and params are per machine."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    names = ["boot.key", "node1.key", "boot.addr", "boot.peers", "tiny/config.json", "plan.json", "params.json"]
    result = subprocess.run(["git", "check-ignore", *names], cwd=root, capture_output=True, text=True)
    assert sorted(result.stdout.split()) == sorted(names)


def test_the_design_document_names_only_paths_that_exist():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "ARCHITECTURE.md").read_text()
    paths = set(re.findall(r"`((?:nesa_node|routing|sharding|compression|topology|tests|bench|docs)/[\w./]*)`", text))
    assert len(paths) > 30
    missing = sorted(path for path in paths if not (root / path).exists())
    assert missing == []


def test_the_reliability_document_names_only_tests_that_exist():
    """docs/RELIABILITY.md names the tests of each requirement: `file::test` (or `::test` after a file named earlier in
    the same table cell), and bare test names in test_bad_input.py's table."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "RELIABILITY.md").read_text()
    sources = {path: path.read_text() for path in (root / "tests").rglob("test_*.py")}
    defined_anywhere = {name for source in sources.values() for name in re.findall(r"^def (test_\w+)", source, re.M)}
    named, missing = 0, []
    for cell in re.split(r"\||\n", text):
        current: Path | None = None
        for token in re.findall(r"`([^`]+)`", cell):
            path, _, test = token.partition("::")
            if path.startswith("tests/") and path.endswith(".py"):
                current = root / path
                if not current.is_file():
                    missing.append(path)
            elif path or not test:
                if re.fullmatch(r"test_\w+", token) and token not in defined_anywhere:
                    missing.append(token)
                named += bool(re.fullmatch(r"test_\w+", token))
                continue
            if test:
                named += 1
                if current is None or not re.search(rf"^def {re.escape(test)}\(", sources.get(current, ""), re.M):
                    missing.append(f"{current}::{test}")
    assert named > 80
    assert missing == []
