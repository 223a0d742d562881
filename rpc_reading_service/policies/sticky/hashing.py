"""Consistent hashing of item keys to worker servers, and a stable split among a server's sessions.

A key is first encoded canonically (:func:`encode_key`: the same bytes in every process and
run, unlike Python's salted ``hash()`` or a pickle, whose memo makes equal tuples pickle
differently), then placed by rendezvous (highest-random-weight) hashing: every server scores
the key with blake2b over (server, key) and the highest score wins. Adding a server moves
exactly the keys the new server now wins (about 1/(N+1) of them, all to it); removing one
moves only the keys it had. The sessions of one server share its cache, so within a server
the key is split by a second, independent hash modulo the number of its sessions.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Sequence, Tuple

from ...errors import ConfigurationError
from ...stable_keys import sized, encode_key

__all__ = ["Rendezvous", "StickyAssignment", "trainer_rank_of"]

_DIGEST = 8
_SERVER_PERSON = b"rrs-sticky-srv"
_SESSION_PERSON = b"rrs-sticky-ses"
_TRAINER_PERSON = b"rrs-sticky-dst"
_TABLE_PERSON = b"rrs-sticky-tab"


def _score(prefix: "hashlib._Hash", key_bytes: bytes) -> int:
    hasher = prefix.copy()
    hasher.update(key_bytes)
    return int.from_bytes(hasher.digest(), "big")


class Rendezvous:
    """Rendezvous hashing over ``nodes`` (strings: server addresses): :meth:`choose` gives a
    key's node. Each node's hasher is prepared once, so a key costs one blake2b per node."""

    def __init__(self, nodes: Sequence[str]):
        self.nodes: Tuple[str, ...] = tuple(dict.fromkeys(nodes))
        if not self.nodes:
            raise ConfigurationError("the sticky distribution needs at least one worker server")
        self._prefixes = []
        for node in self.nodes:
            prefix = hashlib.blake2b(digest_size=_DIGEST, person=_SERVER_PERSON)
            prefix.update(sized(b"s", node.encode("utf-8", "surrogatepass")))
            self._prefixes.append(prefix)

    def choose_index(self, key_bytes: bytes) -> int:
        """The index in :attr:`nodes` of the node that wins the encoded key (ties: the first)."""
        scores = [_score(prefix, key_bytes) for prefix in self._prefixes]
        return scores.index(max(scores))

    def choose(self, key_bytes: bytes) -> str:
        """The node that wins the encoded key."""
        return self.nodes[self.choose_index(key_bytes)]

    def __reduce__(self) -> Any:
        return (Rendezvous, (self.nodes,))  # hashlib objects do not pickle: rebuild them


def _split(person: bytes, key_bytes: bytes, count: int) -> int:
    """A stable pick of one of ``count`` (independent of the rendezvous scores)."""
    if count == 1:
        return 0
    digest = hashlib.blake2b(key_bytes, digest_size=_DIGEST, person=person).digest()
    return int.from_bytes(digest, "big") % count


class StickyAssignment:
    """Which worker session (rank) owns a key, given the server address of every rank.

    ``rank_addresses[rank]`` is the address the trainer connects to for worker ``rank``
    (sessions of one server share it). A key goes to a server by :class:`Rendezvous` over
    the distinct addresses, then to one of that server's ranks by a stable split. Every
    session computes the same table, so each key belongs to exactly one rank.
    """

    def __init__(self, rank_addresses: Sequence[str]):
        self.rank_addresses: Tuple[str, ...] = tuple(rank_addresses)
        self.servers = Rendezvous(self.rank_addresses)
        ranks: Dict[str, List[int]] = {server: [] for server in self.servers.nodes}
        for rank, address in enumerate(self.rank_addresses):
            ranks[address].append(rank)
        self._ranks_of_server: Tuple[Tuple[int, ...], ...] = tuple(
            tuple(ranks[server]) for server in self.servers.nodes
        )

    @property
    def num_ranks(self) -> int:
        """The number of worker sessions the keys are split among."""
        return len(self.rank_addresses)

    def server_of(self, key: Any) -> str:
        """The address of the server that owns ``key``."""
        return self.servers.choose(encode_key(key))

    def rank_of_encoded(self, key_bytes: bytes) -> int:
        """The rank that owns an already encoded key."""
        ranks = self._ranks_of_server[self.servers.choose_index(key_bytes)]
        return ranks[_split(_SESSION_PERSON, key_bytes, len(ranks))]

    def rank_of(self, key: Any) -> int:
        """The rank (worker session) that owns ``key``."""
        return self.rank_of_encoded(encode_key(key))

    def digest(self) -> str:
        """A hex digest of the placement (which rank owns which key), for checkpoints: the
        ranks' server addresses in rank order. With one server its address decides nothing
        (a local server's differs every run): then only the number of ranks counts."""
        table = self.rank_addresses if len(self.servers.nodes) > 1 else self.num_ranks
        return hashlib.blake2b(encode_key(table), digest_size=_DIGEST, person=_TABLE_PERSON).hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StickyAssignment) and other.rank_addresses == self.rank_addresses

    def __hash__(self) -> int:
        return hash(self.rank_addresses)

    def __repr__(self) -> str:
        return f"StickyAssignment({list(self.rank_addresses)!r})"


def trainer_rank_of(key_bytes: bytes, world_size: int) -> int:
    """The torch.distributed trainer rank that owns an encoded key (a stable split: trainer
    ranks do not change within a job)."""
    return _split(_TRAINER_PERSON, key_bytes, world_size)
