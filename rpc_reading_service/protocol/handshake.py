"""The handshake, before anything is unpickled: a mutual HMAC challenge-response on a shared key K::

    client -> HELLO      client nonce Nc, package version
    server -> CHALLENGE  server nonce Ns, HMAC(K, "server" | Nc | Ns)
    client -> PROOF      HMAC(K, "client" | Ns | Nc)          (after checking the server's proof)
    server -> WELCOME    package version                      (or REJECT with a reason)

Both sides prove the key, so a trainer never unpickles data from an impostor either.
Handshake frames carry raw bytes only. Sans I/O: frames in, frames out.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import List, Optional

from ..errors import AuthenticationError, RemoteProtocolError
from ..safe_text import printable
from .frames import Buffer, Frame, MessageKind, encode_frame

__all__ = ["NONCE_BYTES", "ClientHandshake", "ServerHandshake", "encode_reject", "decode_reject"]

NONCE_BYTES = 32
_HELLO = struct.Struct(f"!{NONCE_BYTES}s")
_DIGEST_BYTES = hashlib.sha256().digest_size


def handshake_proof(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 under ``key`` of ``label`` and the two nonces: what each side proves it holds the key with."""
    return hmac.new(key, label + first + second, hashlib.sha256).digest()


def _expect(frame: Frame, kind: MessageKind, escape_reason: bool = False) -> None:
    # The trainer's error reaches a user's terminal as it is, so the client escapes a REJECT's
    # reason (the peer may not have authenticated); the server escapes all it logs itself.
    if frame.kind == MessageKind.REJECT:
        reason = decode_reject(frame) if escape_reason else bytes(frame.body[:512]).decode("utf-8", "replace")
        raise AuthenticationError(f"peer refused the connection: {reason}")
    if frame.kind != kind:
        raise RemoteProtocolError(f"expected {kind.name} during the handshake, got {frame.kind.name}")


def encode_reject(reason: str) -> List[Buffer]:
    """Encode a REJECT frame carrying a human-readable reason (raw UTF-8, never pickled)."""
    return encode_frame(MessageKind.REJECT, [reason.encode("utf-8")[:1024]])


def decode_reject(frame: Frame) -> str:
    """The reason of a REJECT frame, escaped: the peer may not have authenticated."""
    return printable(bytes(frame.body[:1024]).decode("utf-8", "replace"))


class _HandshakeSide:
    """What both sides of the handshake hold: the key, their own nonce and package version, the
    peer's nonce once it came, and the peer's package version."""

    def __init__(self, key: bytes, package_version: str = "", nonce: Optional[bytes] = None):
        self._key = key
        self._nonce = nonce or os.urandom(NONCE_BYTES)
        self._package_version = package_version.encode("utf-8")[:64]
        self._peer_nonce: Optional[bytes] = None
        #: The package version the peer announced ("" if it sent none).
        self.peer_package_version = ""
        #: Whether the handshake completed (both sides proved the key).
        self.done = False


class ClientHandshake(_HandshakeSide):
    """The trainer's side of the mutual HMAC challenge-response."""

    def hello(self) -> List[Buffer]:
        """The first frame to send."""
        return encode_frame(MessageKind.HELLO, [_HELLO.pack(self._nonce), self._package_version])

    def receive_challenge(self, frame: Frame) -> List[Buffer]:
        """Check the server's proof of the key; return the PROOF frame to send."""
        _expect(frame, MessageKind.CHALLENGE, escape_reason=True)
        body = bytes(frame.body)
        if len(body) != NONCE_BYTES + _DIGEST_BYTES:
            raise RemoteProtocolError("malformed CHALLENGE frame")
        server_nonce, server_proof = body[:NONCE_BYTES], body[NONCE_BYTES:]
        if not hmac.compare_digest(server_proof, handshake_proof(self._key, b"server", self._nonce, server_nonce)):
            if self._key and hmac.compare_digest(server_proof, handshake_proof(b"", b"server", self._nonce, server_nonce)):
                raise AuthenticationError(
                    "the worker has no auth key, but this trainer passes one: start the worker with the same key "
                    "(rpc-reading-worker --auth-key-file FILE, or RPC_READING_SERVICE_AUTH_KEY in its environment), "
                    "or connect with auth_key=None (a worker without a key listens on loopback only)"
                )
            if not self._key:
                raise AuthenticationError(
                    "this trainer has no auth key (auth_key=None) but the worker requires one: pass "
                    "auth_key= with the key the worker was started with (its --auth-key-file, or "
                    "RPC_READING_SERVICE_AUTH_KEY in its environment)"
                )
            raise AuthenticationError(
                "the worker does not hold the same auth key as this trainer: pass the key the worker "
                "was started with (--auth-key-file / RPC_READING_SERVICE_AUTH_KEY) as auth_key="
            )
        self._peer_nonce = server_nonce
        return encode_frame(MessageKind.PROOF, [handshake_proof(self._key, b"client", server_nonce, self._nonce)])

    def receive_welcome(self, frame: Frame) -> None:
        """Finish the handshake on the server's WELCOME."""
        _expect(frame, MessageKind.WELCOME, escape_reason=True)
        if self._peer_nonce is None:
            raise RemoteProtocolError("WELCOME before CHALLENGE")
        # Servers since 0.1.0 put their package version in WELCOME (older ones send nothing).
        self.peer_package_version = bytes(frame.body[:64]).decode("utf-8", "replace")
        self.done = True


class ServerHandshake(_HandshakeSide):
    """The worker server's side of the mutual HMAC challenge-response."""

    def __init__(self, key: bytes, nonce: Optional[bytes] = None, package_version: str = ""):
        super().__init__(key, package_version, nonce)

    def receive_hello(self, frame: Frame) -> List[Buffer]:
        """Answer a HELLO with a CHALLENGE that also proves this server holds the key."""
        _expect(frame, MessageKind.HELLO)
        if self._peer_nonce is not None:
            raise RemoteProtocolError("second HELLO in one handshake")
        body = bytes(frame.body)
        if len(body) < NONCE_BYTES:
            raise RemoteProtocolError("malformed HELLO frame")
        self._peer_nonce = body[:NONCE_BYTES]
        self.peer_package_version = body[NONCE_BYTES:].decode("utf-8", "replace")
        proof = handshake_proof(self._key, b"server", self._peer_nonce, self._nonce)
        return encode_frame(MessageKind.CHALLENGE, [self._nonce, proof])

    def receive_proof(self, frame: Frame) -> List[Buffer]:
        """Verify the client's PROOF; return WELCOME, or raise AuthenticationError."""
        _expect(frame, MessageKind.PROOF)
        if self._peer_nonce is None:
            raise RemoteProtocolError("PROOF before HELLO")
        expected = handshake_proof(self._key, b"client", self._nonce, self._peer_nonce)
        if not hmac.compare_digest(bytes(frame.body), expected):
            raise AuthenticationError("client failed the auth-key challenge (wrong or missing auth key)")
        self.done = True
        return encode_frame(MessageKind.WELCOME, [self._package_version])
