"""Where torchdata has DataLoader2 (< 0.10) and no torchdata.nodes, the torchdata.nodes front end
says what to install; the DataLoader2 one loads."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.mark.skipif(importlib.util.find_spec("torchdata.nodes") is not None, reason="this torchdata has torchdata.nodes")
def test_nodes_front_end_says_what_to_install():
    with pytest.raises(ImportError, match=r"pip install 'rpc-reading-service\[nodes\]'"):
        from rpc_reading_service import RemoteNode  # noqa: F401
    from rpc_reading_service import RemoteIterable, RPCReadingService  # noqa: F401 - both load here
