"""PPO with a critic: token rewards, GAE, whitening, value-loss pieces and the KL controller against numbers
worked by hand; the value model; config errors before Ray; two PPO steps through the CLI on the tiny model.

Expected values are literals worked by hand in the comments, not re-derived with the code under test.
"""

import warnings
from pathlib import Path

import pytest
import torch

from dockrl.algos.estimators import gae_advantages, masked_moments, whiten
from dockrl.algos.losses import value_clip_frac, value_loss
from dockrl.algos.ppo import (
    KLController,
    explained_variance,
    explained_variance_moments,
    pad_rows,
    token_level_rewards,
)
from dockrl.cli import main
from dockrl.config import ConfigError, CriticConfig, TrainConfig, load_config, step_plan
from dockrl.config.specs import specs
from dockrl.engines.train.batch import make_micro_batch
from dockrl.engines.train.train_engine import TrainEngine
from dockrl.models.hf import save_model
from dockrl.models.value import load_value_model, value_model_kind
from dockrl.recipes.preflight import preflight_train
from dockrl.workers.critic import CriticWorker
from helpers import close
from runs import tiny_paths

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# ---------------------------------------------------------------- token rewards, GAE, whitening


def test_pad_rows_of_uneven_length():
    padded, mask = pad_rows([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])])
    close(padded, [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_token_rewards_put_the_score_on_the_last_valid_token_minus_the_kl_penalty():
    scores = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()  # lengths 3 and 1
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 9.0, 9.0]])  # 9 is padding
    close(token_level_rewards(scores, mask), [[0.0, 0.0, 1.0], [-0.5, 0.0, 0.0]])
    # row 0: -0.5 * [0.1, 0.2, 0.3] + [0, 0, 1] ; row 1: -0.5 * 0.4 - 0.5 on its only token
    close(token_level_rewards(scores, mask, kl, 0.5), [[-0.05, -0.1, 0.85], [-0.7, 0.0, 0.0]])


def test_gae_on_kl_shaped_token_rewards_then_whitening_by_hand():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    rewards = torch.tensor([[-0.05, -0.1, 0.85], [-0.7, 0.0, 0.0]])  # from the test above
    values = torch.tensor([[0.5, 0.4, 0.3], [0.2, 7.0, 7.0]])  # 7 is padding
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)  # gamma * lam = 0.72
    # row 0: d2 = 0.85 - 0.3 = 0.55 = A2
    #        d1 = -0.1 + 0.9*0.3 - 0.4 = -0.23, A1 = -0.23 + 0.72*0.55 = 0.166
    #        d0 = -0.05 + 0.9*0.4 - 0.5 = -0.19, A0 = -0.19 + 0.72*0.166 = -0.07048
    # row 1: d0 = -0.7 - 0.2 = -0.9 (V past the end is 0)
    close(adv, [[-0.07048, 0.166, 0.55], [-0.9, 0.0, 0.0]])
    close(ret, [[0.42952, 0.566, 0.85], [-0.7, 0.0, 0.0]])
    # whitening over the 4 valid tokens: mean -0.06362, population variance 0.28220835, std 0.53123286
    close(whiten(adv, mask), [[-0.012913, 0.432240, 1.155087], [-1.574413, 0.0, 0.0]])


def test_whitening_moments_summed_over_two_ranks_equal_the_whole_batch():
    adv = torch.tensor([[-0.07048, 0.166, 0.55], [-0.9, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    moments = masked_moments(adv[:1], mask[:1]) + masked_moments(adv[1:], mask[1:])  # a 2-rank all-reduce
    close(whiten(adv[1:], mask[1:], moments=moments), [[-1.574413, 0.0, 0.0]])


# ---------------------------------------------------------------- critic loss pieces


def test_value_clip_fraction_by_hand():
    values = torch.tensor([[1.0, 0.2, 5.0]])
    old = torch.tensor([[0.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 1.5, 0.0]])
    mask = torch.tensor([[1, 1, 0]]).bool()
    # token 0: unclipped error 0 < clipped (0.2 - 1)^2 = 0.64 -> clipped branch; token 1: 1.69 > 0.49 -> not
    close(value_clip_frac(values, old, returns, mask, clip=0.2), 0.5)
    close(value_loss(values, old, returns, mask, clip=0.2), 0.5825)  # unchanged by the refactor


def test_explained_variance_by_hand_and_over_shards():
    values = torch.tensor([[1.0, 2.0], [3.0, 9.0]])  # 9 is padding
    returns = torch.tensor([[2.0, 2.0], [4.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]]).bool()
    # R - V = [1, 0, 1]: variance 2/3 - 4/9 = 2/9 ; R = [2, 2, 4]: variance 8 - 64/9 = 8/9
    # 1 - (2/9) / (8/9 + 1e-5) = 0.7500028
    whole = explained_variance(explained_variance_moments(values, returns, mask))
    assert abs(whole - 0.7500028) < 1e-6
    summed = explained_variance_moments(values[:1], returns[:1], mask[:1]) + explained_variance_moments(
        values[1:], returns[1:], mask[1:]
    )
    assert abs(explained_variance(summed) - whole) < 1e-9
    assert abs(explained_variance(explained_variance_moments(returns, returns, mask)) - 1.0) < 1e-9


def test_kl_controllers_by_hand():
    fixed = KLController("fixed", 0.1)
    assert fixed.update(5.0, 16) == 0.1
    adaptive = KLController("adaptive", 0.1, target=0.05, horizon=100)
    # error = clip(0.06 / 0.05 - 1, -0.2, 0.2) = 0.2 -> x (1 + 0.2 * 16 / 100) = 1.032
    assert adaptive.update(0.06, 16) == pytest.approx(0.1032)
    # error = 0.0525 / 0.05 - 1 = 0.05 -> x 1.008
    assert adaptive.update(0.0525, 16) == pytest.approx(0.1040256)
    # KL 0: error -0.2 -> x 0.968
    assert KLController("adaptive", 0.1, target=0.05, horizon=100).update(0.0, 16) == pytest.approx(0.0968)
    with pytest.raises(ValueError, match="unknown KL controller 'pid'"):
        KLController("pid", 0.1)


# ---------------------------------------------------------------- the value model


def test_value_model_head_is_fresh_from_a_causal_lm_and_round_trips(tiny_model, tmp_path):
    model = load_value_model(tiny_model, seed=3)
    assert "lm_head.weight" not in model.state_dict() and model.score.weight.shape == (1, 64)
    assert torch.equal(load_value_model(tiny_model, seed=3).score.weight, model.score.weight)
    assert not torch.equal(load_value_model(tiny_model, seed=4).score.weight, model.score.weight)
    save_model(model, model.args, tmp_path / "critic")
    reloaded = load_value_model(tmp_path / "critic", seed=99)  # a saved head is loaded, not drawn
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids), model(ids))


def test_critic_engine_values_ignore_padding_and_training_fits_returns(tiny_model):
    critic = CriticConfig(lr=1e-2, grad_clip=0.0)
    engine = TrainEngine(tiny_model, device="cpu", precision="fp32", optim=critic, kind=value_model_kind(0))
    # Shard-sized loading draws the same fresh head as the whole-model loader.
    assert torch.equal(engine.model.score.weight, load_value_model(tiny_model, seed=0).score.weight)
    prompts = [torch.tensor([3, 4, 5]), torch.tensor([6, 7])]
    responses = [torch.tensor([8, 9]), torch.tensor([10, 11, 12, 13])]
    mb = make_micro_batch(
        prompts, responses, pad_token_id=0, per_token={"returns": [torch.ones(2), -torch.ones(4)]}
    )
    with torch.no_grad():
        together = mb.unpad(engine.logits(mb))
        alone = make_micro_batch(prompts[:1], responses[:1], pad_token_id=0)
        # the value of the state before response token j sits at position P - 1 + j
        torch.testing.assert_close(together[0], engine.model(torch.tensor([[3, 4, 5, 8, 9]]))[0, 2:4])
        torch.testing.assert_close(engine.logits(alone)[0, 2:4], together[0])  # padding changes nothing
    old = torch.zeros_like(mb.per_token["returns"])  # not read with clip=None

    def loss_fn(vpred, mb):
        loss = value_loss(vpred, old, mb.per_token["returns"], mb.response_mask, clip=None)
        return loss, {"value_loss": loss.item()}

    losses = [engine.train_step([mb], loss_fn)["value_loss"] for _ in range(15)]
    assert losses[-1] < 0.1 * losses[0], losses


class _CriticDock:
    """DockClient's get/put for one critic rank: every row at once, stage after stage."""

    def __init__(self, columns: dict[str, list]) -> None:
        self.table = [dict(zip(columns, values)) for values in zip(*columns.values())]

    def get(self, consumer, columns, count, *, balance_over, peer):
        assert count == len(self.table) and balance_over == 1 and peer == 0
        return list(range(count)), {c: [row[c] for row in self.table] for c in columns}

    def put(self, producer, rows, batch):
        for column, values in batch.items():
            for row, value in zip(rows, values):
                self.table[row][column] = value


def _critic_step(
    tiny_model, arithmetic_data, num_groups: int, weights: list[float]
) -> tuple[dict, _CriticDock]:
    """One critic step (values, GAE, one optimizer step with micro-batches of one row) on the first
    `num_groups` groups of two rows; returns its metrics and the dock."""
    extra = [f"run.prompts_per_step={num_groups}", "critic.micro_batch_size=1", "critic.mini_batches=1"]
    cfg = load_config(TrainConfig, None, _base(tiny_model, arithmetic_data) + ["algo.name=ppo", *extra])
    rows = 2 * num_groups
    dock = _CriticDock(
        {
            "prompt_ids": [
                torch.tensor([3, 4, 5]),
                torch.tensor([3, 4, 5]),
                torch.tensor([6, 7]),
                torch.tensor([6, 7]),
            ],
            "response_ids": [
                torch.tensor([8, 9]),
                torch.tensor([10, 11, 12]),
                torch.tensor([13]),
                torch.tensor([14, 15]),
            ],
            "reward": [1.0, 0.0, 0.0, 1.0],
            "update_weight": weights,
        }
    )
    dock.table = dock.table[:rows]
    plan = step_plan(cfg)
    worker = CriticWorker("critic-0", 0, 1, spec=specs(cfg, plan).critic, plan=plan, client=dock)
    worker.engine = TrainEngine(
        tiny_model, device="cpu", precision="fp32", optim=cfg.critic, kind=value_model_kind(cfg.run.seed)
    )
    worker.compute_values()
    return worker.update().metrics, dock


def test_critic_leaves_rows_of_weight_0_out_of_its_loss_and_figures(tiny_model, arithmetic_data):
    """Group 2 (rows 2-3) was dropped for a failed reward (update_weight 0). The step's value loss is the hand
    value 0.5 mean (V - R)^2 over rows 0-1's tokens (R: the score on every token, gamma = lam = 1; before the
    optimizer step V is the values stage's own, so the clip never binds), and every critic figure equals a
    step without group 2: masked rows add exact zeros, and micro-batches of one row compute the same bits."""
    metrics, dock = _critic_step(tiny_model, arithmetic_data, 2, [1.0, 1.0, 0.0, 0.0])
    alone, _ = _critic_step(tiny_model, arithmetic_data, 1, [1.0, 1.0])
    kept = dock.table[:2]
    squared = [(float(v) - row["reward"]) ** 2 for row in kept for v in row["values"]]
    # R up to GAE's fp32 recursion: per token <= 3 roundings of terms within |R| + 2 max|V|, then + V (1 more)
    largest = max(float(v.abs().max()) for v in (kept[0]["values"], kept[1]["values"]))
    for row, target in zip(kept, ([1.0, 1.0], [0.0, 0.0, 0.0])):
        bound = (3 * len(target) + 1) * 2.0**-24 * (1 + 2 * largest)
        assert row["returns"].tolist() == pytest.approx(target, rel=0, abs=bound)
    # fp32, relative: a square 3u (the subtraction, the square), a row's sum of <= 3 of them 2u, the / 5 u
    assert metrics["critic/value_loss"] == pytest.approx(0.5 * sum(squared) / 5, rel=8 * 2.0**-24, abs=0)
    for key in alone:
        if key != "critic/update_s":
            assert metrics[key] == alone[key], key


# ---------------------------------------------------------------- config


def _base(tiny_model, arithmetic_data) -> list[str]:
    steps = ["run.steps=2", "run.prompts_per_step=4", "rollout.samples_per_prompt=2"]
    return tiny_paths(tiny_model, arithmetic_data) + steps


def test_ppo_example_validates_without_warnings(tiny_model, arithmetic_data):
    cfg = load_config(TrainConfig, EXAMPLES / "ppo_tiny.yaml", tiny_paths(tiny_model, arithmetic_data))
    assert cfg.algo.name == "ppo" and cfg.algo.kl_in_reward and cfg.algo.kl_ctrl == "adaptive"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preflight_train(cfg)
    # PPO has no group baseline: groups of one are fine
    ones = ["rollout.samples_per_prompt=1", "rollout.max_batch_size=4", "algo.critic_warmup_steps=0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preflight_train(
            load_config(
                TrainConfig, EXAMPLES / "ppo_tiny.yaml", tiny_paths(tiny_model, arithmetic_data) + ones
            )
        )


PPO = ["algo.name=ppo"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algo.adv_estimator=gae"], "algo.adv_estimator='gae': GAE needs a critic's values"),
        (PPO + ["algo.adv_estimator=grpo"], "algo.adv_estimator='grpo': algo.name=ppo computes GAE"),
        (["algo.kl_in_reward=true"], "algo.kl_in_reward=True: the KL penalty goes into per-token rewards"),
        (PPO + ["algo.kl_in_reward=true", "algo.kl_coef=0"], "needs the reference model, and algo.kl_coef=0"),
        (PPO + ["algo.kl_ctrl=adaptive"], "algo.kl_ctrl='adaptive': the adaptive controller"),
        (PPO + ["algo.kl_ctrl=pid"], "algo.kl_ctrl='pid': unknown KL controller"),
        (["algo.critic_warmup_steps=1"], "algo.critic_warmup_steps=1: algo.name=grpo has no critic"),
        (PPO + ["algo.gamma=1.5"], "algo.gamma=1.5: must be in"),
        (PPO + ["algo.lam=-0.1"], "algo.lam=-0.1: must be in"),
        (PPO + ["critic.dp=3"], "critic.dp=3: does not divide the 8 rows"),
        (PPO + ["critic.dp=2", "critic.mini_batches=3"], "critic.mini_batches=3: does not divide the 4 rows"),
        (PPO + ["critic.value_clip=0"], "critic.value_clip=0"),
        (
            PPO + ["critic.path=/nonexistent"],
            "critic.path='/nonexistent': the model directory does not exist",
        ),
    ],
)
def test_conflicting_ppo_settings_are_errors(overrides, expected, tiny_model, arithmetic_data):
    with pytest.raises(ConfigError, match=expected):  # closed choices fail at load, the rest in validation
        preflight_train(load_config(TrainConfig, None, _base(tiny_model, arithmetic_data) + overrides))


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["critic.lr=0.1"], "critic settings have no effect with algo.name=grpo"),
        (PPO + ["algo.critic_warmup_steps=2"], "the actor never updates"),
    ],
)
def test_ppo_settings_without_effect_warn(overrides, expected, tiny_model, arithmetic_data):
    cfg = load_config(TrainConfig, None, _base(tiny_model, arithmetic_data) + overrides)
    with pytest.warns(UserWarning, match=expected):
        preflight_train(cfg)


def test_cli_rejects_kl_in_reward_without_reference_before_ray(
    monkeypatch, capsys, tiny_model, arithmetic_data
):
    import dockrl.recipes.grpo as grpo

    def forbidden(*args, **kwargs):
        raise AssertionError("Ray was started before the config was validated")

    monkeypatch.setattr(grpo, "init_ray", forbidden)
    args = ["algo.kl_coef=0", "algo.kl_ctrl=fixed"]
    code = main(["train", str(EXAMPLES / "ppo_tiny.yaml"), *tiny_paths(tiny_model, arithmetic_data), *args])
    assert code == 2
    assert "algo.kl_in_reward=True" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end
