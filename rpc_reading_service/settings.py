"""Checks of the numeric and on/off settings of :class:`~rpc_reading_service.RPCReadingService`.

One table says what each setting allows; :func:`check_settings` applies it once, at
construction, so that ``timeout=float("nan")`` or ``prefetch=0`` is refused with a message
naming the parameter instead of failing obscurely (or busy-looping) mid-run.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

from .errors import ConfigurationError

__all__ = [
    "MAX_POSITION",
    "MAX_PREFETCH",
    "MAX_WORKERS",
    "NumberRule",
    "RPC_READING_SERVICE_NUMBERS",
    "RPC_READING_SERVICE_FLAGS",
    "RPC_READING_SERVICE_KINDS",
    "check_number",
    "check_settings",
]


@dataclass(frozen=True)
class NumberRule:
    """What one numeric setting allows: an int or a finite float, at least (or above) ``minimum``."""

    name: str
    integer: bool
    minimum: float
    #: The value must be strictly greater than ``minimum`` (seconds that must not be zero).
    exclusive: bool = False
    #: ``None`` is allowed (the setting is off or derived).
    optional: bool = False
    unit: str = ""
    maximum: Optional[float] = None

    def allowed(self) -> str:
        """The allowed values in words, e.g. ``an int >= 1`` or ``a finite number > 0 (seconds)``."""
        kind = "an int" if self.integer else "a finite number"
        bound = f"{'>' if self.exclusive else '>='} {self.minimum}"
        if self.maximum is not None:
            bound += f" and <= {self.maximum}"
        unit = f" ({self.unit})" if self.unit else ""
        return f"{kind} {bound}{unit}{' or None' if self.optional else ''}"


#: The most worker sessions of one run (each is a process and a connection): far more than a
#: trainer can feed from, so a larger number is a typo.
MAX_WORKERS = 4096
#: The largest ``prefetch`` / ``main_prefetch_cnt``: items or frames held in memory ahead of use.
MAX_PREFETCH = 1 << 20

RPC_READING_SERVICE_NUMBERS = (
    NumberRule("num_workers", integer=True, minimum=0, maximum=MAX_WORKERS),
    NumberRule("prefetch", integer=True, minimum=1, optional=True, unit="frames per worker", maximum=MAX_PREFETCH),
    NumberRule("main_prefetch_cnt", integer=True, minimum=0, unit="items", maximum=MAX_PREFETCH),
    NumberRule("max_frame_bytes", integer=True, minimum=1024, optional=True, unit="bytes"),
    NumberRule("max_reassignments", integer=True, minimum=0),
    NumberRule("min_workers", integer=True, minimum=1, optional=True, maximum=MAX_WORKERS),
    NumberRule("timeout", integer=False, minimum=0, exclusive=True, unit="seconds"),
    NumberRule("connect_timeout", integer=False, minimum=0, exclusive=True, unit="seconds"),
    NumberRule("heartbeat_interval", integer=False, minimum=0, exclusive=True, unit="seconds"),
    NumberRule("item_timeout", integer=False, minimum=0, exclusive=True, optional=True, unit="seconds"),
    NumberRule("poll_interval", integer=False, minimum=0, exclusive=True, optional=True, unit="seconds"),
)
RPC_READING_SERVICE_FLAGS = ("in_order", "pin_memory", "host_store")


def _is_key(value: Any) -> bool:
    return value is None or isinstance(value, (str, bytes))


def _is_optional_callable(value: Any) -> bool:
    return value is None or callable(value)


def _is_module_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(module, types.ModuleType) for module in value)


def _is_dict(value: Any) -> bool:
    return isinstance(value, dict)


#: Settings that are no numbers: (name, check, what is allowed).
RPC_READING_SERVICE_KINDS = (
    ("auth_key", _is_key, "a str, bytes or None"),
    ("worker_init_fn", _is_optional_callable, "a function fn(datapipe, worker_info) or None"),
    ("worker_reset_fn", _is_optional_callable, "a function fn(datapipe, worker_info, seed_generator) or None"),
    ("pickle_by_value", _is_module_list, "a list of imported modules, e.g. [my_package.transforms]"),
    ("options", _is_dict, "a dict of keyword arguments for the transport"),
)

#: Positions past this are no position in any shard (and would overflow the worker's counters).
MAX_POSITION = 2**63 - 1


def check_number(rule: NumberRule, value: Any) -> None:
    """Raise :class:`ConfigurationError` unless ``value`` is allowed by ``rule``."""
    if value is None and rule.optional:
        return
    # bool is an int subclass, but True is no count of workers or seconds.
    numeric = isinstance(value, int) if rule.integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not numeric:
        raise ConfigurationError(
            f"{rule.name} must be {rule.allowed()}, got {value!r} of type {type(value).__name__}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigurationError(f"{rule.name} must be {rule.allowed()}, got {value!r}")
    too_big = rule.maximum is not None and value > rule.maximum
    if value < rule.minimum or (rule.exclusive and value == rule.minimum) or too_big:
        raise ConfigurationError(f"{rule.name} must be {rule.allowed()}, got {value!r}")


def check_settings(
    config: Mapping[str, Any],
    numbers: Sequence[NumberRule] = RPC_READING_SERVICE_NUMBERS,
    flags: Sequence[str] = RPC_READING_SERVICE_FLAGS,
    kinds: Sequence[Tuple[str, Callable[[Any], bool], str]] = RPC_READING_SERVICE_KINDS,
) -> None:
    """Check every numeric setting, on/off flag and typed setting in ``config`` that the tables name."""
    for rule in numbers:
        if rule.name in config:
            check_number(rule, config[rule.name])
    for name in flags:
        if name in config and not isinstance(config[name], bool):
            raise ConfigurationError(f"{name} must be True or False, got {config[name]!r}")
    for name, allowed, description in kinds:
        if name in config and not allowed(config[name]):
            raise ConfigurationError(f"{name} must be {description}, got {config[name]!r}")
