"""algos/registry.py: an estimator registered by one decorated function is a config choice, its traits (never its
name) decide the step plan and the checks, an unregistered name is an error naming the registered ones; the
policy loss takes the resolved LossPlan whole; the reward stage's terms (rewards/terms.py) by hand."""

import dataclasses
import math
import warnings

import pytest
import torch

from dockrl.algos import registry
from dockrl.algos.distill import DistillSums
from dockrl.algos.estimators import compute_advantages
from dockrl.algos.losses import PPO_CLIP_LOSS, policy_loss
from dockrl.algos.registry import AdvantageSettings, estimator
from dockrl.config import ConfigError, TrainConfig, check_train, load_config, loss_plan, resolve
from dockrl.dock.columns import ENV_FAILED, ENV_REWARD, LABEL, RESPONSE_IDS, RM_SCORE
from dockrl.observe import metric_names
from dockrl.rewards.terms import (
    Accuracy,
    DropFailedGroups,
    EnvReward,
    GroupAdvantages,
    ModelScore,
    OverlongPenalty,
    ScoredGroups,
)
from helpers import close

# The rules read no file: any paths will do.
REQUIRED = [
    "model.path=/models/tiny",
    "data.train_path=/data/train.jsonl",
    "run.steps=2",
    "run.prompts_per_step=4",
]


def _cfg(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, [*REQUIRED, "rollout.samples_per_prompt=3", *overrides])


@pytest.fixture
def median_baseline():
    """A test's own estimator: each reward minus its group's median, whitened over the step like REINFORCE++."""

    @estimator("median_baseline", group_baseline=True, whitened=True)
    def median_baseline(rewards, group_size, settings):
        grouped = rewards.float().view(-1, group_size)  # [G, S]
        return (grouped - grouped.median(dim=1, keepdim=True).values).reshape(-1)

    yield "median_baseline"
    registry.unregister_estimator("median_baseline")


def test_a_registered_estimator_is_a_config_choice_and_runs(median_baseline):
    cfg = _cfg(f"algo.adv_estimator={median_baseline}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_train(cfg)
    plan = resolve(cfg).plan
    assert (plan.estimator, plan.advantages_by, plan.whiten, plan.critic) == (
        median_baseline,
        "reward",
        True,
        False,
    )
    # groups [1, 5, 2] and [4, 4, 0]: medians 2 and 4
    rewards = torch.tensor([1.0, 5.0, 2.0, 4.0, 4.0, 0.0])
    assert compute_advantages(median_baseline, rewards, 3).tolist() == [-1.0, 3.0, 0.0, 0.0, 0.0, -4.0]
    # the reward stage's advantage term looks it up by name too
    group = ScoredGroups({RESPONSE_IDS: [torch.zeros(2)] * 6}, [""] * 6, [""] * 6, group_size=3)
    group.scores = rewards.tolist()
    GroupAdvantages(median_baseline, AdvantageSettings()).apply(group)
    assert [a.tolist() for a in group.advantages] == [
        [-1.0] * 2,
        [3.0] * 2,
        [0.0] * 2,
        [0.0] * 2,
        [0.0] * 2,
        [-4.0] * 2,
    ]


def test_traits_not_names_decide_what_config_allows(median_baseline):
    # kl_in_reward needs an estimator whose returns take the KL: median_baseline was registered without it
    with pytest.raises(
        ConfigError, match="algo.kl_in_reward=True: the KL penalty goes into per-token rewards"
    ):
        check_train(_cfg(f"algo.adv_estimator={median_baseline}", "algo.kl_in_reward=true"))
    # a group-baseline estimator in groups of one warns; a critic algorithm refuses a group estimator
    with pytest.warns(UserWarning, match="group-baseline advantages are all zero with groups of one"):
        check_train(_cfg(f"algo.adv_estimator={median_baseline}", "rollout.samples_per_prompt=1"))
    with pytest.raises(ConfigError, match="algo.name=ppo computes GAE advantages from its critic's values"):
        check_train(_cfg("algo.name=ppo", f"algo.adv_estimator={median_baseline}"))


def test_an_unregistered_estimator_is_an_error_naming_the_registered_ones(median_baseline):
    with pytest.raises(
        ConfigError, match="algo.adv_estimator='vtrace': unknown estimator; use one of"
    ) as err:
        _cfg("algo.adv_estimator=vtrace")
    assert f"grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, none, gae, {median_baseline}" in str(
        err.value
    )
    cfg = _cfg()
    cfg.algo.adv_estimator = "vtrace"  # set in code, past the loader: the rules refuse it too
    with pytest.raises(
        ConfigError, match=f"algo.adv_estimator='vtrace': unknown estimator.*'{median_baseline}'"
    ):
        check_train(cfg)
    with pytest.raises(ValueError, match="unknown advantage estimator 'vtrace'"):
        compute_advantages("vtrace", torch.zeros(3), 3)
    with pytest.raises(ValueError, match="'median_baseline' is registered already"):
        estimator(median_baseline)(lambda rewards, group_size, settings: rewards)


def test_unregistering_takes_the_choice_away():
    @estimator("short_lived")
    def short_lived(rewards, group_size, settings):
        return rewards

    assert _cfg("algo.adv_estimator=short_lived").algo.adv_estimator == "short_lived"
    registry.unregister_estimator("short_lived")
    with pytest.raises(ConfigError, match="'short_lived': unknown estimator"):
        _cfg("algo.adv_estimator=short_lived")


def test_every_preset_names_a_registered_estimator_and_the_built_in_traits():
    known = registry.estimators()
    assert {preset.estimator for preset in registry.PRESETS.values()} <= set(known)
    traits = {
        name: tuple(
            n for n in ("needs_critic", "whitened", "kl_in_reward", "group_baseline") if getattr(e, n)
        )
        for name, e in known.items()
    }
    assert traits == {
        "grpo": ("group_baseline",),
        "dr_grpo": ("group_baseline",),
        "rloo": ("group_baseline",),
        "reinforce_pp": ("whitened", "kl_in_reward"),
        "reinforce_pp_baseline": ("whitened", "kl_in_reward", "group_baseline"),
        "none": (),
        "gae": ("needs_critic", "whitened", "kl_in_reward"),
    }
    assert [n for n, e in known.items() if e.std_normalized] == ["grpo"]
    assert [n for n, e in known.items() if e.needs_teacher] == ["none"]


# ---------------------------------------------------------------- the policy loss takes the plan


def test_policy_loss_from_the_resolved_plan_equals_its_keyword_form():
    torch.manual_seed(0)
    old = torch.randn(3, 5)
    logp = (old + 0.2 * torch.randn(3, 5)).requires_grad_(True)
    ref, entropy, adv = torch.randn(3, 5), torch.rand(3, 5), torch.randn(3)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 2, 4])[:, None]
    cfg = _cfg("algo.name=gspo", "algo.kl_coef=0.01", "algo.entropy_coef=0.001")
    plan = loss_plan(cfg.algo, cfg.rollout.max_new_tokens)
    by_plan = policy_loss(logp, old, adv, mask, plan, ref_logprobs=ref, entropy=entropy, num_tokens=11.0)
    keywords = {
        f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if not f.name.startswith("rollout")
    }
    by_keywords = policy_loss(
        logp, old, adv, mask, ref_logprobs=ref, entropy=entropy, num_tokens=11.0, **keywords
    )
    for field in dataclasses.fields(by_plan):
        assert torch.equal(getattr(by_plan, field.name), getattr(by_keywords, field.name)), field.name
    assert plan.sequence_ratio and plan.agg == "seq-mean-token-mean" and plan.entropy_coef == 0.001
    # without a plan: PPO's clip, token-mean, no KL or entropy term
    assert torch.equal(
        policy_loss(logp, old, adv, mask).loss, policy_loss(logp, old, adv, mask, PPO_CLIP_LOSS).loss
    )
    with pytest.raises(TypeError, match=r"\['clip'\], which are no LossPlan fields"):
        policy_loss(logp, old, adv, mask, clip=0.1)


# ---------------------------------------------------------------- the reward terms by hand


def test_reward_terms_add_in_order():
    """Rows 0-1 and 2-3 form groups of 2. Env rewards [1, nan, 0.5, 2] with weight 2 and row 3's environment
    failing -> [2, 0, 1, 0] (row 3 failed: 0); accuracy is that total (no <fn>/correct); the reward model adds
    0.5 x [1, -1, 0, 4] -> [2.5, -0.5, 1, 2]; overlong (max 4, buffer 2, penalty 1) on lengths [1, 3, 4, 5]:
    [0, -0.5, -1, -1] -> [2.5, -1, 0, 1]; row 3's group is dropped from the update."""
    batch = {
        ENV_REWARD: [1.0, math.nan, 0.5, 2.0],
        ENV_FAILED: [0.0, 0.0, 0.0, 1.0],
        RM_SCORE: [1.0, -1.0, 0.0, 4.0],
        RESPONSE_IDS: [torch.zeros(n) for n in (1, 3, 4, 5)],
        LABEL: [None] * 4,
    }
    group = ScoredGroups(batch, [""] * 4, [""] * 4, group_size=2)
    terms = [EnvReward(2.0), Accuracy(), ModelScore(0.5), OverlongPenalty(4, 2, 1.0), DropFailedGroups()]
    for term in terms:
        term.apply(group)
    close(group.scores, [2.5, -1.0, 0.0, 1.0])
    assert group.accuracy == [2.0, 0.0, 1.0, 0.0] and group.correct == []
    assert group.failed == [3] and group.errors == 1 and group.weights == [1.0, 1.0, 0.0, 0.0]
    assert list(group.components) == ["env", "rm", "overlong"]
    assert group.components["overlong"] == [0.0, -0.5, -1.0, -1.0]
    out = group.columns_out()
    assert list(out) == ["reward", "update_weight", "reward/env", "reward/rm", "reward/overlong"]
    columns = {c for term in terms for c in term.columns}
    assert columns == {ENV_REWARD, ENV_FAILED, RM_SCORE, RESPONSE_IDS}
    with pytest.raises(ValueError, match="needs the RewardWorker's max_new_tokens"):
        OverlongPenalty(None, 2, 1.0)


def test_distill_figures_carry_the_metric_names():
    sums = DistillSums(tokens=2.0, reverse_kl=1.0, teacher_logprob=-3.0)
    assert set(sums.means()) == {metric_names.DISTILL_REVERSE_KL, metric_names.DISTILL_TEACHER_LOGPROB}
