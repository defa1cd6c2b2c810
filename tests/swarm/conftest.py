"""Swarm fixtures: a real local swarm (tests/support/swarm.py) per test or per module, always shut down."""

from __future__ import annotations

import pytest

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
