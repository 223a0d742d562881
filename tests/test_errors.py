"""The typed errors: exported at top level, with the base classes callers catch."""

import rpc_reading_service as rrs
from rpc_reading_service.errors import describe_worker


def test_errors_are_exported_and_typed():
    for name in ("AuthenticationError", "ProtocolError", "WorkerLostError", "WorkerStartupError", "ItemPicklingError",
                 "RemoteWorkerError", "FrameTooLargeError", "ConfigurationError", "ItemTooLargeError"):
        error = getattr(rrs, name)
        assert name in rrs.__all__
        assert issubclass(error, rrs.RPCReadingServiceError)
    assert issubclass(rrs.FrameTooLargeError, rrs.ProtocolError)
    assert issubclass(rrs.WorkerLostError, ConnectionError)
    assert issubclass(rrs.ConfigurationError, ValueError)
    assert issubclass(rrs.ItemTooLargeError, ValueError)
    assert issubclass(rrs.RemoteWorkerError, RuntimeError)
    lost = rrs.WorkerLostError("gone", rank=3, address="h:1")
    assert (lost.rank, lost.address, str(lost)) == (3, "h:1", "gone")


def test_describe_worker():
    assert describe_worker(1, "10.0.0.2:29600") == "worker 1 (10.0.0.2:29600)"
    assert describe_worker(None, "h:1") == "worker at h:1"
    assert describe_worker(2, None) == "worker 2"
    assert describe_worker(None, None) == "worker"
