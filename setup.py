"""Package discovery for the mapping in pyproject.toml's [tool.setuptools.package-dir]: every folder with an
__init__.py under each mapped folder becomes a package, so a new subpackage is never left out of the wheel."""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
packages = []
for package, folder in package_dir.items():
    packages.append(package)
    packages += [f"{package}.{name}" for name in find_packages(str(ROOT / folder))]

setup(packages=sorted(packages), package_dir=package_dir)
