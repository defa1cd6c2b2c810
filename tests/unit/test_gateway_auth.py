"""The gateway's API keys and its loopback check (gateway/auth.py)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nesa_node.gateway.auth import ApiKeys, is_loopback


def keys_file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_keys_are_read_one_per_line_skipping_blanks_and_comments(tmp_path):
    keys = ApiKeys.from_file(keys_file(tmp_path, "# ops\n  sk-a  \n\nsk-b\n# sk-c\n"))
    assert len(keys) == 2
    assert keys.allows("Bearer sk-a") and keys.allows("bearer  sk-b ") and keys.allows("Bearer sk-b")
    for header in (None, "", "Bearer", "Bearer ", "Basic sk-a", "sk-a", "Bearer sk-c", "Bearer # ops", "Bearer sk-a2"):
        assert not keys.allows(header), header


@pytest.mark.parametrize(
    "text, message",
    [("", "no key"), ("# only a comment\n\n", "no key"), ("sk one\n", "spaces"), ("k" * 513, "over 512")],
)
def test_a_key_file_without_usable_keys_is_refused_naming_it(tmp_path, text, message):
    path = keys_file(tmp_path, text)
    with pytest.raises(ValueError, match=message) as refused:
        ApiKeys.from_file(path)
    assert str(path) in str(refused.value)


def test_a_missing_file_is_refused_and_a_loose_one_warned_about(tmp_path, caplog):
    with pytest.raises(ValueError, match="No such file"):
        ApiKeys.from_file(tmp_path / "absent")
    with caplog.at_level(logging.WARNING):
        ApiKeys.from_file(keys_file(tmp_path, "sk-a\n", mode=0o644))
    assert "chmod 600" in caplog.text


@given(st.text(max_size=80))
def test_no_header_but_the_exact_key_is_allowed(header):
    keys = ApiKeys(["sk-secret"])
    assert keys.allows(header) == (header.strip().partition(" ")[0].lower() == "bearer"
                                   and header.strip().partition(" ")[2].strip() == "sk-secret")  # fmt: skip


@pytest.mark.parametrize(
    "host, local",
    [("127.0.0.1", True), ("127.4.5.6", True), ("::1", True), ("::ffff:127.0.0.1", True), ("192.0.2.2", False),
     ("10.0.0.1", False), ("::ffff:10.0.0.1", False), ("fd00::2", False), ("localhost", False), ("", False),
     (None, False)],
)  # fmt: skip
def test_only_loopback_addresses_are_this_machine(host, local):
    assert is_loopback(host) is local
