"""Auth key files: a real worker server warns about a key file other users can read."""

from __future__ import annotations

import secrets

import pytest
from conftest import start_server


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, warned", [(0o644, True), (0o640, True), (0o600, False)])
def test_worker_warns_once_about_a_key_file_others_can_read(tmp_path, mode, warned):
    key = secrets.token_hex(32)
    key_file = tmp_path / "key.txt"
    key_file.write_text(key + "\n")
    key_file.chmod(mode)
    server = start_server(tmp_path, key=secrets.token_hex(8), args=["--auth-key-file", str(key_file)])
    try:
        warnings = [line for line in server.stderr().splitlines() if "chmod 600" in line]
        if warned:
            assert len(warnings) == 1, server.stderr()
            assert str(key_file) in warnings[0] and "WARNING" in warnings[0] and "other users" in warnings[0]
        else:
            assert warnings == [], server.stderr()
    finally:
        server.stop()
