"""Checkpoint directories (staged, renamed, pruned) and the driver's resume state, without Ray or torch.distributed."""

import json
import random

import numpy as np
import pytest
import torch

from dockrl.checkpoint import directory
from dockrl.checkpoint.state import (
    NEUTRAL_KEYS,
    computation_config,
    config_changes,
    config_hash,
    data_fingerprint,
    rng_states,
    set_rng_states,
)
from dockrl.config import TrainConfig, from_dict, to_dict


def _save(checkpoints, step: int, **state):
    staging = directory.begin(checkpoints, step)
    (staging / "actor").mkdir()
    return directory.commit(staging, {"step": step, **state})


def test_a_checkpoint_is_complete_only_after_its_rename(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    staging = directory.begin(checkpoints, 3)
    (staging / "actor").mkdir()
    assert staging.name == "step_000003.tmp" and directory.complete_checkpoints(checkpoints) == []
    assert directory.newest_checkpoint(checkpoints) is None  # a torn save is never picked
    final = directory.commit(staging, {"step": 3})
    assert final.name == "step_000003" and not staging.exists() and directory.is_checkpoint(final)
    assert directory.read_trainer_state(final) == {"step": 3}
    assert directory.newest_checkpoint(checkpoints) == final


def test_prune_keeps_the_newest_and_staging_is_cleaned(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        _save(checkpoints, step)
    assert [s for s, _ in directory.complete_checkpoints(checkpoints)] == [2, 4, 6, 8]
    removed = directory.prune(checkpoints, keep=2)
    assert [p.name for p in removed] == ["step_000002", "step_000004"]
    assert [s for s, _ in directory.complete_checkpoints(checkpoints)] == [6, 8]
    assert directory.prune(checkpoints, keep=None) == []
    directory.begin(checkpoints, 10)  # a save killed halfway
    (checkpoints / "step_000006.deleting").mkdir()  # a delete killed halfway
    directory.clean_staging(checkpoints)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000006", "step_000008"]


def test_saving_a_step_again_keeps_the_abandoned_one(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    _save(checkpoints, 4, timeline="first")
    final = _save(checkpoints, 4, timeline="second")
    assert directory.read_trainer_state(final)["timeline"] == "second"
    abandoned = checkpoints / "step_000004.abandoned"
    assert json.loads((abandoned / directory.TRAINER_STATE).read_text())["timeline"] == "first"
    assert [s for s, _ in directory.complete_checkpoints(checkpoints)] == [4]


def test_commit_fsyncs_every_file_and_directory_before_the_rename(tmp_path, monkeypatch):
    """A power loss after the rename must not leave a torn file in a complete checkpoint: the shards, hf/,
    inflight.pt and trainer_state.json, and every directory holding them, are fsynced before os.replace."""
    import os

    staging = directory.begin(tmp_path / "checkpoints", 7)
    for relative in (
        "actor/__0_0.distcp",
        "actor/.metadata",
        "hf/model.safetensors",
        "hf/config.json",
        "critic/hf/model.safetensors",
        "inflight.pt",
    ):
        (staging / relative).parent.mkdir(parents=True, exist_ok=True)
        (staging / relative).write_bytes(b"x")
    events: list[tuple[str, str]] = []
    opened: dict[int, str] = {}
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def spy_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        opened[fd] = os.path.realpath(path)
        return fd

    def spy_fsync(fd):
        events.append(("fsync", opened.get(fd, f"fd {fd}")))
        return real_fsync(fd)

    def spy_replace(src, dst):
        events.append(("replace", os.path.realpath(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    final = directory.commit(staging, {"step": 7})
    renamed = events.index(("replace", os.path.realpath(staging)))
    synced_before = {path for kind, path in events[:renamed] if kind == "fsync"}
    committed = [final, *final.rglob("*")]
    assert len(committed) == 12  # the root, 4 directories, 7 files (trainer_state.json among them)
    for path in committed:
        assert os.path.realpath(staging / path.relative_to(final)) in synced_before, path


def test_paths_resolve_a_checkpoint_root_to_its_exports(tmp_path):
    final = _save(tmp_path, 2)
    assert directory.resolve_model_path(str(final)) == str(final / "hf")
    assert directory.resolve_model_path(str(tmp_path / "plain")) == str(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="not from an algo.name=ppo run"):
        directory.resolve_critic_path(str(final))
    (final / "critic" / "hf").mkdir(parents=True)
    assert directory.resolve_critic_path(str(final)) == str(final / "critic" / "hf")


def _config(**run) -> TrainConfig:
    raw = {
        "model": {"path": "m"},
        "data": {"train_path": "d"},
        "run": {"steps": 4, "prompts_per_step": 2, **run},
    }
    return from_dict(TrainConfig, raw)


def test_only_settings_that_change_the_computation_count():
    base = computation_config(to_dict(_config()))
    assert "actor.lr" in base and "reward.functions" in base and not NEUTRAL_KEYS & set(base)
    neutral = computation_config(to_dict(_config(name="x", resume="auto", max_restarts=3, save_every=7)))
    assert config_changes(base, neutral) == [] and config_hash(base) == config_hash(neutral)
    changed = computation_config(to_dict(_config(seed=1)))
    assert config_changes(base, changed) == ["run.seed: 0 -> 1"] and config_hash(base) != config_hash(changed)


def test_rng_states_round_trip_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = json.loads(json.dumps(rng_states()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    set_rng_states(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_data_fingerprint_sees_a_changed_prompt_or_label():
    items = [([1, 2, 3], "5"), ([4, 5], 7)]
    assert data_fingerprint(items) == data_fingerprint([([1, 2, 3], "5"), ([4, 5], 7)])
    assert data_fingerprint(items) != data_fingerprint([([1, 2, 3], "5"), ([4, 5], 8)])
    assert data_fingerprint(items) != data_fingerprint(items[::-1])
