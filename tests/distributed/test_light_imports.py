"""What stays light: each check runs a fresh interpreter and names the heavy modules it found loaded.

A run's start-up pays for every import on its critical path (torch is 1.5-2 s of CPU here): the driver reads
its config and data before Ray starts, and the dock's actors only move bytes. Each check below fails if a
module on those paths imports torch (or Ray) at the top again; adding `import torch` to one of them makes it
fail (tried for dockrl.models.config and dockrl.dock.warehouse).
"""

import subprocess
import sys
import textwrap

import pytest

from runs import tiny_paths

HEAVY = ("torch", "ray", "transformers", "datasets", "math_verify")


def _loaded_after(code: str) -> list[str]:
    probe = textwrap.dedent(code) + textwrap.dedent(
        f"""
        import sys, json
        print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    return json.loads(done.stdout.strip().splitlines()[-1])


def test_data_and_rewards_import_without_torch_or_ray():
    assert _loaded_after("import dockrl.data, dockrl.rewards") == []


def test_the_registries_config_reads_import_without_torch():
    """The sockets' records the config validates against (backends: names, settings sections, checks)."""
    assert _loaded_after("import dockrl.backends, dockrl.backends.vllm, dockrl.backends.dockrl") == []


def test_the_algorithm_registry_imports_without_torch():
    """What config/ imports of algos/: the registry, and the built-in estimators it finds registered (the driver
    checks a config before any worker starts)."""
    loaded = _loaded_after(
        """
        from dockrl.algos.registry import estimator_names, PRESETS, LossPlan
        import dockrl.algos, dockrl.algos.estimators, dockrl.config
        assert "grpo" in estimator_names() and "gae" in estimator_names()
        """
    )
    assert loaded == []


def test_the_dock_imports_without_torch():
    """The controller's and the warehouses' modules (their processes never decode a tensor: dock/cells.py)."""
    loaded = _loaded_after("import dockrl.dock.warehouse, dockrl.dock.shared, dockrl.dock.cells")
    assert loaded == []


def test_environment_workers_import_without_torch():
    """The environment tier's processes (workers/env.py) hold environments, never a tensor."""
    assert _loaded_after("import dockrl.workers.env, dockrl.envs.host") == ["ray"]


def test_dockrl_train_parses_and_checks_a_cpu_config_without_torch(tiny_model, arithmetic_data, tmp_path):
    """`dockrl train`'s parser (benchmark options are imported for `dockrl bench` only) and the preflight of a
    CPU config (device, bf16 support from the CPU flags, model and data files) run before Ray starts."""
    config = tmp_path / "run.yaml"
    config.write_text("run:\n  steps: 1\n  prompts_per_step: 2\n  device: cpu\n")
    overrides = [*tiny_paths(tiny_model, arithmetic_data)]
    loaded = _loaded_after(
        f"""
        from dockrl.cli import build_parser
        from dockrl.config import TrainConfig, load_config
        from dockrl.recipes.preflight import preflight_train
        from dockrl.recipes import resume, common
        args = build_parser(["train", {str(config)!r}]).parse_args(["train", {str(config)!r}])
        preflight_train(load_config(TrainConfig, args.config, {overrides!r}))
        """
    )
    assert loaded == []


@pytest.mark.parametrize("bench", ["dock", "startup"])
def test_a_benchmark_imports_only_its_own_module(bench):
    loaded = _loaded_after(
        f"""
        from dockrl.cli import build_parser
        build_parser(["bench", {bench!r}]).parse_args(["bench", {bench!r}])
        """
    )
    assert "torch" not in loaded
