"""What goes into a rollout engine and what comes out: a `Request` (a prompt, one seed per sample, how they are
drawn), a `Generation` per finished sample and the `Completion` that names its request. Every rollout backend
speaks these (backend.py); `_Running` is RolloutEngine's host-side state of a sample while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dockrl.engines.rollout.sampling import SamplingParams


@dataclass
class Request:
    """One prompt and the samples to draw from it (n = len(seeds)); they share one prefill."""

    prompt_ids: list[int]
    """The prompt's token ids (at least one)."""
    seeds: list[int]
    """One seed per sample; sample i's tokens depend only on the prompt, params and seeds[i]."""
    params: SamplingParams
    """How every sample of this request is drawn."""
    tag: Any = None
    """Caller's handle, returned with each Completion (e.g. dock row ids)."""
    kv_key: Any = None
    """One sample only: keep its KV under this key when it finishes, and start from the KV kept under it when
    the prompt extends the kept positions (a trajectory's next turn; see kept_kv.py)."""
    images: tuple[torch.Tensor, torch.Tensor] | None = None
    """A vision model's prompt images: (uint8 patches [N, C*t*p*p], grid [n, 3]) as the dock holds them; the
    prompt holds their <|image_pad|> tokens. None (or 0 images): text."""


@dataclass
class Generation:
    """One completed sample."""

    token_ids: torch.Tensor
    """int64 [R] generated tokens, including the stop token if one was produced."""
    logprobs: torch.Tensor
    """float32 [R] log-prob of each generated token (see `sampling` for the exact formula)."""
    finish_reason: str
    """"stop" (a stop token or stop string was produced) or "length" (max_new_tokens reached)."""
    routes: torch.Tensor | None = None
    """MoE models with record_routes: int16 [P + R - 1, L, k], the experts each MoE layer routed every fed
    token to (the prompt's tokens, then each generated token but the last, which is never fed)."""


@dataclass
class Completion:
    """A finished sample: which request (tag) and sample index, and what it generated."""

    tag: Any
    sample: int
    generation: Generation


@dataclass
class _Running:
    """Host-side state of the sample living in one slot, from admission until it finishes."""

    request: Request
    sample: int
    length: int
    """Tokens in this slot's cache = cache position of the next token fed."""
    admitted: int
    """Admission order (the youngest running sample, the highest, is the one preempted)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # record_routes: [n, L, k] pieces, prompt first
    joining: int | None = None
    """A returning turn whose new positions (its prompt from this kept length on) run in the next decode step's
    forward (RolloutEngine._joins_decode), not yet run; None once they have (and for every other sample)."""


def same_images(first: tuple | None, second: tuple | None) -> bool:
    """Whether two requests' images (uint8 patches, grid) are the same (None and 0 images: none)."""
    first = None if first is None or not len(first[1]) else first
    second = None if second is None or not len(second[1]) else second
    if first is None or second is None:
        return first is second
    return all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(first, second))
