"""Native batched KV-cache sampler on dockrl's `Transformer`.

```
prompts --left-pad--> ids [B, P], key_mask, per-row positions (0 at each row's first real token)
   prefill once: logits of the last prompt slot, KV cache slots [0, P)
   loop step = 0 .. max_new_tokens-1:
       sample one token per row from that row's own generator  -> token, logprob
       rows that produced a stop token are done (decoded along, their later tokens dropped)
       all done? stop.  else decode [B, 1] at slot P + step
```

Shape letters: B batch (requests in one chunk), P longest prompt, V vocabulary.

Sampling order: logits / temperature, then top-k, then top-p (nucleus) on the renormalized top-k
distribution, then one draw per row by inverse CDF from a uniform taken from the row's own CPU
`torch.Generator` seeded with the request's seed. A row's draws never depend on the other rows, so a
request gives the same tokens alone or in any batch (up to float non-associativity of batched matmuls).

Log-probs: `rollout_logprobs` are log_softmax(logits / temperature)[token] over the FULL vocabulary, in
fp32, before top-k/top-p filtering; this is what the trainer recomputes from the same logits, so rollout and
trainer log-probs agree. With temperature 0 (greedy) the formula uses temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dockrl.models.decoder import KVCache, Transformer


@dataclass
class SamplingParams:
    """How to sample one batch of completions."""

    max_new_tokens: int
    """Most tokens generated per request (the stop token, if produced, counts)."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of top tokens with probability mass >= top_p; 1.0 = off."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    stop_token_ids: list[int] = field(default_factory=list)
    """A request ends right after producing one of these tokens (finish_reason "stop")."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"sampling temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p={self.top_p} must be in (0, 1]; use 1.0 to turn it off")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k={self.top_k} must be >= 0; use 0 to turn it off")


@dataclass
class Generation:
    """One completed request."""

    token_ids: torch.Tensor
    """int64 [R] generated tokens, including the stop token if one was produced."""
    logprobs: torch.Tensor
    """float32 [R] log-prob of each generated token (see module docstring for the exact formula)."""
    finish_reason: str
    """"stop" (a stop token was produced) or "length" (max_new_tokens reached)."""


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    seeds: list[int],
    *,
    pad_token_id: int = 0,
    max_batch_size: int | None = None,
) -> list[Generation]:
    """Sample one completion per prompt, request i drawing only from a generator seeded with seeds[i].

    Requests are processed in chunks of at most max_batch_size (None = all at once); results come back in
    the order of `prompts`.
    """
    _validate_requests(model, prompts, params, seeds, max_batch_size)
    chunk_size = max_batch_size or max(len(prompts), 1)
    generations: list[Generation] = []
    for start in range(0, len(prompts), chunk_size):
        end = start + chunk_size
        generations += _generate_chunk(model, prompts[start:end], params, seeds[start:end], pad_token_id)
    return generations


def _validate_requests(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    seeds: list[int],
    max_batch_size: int | None,
) -> None:
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 or None")
    max_positions = model.args.max_position_embeddings
    limit = max_positions - params.max_new_tokens
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
        if len(prompt) > limit:
            raise ValueError(
                f"prompt {index} has {len(prompt)} tokens, more than the limit {limit} = "
                f"max_position_embeddings={max_positions} - max_new_tokens={params.max_new_tokens}; "
                "shorten the prompt or lower max_new_tokens"
            )


def _generate_chunk(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    seeds: list[int],
    pad_token_id: int,
) -> list[Generation]:
    """Prefill then decode one batch of requests into a static KV cache."""
    weight = model.output_weight()
    device, dtype = weight.device, weight.dtype
    batch, max_prompt_len = len(prompts), max(len(prompt) for prompt in prompts)
    total_len = max_prompt_len + params.max_new_tokens
    prompt_lens = torch.tensor([len(prompt) for prompt in prompts], device=device)  # [B]
    input_ids = torch.full((batch, max_prompt_len), pad_token_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        input_ids[row, max_prompt_len - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
    pad_lens = max_prompt_len - prompt_lens  # [B]
    slots = torch.arange(total_len, device=device)  # [P + max_new_tokens]
    # Generated slots are marked real up front: a slot is only ever read after it has been written.
    key_mask = slots[None, :] >= pad_lens[:, None]  # [B, P + max_new_tokens]
    positions = (slots[None, :] - pad_lens[:, None]).clamp(min=0)  # [B, P + max_new_tokens]
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)

    cache = KVCache(model.args, batch, total_len, dtype, device)
    logits = model(input_ids, positions[:, :max_prompt_len], key_mask[:, :max_prompt_len], cache, 0)[:, -1]
    tokens_by_step, logprobs_by_step = [], []
    done = torch.zeros(batch, dtype=torch.bool, device=device)  # [B]
    num_generated = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
    for step in range(params.max_new_tokens):
        token, logprob = sample_next(logits, params, generators)  # [B], [B]
        num_generated += (~done).long()
        tokens_by_step.append(token)
        logprobs_by_step.append(logprob)
        done |= torch.isin(token, stop_ids)
        if step + 1 == params.max_new_tokens or bool(done.all()):
            break
        slot = max_prompt_len + step
        step_logits = model(
            token[:, None], positions[:, slot : slot + 1], key_mask[:, : slot + 1], cache, slot
        )
        logits = step_logits[:, -1]  # [B, V]
    tokens = torch.stack(tokens_by_step, dim=1).cpu()  # [B, steps]
    logprobs = torch.stack(logprobs_by_step, dim=1).cpu()  # [B, steps]
    return [
        _finish(tokens[row, :count], logprobs[row, :count], params)
        for row, count in enumerate(num_generated.tolist())
    ]


def _finish(token_ids: torch.Tensor, logprobs: torch.Tensor, params: SamplingParams) -> Generation:
    stopped = len(token_ids) > 0 and int(token_ids[-1]) in params.stop_token_ids
    return Generation(token_ids.clone(), logprobs.clone(), "stop" if stopped else "length")


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits [B, V]; returns (tokens int64 [B], logprobs float32 [B]).

    Row i uses only generators[i] (a CPU generator), drawing exactly one uniform per call when sampling.
    """
    logits = logits.float()
    temperature = params.temperature if params.temperature > 0 else 1.0
    scaled = logits / temperature  # [B, V]
    if params.temperature == 0:
        tokens = scaled.argmax(dim=-1)
    else:
        filtered = top_k_top_p_filter(scaled, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1)  # [B, V]
        uniforms = torch.cat([torch.rand(1, generator=generator) for generator in generators])
        tokens = _inverse_cdf_sample(probs, uniforms.to(probs.device))
    logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def top_k_top_p_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and then outside the top-p nucleus; logits [B, V].

    The nucleus is the smallest prefix of tokens sorted by probability (renormalized after top-k) whose
    mass reaches top_p: a token is kept when the mass strictly before it is below top_p, so the most likely
    token always survives. top_k=0 and top_p=1.0 turn the respective filter off.
    """
    vocab_size = logits.shape[-1]
    if (top_k <= 0 or top_k >= vocab_size) and top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    if 0 < top_k < vocab_size:
        sorted_logits[..., top_k:] = float("-inf")
    if top_p < 1.0:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i takes the first token whose cumulative probability exceeds uniforms[i] * total; probs [B, V]."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    targets = uniforms * cdf[:, -1]  # [B]
    tokens = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(-1)
    # Rounding can push the target to the total; fall back to the last token that has probability.
    last_kept = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(tokens, last_kept)
