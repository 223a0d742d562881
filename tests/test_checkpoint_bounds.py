"""Edited, forged and corrupted checkpoints: refused with a ``ConfigurationError``, never resumed wrong.

A state ``state_dict()`` wrote carries a digest of its fields: any edit is refused. A state
without one (written before checkpoints carried it) loads with a warning; every number of it is
still bounded by what the run can have produced, so that an edited one is refused (or, inside
the bounds, resumes some items of the epoch) instead of eating memory, hanging or silently
dropping items: positions past the end of a worker's shard or chunk are refused by the worker,
a "dynamic" book with more open chunks than a window by the trainer. States whose digest an
editor recomputed (``signed``) stand for a forger, who gets the same bounds.

Workers are sessions on one keyed server shared by the module. The memory test resumes in a
subprocess with an address-space limit, so that unbounded code fails fast instead of eating the
machine.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import resource
import subprocess
import sys
import warnings
from typing import Any, Callable, Dict

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import ConfigurationError, RPCReadingService
from rpc_reading_service.trainer.checkpoint import ReadingServiceState, checkpoint_digest
from rpc_reading_service.policies import create_distribution
from rpc_reading_service.policies.merge import EpochProgress
from rpc_reading_service.policies.base import EpochRun
from rpc_reading_service.policies.dynamic.trainer import Dynamic

SEED = 7
N_ITEMS = 67  # three shards of 23, 22, 22
RS_STATE = "reading_service_state"
CUT = 20  # items taken before the checkpoint


def sharded(n: int = N_ITEMS):
    return IterableWrapper(range(n)).shuffle().sharding_filter()


def dispatched(n: int = N_ITEMS):
    return IterableWrapper(range(n)).shuffle().sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)


#: name -> (graph, distribution, epochs fully run before the cut): every policy's checkpoint.
POLICIES: Dict[str, tuple] = {
    "round_robin": (sharded, "round_robin", 0),
    "first_ready": (sharded, "first_ready", 0),
    "sticky": (sharded, "sticky", 0),
    "dynamic": (sharded, lambda: Dynamic(chunk_size=3), 0),
    "dynamic-guided": (sharded, lambda: Dynamic(chunk_size=3), 1),  # the second epoch: a guided schedule
    "dispatch": (dispatched, "round_robin", 0),
    "dynamic-dispatch": (dispatched, lambda: Dynamic(chunk_size=3), 0),
}


@pytest.fixture(scope="module")
def make_rs(worker_server) -> Callable[[str], RPCReadingService]:
    def make(policy: str) -> RPCReadingService:
        distribution = POLICIES[policy][1]
        return RPCReadingService(
            num_workers=3, workers=[worker_server.address], auth_key=worker_server.key,
            distribution=distribution() if callable(distribution) else distribution,
        )  # fmt: skip

    return make


@pytest.fixture(scope="module")
def checkpoints(make_rs) -> Dict[str, tuple]:
    """policy -> (state_dict() taken ``CUT`` items into an epoch, that epoch's items): taken once."""
    taken = {}
    for policy, (graph, _distribution, before) in POLICIES.items():
        dl = DataLoader2(graph(), reading_service=make_rs(policy))
        dl.seed(SEED)
        try:
            for _ in range(before):
                list(dl)
            it = iter(dl)
            head = [next(it) for _ in range(CUT)]
            state = dl.state_dict()
            epoch = head + list(it)
        finally:
            dl.shutdown()
        taken[policy] = (state, epoch)
    return taken


def values_of(state: dict) -> dict:
    return json.loads(state[RS_STATE])


def with_values(state: dict, values: dict) -> dict:
    return dict(state, **{RS_STATE: json.dumps(values).encode()})


def signed(values: dict) -> dict:
    """``values`` with the digest of its fields as they are now (what a deliberate editor could write)."""
    fields = {key: value for key, value in values.items() if key != "digest"}
    return {**fields, "digest": checkpoint_digest(fields)}


def _unsigned(values: dict) -> dict:
    """``values`` as a state written before checkpoints carried a digest."""
    return {key: value for key, value in values.items() if key != "digest"}


def resume(state: dict, rs: RPCReadingService) -> list:
    dl = DataLoader2.from_state(state, rs)
    try:
        return list(dl)
    finally:
        dl.shutdown()


# -- the digest ---------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_an_untouched_state_resumes_exactly(make_rs, checkpoints):
    state, epoch = checkpoints["round_robin"]
    assert values_of(state)["digest"].startswith("sha256:")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no digest" warning for a state of this version
        assert resume(state, make_rs("round_robin")) == epoch[CUT:]


@pytest.mark.timeout(120)
def test_an_edit_inside_the_shard_is_refused_by_the_digest(make_rs, checkpoints):
    """``consumed[0] += 5`` is a position the shard has: only the digest tells it from a real one."""
    state, _epoch = checkpoints["round_robin"]
    values = values_of(state)
    values["consumed"][0] += 5
    with pytest.raises(ConfigurationError, match="does not match its digest.*edited, truncated or corrupted"):
        resume(with_values(state, values), make_rs("round_robin"))


@pytest.mark.timeout(120)
def test_a_state_without_digest_still_resumes_with_a_warning(make_rs, checkpoints):
    state, epoch = checkpoints["dynamic"]
    with pytest.warns(UserWarning, match="has no digest"):
        got = resume(with_values(state, _unsigned(values_of(state))), make_rs("dynamic"))
    assert got == epoch[CUT:]


@pytest.mark.parametrize(
    "raw", ["{}", {"version": 1}, None, 5, ["a"], 1.5], ids=["str", "dict", "None", "int", "list", "float"]
)
def test_a_state_of_the_wrong_type_is_a_configuration_error(raw):
    with pytest.raises(ConfigurationError, match="must be bytes"):
        ReadingServiceState.from_bytes(raw)


def test_a_deeply_nested_state_is_a_configuration_error(checkpoints):
    with pytest.raises(ConfigurationError, match="not an RPCReadingService checkpoint"):
        ReadingServiceState.from_bytes(b"[" * 100000 + b"]" * 100000)
    values = values_of(checkpoints["dynamic"][0])
    values["distribution"]["complete"] = json.loads("[" * 900 + "]" * 900)  # JSON parses it; copying it would not
    with pytest.raises(ConfigurationError, match="field 'distribution' nests objects and lists more than 16 deep"):
        ReadingServiceState.from_bytes(json.dumps(values).encode())


# -- positions past the end: the worker knows where its shard ends --------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["round_robin", "first_ready", "sticky", "dispatch"])
def test_a_position_past_the_end_of_a_shard_is_refused(make_rs, checkpoints, policy):
    """``consumed[0] = 10**12`` resumed 34 items of 67 and said nothing: now the worker refuses it."""
    state, _epoch = checkpoints[policy]
    values = _unsigned(values_of(state))
    values["consumed"][0] = 10**12
    with pytest.warns(UserWarning, match="has no digest"):
        with pytest.raises(ConfigurationError, match=r"(?s)worker process 0 .*field 'consumed' says 1000000000000 items"):
            resume(with_values(state, values), make_rs(policy))
    values["consumed"][0] = 2**63 - 1  # also with a digest an editor recomputed
    with pytest.raises(ConfigurationError, match=r"(?s)worker process 0 .*field 'consumed' says"):
        resume(with_values(state, signed(values)), make_rs(policy))


@pytest.mark.timeout(60)
def test_a_position_past_the_end_of_the_trainers_own_graph_is_refused(checkpoints):
    state, _epoch = checkpoints["round_robin"]
    dl = DataLoader2(sharded(), reading_service=RPCReadingService(num_workers=0))
    dl.seed(SEED)
    try:
        it = iter(dl)
        head = [next(it) for _ in range(CUT)]
        values = values_of(dl.state_dict())
    finally:
        dl.shutdown()
    assert values["consumed"] == [CUT] and head
    values["consumed"] = [N_ITEMS + 1]
    with pytest.raises(ConfigurationError, match=f"field 'consumed' says {N_ITEMS + 1} items of the trainer's own graph"):
        resume(with_values(state, signed(values)), RPCReadingService(num_workers=0))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["dynamic", "dynamic-dispatch"])
def test_more_items_delivered_of_a_chunk_than_it_has_is_refused(make_rs, checkpoints, policy):
    state, _epoch = checkpoints[policy]
    values = signed(values_of(state))
    book = values["distribution"]
    if not book["delivered"]:  # the cut fell on a chunk boundary: claim items of the next open chunk
        book["delivered"] = [[book["complete_below"], 0]]
    book["delivered"][0][1] = 10**6
    with pytest.raises(ConfigurationError, match=r"field 'distribution' \('delivered'\) says 1000000 items of chunk"):
        resume(with_values(state, signed(values)), make_rs(policy))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["dynamic", "dynamic-dispatch"])
def test_chunks_complete_past_the_end_of_the_stream_are_refused(make_rs, checkpoints, policy):
    """Every chunk below 10**6 complete: the epoch would end at once with none of its items. With
    the stream's length in the state, the trainer refuses it at once; without, once it knows the end."""
    state, _epoch = checkpoints[policy]
    values = signed(values_of(state))
    values["distribution"].update(complete_below=10**6, next_chunk=10**6, complete=[], delivered=[])
    values["distribution"]["stream_length"] = N_ITEMS
    with pytest.raises(ConfigurationError, match=f"has next_chunk 1000000, past the end of its stream of {N_ITEMS}"):
        resume(with_values(state, signed(values)), make_rs(policy))
    del values["distribution"]["stream_length"]
    with pytest.raises(ConfigurationError, match=r"chunks up to 999999 complete, but the stream has \d+ chunks"):
        resume(with_values(state, signed(values)), make_rs(policy))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["dynamic", "dynamic-dispatch"])
def test_chunks_open_past_the_end_of_the_stream_resume_the_rest_of_the_epoch(make_rs, checkpoints, policy):
    """A re-signed next_chunk a few chunks past the end: the open chunks there hold nothing, and the
    epoch ends (a dispatched one waited forever for units its dispatcher never makes)."""
    state, epoch = checkpoints[policy]
    values = values_of(state)
    values["distribution"]["next_chunk"] = N_ITEMS + 6
    assert sorted(resume(with_values(state, signed(values)), make_rs(policy))) == sorted(epoch[CUT:])


# -- memory: a number of the state is never the size of an allocation --------------------------------
_RESUME_SCRIPT = """
import json, pickle, sys
from torchdata.dataloader2 import DataLoader2
from rpc_reading_service import ConfigurationError, RPCReadingService
from rpc_reading_service.policies.dynamic.trainer import Dynamic

for path in sys.argv[3:]:  # one line per state, in order: what its resume did
    with open(path, "rb") as handle:
        state = pickle.load(handle)
    rs = RPCReadingService(num_workers=3, workers=[sys.argv[1]], auth_key=sys.argv[2], distribution=Dynamic(chunk_size=3))
    try:
        dl = DataLoader2.from_state(state, rs)
        try:
            outcome = f"RESUMED {len(list(dl))}"
        finally:
            dl.shutdown()
    except ConfigurationError as exc:
        outcome = f"REFUSED {exc}"
    except BaseException as exc:
        outcome = f"FAILED {type(exc).__name__}: {exc}"
    print(json.dumps(outcome), flush=True)
"""

#: The resuming trainer's address space: a trainer needs under 1 GiB; old code built a list
#: over ``range(complete_below, next_chunk)`` (3 GiB in 8 s for next_chunk=2**40).
ADDRESS_SPACE = 2 * 1024**3

#: ``(field, value)`` of the "dynamic" state set to a huge number.
HUGE = [("next_chunk", 2**40), ("next_chunk", 2**62), ("schedule", "huge")]


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.fixture(scope="module")
def huge_resumes(worker_server, checkpoints, tmp_path_factory) -> Dict[tuple, str]:
    """``(field, value)`` of :data:`HUGE` -> what resuming that state did, each in turn in one
    subprocess with the address-space limit (one torch import for all)."""
    paths = []
    for field, value in HUGE:
        policy = "dynamic-guided" if field == "schedule" else "dynamic"
        state, _epoch = checkpoints[policy]
        values = _unsigned(values_of(state))
        if field == "schedule":  # a guided schedule of 2**30 workers: its tail alone would be billions of bounds
            values["distribution"]["schedule"].update(workers=2**30, divisor=2**9, length=2**39)
        else:
            values["distribution"][field] = value
        paths.append(tmp_path_factory.mktemp("huge") / "state.pkl")
        paths[-1].write_bytes(pickle.dumps(with_values(state, values)))
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _RESUME_SCRIPT, worker_server.address, worker_server.key, *map(str, paths)],
        capture_output=True, text=True, timeout=120, preexec_fn=_limit_address_space,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)),
    )  # fmt: skip
    outcomes = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and len(outcomes) == len(HUGE), (done.stdout, done.stderr[-3000:])
    return dict(zip(HUGE, outcomes))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("field, value", HUGE)
def test_a_huge_dynamic_number_is_refused_without_eating_memory(huge_resumes, field, value):
    outcome = huge_resumes[field, value]
    assert outcome.startswith("REFUSED"), outcome
    assert "malformed RPCReadingService checkpoint: the 'dynamic' distribution state" in outcome


# -- any number, any type, anywhere: refused or resumed, never another exception ------------------
def _leaves(value: Any, path: tuple = ()) -> list:
    """Every path into a JSON value (containers too)."""
    paths = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += _leaves(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths += _leaves(item, path + (index,))
    return paths


def _replace(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    copy = list(value) if isinstance(value, list) else dict(value)
    copy[path[0]] = _replace(value[path[0]], path[1:], new)
    return copy


NUMBERS = st.sampled_from([-1, 0, 1, 2, 3, 22, 23, 67, 68, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 10**30])
ANY_VALUE = st.one_of(
    NUMBERS, st.integers(), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=5),
    st.lists(NUMBERS, max_size=4), st.dictionaries(st.text(max_size=3), NUMBERS, max_size=2),
    st.lists(st.lists(NUMBERS, max_size=3), max_size=3),
)  # fmt: skip


def _check_offline(policy: str, values: dict) -> None:
    """What a resume checks before it starts a worker: parsing, the policy's check, the book's resume."""
    graph, option, _before = POLICIES[policy]
    distribution = option() if callable(option) else create_distribution(option)
    state = ReadingServiceState.from_bytes(json.dumps(values).encode())
    state.check_compatible(3, state.graph)
    if not state.in_epoch:
        distribution.hint_from_state(state.distribution)
        return
    distribution.check_state(state.distribution)
    state.check_distribution(distribution.name)
    if isinstance(distribution, Dynamic):  # builds the book from the state (nothing is sent before iterating)
        units = object() if graph is dispatched else None
        run = EpochRun([None] * 3, None, EpochProgress(1, [0, 0, 0]), None, state.distribution, 1, units)  # type: ignore[arg-type]
        distribution.merger(run)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_mutation_is_refused_or_loads(checkpoints, data):
    """Offline: every field replaced by any JSON value, with the digest kept, recomputed or removed."""
    policy = data.draw(st.sampled_from(sorted(POLICIES)))
    values = values_of(checkpoints[policy][0])
    path = data.draw(st.sampled_from(_leaves(values)[1:]))
    mutated = _replace(values, path, data.draw(ANY_VALUE))
    mutated = data.draw(st.sampled_from([lambda v: v, signed, _unsigned]))(mutated)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _check_offline(policy, mutated)
        except ConfigurationError:
            pass


@pytest.mark.timeout(300)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_forged_number_resumes_items_of_the_epoch_or_is_refused(make_rs, checkpoints, data):
    """With real workers: a number of a re-signed state replaced by another resumes only items of the
    epoch, at most as many as it has left to give plus those given back, or is refused; the
    unchanged state resumes exactly."""
    policy = data.draw(st.sampled_from(sorted(POLICIES)))
    state, epoch = checkpoints[policy]
    values = values_of(state)
    numbers = [path for path in _leaves(values) if isinstance(_get(values, path), int) and path[0] != "version"]
    path = data.draw(st.sampled_from(numbers))
    new = data.draw(st.one_of(NUMBERS, st.just(_get(values, path)), st.integers(0, 100)))
    mutated = signed(_replace(values, path, new))
    try:
        got = resume(with_values(state, mutated), make_rs(policy))
    except ConfigurationError:
        event("refused")
        return
    event("resumed")
    if new == _get(values, path):
        assert got == epoch[CUT:] if policy != "first_ready" else sorted(got) == sorted(epoch[CUT:])
    missing = collections.Counter(got) - collections.Counter(epoch)
    assert not missing, f"items that are not the epoch's: {missing}"


def _get(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value
