"""The installed layout as a tree of links, and the import contracts checked on it.

pyproject.toml installs routing/, sharding/, topology/ and compression/ as subpackages of nesa_node; import-linter
reads packages from the file system, so it is given a tree that is laid out that way: links to the source files
under their import names. `python tests/support/layout.py` (what `make lint` runs) builds one in a temporary folder
and runs lint-imports on it; exits with lint-imports' status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def mirror_tree(target: Path) -> Path:
    """Links to every source module of the package, at its installed path under `target`; returns `target`."""
    for package, folder in PACKAGE_DIR.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            link = target.joinpath(*package.split("."), path.relative_to(base))
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
    return target


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports with pyproject.toml's contracts on `tree` (output captured)."""
    executable = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(executable), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="nesa-layout-") as folder:
        result = lint_imports(mirror_tree(Path(folder)))
    print(result.stdout, end="")
    print(result.stderr, end="", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
