"""The package's shape: every subpackage reaches the wheel, and the layer contracts of `make lint` catch an import
that breaks them (checked on a copy of the tree with one wrong import added)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.layout import PACKAGE_DIR, ROOT, lint_imports, mirror_tree

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def source_packages() -> set[str]:
    """Every package of the source tree, by its import name (folders mapped through pyproject's package-dir)."""
    packages = set()
    for package, folder in PACKAGE_DIR.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base).parts
            packages.add(".".join((package, *relative)))
    return packages


def test_wheel_contains_every_subpackage(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for folder in PACKAGE_DIR.values():
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", tmp_path, source],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("nesa_node-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {name.rpartition("/")[0].replace("/", ".") for name in names if name.endswith("/__init__.py")}
    expected = source_packages()
    assert {"nesa_node.protocol", "nesa_node.routing", "nesa_node.server", "nesa_node.client"} <= expected
    assert in_wheel == expected
    assert any(name.endswith("licenses/LICENSE") for name in names)
    modules = [name for name in names if name.endswith(".py")]
    assert "nesa_node/routing/cost.py" in modules and "nesa_node/protocol/lane.py" in modules


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is installed by `make install`")
@pytest.mark.parametrize(
    ("module", "source", "broken"),
    [
        ("routing/leak.py", "from nesa_node.server import node\n", "pure core"),
        ("server/leak.py", "import nesa_node.client.session\n", "server never imports client"),
        ("protocol/leak.py", "from nesa_node.client import swarm\n", "protocol imports neither server nor client"),
        ("errors_leak.py", "", "layers"),
    ],
    ids=["pure-core", "server-client", "protocol", "layers"],
)
def test_layer_contracts_fail_on_a_wrong_import(tmp_path, module, source, broken):
    tree = tmp_path / "tree"
    mirror_tree(tree)
    clean = lint_imports(tree)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    if module == "errors_leak.py":  # the error tree must stay at the bottom of the graph
        errors = tree / "nesa_node" / "errors.py"
        text = errors.read_text()
        errors.unlink()
        errors.write_text(text + "\nfrom nesa_node.protocol import records  # noqa: E402\n")
    else:
        (tree / "nesa_node" / module).write_text(source)
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout
    broken_lines = [line for line in result.stdout.splitlines() if line.rstrip().endswith("BROKEN")]
    assert any(line.startswith(broken) for line in broken_lines), result.stdout
