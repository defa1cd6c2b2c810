"""Headless Chromium for tests, driven through chromedriver's W3C WebDriver HTTP API (Debian's `chromium` and
`chromium-driver`; nothing is downloaded). Every process started here is stopped on close."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def browser_missing() -> str | None:
    """None when headless Chromium can run here, else why not (the test skips with it)."""
    for tool in ("chromium", "chromedriver"):
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian's chromium and chromium-driver)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Browser:
    def __init__(self, *, width: int = 1280, height: int = 1100):
        port = _free_port()
        self.driver = subprocess.Popen(
            ["chromedriver", f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                self._call("GET", "/status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.driver.kill()
                    raise
                time.sleep(0.1)
        options = {
            "binary": shutil.which("chromium"),
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={width},{height}"],
        }  # fmt: skip
        capabilities = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}}
        self.session = self._call("POST", "/session", capabilities)["sessionId"]

    def _call(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["value"]

    def get(self, url: str) -> None:
        self._call("POST", f"/session/{self.session}/url", {"url": url})

    def run(self, script: str):
        """The value of a JavaScript function body run in the page."""
        return self._call("POST", f"/session/{self.session}/execute/sync", {"script": script, "args": []})

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self._call("GET", f"/session/{self.session}/screenshot")))
        return path

    def close(self) -> None:
        try:
            self._call("DELETE", f"/session/{self.session}")
        except OSError:
            pass
        finally:
            self.driver.terminate()
            try:
                self.driver.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.driver.kill()
