"""algo.rollout_is and when the old log-prob pass runs: truncated (tis) against masked (decoupled) weights by
hand, the plan's stages, and the settings refused or warned about by name."""

import warnings

import pytest
import torch

from dockrl.algos.losses import policy_loss
from dockrl.backends.vllm import logprobs_mode
from dockrl.config import ConfigError, TrainConfig
from dockrl.config.loader import load_config
from dockrl.config.step_plan import loss_plan, step_plan
from dockrl.config.validate import check_train
from dockrl.engines.train.policy_update import importance_weights

# The rules read no file: any paths will do.
REQUIRED = [
    "model.path=/models/tiny",
    "data.train_path=/data/train.jsonl",
    "run.steps=2",
    "run.prompts_per_step=4",
]


def _cfg(overrides: list[str]) -> TrainConfig:
    return load_config(TrainConfig, None, [*REQUIRED, *overrides])


def _plan(rollout_is: str):
    cfg = _cfg([f"algo.rollout_is={rollout_is}", "algo.rollout_is_cap=2.0"])
    return loss_plan(cfg.algo, cfg.rollout.max_new_tokens)


def test_tis_truncates_and_decoupled_masks_weights_above_the_cap():
    raw = torch.tensor([[0.5, 1.5, 3.0, 2.0]])  # pi_old / pi_rollout per token
    assert torch.equal(importance_weights(raw, _plan("tis")), torch.tensor([[0.5, 1.5, 2.0, 2.0]]))
    assert torch.equal(importance_weights(raw, _plan("decoupled")), torch.tensor([[0.5, 1.5, 0.0, 2.0]]))


def test_the_two_corrections_give_different_losses_by_hand():
    """Ratio 1 (logp = old): each token's surrogate is -A * w; token-mean over the 4 tokens.
    A = [1, -2, 4, 0.5], raw w = [0.5, 1.5, 3.0, 2.0]:
    tis:       -(1*0.5 - 2*1.5 + 4*2.0 + 0.5*2.0) / 4 = -(0.5 - 3 + 8 + 1) / 4 = -1.625
    decoupled: -(1*0.5 - 2*1.5 + 4*0.0 + 0.5*2.0) / 4 = -(0.5 - 3 + 0 + 1) / 4 = 0.375"""
    logp = torch.log(torch.tensor([[0.2, 0.3, 0.4, 0.5]]))
    advantages = torch.tensor([[1.0, -2.0, 4.0, 0.5]])
    mask = torch.ones(1, 4)
    raw = torch.tensor([[0.5, 1.5, 3.0, 2.0]])
    losses = {}
    for kind in ("tis", "decoupled"):
        out = policy_loss(
            logp,
            logp,
            advantages,
            mask,
            clip_low=0.2,
            clip_high=0.2,
            agg="token-mean",
            num_tokens=4.0,
            is_weights=importance_weights(raw, _plan(kind)),
        )
        losses[kind] = out.pg_loss.item()
    assert losses["tis"] == pytest.approx(-1.625, abs=1e-6)
    assert losses["decoupled"] == pytest.approx(0.375, abs=1e-6)


@pytest.mark.parametrize(
    "overrides, old_pass, reads_old",
    [
        ([], False, False),  # on-policy
        (["algo.rollout_is=decoupled"], False, False),  # decoupled on-policy: the proximal policy is current
        (
            ["rollout.placement=separate", "rollout.max_staleness=2"],
            False,
            False,
        ),  # stale, one update: no pass
        (["actor.mini_batches=2"], True, True),  # several optimizer steps: the old policy differs
        (
            ["actor.mini_batches=2", "algo.old_logprobs=rollout"],
            False,
            False,
        ),  # the rollout's are the old ones
    ],
)
def test_the_old_log_prob_pass_runs_only_where_it_differs_from_the_update(overrides, old_pass, reads_old):
    plan = step_plan(_cfg(overrides))
    assert plan.old_logprobs == old_pass
    assert (not plan.single_update and not plan.old_from_rollout) == reads_old


def test_tis_with_rollout_old_log_probs_is_refused_by_name():
    cfg = _cfg(["algo.rollout_is=tis", "algo.old_logprobs=rollout", "actor.mini_batches=2"])
    with pytest.raises(ValueError, match="algo.old_logprobs='rollout': algo.rollout_is=tis needs the policy"):
        check_train(cfg)


def test_asynchronous_runs_without_a_correction_warn_and_with_one_do_not():
    stale = ["rollout.placement=separate", "rollout.max_staleness=1"]
    with pytest.warns(UserWarning, match="rollout.max_staleness=1 with algo.rollout_is=none"):
        check_train(_cfg(stale))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_train(_cfg([*stale, "algo.rollout_is=tis"]))


VLLM_FILTERED = ["rollout.backend=vllm", "rollout.temperature=0.8"]


@pytest.mark.parametrize(
    "extra, setting, reader",
    [
        (["rollout.top_p=0.7", "algo.rollout_is=tis"], "rollout.top_p=0.7", "algo.rollout_is=tis"),
        (["rollout.top_k=20", "algo.rollout_is=decoupled"], "rollout.top_k=20", "algo.rollout_is=decoupled"),
        (
            ["rollout.min_p=0.05", "algo.old_logprobs=rollout", "actor.mini_batches=2"],
            "rollout.min_p=0.05",
            "algo.old_logprobs=rollout",
        ),
        (
            ["rollout.top_p=0.9", "algo.name=opd", "distill.teacher_path=/models/teacher"],
            "rollout.top_p=0.9",
            "distill.teacher_path",
        ),
    ],
)
def test_vllm_filtered_logprobs_are_refused_with_the_corrections_that_read_them(extra, setting, reader):
    """vLLM at a temperature other than 1 reports the filtered, renormalised log-probs: a filter with a
    correction that reads them is an error naming both; at temperature 1, without a filter, without a reader or
    on the dockrl engine (the model's log-probs whatever the filter) the same settings pass."""
    with pytest.raises(
        ConfigError, match=rf"{setting}: with rollout.backend=vllm .* which {reader} compares"
    ):
        check_train(_cfg([*VLLM_FILTERED, *extra]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the settings' other notes (e.g. old_logprobs=rollout)
        check_train(_cfg(["rollout.backend=vllm", "rollout.temperature=1.0", *extra]))
        check_train(_cfg(["rollout.temperature=0.8", *extra]))
        check_train(_cfg([*VLLM_FILTERED, extra[0]]))  # the filter, no reader
        check_train(_cfg([*VLLM_FILTERED, *extra[1:]]))  # the reader, no filter
    assert logprobs_mode(1.0) == logprobs_mode(0.0) == "raw_logprobs"
    assert logprobs_mode(0.8) == "processed_logprobs"
