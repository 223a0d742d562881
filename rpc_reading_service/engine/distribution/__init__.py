"""Work distribution: which worker gets which items of the sharded stream, and in which order they are delivered."""

from .merge import EpochProgress, ReplaceFn, iterate_as_completed, iterate_in_order

__all__ = ["EpochProgress", "ReplaceFn", "iterate_in_order", "iterate_as_completed"]
