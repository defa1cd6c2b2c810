"""deploy/: the systemd unit passes `systemd-analyze verify` and scores an exposure of at most 3.0 in
`systemd-analyze security` (run on a copy whose ExecStart names this checkout's nesa-node, as installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "systemd" / "nesa-node@.service"

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze (systemd)")


@pytest.fixture
def installed_unit(tmp_path) -> Path:
    """The unit as an instance, its ExecStart pointing at this environment's nesa-node."""
    nesa_node = Path(sys.executable).with_name("nesa-node")
    assert nesa_node.is_file(), nesa_node
    text = UNIT.read_text()
    assert "ExecStart=/opt/nesa-node/venv/bin/nesa-node " in text
    path = tmp_path / "nesa-node@node1.service"
    path.write_text(text.replace("/opt/nesa-node/venv/bin/nesa-node", str(nesa_node)))
    return path


def test_the_unit_verifies(installed_unit):
    result = subprocess.run(["systemd-analyze", "verify", str(installed_unit)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr


def test_the_units_exposure_is_at_most_3(installed_unit):
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(installed_unit)],
        capture_output=True,
        text=True,
    )
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert score is not None, result.stdout + result.stderr
    print(f"systemd-analyze security: exposure {score.group(1)}")
    assert float(score.group(1)) <= 3.0


def test_the_unit_is_a_notify_service_that_drains_and_restarts():
    settings = dict(
        line.split("=", 1) for line in UNIT.read_text().splitlines() if "=" in line and not line.startswith("#")
    )
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert settings["KillSignal"] == "SIGTERM" and settings["Restart"] == "on-failure"
    assert int(settings["WatchdogSec"]) > 0 and settings["DynamicUser"] == "yes"
    assert settings["StateDirectory"] == "nesa-node/%i" and settings["ProtectSystem"] == "strict"
    example = (DEPLOY / "systemd" / "nesa-node.env.example").read_text()
    assert "--identity /var/lib/nesa-node/" in example  # the state directory: the peer id survives restarts
