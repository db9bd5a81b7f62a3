"""A vision-language policy's config: what its images cannot reach is refused by name before any process
starts (recipes/preflight.py `_check_vision`, backends/vllm.py), and text-model runs are unchanged."""

import pytest

from dockrl.config import ConfigError, TrainConfig, load_config
from dockrl.recipes.preflight import preflight_train

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from dockrl.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("vl") / "model", family="qwen2_5_vl")


def _base(model, arithmetic_data) -> list[str]:
    return [
        f"model.path={model}",
        f"data.train_path={arithmetic_data['train']}",
        "run.steps=1",
        "run.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
    ]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["actor.cp=2", "actor.dp=1"], "actor.cp=2: splits sequences"),
        (["rollout.partial=true", "rollout.max_staleness=1"], "rollout.partial=True: carries cut rows"),
        (["algo.name=ppo"], "algo.adv_estimator=.*runs a critic"),
        (["actor.vision.freeze=false", "actor.lora.rank=4"], "actor.vision.freeze=False: trains the vision"),
    ],
)
def test_what_images_cannot_reach_is_refused_by_name(tiny_vl, arithmetic_data, overrides, expected):
    cfg = load_config(TrainConfig, None, _base(tiny_vl, arithmetic_data) + overrides)
    with pytest.raises(ConfigError, match=expected):
        preflight_train(cfg)


def test_a_vision_model_with_the_defaults_passes(tiny_vl, arithmetic_data):
    resolved = preflight_train(load_config(TrainConfig, None, _base(tiny_vl, arithmetic_data)))
    assert resolved.cfg.actor.vision.freeze


def test_vllm_refuses_a_vision_model_by_name(tiny_vl):
    """The backend's own check (preflight asks it once vLLM is installed: tests/vllm run that tier)."""
    from dockrl.backends.vllm import model_problem
    from dockrl.models.config import read_config

    assert "vision-language model (family 'qwen2_5_vl')" in model_problem(read_config(tiny_vl), "cpu")
