"""Algorithms through the CLI: every examples/<algo>_tiny.yaml validates, conflicting settings fail before Ray,
and a few algorithms run two steps end to end on the tiny model (the rest share their code paths and are
covered by tests/unit/test_algos_more.py)."""

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from dockrl.cli import main
from dockrl.config import ConfigError, TrainConfig, load_config
from dockrl.models.hf import load_state_dict
from dockrl.recipes.preflight import preflight_train
from runs import tiny_paths

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ALGORITHMS = ["grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo", "gspo"]


def _base(tiny_model, arithmetic_data) -> list[str]:
    steps = ["run.steps=1", "run.prompts_per_step=4", "rollout.samples_per_prompt=2"]
    return tiny_paths(tiny_model, arithmetic_data) + steps


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_tiny_example_validates_without_warnings(algo, tiny_model, arithmetic_data):
    path = EXAMPLES / f"{algo}_tiny.yaml"
    cfg = load_config(TrainConfig, path, tiny_paths(tiny_model, arithmetic_data))
    assert cfg.algo.name == algo
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preflight_train(cfg)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algo.name=a2c"], "algo.name='a2c': unknown algorithm"),
        (["algo.adv_estimator=gae"], "algo.adv_estimator='gae': GAE needs a critic"),
        (["algo.adv_estimator=vtrace"], "algo.adv_estimator='vtrace': unknown estimator"),
        (["algo.name=dapo", "algo.kl_coef=0", "rollout.samples_per_prompt=1"], "needs at least 2"),
        (["algo.name=rloo", "rollout.samples_per_prompt=1"], "rollout.samples_per_prompt=1"),
        (["algo.name=dapo", "algo.kl_coef=0.01"], "DAPO trains without a reference model"),
        (["algo.overlong_buffer_len=9", "rollout.max_new_tokens=8"], "algo.overlong_buffer_len=9"),
        (["algo.overlong_penalty=-1"], "algo.overlong_penalty=-1"),
        (
            ["algo.dynamic_sampling=true", "rollout.samples_per_prompt=1"],
            "algo.dynamic_sampling=True: drops groups without reward spread",
        ),
        (["algo.dynamic_sampling=true", "algo.max_sampling_rounds=0"], "algo.max_sampling_rounds=0"),
        (["algo.rollout_is=tis", "algo.rollout_is_cap=0.5"], "algo.rollout_is_cap=0.5: must be >= 1"),
        (["rollout.replicas=2"], "rollout.replicas=2: colocated rollout runs on the actor's ranks"),
        (
            ["algo.old_logprobs=rollout", "algo.rollout_is=decoupled", "actor.mini_batches=2"],
            "algo.old_logprobs='rollout': algo.rollout_is=decoupled needs the policy's own log-probs",
        ),
        (
            ["rollout.placement=separate", "rollout.tp=2"],
            "rollout.tp=2: rollout.placement=separate sends full",
        ),
        (["rollout.placement=separate", "rollout.replicas=0"], "rollout.replicas=0: must be >= 1"),
        (["rollout.partial=true"], "rollout.partial=True: a response cut at one step is finished by a later"),
        (
            [
                "rollout.partial=true",
                "rollout.max_staleness=1",
                "rollout.partial_tokens=8",
                "rollout.max_new_tokens=8",
            ],
            "rollout.partial_tokens=8: no response is ever cut",
        ),
        (["rollout.max_staleness=1"], "rollout.max_staleness=1: colocated rollout shares the actor's ranks"),
        (
            ["rollout.max_staleness=9", "rollout.placement=separate"],
            "rollout.max_staleness=9: each step ahead",
        ),
        (
            ["rollout.partial=true", "rollout.max_staleness=1", "algo.dynamic_sampling=true"],
            "asynchronous \\(or partial\\) rollout with algo.dynamic_sampling is not built yet",
        ),
        (["algo.kl_in_reward=true"], "only PPO's GAE and REINFORCE\\+\\+'s returns use"),
        (
            ["algo.name=reinforce_pp", "algo.kl_in_reward=true", "algo.kl_ctrl=adaptive"],
            "the adaptive KL controller lives in PPO's critic",
        ),
    ],
)
def test_conflicting_algorithm_settings_are_errors(overrides, expected, tiny_model, arithmetic_data):
    with pytest.raises(ConfigError, match=expected):  # closed choices fail at load, the rest in validation
        preflight_train(load_config(TrainConfig, None, _base(tiny_model, arithmetic_data) + overrides))


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algo.name=dr_grpo", "algo.loss_agg=token-mean"], "defined with algo.loss_agg=seq-mean-token-sum"),
        (
            ["algo.name=dapo", "algo.kl_coef=0", "algo.clip_high=0.28", "algo.loss_agg=seq-mean-token-mean"],
            "loss_agg=token-mean",
        ),
        (["algo.name=dapo", "algo.kl_coef=0", "algo.clip_high=0.2"], "no clip-higher"),
        (["algo.name=rloo", "algo.norm_adv_by_std=false"], "norm_adv_by_std=False has no effect"),
        (
            ["algo.name=rloo", "algo.adv_eps=0.01"],
            r"algo.adv_eps=0.01 has no effect with algo.name=rloo \(estimator rloo\)",
        ),
        (["algo.name=ppo", "algo.adv_eps=0.01"], "algo.adv_eps=0.01 has no effect with algo.name=ppo"),
        (
            ["dock.mode=driver", "dock.transport=ray"],
            "dock.transport=ray has no effect with dock.mode=driver",
        ),
        (["data.eval_limit=4"], "data.eval_limit=4 has no effect without data.eval_path"),
        (["algo.old_logprobs=rollout"], "algo.old_logprobs=rollout has no effect with one on-policy update"),
        (
            ["placement.rollout=[test_pool]"],
            "placement.rollout=\\['test_pool'\\] has no effect with rollout.placement",
        ),
        # a single on-policy update: every importance ratio is exactly 1, no clip ever acts
        (["algo.clip_high=0.28"], r"the ratio clip \(algo.clip_low=0.2, algo.clip_high=0.28\) never acts"),
        (["algo.name=dapo", "algo.kl_coef=0"], "never acts: with actor.mini_batches=1 and actor.epochs=1"),
        (
            [
                "algo.name=gspo",
                "algo.kl_coef=0",
                "actor.mini_batches=2",
                "algo.clip_low=0.2",
                "algo.clip_high=0.2",
            ],
            r"clips the sequence ratio at 1 - 0.0003 / 1 \+ 0.0004 \(the GSPO paper\)",
        ),
        (
            ["algo.name=gspo", "algo.kl_coef=0", "actor.mini_batches=2", "algo.loss_agg=token-mean"],
            "seq-mean-token-mean",
        ),
        (["algo.kl_estimator=k1"], "k1 in the loss has zero expected gradient"),
        (["rollout.top_p=0.9"], "rollout.top_p=0.9: the rollout samples from a truncated distribution"),
    ],
)
def test_settings_without_effect_warn(overrides, expected, tiny_model, arithmetic_data):
    cfg = load_config(TrainConfig, None, _base(tiny_model, arithmetic_data) + overrides)
    with pytest.warns(UserWarning, match=expected):
        preflight_train(cfg)


def test_unset_loss_settings_are_the_algorithms_own(tiny_model, arithmetic_data):
    def loss(*overrides):
        return preflight_train(
            load_config(TrainConfig, None, _base(tiny_model, arithmetic_data) + list(overrides))
        ).plan.loss

    two = "actor.mini_batches=2"
    assert (loss().clip_low, loss().clip_high, loss().agg) == (0.2, 0.2, "token-mean")
    dapo = loss("algo.name=dapo", "algo.kl_coef=0", two)
    assert (dapo.clip_low, dapo.clip_high, dapo.agg) == (0.2, 0.28, "token-mean")
    gspo = loss("algo.name=gspo", "algo.kl_coef=0", two)
    assert (gspo.clip_low, gspo.clip_high, gspo.agg, gspo.sequence_ratio) == (
        3e-4,
        4e-4,
        "seq-mean-token-mean",
        True,
    )
    dr = loss("algo.name=dr_grpo", "rollout.max_new_tokens=8")
    assert (dr.agg, dr.seq_len_norm) == ("seq-mean-token-sum", 8.0)
    assert loss("algo.clip_low=0.1", "algo.clip_high=0.3", two).clip_high == 0.3  # explicit values win


def test_unset_kl_coef_is_the_algorithms_own(tiny_model, arithmetic_data):
    """DAPO, GSPO and Dr. GRPO train without a reference model; the rest keep a small KL term (0.001)."""

    def resolved(*overrides):
        run = preflight_train(
            load_config(TrainConfig, None, _base(tiny_model, arithmetic_data) + list(overrides))
        )
        cfg, plan = run.cfg, run.plan
        return cfg.algo.kl_coef, plan.reference, plan.loss.kl_coef

    two = "actor.mini_batches=2"
    assert resolved() == (0.001, True, 0.001)
    assert resolved("algo.name=dapo", two) == (0.0, False, 0.0)  # no "set kl_coef=0" error for DAPO's own
    assert resolved("algo.name=gspo", two) == (0.0, False, 0.0)
    assert resolved("algo.name=dr_grpo") == (0.0, False, 0.0)
    assert resolved("algo.name=gspo", "algo.kl_coef=0.01", two) == (0.01, True, 0.01)  # explicit values win
    with pytest.raises(ConfigError, match="algo.kl_coef=0.01: DAPO trains without a reference model"):
        resolved("algo.name=dapo", "algo.kl_coef=0.01", two)


def test_groups_of_one_warn_only_where_a_group_baseline_is_used(tiny_model, arithmetic_data):
    ones = _base(tiny_model, arithmetic_data) + ["rollout.samples_per_prompt=1", "rollout.max_batch_size=4"]
    with pytest.warns(UserWarning, match="all zero with groups of one"):
        preflight_train(load_config(TrainConfig, None, ones))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preflight_train(load_config(TrainConfig, None, ones + ["algo.name=reinforce_pp"]))


def test_cli_rejects_dapo_with_groups_of_one_before_ray(monkeypatch, capsys, tiny_model, arithmetic_data):
    import dockrl.recipes.grpo as grpo

    def forbidden(*args, **kwargs):
        raise AssertionError("Ray was started before the config was validated")

    monkeypatch.setattr(grpo, "init_ray", forbidden)
    args = ["rollout.samples_per_prompt=1", "run.prompts_per_step=4"]
    code = main(["train", str(EXAMPLES / "dapo_tiny.yaml"), *tiny_paths(tiny_model, arithmetic_data), *args])
    assert code == 2
    assert "rollout.samples_per_prompt=1" in capsys.readouterr().err


REQUIRED = ["reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/clip_frac", "actor/kl", "timing/step"]


# dapo: overlong shaping, clip-higher, dynamic sampling, no reference; reinforce_pp(_baseline): step
# whitening across the dock; dr_grpo: the max_new_tokens loss normaliser through the actor; rloo: the
# leave-one-out baseline; gspo: the sequence-level ratio. grpo runs in test_e2e_grpo.py, ppo in test_ppo.py.
@pytest.mark.parametrize("algo", ["dapo", "reinforce_pp", "reinforce_pp_baseline", "rloo", "dr_grpo", "gspo"])
def test_two_steps_through_cli(algo, ray_session, tmp_path, tiny_model, arithmetic_data):
    code = main(
        [
            "train",
            str(EXAMPLES / f"{algo}_tiny.yaml"),
            *tiny_paths(tiny_model, arithmetic_data),
            # A random model never answers right; a length reward gives the groups reward spread. For dapo
            # a sparse reward leaves many groups flat, so dynamic sampling drops, refills and fills.
            "reward.functions=[{name: exact_answer}, {name: 'reward_fixtures:"
            + ("sparse_reward'}]" if algo == "dapo" else "length_reward', weight: 0.1}]"),
            "reward.num_processes=0",
            # rloo also runs the truncated importance-sampling correction against the rollout's log-probs
            # in fp32, where rollout and trainer log-probs agree to rounding (checked below)
            *(["algo.rollout_is=tis", "run.precision=fp32"] if algo == "rloo" else []),
            "run.save_every=2",
            "run.progress=false",
            "run.worker_timeout_s=300",
            "dock.get_timeout_s=120",
            f"run.output_dir={tmp_path}",
            f"run.name={algo}",
        ]
    )
    assert code == 0
    run = tmp_path / algo
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in REQUIRED:
            assert key in row and math.isfinite(row[key]), key
        assert row["actor/grad_norm"] > 0
        if algo == "dapo":  # dynamic sampling: every generated row is in the dock; 4 groups are trained on
            assert row["dock/rows"] == 4 * row["dapo/generated_groups"]
            assert 1 <= row["dapo/rounds"] <= 3
            assert row["dapo/informative_groups"] + row["dapo/filled_groups"] == 4
            assert row["dapo/generated_groups"] - row["dapo/dropped_groups"] == 4
        else:
            assert row["dock/rows"] == 16
        # only the reinforce_pp examples keep a KL term: the others run no reference stage
        assert ("timing/reference" in row) == algo.startswith("reinforce_pp")
        if algo.startswith("reinforce_pp"):  # the KL sits in the reward (summed to go), not in the loss
            assert row["reward/kl_coef"] == 0.001 and row["reward/kl_penalty"] >= 0 and row["actor/kl"] >= 0
            assert "timing/old_logprobs" in row  # the sampling policy's log-probs feed the KL
        # only the dapo example shapes overlong responses
        assert ("reward/overlong_penalty" in row) == (algo == "dapo")
        if algo == "dapo":
            assert row["reward/overlong_penalty"] <= 0 and 0 <= row["reward/overlong_frac"] <= 1
        if algo in ("dapo", "gspo"):  # two mini-batches: the second is off-policy, its ratios leave 1
            assert row["actor/approx_kl"] != 0
            assert row["actor/clip_frac"] == pytest.approx(
                row["actor/clip_frac_high"] + row["actor/clip_frac_low"]
            )
    if algo == "rloo":  # fp32 rollout and trainer agree to rounding: every weight is 1, none capped
        for row in rows:
            assert row["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
            assert row["rollout/is_capped_frac"] == 0
    if algo == "gspo":  # the sequence clip of 1 +- 3e-4 / 4e-4 acts on ratios that moved, in both directions
        assert rows[0]["actor/clip_frac_high"] > 0 and rows[0]["actor/clip_frac_low"] > 0
    if algo == "dapo":
        assert sum(row["dapo/dropped_groups"] for row in rows) > 0 and max(r["dapo/rounds"] for r in rows) > 1
    summary = json.loads((run / "summary.json").read_text())
    trained, initial = load_state_dict(f"{summary['checkpoint']}/hf"), load_state_dict(tiny_model)
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "the update moved the weights"
