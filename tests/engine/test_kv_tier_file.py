"""The KV tier's file (--kv-offloading-path) holds the KV of every prompt: it is created 0600
(O_EXCL, never through a symbolic link), and an existing one is adopted only when it is a
regular file of this user that no one else may access — else a clear error naming the path."""

import os
import stat

import pytest
import torch

from engine.kv.kv_tier_storage import HostTierStorage, TierFileRefused, open_tier_file


def _storage(path) -> HostTierStorage:
    return HostTierStorage(torch.zeros((4, 2, 8)), num_slots=3, path=str(path))


def test_a_new_tier_file_is_private_to_this_user(tmp_path):
    path = tmp_path / "tier.bin"
    old = os.umask(0)  # even with a permissive umask
    try:
        tier = _storage(path)
    finally:
        os.umask(old)
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert st.st_size >= 3 * 2 * 8 * 4
    tier.pool[1] = 7.0
    tier.store_many([2], [1])
    assert torch.equal(tier.slots[2], torch.full((2, 8), 7.0))


def test_an_existing_private_file_is_adopted(tmp_path):
    path = tmp_path / "tier.bin"
    path.write_bytes(b"")
    path.chmod(0o600)
    _storage(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_an_existing_file_others_may_access_is_refused_naming_the_path(tmp_path, mode):
    path = tmp_path / "tier.bin"
    path.write_bytes(b"secret")
    path.chmod(mode)
    with pytest.raises(TierFileRefused, match=f"--kv-offloading-path {path} has mode {mode:04o}"):
        _storage(path)
    assert path.read_bytes() == b"secret"  # untouched


def test_a_symbolic_link_or_a_directory_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    target.chmod(0o600)
    link = tmp_path / "tier.bin"
    link.symlink_to(target)
    with pytest.raises(TierFileRefused, match=f"--kv-offloading-path {link}: cannot open it"):
        open_tier_file(str(link))
    with pytest.raises(TierFileRefused, match=str(tmp_path)):
        open_tier_file(str(tmp_path))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_file_of_another_user_is_refused(tmp_path):
    path = tmp_path / "tier.bin"
    path.write_bytes(b"")
    path.chmod(0o600)
    os.chown(path, 12345, 12345)
    with pytest.raises(TierFileRefused, match="is owned by uid 12345"):
        _storage(path)
