"""RemoteNode and RemoteMapper take ``autoscale=`` (the engine's feature: tests/test_autoscale.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchdata.nodes", reason="torchdata.nodes needs torchdata >= 0.10")

from rpc_reading_service import Autoscale, ConfigurationError, RemoteMapper, RemoteNode  # noqa: E402


def test_remote_node_and_mapper_take_autoscale_and_check_its_bounds():
    from torchdata.nodes import IterableWrapper

    autoscale = Autoscale(min_sessions=1, max_sessions=2)
    node = RemoteNode(lambda info: range(4), num_workers=2, autoscale=autoscale)
    assert node._run.config.autoscale is autoscale
    with pytest.raises(ConfigurationError, match=r"starts with 3 worker sessions, outside Autoscale's bounds \[1, 2\]"):
        RemoteMapper(IterableWrapper(range(4)), abs, num_workers=3, autoscale=autoscale)
