"""What a resumed run must match, and the driver's own state: config fingerprints and RNG states.

A checkpoint records the *computation config*: every resolved setting except those that cannot change what
the run computes (where it writes, how long it waits, how it reports, how it recovers). Resuming with a
different computation config would not reproduce the uninterrupted run, so it is refused with the keys named
unless `run.resume_force=true`. The parallel layout (LAYOUT_KEYS) is the exception: it may change on resume
(the state reshards), and the resumed run then repeats the original to rounding, not bit for bit.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
from typing import Any

import numpy as np

# Settings that change no number the run computes (outputs, timeouts, reporting, recovery).
NEUTRAL_KEYS = frozenset(
    {
        "run.resume",
        "run.resume_force",
        "run.max_restarts",
        "run.keep_checkpoints",
        "run.save_every",
        "run.progress",
        "run.loggers",
        "run.name",
        "run.output_dir",
        "run.log_samples",
        "run.ray_address",
        "run.worker_timeout_s",
        "run.heartbeat_timeout_s",
        "dock.get_timeout_s",
    }
)


# The parallel layout: a checkpoint reshards to another one on load (checkpoint/sharded.py), and the run then
# computes the same numbers up to fp32 reassociation (another split of the same sums), not bit for bit. A
# resume may change them; it is reported, never refused.
LAYOUT_KEYS = frozenset(
    {
        "actor.dp",
        "actor.cp",
        "actor.tp",
        "critic.dp",
        "critic.cp",
        "distill.cp",
        "distill.tp",
        "rollout.tp",
        "rollout.replicas",
    }
)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config sections -> {"section.key": value} (lists, e.g. reward.functions, stay values)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def computation_config(config: dict[str, Any]) -> dict[str, Any]:
    """The flattened settings that change the computation (see NEUTRAL_KEYS), JSON-normalised."""
    flat = {k: v for k, v in flatten(config).items() if k not in NEUTRAL_KEYS}
    return json.loads(json.dumps(flat, sort_keys=True, default=str))


def config_hash(computation: dict[str, Any]) -> str:
    """A short, stable fingerprint of a computation config."""
    return hashlib.sha256(json.dumps(computation, sort_keys=True).encode()).hexdigest()[:16]


def config_changes(saved: dict[str, Any], current: dict[str, Any], *, layout: bool = False) -> list[str]:
    """`key: saved -> current` for every computation setting that differs: outside LAYOUT_KEYS, or with
    `layout`, inside them."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        before, after = saved.get(key, "<unset>"), current.get(key, "<unset>")
        if before != after and (key in LAYOUT_KEYS) == layout:
            changes.append(f"{key}: {before!r} -> {after!r}")
    return changes


def data_fingerprint(items: list[tuple[list[int], Any]], images: list[bytes] | None = None) -> str:
    """A fingerprint of the encoded training prompts and labels, in file order; `images` (a vision-language
    model's run): each row's image patches and grid as bytes, so other pixels under the same text differ too."""
    digest = hashlib.sha256()
    for ids, label in items:
        digest.update(json.dumps([ids, str(label)]).encode())
    for pixels in images or ():
        digest.update(hashlib.sha256(pixels).digest())
    return digest.hexdigest()[:16]


def rng_states() -> dict[str, Any]:
    """This process's Python, NumPy and torch RNG states, JSON-encodable."""
    import torch  # here: the driver reads this module before any worker starts, and torch costs seconds

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # the MT19937 tuple
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` returned."""
    import torch

    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    raw = np.frombuffer(base64.b64decode(states["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))
