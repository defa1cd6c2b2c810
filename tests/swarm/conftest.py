"""Swarm fixtures: a real local swarm (tests/support/swarm.py) per test or per module, always shut down."""

from __future__ import annotations

import pytest

from tests.support.cli import Operator
from tests.support.swarm import LocalSwarm


@pytest.fixture
def local_swarm():
    swarm = LocalSwarm()
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture(scope="module")
def module_swarm():
    swarm = LocalSwarm()
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture
def operator(tmp_path):
    """An Operator in the test's folder: `nesa-node` commands as real processes, all stopped after the test."""
    operator = Operator(tmp_path)
    yield operator
    operator.stop_all()
