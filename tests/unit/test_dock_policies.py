"""Dock allocation policies, balancing, partial-rollout carry-over and capacity (no Ray), and a
property-based interleaving of producers and consumers over 2 warehouses."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dockrl.dock import Candidates, DockController, DockError, Warehouse, balanced_partition, resolve_policy

COLS = ["response_ids"]


def prefer_long(candidates: Candidates) -> np.ndarray:
    """A custom policy: most tokens first (named in tests as 'test_dock_policies:prefer_long')."""
    return np.argsort(-candidates.tokens, kind="stable")


def broken_policy(candidates: Candidates) -> list[int]:
    return [0, 0]


def with_responses(lengths: list[int], group_size: int = 1, policy: str = "first") -> DockController:
    controller = DockController(2, policy=policy)
    controller.add_groups([group_size] * (len(lengths) // group_size), [2] * (len(lengths) // group_size))
    rows = list(range(len(lengths)))
    controller.mark_ready(0, rows, COLS, {"response_len": lengths})
    return controller


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 10_000), min_size=1, max_size=40), num_bins=st.integers(1, 6))
def test_balanced_partition_sizes_differ_by_one_and_tokens_by_the_longest_item(tokens, num_bins):
    tokens = np.asarray(tokens)
    bins = balanced_partition(tokens, num_bins)
    assert sorted(np.concatenate(bins).tolist()) == list(range(len(tokens)))
    sizes = [b.size for b in bins]
    assert max(sizes) - min(sizes) <= 1
    loads = [int(tokens[b].sum()) for b in bins]
    assert max(loads) - min(loads) <= tokens.max()
    if len(tokens) % num_bins == 0:
        assert max(loads) - min(loads) <= tokens.max() - tokens.min()


def test_balance_over_hands_each_peer_a_bin_of_equal_rows_and_near_equal_tokens():
    lengths = [100, 90, 1, 1, 1, 1, 80, 70]  # +2 prompt tokens each; rows 0-3 vs 4-7 would be 200 vs 160
    controller = with_responses(lengths)
    first = controller.allocate("train", COLS, 4, balance_over=2)
    assert not controller.all_consumed("train")  # the second bin is still owed to the peer
    second = controller.allocate("train", COLS, 4, balance_over=2)
    assert (first.rows, second.rows) == ([0, 2, 4, 7], [1, 3, 5, 6])  # 180 vs 180 tokens
    assert controller.all_consumed("train")
    assert controller.allocate("train", COLS, 4, balance_over=2) is None
    with pytest.raises(ValueError, match="balance_over"):
        controller.allocate("x", COLS, 4, balance_over=2, whole_groups=True)


def test_balance_over_with_peer_gives_each_rank_its_bin_whoever_asks_first():
    lengths = [100, 90, 1, 1, 1, 1, 80, 70]
    for order in ((0, 1), (1, 0)):  # the same rows per peer in either call order (the test above's bins)
        controller = with_responses(lengths)
        got = {peer: controller.allocate("train", COLS, 4, balance_over=2, peer=peer).rows for peer in order}
        assert got == {0: [0, 2, 4, 7], 1: [1, 3, 5, 6]}
        assert controller.all_consumed("train")
    with pytest.raises(ValueError, match="peer=2 must be in 0..1"):
        with_responses(lengths).allocate("train", COLS, 4, balance_over=2, peer=2)


def test_balance_over_waits_for_all_peers_rows_then_serves_the_tail():
    controller = DockController(1)
    controller.add_groups([1] * 6, [1] * 6)
    controller.mark_ready(0, [0, 1, 2], COLS, {"response_len": [5, 5, 5]})
    assert controller.allocate("train", COLS, 2, balance_over=2) is None  # 3 < 2 x 2 ready
    controller.mark_ready(0, [3, 4, 5], COLS, {"response_len": [9, 1, 1]})
    bins = [controller.allocate("train", COLS, 2, balance_over=2).rows for _ in range(2)]
    rest = [controller.allocate("train", COLS, 2, balance_over=2) for _ in range(2)]
    assert [len(b) for b in bins] == [2, 2] and [len(a.rows) for a in rest] == [1, 1]  # tail: 1 row each
    assert sorted(bins[0] + bins[1] + rest[0].rows + rest[1].rows) == list(range(6))
    assert controller.all_consumed("train")


def test_oldest_policy_and_partial_rollout_carry_over_with_ages():
    controller = DockController(2, policy="oldest")
    controller.add_groups([2, 2, 2], [3, 4, 5])  # rows 0-1 | 2-3 | 4-5
    controller.mark_ready(0, list(range(6)), ["prompt_ids"])
    controller.mark_ready(1, [0, 1, 4], ["response_ids"], {"response_len": [7, 8, 9]})
    controller.allocate("rollout", ["prompt_ids"], 6)
    kept = controller.reset(keep_unfinished="response_ids")
    assert kept == [2, 3, 4, 5]  # groups 1 and 2 have rows without a response; group 0 is done
    assert controller.num_rows() == 4 and controller.group_sizes() == [2, 2]
    assert controller.lengths([0, 1, 2, 3]) == {"prompt_len": [4, 4, 5, 5], "response_len": [-1, -1, 9, -1]}
    assert controller.locations([2], ["response_ids", "prompt_ids"]) == {
        "response_ids": [1],
        "prompt_ids": [0],
    }
    assert controller.consumed_count("rollout") == 0  # the new step serves them again
    assert controller.stats()["ages"] == {1: 4}
    # The next step's prompts go beside the carried-over rows; oldest first serves the old ones first.
    assert controller.add_groups([2], [6]) == [4, 5]
    controller.mark_ready(0, [4, 5], ["prompt_ids"])
    assert controller.allocate("rollout", ["prompt_ids"], 2, whole_groups=True).rows == [0, 1]
    assert controller.allocate("rollout", ["prompt_ids"], 2, policy="first").rows == [2, 3]
    # Still unfinished after another step: age 2, kept ahead of the younger group.
    controller.mark_ready(0, [2, 3], ["response_ids"])
    assert controller.reset(keep_unfinished="response_ids") == [0, 1, 4, 5]
    assert controller.stats()["ages"] == {1: 2, 2: 2}
    assert controller.reset(keep_unfinished="prompt_ids") == [] and controller.num_rows() == 0


def test_max_rows_leaves_room_for_next_prompts_or_names_the_setting():
    controller = DockController(1, max_rows=6)
    controller.add_groups([2, 2], [1, 1])
    controller.mark_ready(0, [0, 1], COLS)
    controller.reset(keep_unfinished="response_ids")  # rows 2-3 survive
    assert controller.add_groups([2], [1]) == [2, 3]
    with pytest.raises(DockError, match=r"dock.max_rows=6 .* 4 it holds \(2 carried over"):
        controller.add_groups([2, 2], [1, 1])


def test_custom_policy_by_module_function_and_broken_policy_is_caught():
    controller = with_responses([1, 9, 5, 7], policy="test_dock_policies:prefer_long")
    assert controller.allocate("c", COLS, 2).rows == [1, 3]
    assert controller.allocate("c", COLS, 2, policy="first").rows == [0, 2]
    with pytest.raises(DockError, match="must return distinct indices"):
        controller.allocate("d", COLS, 2, policy="test_dock_policies:broken_policy")
    with pytest.raises(ValueError, match="dock.policy='nope:f' cannot be imported"):
        resolve_policy("nope:f")
    with pytest.raises(ValueError, match="neither a built-in"):
        DockController(1, policy="newest")


def test_whole_group_policy_sees_group_tokens():
    controller = with_responses([1, 1, 9, 9, 5, 5], group_size=2)
    got = controller.allocate("c", COLS, 2, whole_groups=True, policy="test_dock_policies:prefer_long")
    assert got.rows == [2, 3]


@settings(max_examples=50, deadline=None)
@given(
    schedule=st.lists(st.integers(0, 4), max_size=120),
    group_size=st.integers(1, 3),
    num_groups=st.integers(1, 6),
    lengths=st.lists(st.integers(1, 50), min_size=18, max_size=18),
)
def test_random_interleavings_over_two_warehouses_serve_every_row_once(
    schedule, group_size, num_groups, lengths
):
    """Actors 0, 1: producers homed on warehouses 0, 1. Actor 2: reward (whole groups). Actors 3, 4: two
    data-parallel trainers sharing the `train` consumer with balance_over=2. The schedule says who acts."""
    controller = DockController(2)
    warehouses = [Warehouse(0, controller), Warehouse(1, controller)]
    num_rows = group_size * num_groups
    rows = controller.add_groups([group_size] * num_groups, [2] * num_groups)
    for group in range(num_groups):
        group_rows = rows[group * group_size : (group + 1) * group_size]
        warehouses[group % 2].put(group_rows, {"prompt_ids": [[group] * 2] * group_size})
    held: dict[int, list[int]] = {0: [], 1: []}
    served: dict[str, list[list[int]]] = {"rollout": [], "reward": [], "train": []}
    balance_checks = []

    def fetch(allocation, column):
        return [
            warehouses[w].get([row], [column])[column][0]
            for row, w in zip(allocation.rows, allocation.locations[column])
        ]

    def act(actor: int) -> None:
        if actor < 2:  # producer
            if not held[actor]:
                got = controller.allocate(
                    "rollout", ["prompt_ids"], 2 * group_size, whole_groups=True, min_count=group_size
                )
                if got is not None:
                    served["rollout"].append(got.rows)
                    held[actor] = list(got.rows)
                return
            row = held[actor].pop()
            warehouses[actor].put([row], {"response_ids": [[row] * lengths[row % 18]]})
        elif actor == 2:
            got = controller.allocate("reward", ["prompt_ids", "response_ids"], group_size, whole_groups=True)
            if got is not None:
                assert fetch(got, "response_ids") == [[r] * lengths[r % 18] for r in got.rows]
                served["reward"].append(got.rows)
                warehouses[0].put(got.rows, {"reward": [1.0] * len(got.rows)})
        else:
            got = controller.allocate("train", ["response_ids", "reward"], 2, balance_over=2)
            if got is not None:
                served["train"].append(got.rows)
                planned = controller._planned.get("train", {})
                if planned:  # this call made a plan: its bins are this one and the planned one
                    balance_checks.append([got.rows, next(iter(planned.values())).rows])

    for actor in schedule:
        act(actor)
    for _ in range(10 * num_rows + 10):  # then round-robin until every consumer is done
        if all(controller.all_consumed(c) for c in served):
            break
        for actor in range(5):
            act(actor)
    for consumer, batches in served.items():
        flat = sorted(r for batch in batches for r in batch)
        assert flat == list(range(num_rows)), consumer  # no loss, no duplicates
    for batch in served["rollout"] + served["reward"]:
        groups = {r // group_size for r in batch}
        assert len(batch) == len(groups) * group_size  # whole groups only
    for bins in balance_checks:
        loads = [sum(2 + lengths[r % 18] for r in b) for b in bins]
        assert abs(len(bins[0]) - len(bins[1])) <= 1
        assert abs(loads[0] - loads[1]) <= 2 + max(lengths[r % 18] for b in bins for r in b)
    stats = controller.stats()
    assert stats["warehouse_cells"][0] + stats["warehouse_cells"][1] == 3 * num_rows


def test_undeclared_columns_are_refused_naming_the_declared_ones(capsys):
    from pathlib import Path

    from dockrl.cli import main
    from dockrl.dock.client import DockClient
    from dockrl.dock.columns import PROMPT_IDS, RESPONSE_IDS, check_columns, reward_component
    from dockrl.dock.errors import DockError

    client = DockClient(None, [None])  # the check comes before any request
    with pytest.raises(DockError, match=r"put of undeclared column\(s\) \['respons_ids'\].*'response_ids'"):
        client.put("rollout", [0], {"respons_ids": [[1]]})
    with pytest.raises(DockError, match=r"get of undeclared column\(s\) \['old_logprob'\]"):
        client.get("update", [PROMPT_IDS, "old_logprob"], 1)
    with pytest.raises(DockError, match="add_groups of undeclared"):
        client.add_groups([[1]], ["1"], 1, extra={"weight": [1.0]})
    check_columns([PROMPT_IDS, RESPONSE_IDS, reward_component("exact_answer/correct")], "get")  # declared
    main(["columns"])
    path = Path(__file__).resolve().parents[2] / "docs" / "columns.md"
    assert path.read_text() == capsys.readouterr().out, (
        "docs/columns.md is stale: dockrl columns > docs/columns.md"
    )
