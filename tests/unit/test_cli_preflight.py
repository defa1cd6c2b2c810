"""The command line's early checks (nesa_node/cli/preflight.py): the mistakes they can tell are told before torch,
hivemind or transformers load, in the words of the later checks, and they never refuse what those accept."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from nesa_node.cli import build_parser
from nesa_node.cli.preflight import check, names_a_peer
from nesa_node.errors import InitialPeersError, ModelLoadError
from nesa_node.peer import check_initial_peers
from nesa_node.sharding.model_folder import declared_blocks

PEER = "QmVjXs6BHfUPfdE6yhUMEKBo6YFxUWnDhSSfWHDDWDHeQW"
HEAVY = ("torch", "hivemind", "transformers")

# fragments of multiaddrs, well-formed and not, joined by "/" into candidate addresses
FRAGMENTS = ("", "ip4", "ip6", "127.0.0.1", "::1", "dns4", "example.org", "tcp", "udp", "31337", "quic-v1", "p2p",
             "ipfs", PEER, PEER[:20], "garbage", " ")  # fmt: skip


def _accepted(address: str) -> bool:
    try:
        check_initial_peers([address])
    except InitialPeersError:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(st.booleans(), st.lists(st.sampled_from(FRAGMENTS), max_size=8))
def test_the_early_address_check_never_refuses_an_address_the_peer_parser_takes(leading_slash, fragments):
    address = ("/" if leading_slash else "") + "/".join(fragments)
    if _accepted(address):
        assert names_a_peer(address), address


@pytest.mark.parametrize(
    "address",
    [f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}", f"/ip6/::1/tcp/1/p2p/{PEER}", f"/dns4/example.org/tcp/1/p2p/{PEER}",
     f"/ip4/127.0.0.1/udp/1/quic-v1/p2p/{PEER}"],
)  # fmt: skip
def test_real_peer_addresses_pass_both_checks(address):
    assert _accepted(address) and names_a_peer(address)


@pytest.mark.parametrize("address", ["garbage", "ip4/127.0.0.1/tcp/1/p2p/" + PEER, "/ip4/127.0.0.1/tcp/1", "/p2p/", ""])
def test_addresses_without_a_peer_are_refused_by_both(address):
    assert not names_a_peer(address) and not _accepted(address)


def test_declared_blocks_is_what_transformers_reads(tiny_models):
    for path in tiny_models.values():
        assert declared_blocks(path) == AutoConfig.from_pretrained(path).num_hidden_layers


@pytest.mark.parametrize(
    "content", ['{"num_hidden_layers": "4"}', '{"num_hidden_layers": true}', '{"num_hidden_layers": 0}', "[4]", "{",
                '{"text_config": {"num_hidden_layers": 4}}'],
)  # fmt: skip
def test_a_config_that_does_not_say_its_blocks_plainly_is_left_to_transformers(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    assert declared_blocks(tmp_path) is None


def test_a_folder_without_config_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        declared_blocks(tmp_path)


def test_command_lines_the_commands_accept_pass(tiny_llama):
    peer = f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}"
    for argv in (
        ["run", "--model", tiny_llama, "--blocks", "0:4", "--new-swarm"],
        ["run", "--model", tiny_llama, "--blocks", "2:4", "--initial-peers", peer],
        ["generate", "--model", tiny_llama, "--prompt", "x", "--initial-peers", peer],
        ["status", "--model", tiny_llama, "--initial-peers", peer],
        ["dht"],
        ["tune", "--scenario", "continent-200", "--model", "./not-needed-without-from-swarm", "--out", "p.json"],
    ):
        check(build_parser().parse_args(argv))


def test_mistakes_are_told_before_any_heavy_import(tmp_path, tiny_llama):
    """Each mistake, run through `main` in one fresh process: exit 2, one `error: [code] ...` line with the later
    check's words, and neither torch, hivemind nor transformers loaded."""
    peer = f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}"
    mistakes = [
        (["generate", "--model", tiny_llama, "--prompt", "x", "--initial-peers", "garbage"], "initial_peers",
         "'garbage' is not a peer address"),
        (["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x", "--initial-peers", peer], "model_load",
         "has no config.json"),
        (["status", "--model", str(tmp_path), "--initial-peers", peer], "model_load", "has no config.json"),
        (["gateway", "--model", str(tmp_path), "--initial-peers", peer], "model_load", "has no config.json"),
        (["run", "--model", tiny_llama, "--blocks", "0:9", "--new-swarm"], "model_load",
         "blocks 0:9 are outside the model's 0:4 range"),
        (["run", "--model", tiny_llama, "--blocks", "0:2"], "bad_value", "give --initial-peers to join a swarm"),
        (["run", "--model", tiny_llama, "--blocks", "0:2", "--new-swarm", "--cuda-graphs"], "bad_value",
         "--cuda-graphs needs a CUDA device"),
        (["run", "--model", tiny_llama, "--blocks", "0:2", "--initial-peers", "/ip4/127.0.0.1/tcp/1"],
         "initial_peers", "is not a peer address"),
        (["dht", "--initial-peers", "garbage"], "initial_peers", "is not a peer address"),
    ]  # fmt: skip
    code = (
        "import contextlib, io, json, sys\nfrom nesa_node.cli import main\nresults = []\n"
        f"for argv in {[argv for argv, _, _ in mistakes]!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        status = main(argv)\n"
        "    results.append([status, err.getvalue()])\n"
        f"print(json.dumps([results, [m for m in {HEAVY!r} if m in sys.modules]]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    results, heavy = json.loads(result.stdout.strip().splitlines()[-1])
    for (argv, code_, phrase), (status, stderr) in zip(mistakes, results, strict=True):
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert status == 2 and len(lines) == 1, (argv, stderr)
        assert lines[0].startswith(f"error: [{code_}] ") and phrase in lines[0], (argv, lines[0])
    assert heavy == [], heavy
