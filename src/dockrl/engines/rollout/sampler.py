"""`generate`: the simple batch API - a list of prompts in, one completion per prompt out - on the engine.

```
prompts, seeds --one Request (n=1) each--> RolloutEngine(num_slots = max_batch_size) --run--> by index
```

Kept for callers that have the whole batch at hand (evaluation, `actor.evaluate`, tests); the actor's
rollout feeds the engine from the dock incrementally instead (`rollout.dock_feed`). Sampling settings,
seeds and the log-prob formula are those of `rollout.sampling`: a request's tokens depend only on its
prompt, params and seed, never on the other prompts or on max_batch_size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dockrl.engines.rollout.backend import RolloutBackend
from dockrl.engines.rollout.requests import Generation, Request
from dockrl.engines.rollout.rollout_engine import RolloutEngine
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.models.decoder import Transformer
from dockrl.models.vision import VisionInputs

__all__ = ["Generation", "SamplingParams", "generate", "generate_with"]


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    seeds: list[int],
    *,
    pad_token_id: int = 0,
    max_batch_size: int | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
    vision: VisionInputs | None = None,
    images: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> list[Generation]:
    """Sample one completion per prompt, request i seeded with seeds[i]; results in the order of `prompts`.
    A vision model takes its `vision` inputs and, per prompt, its images (uint8 patches, grid) or None.

    At most max_batch_size sequences (None = all) run at once; a finished one's slot goes to the next
    prompt. A prompt with len + max_new_tokens > max_position_embeddings is a ValueError naming the limit.
    `detokenize` is needed only when params has stop strings.
    """
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 or None")
    if not prompts:
        return []
    needed = max(len(prompt) for prompt in prompts) + params.max_new_tokens
    engine = RolloutEngine(
        model,
        num_slots=min(max_batch_size or len(prompts), len(prompts)),
        max_seq_len=min(needed, model.args.max_position_embeddings),
        pad_token_id=pad_token_id,
        detokenize=detokenize,
        vision=vision,
    )
    for index, (prompt, seed) in enumerate(zip(prompts, seeds)):
        row_images = None if images is None else images[index]
        engine.add(Request(list(prompt), [seed], params, tag=index, images=row_images))
    generations: list[Generation | None] = [None] * len(prompts)
    for completion in engine.run():
        generations[completion.tag] = completion.generation
    return [generation for generation in generations if generation is not None]  # every prompt completes


def generate_with(
    engine: RolloutBackend, prompts: list[list[int]], params: SamplingParams, seeds: list[int]
) -> list[Generation]:
    """`generate` on an existing engine (any RolloutBackend, e.g. vLLM's): one completion per prompt, request i
    seeded with seeds[i], results in the order of `prompts`. The engine must be idle."""
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt")
    assert not engine.has_work(), "generate_with needs an idle engine"
    for index, (prompt, seed) in enumerate(zip(prompts, seeds)):
        engine.add(Request(list(prompt), [seed], params, tag=index))
    generations: list[Generation | None] = [None] * len(prompts)
    while engine.has_work():
        for completion in engine.step():
            generations[completion.tag] = completion.generation
    return [generation for generation in generations if generation is not None]
