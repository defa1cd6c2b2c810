"""The README's command blocks, run exactly as written, in order, in a fresh folder (with the repository's .venv
linked in, as `make install` leaves it): the swarm by hand, the SDK examples against it, routing's tune commands,
and the graph-model pipeline. Every process the blocks start is stopped at the end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.cli

ROOT = Path(__file__).resolve().parents[2]


def readme_blocks(section: str, language: str) -> list[str]:
    """The ```language blocks of the README section whose heading starts with `section`."""
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"^## {re.escape(section)}.*?$(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, f"README has no section {section!r}"
    blocks = re.findall(rf"^```{language}\n(.*?)^```", match.group(1), flags=re.S | re.M)
    assert blocks, f"README section {section!r} has no {language} block"
    return blocks


class Shell:
    """Runs blocks with bash in `workdir`, each in a new session: the background jobs of a block share its process
    group (no job control in scripts), so `stop` reaches every one of them."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.groups: list[int] = []

    def run(self, script: str, timeout_s: float = 300.0) -> str:
        log = self.workdir / f"block-{len(self.groups)}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                ["bash", "-e", "-c", script], cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self.groups.append(process.pid)
        try:
            status = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"block did not finish in {timeout_s} s:\n{log.read_text()}") from None
        output = log.read_text(errors="replace")
        assert status == 0, f"block exited {status}:\n{script}\n---\n{output}"
        return output

    def python(self, code: str, timeout_s: float = 180.0) -> str:
        result = subprocess.run(
            [str(self.workdir / ".venv" / "bin" / "python"), "-c", code],
            cwd=self.workdir, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        assert result.returncode == 0, f"{code}\n---\n{result.stdout}{result.stderr}"
        return result.stdout

    def members(self) -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) in self.groups:
                    found.append(process)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        return found

    def stop(self) -> None:
        """SIGTERM every process the blocks left running (as `kill %1 %2 ...` would), SIGKILL after 20 s."""
        for group in self.groups:
            try:
                os.killpg(group, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20.0
        while self.members() and time.monotonic() < deadline:
            time.sleep(0.1)
        for group in self.groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def shell(tmp_path):
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # the folder `make install` made
    shell = Shell(tmp_path)
    yield shell
    shell.stop()


def test_readme_swarm_sdk_and_routing_blocks_run_as_written(shell):
    (by_hand,) = readme_blocks("Running a swarm by hand", "sh")
    output = shell.run(by_hand)
    assert "2 nodes, 4 blocks" in output and "all 4 blocks covered" in output, output
    assert output.rstrip().splitlines()[-1].startswith("Beautiful is"), output  # generate's text

    sync_example, async_example = readme_blocks("Client SDK", "python")
    assert shell.python(sync_example).startswith("Beautiful is")
    decoded = shell.python(async_example).strip().splitlines()[-1]
    assert "Beautiful is" in decoded and "Flat is better" in decoded

    (gateway,) = readme_blocks("OpenAI-compatible gateway", "sh")
    answer = json.loads(shell.run(gateway).strip().splitlines()[-1])
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 12, answer
    (openai_example,) = readme_blocks("OpenAI-compatible gateway", "python")
    assert shell.python(openai_example).strip() == answer["choices"][0]["text"].strip()

    (finetune,) = readme_blocks("Fine-tuning a LoRA adapter", "sh")
    output = shell.run(". .venv/bin/activate\n" + finetune)  # the by-hand block's shell, activated
    assert "adapter: finetuned/adapter" in output and "Traceback" not in output, output
    assert json.loads((shell.workdir / "finetuned" / "metrics.json").read_text())["steps"] == 20
    (finetune_sdk,) = readme_blocks("Fine-tuning a LoRA adapter", "python")
    shell.python(finetune_sdk)
    assert (shell.workdir / "my-adapter" / "adapter_config.json").is_file()

    (routing,) = readme_blocks("Routing", "sh")
    output = shell.run(". .venv/bin/activate\n" + routing)  # the by-hand block's shell, activated
    assert output.count("untuned -> tuned") == 2, output
    assert (shell.workdir / "params.json").is_file()

    shell.stop()
    assert shell.members() == [], "a process the README started outlived SIGTERM"


def test_readme_graph_model_block_runs_as_written(shell):
    (graph,) = readme_blocks("Graph models", "sh")
    output = shell.run(". .venv/bin/activate\n" + graph)  # the by-hand section's shell, activated
    assert "Traceback" not in output, output
    assert "max abs difference from the single-process forward" in output, output
    (snippet,) = readme_blocks("Graph models", "python")
    printed = shell.python(snippet).strip()
    assert printed.startswith("2 outputs, largest difference"), printed
    assert float(printed.split()[-1]) < 1e-4, printed
    shell.stop()
    assert shell.members() == [], "a process the README started outlived SIGTERM"
