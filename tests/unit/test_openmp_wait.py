"""OpenMP's idle spin is shortened before torch loads, unless the operator chose a wait policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nesa_node import openmp_wait


def test_short_spin_sets_the_spin_count_when_nothing_is_chosen():
    environ = {"PATH": "/usr/bin"}
    assert openmp_wait.short_spin(environ) is True
    assert environ == {"PATH": "/usr/bin", "GOMP_SPINCOUNT": str(openmp_wait.SPIN_COUNT)}


@pytest.mark.parametrize("chosen", [{"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "300000"}])
def test_short_spin_leaves_an_operators_choice_alone(chosen):
    environ = dict(chosen)
    assert openmp_wait.short_spin(environ) is False
    assert environ == chosen


@pytest.mark.parametrize("preset", [{}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_the_cli_sets_it_before_any_command_loads_torch(preset):
    """By the time a command runs, the spin is set and torch is not loaded yet (libgomp reads it as torch loads)."""
    code = (
        "import json, os, sys\n"
        "import nesa_node.cli as cli\n"
        "seen = []\n"
        "cli._dispatch = lambda args: seen.append([os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules]) or 0\n"
        "status = cli.main(['dht'])\n"
        "print(json.dumps([status, seen]))\n"
    )
    environ = {key: value for key, value in os.environ.items() if key not in openmp_wait.USER_SETTINGS}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**environ, **preset}
    )
    assert result.returncode == 0, result.stderr
    status, seen = json.loads(result.stdout.strip().splitlines()[-1])
    expected = None if preset else str(openmp_wait.SPIN_COUNT)
    assert status == 0 and seen == [[expected, False]]
