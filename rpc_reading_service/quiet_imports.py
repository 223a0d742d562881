"""Importing torchdata without its deprecation banner.

torchdata 0.9 prints an 8-line banner ("the 'datapipes', 'dataloader2' modules are
deprecated") on the first import of its datapipes: noise in every worker server's log, in
``rpc-reading-worker --help`` and in a trainer that imports this package first. Only that
one warning is muted, and only around our own first import; every other warning still shows.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

__all__ = ["torchdata_banner_muted"]

_BANNER = r"\s*#+\s*WARNING!\s*The 'datapipes', 'dataloader2' modules are deprecated"


@contextlib.contextmanager
def torchdata_banner_muted() -> Iterator[None]:
    """A context in which importing torchdata's datapipes prints no deprecation banner."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_BANNER, category=UserWarning)
        yield
