"""NESA_SWITCH_INTERVAL_MS (nesa_node/event_loop.py): the thread switch interval of the processes `run` starts,
from 0.1 to 100 ms; anything else is said on stderr and leaves the interpreter's interval as it was."""

import sys

import pytest

from nesa_node import event_loop


async def _interval() -> float:
    return sys.getswitchinterval()


@pytest.fixture
def restored():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_the_interval_given_in_milliseconds_is_set_for_the_run(monkeypatch, restored):
    monkeypatch.setenv("NESA_SWITCH_INTERVAL_MS", "0.5")
    assert event_loop.run(_interval()) == pytest.approx(0.0005)


@pytest.mark.parametrize("given", ["0", "-1", "250", "fast", "nan", "inf"])
def test_a_value_outside_the_range_is_said_and_ignored(monkeypatch, restored, capsys, given):
    monkeypatch.setenv("NESA_SWITCH_INTERVAL_MS", given)
    assert event_loop.run(_interval()) == restored
    assert f"NESA_SWITCH_INTERVAL_MS={given!r} ignored" in capsys.readouterr().err


def test_unset_leaves_the_interpreters_interval(monkeypatch, restored, capsys):
    monkeypatch.delenv("NESA_SWITCH_INTERVAL_MS", raising=False)
    assert event_loop.run(_interval()) == restored and capsys.readouterr().err == ""
