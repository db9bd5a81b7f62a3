"""Context parallelism's settings checked before any process starts (the (dp, cp) = (2, 2) run through the CLI is
tests/slow/test_cp_run.py)."""

import re

import pytest

from dockrl.config import ConfigError, TrainConfig, load_config
from dockrl.recipes.preflight import preflight_train


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["actor.cp=0"], "actor.cp=0: must be >= 1"),
        (
            ["actor.cp=2", "rollout.tp=3"],
            "rollout.tp=3: does not divide the actor's actor.dp x actor.cp x actor.tp",
        ),
        (["actor.cp=2", "actor.ep=2"], "actor.cp=2: with actor.ep=2: context parallelism of MoE models"),
    ],
)
def test_cp_config_errors(tiny_model, arithmetic_data, extra, expected):
    base = [f"model.path={tiny_model}", f"data.train_path={arithmetic_data['train']}", "run.steps=1"]
    base += ["run.prompts_per_step=4", "rollout.samples_per_prompt=2"]
    with pytest.raises(ConfigError, match=re.escape(expected)):
        preflight_train(load_config(TrainConfig, None, base + extra))


def test_cp_with_moe_model_is_refused(tmp_path, arithmetic_data):
    from dockrl.models.tiny import make_tiny

    moe = make_tiny(tmp_path / "moe", family="qwen3_moe", hidden_size=64, num_layers=2)
    base = [f"model.path={moe}", f"data.train_path={arithmetic_data['train']}", "run.steps=1"]
    base += ["run.prompts_per_step=4", "rollout.samples_per_prompt=2", "actor.cp=2"]
    with pytest.raises(
        ConfigError, match=re.escape("actor.cp=2: splits sequences, and context parallelism of MoE")
    ):
        preflight_train(load_config(TrainConfig, None, base))


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["critic.cp=0"], "critic.cp=0: must be >= 1"),
        (["distill.cp=0"], "distill.cp=0: must be >= 1"),
        (
            ["distill.num_workers=2", "distill.cp=2", "distill.tp=2"],
            "distill.cp=2: times distill.tp=2 does not divide distill.num_workers=2",
        ),
    ],
)
def test_critic_and_teacher_cp_config_errors(tiny_model, arithmetic_data, extra, expected):
    base = [f"model.path={tiny_model}", f"data.train_path={arithmetic_data['train']}", "run.steps=1"]
    base += ["run.prompts_per_step=4", "rollout.samples_per_prompt=2", "algo.name=ppo"]
    if any(x.startswith("distill.") for x in extra):
        base = [x for x in base if x != "algo.name=ppo"] + [f"distill.teacher_path={tiny_model}"]
    with pytest.raises(ConfigError, match=re.escape(expected)):
        preflight_train(load_config(TrainConfig, None, base + extra))


def test_critic_and_teacher_cp_with_moe_models_are_refused(tmp_path, tiny_model, arithmetic_data):
    from dockrl.models.tiny import make_tiny

    moe = make_tiny(tmp_path / "moe", family="qwen3_moe", hidden_size=64, num_layers=2)
    base = [f"data.train_path={arithmetic_data['train']}", "run.steps=1"]
    base += ["run.prompts_per_step=4", "rollout.samples_per_prompt=2"]
    critic = base + [f"model.path={tiny_model}", "algo.name=ppo", f"critic.path={moe}", "critic.cp=2"]
    with pytest.raises(
        ConfigError, match=re.escape("critic.cp=2: splits sequences, and context parallelism")
    ):
        preflight_train(load_config(TrainConfig, None, critic))
    teacher = base + [f"model.path={moe}", f"distill.teacher_path={moe}", "distill.cp=2"]
    teacher += ["distill.num_workers=2"]
    with pytest.raises(
        ConfigError, match=re.escape("distill.cp=2: splits sequences, and context parallelism")
    ):
        preflight_train(load_config(TrainConfig, None, teacher))


def test_cp_with_top_k_distillation_is_accepted(tiny_model, arithmetic_data):
    """The student's top-k scoring over a split sequence is built (tests/distributed/test_cp_critic_teacher.py)."""
    base = [f"model.path={tiny_model}", f"data.train_path={arithmetic_data['train']}", "run.steps=1"]
    base += ["run.prompts_per_step=4", "rollout.samples_per_prompt=2", "actor.cp=2", "algo.name=opd"]
    base += [f"distill.teacher_path={tiny_model}", "distill.top_k=4", "distill.num_workers=2", "distill.cp=2"]
    resolved = preflight_train(load_config(TrainConfig, None, base))
    assert resolved.cfg.actor.cp == 2 and resolved.cfg.distill.cp == 2
