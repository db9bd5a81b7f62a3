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


class _OneDockClient:
    """The driver's client as save_inflight sees it: one dock of `num_rows` rows, of which `peek` returns
    `readable` (a consuming read repeated at a second save returned none)."""

    def __init__(self, num_rows: int, readable: int) -> None:
        self.num_rows, self.readable = num_rows, readable

    def select(self, dock: int) -> None:
        pass

    def stats(self) -> dict:
        return {"num_rows": self.num_rows, "num_groups": self.num_rows // 4, "ready": {"response_ids": 16}}

    def peek(self, columns: list[str]):
        rows = list(range(self.readable))
        return rows, {c: [[7]] * len(rows) for c in columns}


@pytest.mark.parametrize("readable", [0, 12])
def test_a_step_in_flight_read_without_all_its_rows_is_never_saved(tmp_path, readable):
    from dockrl.recipes.common import EncodedPrompt
    from dockrl.recipes.inflight import Generation, InflightSaveError, save_inflight

    batch = [EncodedPrompt(ids=[1, 2], text="1+1", label="2", index=i) for i in range(4)]  # 4 groups of 4
    generation = Generation(3, 0, 0, batch, 0.0, 0.0, None, results=([], [], 0.0))
    with pytest.raises(
        InflightSaveError, match=f"step 3, in flight in dock 0, holds 16 rows .* {readable} could"
    ):
        save_inflight(tmp_path, [generation], _OneDockClient(16, readable))
    assert not (tmp_path / "inflight.pt").exists()
    assert save_inflight(tmp_path, [generation], _OneDockClient(16, 16)) == 16


def test_resuming_an_older_checkpoint_abandons_the_later_ones_and_pruning_spares_the_new_one(tmp_path):
    """Resume from step 40 of a run that reached 50 (it diverged), then save every 5 with keep_checkpoints=1:
    the old 45 and 50 are renamed, never deleted, before the first step; the new 45 is the newest of the
    directory and survives its own prune (ranked by step against the old 50 it would have been doomed)."""
    from dockrl.observe.run_dir import RunDir
    from dockrl.recipes.resume import ResumePoint, newest, timeline_head

    run = RunDir(tmp_path, "diverged")
    for step in (40, 45, 50):
        _save(run.checkpoints, step, timeline="old")
    origin = ResumePoint(directory.step_dir(run.checkpoints, 40), {"step": 40})
    abandoned = directory.abandon_from(run.checkpoints, 40, origin.path)
    assert sorted(p.name for p in abandoned) == ["step_000045.abandoned", "step_000050.abandoned"]
    assert [s for s, _ in directory.complete_checkpoints(run.checkpoints)] == [40]
    assert timeline_head(run, origin).path == origin.path  # a restart before the first save
    new = _save(run.checkpoints, 45, timeline="new")
    assert directory.prune(run.checkpoints, keep=1, newest=new) == [origin.path]
    assert newest(run).state["timeline"] == "new" and timeline_head(run, origin).path == new
    # `newest` protects the just-written checkpoint even where ranking by step would doom it
    _save(run.checkpoints, 60, timeline="other")
    assert directory.prune(run.checkpoints, keep=1, newest=new) == []
    assert directory.abandon_from(run.checkpoints, 45, new) == [run.checkpoints / "step_000060.abandoned"]


def test_a_restart_before_the_first_save_continues_from_another_runs_checkpoint(tmp_path):
    """run.resume=<another run's checkpoint>: until this run saves, its timeline stands at that checkpoint
    (older checkpoints of this directory belong to an earlier timeline); the same step here is abandoned."""
    from dockrl.observe.run_dir import RunDir
    from dockrl.recipes.resume import ResumePoint, timeline_head

    source = _save(RunDir(tmp_path, "a").checkpoints, 40)
    run = RunDir(tmp_path, "b")
    assert timeline_head(run, None) is None  # a fresh run without checkpoints starts at step 1
    old = _save(run.checkpoints, 20)
    _save(run.checkpoints, 40)
    origin = ResumePoint(source, {"step": 40})
    assert directory.abandon_from(run.checkpoints, 40, source) == [run.checkpoints / "step_000040.abandoned"]
    assert timeline_head(run, origin) is origin and timeline_head(run, None).path == old
    assert timeline_head(run, origin).path == source
    mine = _save(run.checkpoints, 42)
    assert timeline_head(run, origin).path == mine


def test_a_changed_parallel_layout_is_reported_in_one_line_and_accepted(caplog):
    """actor.dp/tp, critic.dp and the rollout layout may change on resume (the state reshards on load):
    reported, never refused; any other computation setting still is."""
    import logging
    from pathlib import Path

    from dockrl.config.fields import ConfigError
    from dockrl.recipes.resume import ResumePoint, check_compatible

    def config(**sections) -> TrainConfig:
        raw = {
            "model": {"path": "m"},
            "data": {"train_path": "d"},
            "run": {"steps": 4, "prompts_per_step": 2},
        }
        return from_dict(TrainConfig, {**raw, **sections})

    saved = computation_config(to_dict(config(actor={"dp": 2})))
    point = ResumePoint(Path("step_000002"), {"config": saved, "data_fingerprint": "f"})
    with caplog.at_level(logging.WARNING, logger="dockrl.recipes.resume"):
        check_compatible(config(actor={"dp": 1, "tp": 2}, rollout={"replicas": 2}), point, "f")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1, lines
    assert "actor.dp: 2 -> 1; actor.tp: 1 -> 2; rollout.replicas: 1 -> 2" in lines[0]
    assert "not bit for bit" in lines[0]
    with pytest.raises(ConfigError, match=r"actor\.lr: .* -> 0\.5") as refused:
        check_compatible(config(actor={"dp": 4, "lr": 0.5}), point, "f")
    assert "actor.dp" not in str(refused.value)
