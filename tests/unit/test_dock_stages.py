"""One stage vocabulary: every dock client checks a get's consumer and a put's producer against the column
schema at the call (no Ray, no request is ever sent), and every client kind offers the same DockAPI."""

import inspect
import re
from pathlib import Path

import pytest

from dockrl.dock import DockAPI, DockChoice, DockError, Stage
from dockrl.dock.central import CentralClient
from dockrl.dock.client import DockClient
from dockrl.dock.columns import (
    ADVANTAGES,
    LABEL,
    OLD_LOGPROBS,
    PROMPT_IDS,
    REF_LOGPROBS,
    RESPONSE_IDS,
    REWARD,
    check_get,
    check_put,
    reward_component,
    schema,
)
from dockrl.dock.stages import DOCK_STAGES
from dockrl.observe.run_dir import StageTimer
from dockrl.parallel.replica import ReplicaClient


class NoRequests:
    """A transport that fails the test if a checked call reaches it."""

    def request(self, *args, **kwargs):
        raise AssertionError(f"a request was sent: {args}")


def clients() -> list:
    """One client of every kind, none of which can reach a dock."""
    dock = DockClient(None, [None])
    central = CentralClient(NoRequests(), "driver")
    return [dock, central, DockChoice([dock]), ReplicaClient(central, None, 0, 1)]


@pytest.mark.parametrize("client", clients(), ids=lambda c: type(c).__name__)
def test_a_get_by_a_stage_that_does_not_read_the_column_fails_at_the_call(client):
    with pytest.raises(
        DockError,
        match=r"get of column 'label' by stage 'update': its declared readers are \['reward', 'checkpoint'\]",
    ):
        client.get(Stage.UPDATE, [PROMPT_IDS, LABEL], 4)
    with pytest.raises(
        DockError,
        match=r"column 'ref_logprobs' by stage 'reward'.*\['update', 'critic_update', 'checkpoint'\]",
    ):
        client.get("reward", [RESPONSE_IDS, REF_LOGPROBS], 4, whole_groups=True)
    with pytest.raises(
        DockError, match=r"consumer 'train' is not a dock stage; the dock stages are \[.*'update'"
    ):
        client.get("train", [RESPONSE_IDS], 4)
    with pytest.raises(DockError, match="consumer 'step' is not a dock stage"):  # a timer-only stage
        client.get(Stage.STEP, [RESPONSE_IDS], 4)


@pytest.mark.parametrize("client", clients(), ids=lambda c: type(c).__name__)
def test_a_put_by_a_stage_that_does_not_produce_the_column_fails_at_the_call(client):
    with pytest.raises(
        DockError, match=r"put of column 'response_ids' by stage 'reward': it is written by \['rollout'\]"
    ):
        client.put(Stage.REWARD, [0], {REWARD: [1.0], RESPONSE_IDS: [[1]]})
    with pytest.raises(DockError, match=r"column 'old_logprobs' by stage 'reference'.*\['old_logprobs'\]"):
        client.put(Stage.REFERENCE, [0], {OLD_LOGPROBS: [[0.0]]})
    with pytest.raises(DockError, match="producer 'ref' is not a dock stage"):
        client.put("ref", [0], {REF_LOGPROBS: [[0.0]]})
    with pytest.raises(DockError, match=r"add_groups of column 'reward' by stage 'driver'"):
        client.add_groups([[1]], ["1"], 1, extra={REWARD: [1.0]})


def test_declared_producers_and_readers_pass_the_check():
    assert check_get(Stage.UPDATE, [PROMPT_IDS, RESPONSE_IDS, ADVANTAGES, REF_LOGPROBS]) is Stage.UPDATE
    assert check_get("rollout", [PROMPT_IDS]) is Stage.ROLLOUT  # a plain name of a stage is that stage
    assert check_put(Stage.REWARD, [REWARD, ADVANTAGES, reward_component("exact_answer/correct")])
    assert check_put(Stage.CRITIC_UPDATE, [ADVANTAGES])  # advantages: group estimators or GAE
    # The checkpoint reads every column of the rows in flight and writes them back on resume.
    every = [spec.name for spec in schema()] + [reward_component("rm")]
    assert check_get(Stage.CHECKPOINT, every) is check_put(Stage.CHECKPOINT, every) is Stage.CHECKPOINT


def test_every_dock_stage_is_declared_and_no_other_stage_is():
    producers = {stage for spec in schema() for stage in spec.producers}
    readers = {stage for spec in schema() for stage in spec.readers}
    consumers = DOCK_STAGES - {Stage.DRIVER}  # the driver only adds prompts
    assert consumers <= readers, consumers - readers
    # The update only reads; the checkpoint writes back any column it saved (a rule of check_put).
    assert DOCK_STAGES - {Stage.UPDATE, Stage.CHECKPOINT} <= producers, DOCK_STAGES - producers
    assert producers | readers <= DOCK_STAGES
    for spec in schema():
        assert spec.producers and Stage.CHECKPOINT in spec.readers, spec.name
        assert all(isinstance(s, Stage) for s in (*spec.producers, *spec.readers)), spec.name


def test_stage_values_are_the_timing_metric_names():
    timer = StageTimer()
    for stage in (Stage.REFERENCE, Stage.OLD_LOGPROBS, Stage.UPDATE, Stage.STEP, Stage.ROLLOUT):
        timer.add(stage, 1.0)
    timer.add("update", 1.0)  # a plain name and its Stage are one label
    from dockrl.observe.metric_names import timing

    assert {timing(stage): seconds for stage, seconds in timer.seconds.items()} == {
        "timing/reference": 1.0,
        "timing/old_logprobs": 1.0,
        "timing/update": 2.0,
        "timing/step": 1.0,
        "timing/rollout": 1.0,
    }


PROTOCOL_METHODS = [  # DockAPI's own and those it takes from RowSource (pull, put, get)
    name
    for base in DockAPI.__mro__
    if base.__module__ == DockAPI.__module__
    for name, member in vars(base).items()
    if inspect.isfunction(member) and not name.startswith("_")
]


@pytest.mark.parametrize("kind", [DockClient, CentralClient, DockChoice, ReplicaClient])
def test_every_client_kind_offers_the_dock_api_with_its_signatures(kind):
    assert set(PROTOCOL_METHODS) >= {"put", "get", "all_consumed", "reset", "add_groups", "stats"}
    for name in PROTOCOL_METHODS:
        expected = inspect.signature(getattr(DockAPI, name))
        actual = inspect.signature(getattr(kind, name))
        assert list(actual.parameters) == list(expected.parameters), (kind.__name__, name)
    assert all(isinstance(client, DockAPI) for client in clients())


def test_recipes_call_no_worker_method_by_its_name():
    recipes = Path(__file__).resolve().parents[2] / "src" / "dockrl" / "recipes"
    calls = [
        f"{path.name}: {line.strip()}"
        for path in sorted(recipes.glob("*.py"))
        for line in path.read_text().splitlines()
        if re.search(r"\.call(_async)?\(\s*[\"']", line)
    ]
    assert calls == []
