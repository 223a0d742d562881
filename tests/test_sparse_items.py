"""Sparse tensors crossing in items, both ways, on real workers: nothing of them stays behind
in either process once the items are gone (torch's own rebuild queues every sparse tensor on a
module-wide list that only ``torch.load`` empties)."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from _server_helpers import remote  # noqa: E402 - tests/ is on sys.path
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import RPCReadingService
from rpc_reading_service.serialization import SHARED_MEMORY_MIN_BYTES, dumps_item, loads_item

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")]

ITEMS = 24
NNZ = SHARED_MEMORY_MIN_BYTES // 8  # indices of 2 x NNZ int64: out of band, in shared memory locally


# -- graph functions the workers import by reference --------------------------------------------
def sparse(item: int) -> torch.Tensor:
    """A sparse item (COO, or CSR for odd items) whose buffers are large."""
    indices = torch.stack([torch.arange(NNZ), torch.arange(NNZ)])
    tensor = torch.sparse_coo_tensor(indices, torch.full((NNZ,), float(item)), (NNZ, NNZ), check_invariants=False)
    return tensor.coalesce() if item % 2 == 0 else tensor.to_sparse_csr()


def held_in_worker(tensor: torch.Tensor) -> tuple:
    """The item, with how many sparse tensors the worker's torch still holds for checking."""
    return tensor, len(torch._utils._sparse_tensors_to_validate)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def check_epochs(reading_service) -> None:
    """Three epochs of sparse items sent to the workers and back: each arrives whole, neither
    side keeps any, and the trainer's open files do not grow from epoch to epoch."""
    dp = (
        IterableWrapper(range(ITEMS))
        .map(sparse)
        .sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
        .map(held_in_worker)
    )
    fds = []
    with DataLoader2(dp, reading_service=reading_service) as dl:
        for _ in range(3):
            held = []
            values = set()
            for tensor, in_worker in dl:
                held.append(in_worker)
                value = int(tensor.values()[0])
                values.add(value)
                assert tensor.layout == (torch.sparse_coo if value % 2 == 0 else torch.sparse_csr)
                assert tensor._nnz() == NNZ
                del tensor
            assert values == set(range(ITEMS))
            assert held == [0] * ITEMS  # the worker keeps none of the items it received
            assert torch._utils._sparse_tensors_to_validate == []  # nor does the trainer
            gc.collect()
            fds.append(open_fds())
    # The first epoch opens what stays open (connections, pools); later ones pin nothing more.
    assert fds[2] <= fds[0] + 4, fds


def test_sparse_items_leave_nothing_behind_with_local_workers():
    check_epochs(RPCReadingService(num_workers=2))


def test_sparse_items_leave_nothing_behind_with_a_tcp_server(fresh_server):
    check_epochs(remote(fresh_server(), num_workers=2))


def test_a_sparse_tensor_torch_pickled_itself_is_released_on_receipt():
    # A tensor subclass, say, travels by torch's own reduction: its rebuild still queues it.
    import pickle

    from rpc_reading_service.serialization import EncodedItem

    received = loads_item(EncodedItem(pickle.dumps(sparse(0), protocol=5)))
    assert received._nnz() == NNZ and torch._utils._sparse_tensors_to_validate == []
    assert loads_item(dumps_item(sparse(1))).layout == torch.sparse_csr


@pytest.mark.filterwarnings("ignore::UserWarning")  # beta sparse CSR
def test_a_received_sparse_tensor_is_checked_when_the_user_asks_for_checks():
    broken = torch.sparse_coo_tensor(torch.tensor([[0, 9]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=False)
    encoded = dumps_item(broken)
    assert loads_item(encoded)._nnz() == 2  # unchecked by default, as torch.load
    with torch.sparse.check_sparse_tensor_invariants():
        with pytest.raises(RuntimeError, match="size is inconsistent with indices"):
            loads_item(encoded)
    assert torch._utils._sparse_tensors_to_validate == []
