"""The dashboard page (nesa_node/gateway/page.py) in headless Chromium, fed a swarm document whose strings are markup:
every string of it comes from peers' records, so the page shows them as text and runs none of them."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nesa_node.gateway.page import PAGE
from tests.support.browser import Browser, browser_missing
from tests.support.swarm import wait_until

pytestmark = pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))

MARKUP = '<img src=x onerror="window.__ran = 1">'
PEER = 'Qm"><img src=x onerror="window.__ran = 2">'
DOCUMENT = {
    "model": MARKUP,
    "num_blocks": 2,
    "time": 0,
    "nodes": [
        {
            "peer_id": PEER,
            "state": MARKUP,
            "blocks": [0, 2],
            "block_ms": MARKUP,
            "speed_source": MARKUP,
            "cache_tokens_left": MARKUP,
            "codecs": ["none", MARKUP],
            "quantization": MARKUP,
            "dtype": "float32",
            "queue": MARKUP,
        }
    ],
    "coverage": [[PEER], [PEER]],
    "gaps": [],
    "chains": [[PEER]],
    "topology": None,
    "change": None,
    "events": [{"time": 0, "peer_id": PEER, "event": MARKUP}],
}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body, kind = (
            (PAGE.encode(), "text/html") if self.path == "/" else (json.dumps(DOCUMENT).encode(), "application/json")
        )
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_strings_of_peers_records_are_shown_as_text_never_run():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    browser = Browser()
    try:
        browser.get(f"http://127.0.0.1:{server.server_address[1]}/")
        wait_until(lambda: browser.run('return document.querySelectorAll("tr.node").length;') == 1, timeout_s=20)
        assert browser.run("return document.querySelectorAll('img').length;") == 0
        assert browser.run("return window.__ran === undefined;")
        row = browser.run('return document.querySelector("tr.node").textContent;')
        assert MARKUP in row  # the codecs, state, quantization: as the text they are
        assert browser.run('return document.querySelector("tr.node").dataset.peer;') == PEER
        assert MARKUP in browser.run('return document.getElementById("events").textContent;')
    finally:
        browser.close()
        server.shutdown()
        server.server_close()
