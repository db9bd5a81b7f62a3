"""Where a resumable checkpoint lives, how it becomes complete, and which ones are kept.

    RUN_DIR/checkpoints/step_000040.tmp/    while it is written (never mistaken for a checkpoint)
        actor/               torch.distributed.checkpoint files of the actor ranks (model, optimizer, LR schedule)
        critic/              the same for PPO's critic ranks; critic/hf/ its Hugging Face export
        hf/                  the policy as a Hugging Face directory, in the checkpoint's source dtype
        adapter/             instead of hf/ under LoRA: the adapters as a PEFT directory (adapter_config.json
                             names the base; actor/ holds the adapters and their optimizer state only)
        trainer_state.json   written last, by the driver
    RUN_DIR/checkpoints/step_000040/        after the rename: complete

Lifecycle: `begin` clears a stale staging directory and makes a fresh one; the workers write their parts;
`commit` writes trainer_state.json, fsyncs every file and directory of the staging directory (the workers'
DCP shards, `hf/`, the driver's inflight.pt, trainer_state.json) and renames it (an atomic rename on one file
system), so after a power loss a complete checkpoint holds no torn file; then `prune` deletes the oldest
complete checkpoints beyond `keep`, only ever after the new one is complete, and never the new one. A kill at
any moment leaves either the previous complete checkpoints or the new one as well.

Timelines: a run that resumes from a checkpoint other than the newest one here starts a new timeline, so
`abandon_from` renames the later ones `*.abandoned` (kept on disk) before its first step; every complete
checkpoint in the directory then belongs to the current timeline or is older than its start, and "newest by
step" is the newest of the current timeline. trainer_state.json's `parent` names the checkpoint each one
descends from.

`resolve_model_path` / `resolve_critic_path` let `model.path`, `critic.path` and `dockrl eval --model` take
a checkpoint root (`step_NNNNNN/`) as well as a Hugging Face directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

ACTOR, ADAPTER, CRITIC, HF = "actor", "adapter", "critic", "hf"
TRAINER_STATE = "trainer_state.json"
STAGING_SUFFIX = ".tmp"
ABANDONED_SUFFIX = ".abandoned"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def step_dir(checkpoints: Path, step: int) -> Path:
    """The final directory of the checkpoint of `step`."""
    return Path(checkpoints) / f"step_{step:06d}"


def is_checkpoint(path: str | Path) -> bool:
    """A complete checkpoint root: a renamed step directory with its trainer_state.json."""
    path = Path(path)
    return path.is_dir() and (path / TRAINER_STATE).is_file() and _STEP_DIR.match(path.name) is not None


def complete_checkpoints(checkpoints: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `checkpoints`, oldest first."""
    root = Path(checkpoints)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and is_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def newest_checkpoint(checkpoints: str | Path) -> Path | None:
    """The complete checkpoint of the highest step, or None."""
    found = complete_checkpoints(checkpoints)
    return found[-1][1] if found else None


def begin(checkpoints: Path, step: int) -> Path:
    """A fresh, empty staging directory for the checkpoint of `step` (a leftover one is removed)."""
    staging = step_dir(checkpoints, step).with_name(f"step_{step:06d}{STAGING_SUFFIX}")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit(staging: Path, trainer_state: dict[str, Any]) -> Path:
    """Write trainer_state.json into `staging` and rename it to its final name; returns that path.

    A complete checkpoint of the same step (from an abandoned timeline) is renamed out of the way first.
    """
    state_file = staging / TRAINER_STATE
    with open(state_file, "w", encoding="utf-8") as f:
        json.dump(trainer_state, f, indent=1, sort_keys=True)
        f.write("\n")
    fsync_tree(staging)  # every file's data and every directory entry on disk before the rename
    final = staging.with_name(staging.name.removesuffix(STAGING_SUFFIX))
    if final.exists():
        abandon(final)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    return final


def prune(checkpoints: Path, keep: int | None, *, newest: Path | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints so that at most `keep` remain (None keeps all); `newest`, the
    newest checkpoint of the run's current timeline (the one just written), is never deleted."""
    if keep is None:
        return []
    found = complete_checkpoints(checkpoints)
    doomed = [path for _, path in found[: max(0, len(found) - keep)]]
    if newest is not None:
        doomed = [path for path in doomed if path.resolve() != Path(newest).resolve()]
    for path in doomed:
        # Renamed first, so a kill halfway through a delete never leaves a torn "complete" checkpoint.
        trash = path.with_name(path.name + ".deleting")
        os.replace(path, trash)
        shutil.rmtree(trash)
    return doomed


def abandon(path: Path) -> Path:
    """Rename a complete checkpoint so it is never resumed from again (kept on disk, nothing is lost)."""
    target = path.with_name(path.name + ABANDONED_SUFFIX)
    index = 1
    while target.exists():
        target = path.with_name(f"{path.name}{ABANDONED_SUFFIX}.{index}")
        index += 1
    os.replace(path, target)
    return target


def abandon_from(checkpoints: Path, step: int, keep: Path) -> list[Path]:
    """Abandon (rename, never delete) every complete checkpoint of step >= `step` except `keep`: a run that
    resumes from `keep` starts a new timeline, and the later checkpoints of the old one must not be resumed,
    restarted from or pruned in its place. Returns their new paths."""
    return [
        abandon(path)
        for found_step, path in complete_checkpoints(checkpoints)
        if found_step >= step and path.resolve() != Path(keep).resolve()
    ]


def clean_staging(checkpoints: Path) -> None:
    """Remove staging and half-deleted directories a killed run left behind."""
    if not checkpoints.is_dir():
        return
    for child in checkpoints.iterdir():
        if child.is_dir() and child.name.endswith((STAGING_SUFFIX, ".deleting")):
            shutil.rmtree(child, ignore_errors=True)


def read_trainer_state(root: str | Path) -> dict[str, Any]:
    """The trainer_state.json of checkpoint root `root`."""
    with open(Path(root) / TRAINER_STATE, encoding="utf-8") as f:
        return json.load(f)


def lora_adapter_dir(path: str | Path) -> Path | None:
    """The PEFT adapter directory of a LoRA checkpoint root (which has no hf/), else None."""
    adapter = Path(path) / ADAPTER
    if is_checkpoint(path) and not (Path(path) / HF).is_dir() and adapter.is_dir():
        return adapter
    return None


def adapter_base(adapter: str | Path) -> str:
    """The base model directory a PEFT adapter directory names (adapter_config.json's
    base_model_name_or_path); FileNotFoundError when it is gone."""
    config = json.loads((Path(adapter) / "adapter_config.json").read_text(encoding="utf-8"))
    base = config.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise FileNotFoundError(
            f"{adapter} holds LoRA adapters of the base model {base!r}, which is not a directory here: "
            "adapters apply only to their base; put it back, or use `dockrl export --merge` where it exists"
        )
    return str(base)


def resolve_model_path(path: str) -> str:
    """`path` itself, or the Hugging Face export inside it when it is a checkpoint root. A LoRA checkpoint
    root has no export of its own: `resolve_lora` gives its base and adapters."""
    if lora_adapter_dir(path) is not None:
        raise ValueError(
            f"{path} is a LoRA checkpoint (adapters only, in {Path(path) / ADAPTER}): write a merged model with "
            f"`dockrl export {path} OUT --merge` and use OUT"
        )
    return str(Path(path) / HF) if is_checkpoint(path) else path


def resolve_lora(path: str) -> tuple[str, str | None]:
    """(model directory, adapter directory or None) of `path`: a model directory, a checkpoint root (its
    hf/ export), or a LoRA checkpoint root (its base and its adapter/)."""
    adapter = lora_adapter_dir(path)
    if adapter is None:
        return resolve_model_path(path), None
    return adapter_base(adapter), str(adapter)


def resolve_critic_path(path: str) -> str:
    """`path` itself, or the critic's Hugging Face export when it is a checkpoint root of a PPO run."""
    if not is_checkpoint(path):
        return path
    critic = Path(path) / CRITIC / HF
    if not critic.is_dir():
        raise FileNotFoundError(
            f"checkpoint {path} has no critic ({critic} is missing): it is not from an algo.name=ppo run; "
            "set critic.path to a causal-LM or critic directory"
        )
    return str(critic)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first (`root` last)."""
    directories = []
    for current, _, files in os.walk(root):
        directories.append(Path(current))
        for name in files:
            _fsync_file(Path(current) / name)
    for path in reversed(directories):
        _fsync_dir(path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
