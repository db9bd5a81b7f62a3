"""DAPO dynamic sampling: which groups a step keeps, drops and fills (pure selection logic)."""

import pytest

from dockrl.config import ConfigError, TrainConfig, load_config
from dockrl.config.algo_checks import check_dynamic_sampling
from dockrl.recipes.dynamic_sampling import group_rewards, has_spread, select_groups


def test_group_rewards_collects_rows_by_group_in_any_order():
    groups = group_rewards([5, 0, 4, 1, 7, 6, 2, 3], [1, 0, 1, 1, 0, 1, 0, 0], group_size=4)
    assert groups == {0: [0, 1, 0, 0], 4: [1, 1, 1, 0]}


def test_select_keeps_the_first_informative_groups_and_drops_the_rest():
    groups = {0: [1, 1], 2: [0, 1], 4: [0, 0], 6: [1, 0], 8: [0.5, 0.25]}
    selection = select_groups(groups, target=2, fill=False)
    assert selection.keep == [2, 6] and selection.drop == [0, 4, 8]
    assert (selection.informative, selection.filled) == (2, 0)


def test_select_fills_a_short_batch_with_zero_spread_groups_only_when_asked():
    groups = {0: [1, 1], 2: [0, 1], 4: [0, 0]}
    short = select_groups(groups, target=3, fill=False)
    assert short.keep == [2] and short.drop == [0, 4]
    full = select_groups(groups, target=2, fill=True)
    assert full.keep == [0, 2] and full.drop == [4]  # the first zero-spread group fills the gap
    assert (full.informative, full.filled) == (1, 1)


def test_has_spread_ignores_float_noise():
    assert not has_spread([0.3, 0.3 + 1e-9]) and has_spread([0.0, 1e-3])


def test_a_length_penalty_does_not_make_an_all_wrong_group_informative():
    """Hand-built groups of 4 where the shaped total and the accuracy disagree: group 0 is all wrong with an
    overlong penalty on two rows (its totals spread), group 4 has one right answer (informative either way),
    group 8 is all right with a reward-model score mixed in (totals spread, nothing to learn)."""
    rows = list(range(12))
    correct = [0, 0, 0, 0] + [0, 1, 0, 0] + [1, 1, 1, 1]
    totals = [0.0, -0.5, 0.0, -1.0] + [0.0, 1.0, 0.0, 0.0] + [1.2, 0.9, 1.0, 1.1]
    by_total = select_groups(group_rewards(rows, totals, 4), target=3, fill=False)
    assert by_total.keep == [0, 4, 8]  # what filtering on the shaped reward kept
    by_accuracy = select_groups(group_rewards(rows, correct, 4), target=3, fill=False)
    assert by_accuracy.keep == [4] and by_accuracy.informative == 1


def test_a_group_left_out_for_a_failed_reward_is_never_informative():
    """Group 2 (weight 0: a reward call failed under reward.on_error=drop_group) has mixed accuracy but no
    update: it neither counts toward the target nor is kept before a zero-spread group is needed."""
    rows, correct = [0, 1, 2, 3, 4, 5], [0, 1, 1, 0, 1, 1]
    weights = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    groups = group_rewards(rows, correct, 2, weights)
    assert groups == {0: [0, 1], 2: [0.0, 0.0], 4: [1, 1]}
    selection = select_groups(groups, target=2, fill=False)
    assert selection.keep == [0] and selection.informative == 1
    assert group_rewards([3, 2, 1, 0], [0, 1, 1, 0], 2, [0.0, 0.0, 1.0, 1.0]) == {0: [0, 1], 2: [0.0, 0.0]}


def test_dynamic_sampling_needs_a_rule_reward():
    """With reward.functions=[] (a reward model only) no group ever has correctness spread: a config error."""
    overrides = ["model.path=m", "data.train_path=d", "run.steps=1", "run.prompts_per_step=1"]
    cfg = load_config(TrainConfig, None, overrides + ["algo.dynamic_sampling=true", "reward.functions=[]"])
    with pytest.raises(ConfigError, match=r"algo.dynamic_sampling=True: .*reward.functions=\[\]"):
        check_dynamic_sampling(cfg)
