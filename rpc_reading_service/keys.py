"""Where shared auth keys come from: a file, the environment, or a fresh random one."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from typing import Optional

from .errors import ConfigurationError

__all__ = ["AUTH_KEY_ENV", "MIN_AUTH_KEY_BYTES", "load_auth_key", "new_auth_key", "weak_key_advice"]

AUTH_KEY_ENV = "RPC_READING_SERVICE_AUTH_KEY"
#: Shorter keys can be guessed offline from one recorded handshake.
MIN_AUTH_KEY_BYTES = 16

log = logging.getLogger(__name__)


def load_auth_key(auth_key_file: Optional[str]) -> bytes:
    """The shared key from ``auth_key_file`` or ``$RPC_READING_SERVICE_AUTH_KEY`` (b"" if neither)."""
    if auth_key_file:
        try:
            with open(auth_key_file, "rb") as handle:
                key = handle.read().strip()
                mode = os.fstat(handle.fileno()).st_mode
        except OSError as exc:
            raise ConfigurationError(f"cannot read --auth-key-file {auth_key_file!r}: {exc.strerror}") from exc
        if not key:
            raise ConfigurationError(f"--auth-key-file {auth_key_file!r} is empty: put the shared key in it")
        if mode & (stat.S_IRGRP | stat.S_IROTH | stat.S_IWGRP | stat.S_IWOTH):
            log.warning(
                "--auth-key-file %r can be read or changed by other users (mode %s), and the key lets "
                "its holder run code on this worker: run `chmod 600 %s`",
                auth_key_file, stat.filemode(mode), auth_key_file,
            )  # fmt: skip
    else:
        key = os.environ.get(AUTH_KEY_ENV, "").strip().encode("utf-8")
    advice = weak_key_advice(key)
    if advice:
        log.warning("%s", advice)
    return key


def new_auth_key() -> bytes:
    """A fresh random shared key (64 hex characters)."""
    return secrets.token_hex(32).encode("ascii")


def weak_key_advice(key: Optional[bytes]) -> str:
    """What to do about a non-empty auth ``key`` shorter than :data:`MIN_AUTH_KEY_BYTES` ("" if it is long enough).

    Args:
        key: The shared key (None or b"": no key, which is no weak one).
    """
    if not key or len(key) >= MIN_AUTH_KEY_BYTES:
        return ""
    return (
        f"the auth key is only {len(key)} bytes: whoever records one handshake can guess a short key offline, and "
        f"the key lets its holder run code on the workers. Use at least {MIN_AUTH_KEY_BYTES} random bytes, e.g. "
        "`python -c 'import secrets; print(secrets.token_hex(32))'`"
    )
