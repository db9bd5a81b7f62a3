"""DAPO dynamic sampling: which groups a step keeps, drops and fills (pure selection logic)."""

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
