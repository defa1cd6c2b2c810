"""Identity key files (RELIABILITY G): created owner-only in one step, links and files of others refused, loose
files tightened; the peer id survives a reuse."""

import logging
import os
import stat

import pytest

from nesa_node.errors import IdentityFileError
from nesa_node.protocol.identity import ensure_identity, load_private_key, peer_id_of_identity


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_key_is_owner_only_and_reused(tmp_path):
    path = ensure_identity(tmp_path / "keys" / "node.key")
    assert mode(path) == 0o400
    first = peer_id_of_identity(path)
    assert peer_id_of_identity(ensure_identity(path)) == first
    load_private_key(path)  # an RSA key hivemind and the record signer can read


def test_a_loose_key_is_tightened_with_a_warning(tmp_path, caplog):
    path = ensure_identity(tmp_path / "node.key")
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING):
        ensure_identity(path)
    assert mode(path) == 0o400
    assert "tightened" in caplog.text


def test_a_symbolic_link_is_refused(tmp_path):
    target = ensure_identity(tmp_path / "real.key")
    link = tmp_path / "link.key"
    link.symlink_to(target)
    with pytest.raises(IdentityFileError, match="symbolic link") as caught:
        ensure_identity(link)
    assert caught.value.code == "identity"
    dangling = tmp_path / "dangling.key"
    dangling.symlink_to(tmp_path / "elsewhere.key")
    with pytest.raises(IdentityFileError, match="symbolic link"):
        ensure_identity(dangling)  # not followed to create a key elsewhere
    assert not (tmp_path / "elsewhere.key").exists()


def test_a_folder_is_refused(tmp_path):
    (tmp_path / "dir.key").mkdir()
    with pytest.raises(IdentityFileError, match="not a regular file"):
        ensure_identity(tmp_path / "dir.key")


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to give a file away")
def test_a_key_of_another_user_is_refused(tmp_path):
    path = ensure_identity(tmp_path / "node.key")
    os.chown(path, 1, 1)
    with pytest.raises(IdentityFileError, match="another user"):
        ensure_identity(path)
