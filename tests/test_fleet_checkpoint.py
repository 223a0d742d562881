"""Checkpoints across fleet sizes: a checkpoint taken with N worker sessions resumed with M.

Under ``distribution="dynamic"`` a mid-epoch checkpoint resumes exactly on any number of
sessions (its positions are chunks of the stream, not per-worker shards): the rest of the epoch
is the uninterrupted N-session run's, and the next epoch is what an M-session run has. Under the
static policies a mid-epoch checkpoint resumes only on N sessions (a clear ConfigurationError
otherwise); one taken between epochs starts the next epoch on any number. Sessions of the
module's one server (see test_checkpoint.py for the graph and the cut helpers).
"""

from __future__ import annotations

import pytest
from test_checkpoint import CUTS, interrupted_run, make_graph, reference, rs_factory  # noqa: F401 - a fixture

from rpc_reading_service import ConfigurationError, RemoteIterable
from rpc_reading_service.policies.dynamic.trainer import Dynamic


def _interrupted_on(make_rs_before, make_rs_after, cut):
    """``interrupted_run`` whose resumed half runs on another reading service."""
    made = []

    def make_rs():
        made.append(None)
        return make_rs_before() if len(made) == 1 else make_rs_after()

    return interrupted_run(make_rs, *CUTS[cut])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("before, after", [(3, 1), (2, 4)])
def test_a_dynamic_checkpoint_resumes_exactly_on_another_number_of_sessions(rs_factory, before, after):  # noqa: F811
    sessions = lambda n: lambda: rs_factory(n, distribution=Dynamic(chunk_size=3))  # noqa: E731
    on_before = reference(sessions(before), ("dynamic", before))
    on_after = reference(sessions(after), ("dynamic", after))
    got, _state = _interrupted_on(sessions(before), sessions(after), "mid-epoch")
    assert got[0] == on_before[0]  # the rest of the interrupted epoch, exactly
    assert got[1] == on_after[1]  # the next epoch: the new fleet's


@pytest.mark.timeout(60)
@pytest.mark.parametrize("distribution", ["round_robin", "first_ready"])
def test_a_static_checkpoint_resumes_on_another_fleet_only_between_epochs(rs_factory, distribution):  # noqa: F811
    sessions = lambda n: lambda: rs_factory(n, distribution=distribution)  # noqa: E731
    with pytest.raises(ConfigurationError, match=r"in an epoch with num_workers=3.*num_workers=2.*between epochs"):
        _interrupted_on(sessions(3), sessions(2), "mid-epoch")
    got, _state = _interrupted_on(sessions(3), sessions(2), "between-epochs")
    if distribution == "round_robin":
        assert got == [reference(sessions(3), ("in_order", 3))[0], reference(sessions(2), ("in_order", 2))[1]]
    for epoch in got:
        assert sorted(x for x, _ in epoch) == list(range(len(epoch))) and len(epoch) == 23


@pytest.mark.timeout(60)
def test_remote_iterable_resumes_a_dynamic_epoch_on_another_fleet(worker_server):
    from torch.utils.data import DataLoader

    def dataset(n):
        return RemoteIterable(
            make_graph(), num_workers=n, workers=[worker_server.address], auth_key=worker_server.key, seed=7,
            distribution="dynamic",
        )  # fmt: skip

    whole = dataset(3)
    try:
        expected = list(DataLoader(whole, batch_size=None))
    finally:
        whole.close()
    first = dataset(3)
    try:
        iterator = iter(DataLoader(first, batch_size=None))
        head = [next(iterator) for _ in range(9)]
        state = first.state_dict()
    finally:
        first.close()
    resumed = dataset(1)
    try:
        resumed.load_state_dict(state)
        rest = list(DataLoader(resumed, batch_size=None))
    finally:
        resumed.close()
    assert head + rest == expected

