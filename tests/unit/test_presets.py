"""Algorithm presets (config/presets.py) and resolution (config/resolve.py): the table is the one source of each
algorithm's settings, algo.ratio_level and algo.loss_normalizer act on their own whatever the name, and the
pure rules and resolve() change nothing of the user's config. No file is read: the paths do not exist."""

import copy
import dataclasses
import typing
import warnings

import pytest

from dockrl.config import (
    PRESETS,
    AlgoConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    check_train,
    load_config,
    loss_plan,
    resolve,
)
from dockrl.config.presets import ADV_ESTIMATORS, LOSS_AGGS, LOSS_NORMALIZERS, RATIO_LEVELS


def _cfg(**algo) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(path="/no/such/model"),
        data=DataConfig(train_path="/no/such/data.jsonl"),
        run=RunConfig(steps=1, prompts_per_step=4),
        algo=AlgoConfig(**algo),
    )


def test_the_schema_choices_are_the_table():
    hints = typing.get_type_hints(AlgoConfig)
    assert typing.get_args(hints["name"]) == tuple(PRESETS)
    estimators = typing.get_args(typing.get_args(hints["adv_estimator"])[0])
    assert estimators == ADV_ESTIMATORS
    for name, preset in PRESETS.items():
        assert preset.estimator in ADV_ESTIMATORS, name
        assert preset.loss_agg in LOSS_AGGS, name
        assert preset.ratio_level in RATIO_LEVELS, name
        assert preset.loss_normalizer in LOSS_NORMALIZERS, name


def test_unset_settings_are_the_rows_own():
    for name, preset in PRESETS.items():
        plan = resolve(_cfg(name=name)).plan
        assert plan.estimator == preset.estimator, name
        assert (plan.loss.clip_low, plan.loss.clip_high, plan.loss.agg) == (
            preset.clip_low,
            preset.clip_high,
            preset.loss_agg,
        )
        assert plan.kl_coef == preset.kl_coef and plan.reference == (preset.kl_coef > 0)
        assert plan.loss.sequence_ratio == (preset.ratio_level == "sequence")
        assert (plan.loss.seq_len_norm is not None) == (preset.loss_normalizer == "max_new_tokens")
        assert plan.critic == (preset.estimator == "gae")


def test_ratio_level_and_normalizer_are_orthogonal_to_the_name():
    assert not loss_plan(AlgoConfig(name="gspo", ratio_level="token")).sequence_ratio
    assert loss_plan(AlgoConfig(name="grpo", ratio_level="sequence")).sequence_ratio
    assert loss_plan(AlgoConfig(name="dr_grpo", loss_normalizer="tokens")).seq_len_norm is None
    grpo = AlgoConfig(loss_agg="seq-mean-token-sum", loss_normalizer="max_new_tokens")
    assert loss_plan(grpo, max_new_tokens=96).seq_len_norm == 96.0
    assert resolve(_cfg(name="dr_grpo")).plan.loss.seq_len_norm == 256.0  # rollout.max_new_tokens' default
    with pytest.raises(ValueError, match="pass rollout.max_new_tokens"):
        loss_plan(AlgoConfig(name="dr_grpo"))


def test_a_normalizer_without_effect_warns_and_unknown_values_are_errors(tmp_path):
    with pytest.warns(
        UserWarning, match="algo.loss_normalizer=max_new_tokens has no effect with algo.loss_agg"
    ):
        check_train(_cfg(loss_normalizer="max_new_tokens"))
    with pytest.raises(ConfigError, match="algo.ratio_level='tokens': unknown choice"):
        check_train(_cfg(ratio_level="tokens"))
    required = ["model.path=m", "data.train_path=d", "run.steps=1", "run.prompts_per_step=1"]
    with pytest.raises(ConfigError, match="algo.loss_normalizer='max_tokens'"):
        load_config(TrainConfig, None, [*required, "algo.loss_normalizer=max_tokens"])


def test_check_and_resolve_change_nothing_and_the_result_is_frozen():
    cfg = _cfg(name="dapo")
    before = copy.deepcopy(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_train(cfg)  # pure: the missing model and data files are the preflight's concern
    resolved = resolve(cfg, {"run.device": "cpu", "model.ref_path": "/ref"})
    assert cfg == before and cfg.algo.kl_coef is None and cfg.run.device == "auto"
    assert resolved.cfg.algo.kl_coef == 0.0 and resolved.cfg.run.device == "cpu"
    assert resolved.cfg.model.ref_path == "/ref" and resolved.cfg is not cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.plan = resolved.plan  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.plan.loss.clip_low = 0.5  # type: ignore[misc]
    again = resolved.with_found({"model.ref_path": "/other"})
    assert again.cfg.model.ref_path == "/other" and resolved.cfg.model.ref_path == "/ref"
    with pytest.raises(KeyError, match="run.devise is not a setting"):
        resolve(cfg, {"run.devise": "cpu"})
