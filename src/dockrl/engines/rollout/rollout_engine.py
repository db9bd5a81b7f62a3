"""RolloutEngine: continuous batching over a fixed pool of sequence slots with a paged KV cache.

```
 add(Request: prompt, n seeds, params) ──▶ waiting (FIFO; preempted samples re-enter at the front)
 step():
   admit   : while the head request's n samples fit in free slots AND the blocks of their prompts (+ the
             first decoded position) can be allocated: take the n lowest free slots and those blocks.
             Prefill all admitted prompts together ONCE (right-padded, causal) into a scratch cache, copy
             each prompt's KV into the blocks of its n samples (shared prefill), draw every first token.
   grow    : a running sample whose next position starts a new block gets one; when none can be had, the
             youngest running sample is preempted: its blocks are freed and it re-queues (to restart from
             its prompt: its tokens are a function of (prompt, seed), so it draws the same ones again).
   decode  : one token for every running slot: input = its last token, written at its own position
             through its block table, attending only its own blocks.
   finish  : a sample that hits a stop token / stop string / max_new_tokens frees its slot and its blocks
             at once; the next step's admit hands them to a waiting request.
   compact : once fewer than half the slots below hi run, the running samples move into the lowest slots
             (their block-table rows and state; no KV is copied), so a long tail decodes a small batch.
   returns the Completions finished in this step
```

Cache layout: paged (models/paged_cache.py) - per layer k, v [K, num_blocks, BLOCK_SIZE, D], in the weights'
dtype on an accelerator and fp32 on a CPU (`cache_dtype`); a slot's block-table row lists its blocks in
position order. A sequence holds ceil(length / BLOCK_SIZE) blocks, not max_seq_len positions: the pool holds
what the running sequences use, grown by doubling up to `kv_cache_tokens` (default: every slot's worst case,
num_slots x max_seq_len, so nothing ever waits for blocks; set lower, samples wait or are preempted instead).
A slot's sequence always starts at position 0, so cache position == RoPE position. Free slots are handed out
lowest index first and decode runs over the slot range [0, hi) with hi = highest running slot + 1; idle slots
inside the range compute a harmless garbage row (their block-table row points at the scratch block 0, where
they write at position 0; their output is dropped). Each step gathers the rows' first ceil(S / BLOCK_SIZE)
blocks, S = longest running sequence + 1 keys, with a causal per-row mask.

Shape letters: G prompts prefilled together, P longest of them, R sample rows, B decode rows (slot range
[0, hi)), S key slots read, H hidden size, V vocabulary.

Tensor parallelism (issue 3's layouts) touches only `_forward_last`: the model's `hidden_states` and its LM
head. Everything else - slots, cache bookkeeping, sampling - is per rank identical, driven by the same
host-side decisions on every rank of a TP group, and sees full-vocabulary logits.

Seeds: each sample carries its own seed; the uniform of its t-th token is a pure function of (seed, t)
(see `sampling.counter_uniforms`), so results do not depend on the batch or on arrival order.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from dockrl.engines.rollout.sampling import RowSettings, SamplingParams, sample_rows
from dockrl.models.decoder import KVCache, Transformer
from dockrl.models.moe import Routing, routing
from dockrl.models.paged_cache import PagedKVCache

_IDLE = SamplingParams(max_new_tokens=1, temperature=0.0)
# Move the running samples into the lowest slots once fewer than this share of the rows [0, hi) run: one copy
# of the movers' written cache rows, after which every decode step reads only running rows (decoding all of
# [0, hi) would attend idle rows' keys at every step; a gather per step would copy the running rows each time).
COMPACT_BELOW = 0.5
# Positions per KV block: a sequence wastes under one block (its last one's unwritten tail); larger blocks mean
# fewer, longer contiguous runs for the per-step gather (32 fp32 positions x D = 32: 4 KiB per key head).
BLOCK_SIZE = 32


def blocks_for(positions: int) -> int:
    """KV blocks that hold `positions` positions."""
    return -(-positions // BLOCK_SIZE)


def cache_dtype(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the weights' on an accelerator; fp32 on a CPU, where a bf16 cache makes decode
    attention slower, not faster (its key slices are strided, and the CPU's bf16 batched matmul copies each
    one first; fp32 reads them in place), while the cache stays small there."""
    return torch.float32 if device.type == "cpu" else weight_dtype


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


class RolloutEngine:
    """Continuous-batching sampler on a dockrl `Transformer` (see the module docstring).

    Lifecycle: build once per model and cache size; `add` requests at any time; call `step` (or iterate
    `run`) until `has_work()` is False. The cache persists across requests; weights may change between
    steps only when no request is running (e.g. after a rollout phase).

    Args:
        model: the rollout model (eval mode; its parameter dtype/device set the cache's).
        num_slots: sequences decoded at once.
        max_seq_len: positions per sequence; a request needs len(prompt) + max_new_tokens of them.
        kv_cache_tokens: positions the paged cache may hold over all sequences (rounded up to whole blocks);
            0: num_slots x max_seq_len, every slot's worst case. The cache grows to it as sequences need.
        pad_token_id: token id used to right-pad prompts prefilled together (never attended to).
        detokenize: token ids -> text, needed only for requests with stop strings.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        num_slots: int,
        max_seq_len: int,
        pad_token_id: int = 0,
        detokenize: Callable[[list[int]], str] | None = None,
        record_routes: bool = False,
        kv_cache_tokens: int = 0,
    ) -> None:
        limit = model.args.max_position_embeddings
        if num_slots < 1:
            raise ValueError(f"rollout engine num_slots={num_slots} must be >= 1")
        if not 1 <= max_seq_len <= limit:
            raise ValueError(
                f"rollout engine max_seq_len={max_seq_len} must be in [1, max_position_embeddings={limit}]"
            )
        if kv_cache_tokens < 0:
            raise ValueError(
                f"rollout engine kv_cache_tokens={kv_cache_tokens} must be >= 0 (0: the worst case)"
            )
        self.model, self.num_slots, self.max_seq_len = model, num_slots, max_seq_len
        self.pad_token_id, self.detokenize = pad_token_id, detokenize
        # MoE: each Generation carries the experts its tokens were routed to (routing replay, routing stats).
        self.record_routes = record_routes and model.args.is_moe
        self.moe_layers = model.args.moe_layers
        weight = model.output_weight()
        self.device, self.dtype = weight.device, weight.dtype
        self.cache_dtype = cache_dtype(self.dtype, self.device)
        # Default: every slot's worst case, in whole blocks.
        max_blocks = blocks_for(kv_cache_tokens) if kv_cache_tokens else num_slots * blocks_for(max_seq_len)
        self.kv_cache_tokens = kv_cache_tokens or max_blocks * BLOCK_SIZE
        self.cache = PagedKVCache(
            model.args, BLOCK_SIZE, min(max_blocks, num_slots), max_blocks, self.cache_dtype, self.device
        )
        # Each slot's blocks in position order (host), and as a table the decode reads (device; 0 = scratch).
        self.blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self.block_table = torch.zeros(
            num_slots, blocks_for(max_seq_len), dtype=torch.long, device=self.device
        )
        self._admissions = 0
        self.waiting: deque[tuple[Request, list[int]]] = deque()  # a request and which of its samples to draw
        self.free: list[int] = list(range(num_slots))  # a heap: lowest slot first keeps `hi` small
        self.running: list[_Running | None] = [None] * num_slots
        # Per-slot device state; idle slots keep length 0 so their garbage writes stay in bounds.
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # [num_slots]
        self.pending = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # last drawn token
        self.seeds = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.steps = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # tokens drawn so far
        self.active = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # 1 = running
        self._all_keys = torch.ones(num_slots, max_seq_len, dtype=torch.bool, device=self.device)
        self._settings: RowSettings | None = None  # of the decoded rows, rebuilt when they change
        self._settings_key: int | None = None  # the hi they were built for
        self.stats = {
            "prefill_calls": 0,
            "prefill_prompts": 0,
            "decode_steps": 0,
            "decode_rows": 0,
            "compactions": 0,  # times the running samples were moved into the lowest slots
            "moved_rows": 0,  # samples moved by those
            "preempted": 0,  # samples sent back to the queue for want of KV blocks
        }

    # ---- public API ------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; raises ValueError (naming the limit) when it can never fit."""
        num_samples, prompt_len = len(request.seeds), len(request.prompt_ids)
        params = request.params
        if prompt_len == 0:
            raise ValueError(f"request {request.tag!r} has an empty prompt; every prompt needs a token")
        if not 1 <= num_samples <= self.num_slots:
            raise ValueError(
                f"request {request.tag!r} asks for {num_samples} samples; use 1 to num_slots={self.num_slots}"
            )
        needed = prompt_len + params.max_new_tokens
        if needed > self.max_seq_len:
            model_limit = self.model.args.max_position_embeddings
            which = (
                f" = the model's max_position_embeddings={model_limit}"
                if model_limit == self.max_seq_len
                else ""
            )
            raise ValueError(
                f"request {request.tag!r}: prompt of {prompt_len} tokens + max_new_tokens="
                f"{params.max_new_tokens} = {needed} exceeds the cache limit max_seq_len={self.max_seq_len}"
                f"{which} tokens per sequence; shorten the prompt or lower max_new_tokens"
            )
        if blocks_for(needed) > self.cache.max_blocks:
            raise ValueError(
                f"request {request.tag!r}: prompt of {prompt_len} tokens + max_new_tokens="
                f"{params.max_new_tokens} = {needed} positions exceed the KV cache's "
                f"kv_cache_tokens={self.kv_cache_tokens} (rollout.kv_cache_tokens, in blocks of {BLOCK_SIZE}): "
                "one sequence must fit; raise kv_cache_tokens to at least "
                f"{blocks_for(needed) * BLOCK_SIZE} or lower max_new_tokens"
            )
        if params.stop_strings and self.detokenize is None:
            raise ValueError(f"request {request.tag!r} has stop_strings but the engine has no detokenize")
        self.waiting.append((request, list(range(num_samples))))

    def has_work(self) -> bool:
        """True while a request is waiting or a sample is running."""
        return bool(self.waiting) or len(self.free) < self.num_slots

    def num_free_slots(self) -> int:
        """Slots not running and not claimed by waiting requests: room for new requests to start now."""
        return len(self.free) - sum(len(samples) for _, samples in self.waiting)

    def kv_cache_bytes(self) -> dict[str, int]:
        """The KV cache's bytes: allocated now, held by sequences at the peak so far, and what max-length slots
        (num_slots x max_seq_len positions, the cache before paging) would take."""
        per_position = self.cache.block_bytes() // BLOCK_SIZE
        return {
            "allocated": self.cache.nbytes(),
            "peak_used": self.cache.peak_used * self.cache.block_bytes(),
            "max_length_slots": self.num_slots * self.max_seq_len * per_position,
        }

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, full tensor) pairs into the model's parameters (RolloutBackend.load_weights); raises
        ValueError naming a parameter the model lacks or a shape that differs. Only while nothing runs. The
        colocated switch and the replicas point parameters at their bucket buffers instead (no copy)."""
        if self.has_work():
            raise RuntimeError("rollout engine: load_weights while requests run; finish them first")
        params = dict(self.model.named_parameters())
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"rollout engine: load_weights got {name!r}, which the model does not have")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"rollout engine: load_weights got {name!r} of shape {tuple(tensor.shape)}; "
                    f"the model's is {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)

    @torch.no_grad()
    def step(self) -> list[Completion]:
        """Admit what fits, then decode one token for every running sample; returns samples finished."""
        finished = self._admit()
        if len(self.free) < self.num_slots:
            finished += self._decode()
        return finished

    def run(self) -> Iterator[Completion]:
        """Step until every queued request is complete, yielding samples as they finish."""
        while self.has_work():
            yield from self.step()

    # ---- admission and shared prefill -----------------------------------------------------------

    def _admit(self) -> list[Completion]:
        admitted: list[tuple[Request, list[int]]] = []
        samples_of: list[list[int]] = []
        while self.waiting and len(self.waiting[0][1]) <= len(self.free):
            request, samples = self.waiting[0]
            # Each sample's blocks: the prompt's positions and the first decoded token's. Samples that find no
            # blocks wait at the head of the queue (with a small pool, a group starts as blocks free up).
            num_blocks = blocks_for(len(request.prompt_ids) + 1)
            count = min(len(samples), self.cache.num_obtainable() // num_blocks)
            if count == 0:
                break
            if count == len(samples):
                self.waiting.popleft()
            else:
                self.waiting[0] = (request, samples[count:])
            slots = [heapq.heappop(self.free) for _ in range(count)]
            for slot in slots:
                self._grant(slot, num_blocks)
            admitted.append((request, slots))
            samples_of.append(samples[:count])
        if not admitted:
            return []
        row_slots = [slot for _, slots in admitted for slot in slots]
        row_prompt = [i for i, (_, slots) in enumerate(admitted) for _ in slots]
        prompts = [request.prompt_ids for request, _ in admitted]
        with self._routes() as seen:
            logits = self._prefill(prompts, row_slots, row_prompt)
        for g, (request, slots) in enumerate(admitted):
            prefix = self._layer_routes(seen, g, len(request.prompt_ids)) if seen is not None else None
            for sample, slot in zip(samples_of[g], slots):
                self._admissions += 1
                self.running[slot] = _Running(request, sample, len(request.prompt_ids), self._admissions)
                if prefix is not None:
                    self.running[slot].routes.append(prefix)  # type: ignore[union-attr]
        index = torch.tensor(row_slots, device=self.device)  # [R]
        self.lengths[index] = torch.tensor(
            [len(admitted[i][0].prompt_ids) for i in row_prompt], device=self.device
        )
        self.seeds[index] = torch.tensor(
            [r.seeds[s] for (r, _), samples in zip(admitted, samples_of) for s in samples], device=self.device
        )
        self.steps[index] = 0
        self.active[index] = 1
        self._settings = None
        settings = RowSettings.build([admitted[i][0].params for i in row_prompt], self.device)
        row_logits = logits[torch.tensor(row_prompt, device=self.device)]  # [R, V]
        tokens, logprobs = sample_rows(row_logits, settings, self.seeds[index], self.steps[index])
        self.pending[index] = tokens
        self.steps[index] += 1
        return self._record(row_slots, tokens.tolist(), logprobs.tolist())

    def _grant(self, slot: int, count: int) -> None:
        """Append `count` new blocks to `slot`'s (callers check they can be had)."""
        start = len(self.blocks[slot])
        self.blocks[slot] += self.cache.allocate(count)
        self.block_table[slot, start : start + count] = torch.tensor(self.blocks[slot][start:])

    def _prefill(self, prompts: list[list[int]], row_slots: list[int], row_prompt: list[int]) -> torch.Tensor:
        """Run each prompt once, copy its KV into the blocks of its samples; returns last logits [G, V]."""
        num_prompts, longest = len(prompts), max(len(prompt) for prompt in prompts)
        ids = torch.full((num_prompts, longest), self.pad_token_id, dtype=torch.long)  # [G, P]
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        # Right padding: pads sit after every real token, so causal attention alone keeps them unseen.
        scratch = KVCache(self.model.args, num_prompts, longest, self.cache_dtype, self.device)
        last = torch.tensor([len(prompt) - 1 for prompt in prompts], device=self.device)  # [G]
        logits = self._forward_last(ids.to(self.device), None, None, scratch, 0, last)  # [G, V]
        # Every prompt position p of every sample row: (its block, offset in the block) <- (prompt, position).
        sources: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        for slot, g in zip(row_slots, row_prompt):
            length = len(prompts[g])
            sources += [g] * length
            positions += range(length)
            blocks += [self.blocks[slot][p // BLOCK_SIZE] for p in range(length)]
        source = torch.tensor(sources, device=self.device)  # [R P']
        position = torch.tensor(positions, device=self.device)
        block = torch.tensor(blocks, device=self.device)
        offset = position % BLOCK_SIZE
        for layer in range(len(self.cache.k)):
            self.cache.k[layer][:, block, offset] = scratch.k[layer][source, :, position].transpose(0, 1)
            self.cache.v[layer][:, block, offset] = scratch.v[layer][source, :, position].transpose(0, 1)
        self.stats["prefill_calls"] += 1
        self.stats["prefill_prompts"] += num_prompts
        return logits

    def _forward_last(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        key_mask: torch.Tensor | None,
        cache: KVCache | PagedKVCache,
        cache_offset: int | torch.Tensor,
        last: torch.Tensor | None,
    ) -> torch.Tensor:
        """The one model call: hidden states, then LM-head logits of token `last[b]` of each row -> [B, V].

        last=None takes the final token. Only these rows go through the LM head (the prefill's other
        positions never need logits). A tensor-parallel model plugs in here.
        """
        if isinstance(cache_offset, torch.Tensor):  # decode: each row at its own length (continuous batching)
            assert key_mask is not None and isinstance(cache, PagedKVCache), (
                "decode: paged, keys masked per row"
            )
            table = self.block_table[: input_ids.shape[0]]
            hidden = self.model.hidden_states_per_row(
                input_ids, cache, cache_offset, table, key_mask, position_ids
            )
        else:  # prefill: the rows of one prompt's samples at the same offset
            assert isinstance(cache, KVCache), "prefill fills a contiguous scratch cache"
            hidden = self.model.hidden_states(
                input_ids, position_ids, key_mask, cache, cache_offset
            )  # [B, T, H]
        if last is None:
            picked = hidden[:, -1]
        else:
            picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [B, H]
        return self.model.lm_logits(picked)  # full vocabulary, also for a tensor-parallel model

    # ---- decode ----------------------------------------------------------------------------------

    def _decode(self) -> list[Completion]:
        """One token for every running sample, as one batch over the slot range [0, hi). Once fewer than
        COMPACT_BELOW of the slots below hi are running, `_compact` first moves the running samples into the
        lowest slots, so a long tail of a few late samples does not pay for the idle slots between them."""
        self._grow()
        slots = [slot for slot, state in enumerate(self.running) if state is not None]
        if len(slots) < COMPACT_BELOW * (slots[-1] + 1):
            slots = self._compact(slots)
        hi = slots[-1] + 1
        num_keys = max(self._state(slot).length for slot in slots) + 1
        if self._settings is None or self._settings_key != hi:
            params = [_IDLE if state is None else state.request.params for state in self.running[:hi]]
            self._settings, self._settings_key = RowSettings.build(params, self.device), hi
        offsets = self.lengths[:hi]
        with self._routes() as seen:
            logits = self._forward_last(
                self.pending[:hi][:, None],
                offsets[:, None],
                self._all_keys[:hi, :num_keys],
                self.cache,
                offsets,
                None,
            )  # [B, V]
        if seen is not None:
            for slot in slots:
                self._state(slot).routes.append(self._layer_routes(seen, slot, 1))
        tokens, logprobs = sample_rows(logits, self._settings, self.seeds[:hi], self.steps[:hi])
        self.lengths[:hi] += self.active[:hi]
        self.steps[:hi] += self.active[:hi]
        self.pending[:hi] = tokens
        for slot in slots:
            self._state(slot).length += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(slots)
        host_tokens, host_logprobs = tokens.tolist(), logprobs.tolist()
        return self._record(slots, [host_tokens[s] for s in slots], [host_logprobs[s] for s in slots])

    def _compact(self, slots: list[int]) -> list[int]:
        """Move the running samples `slots` into slots [0, n), n = len(slots): each one above n takes a free slot
        below n, with its blocks (block-table row; the KV stays where it is), its device state and its host
        state. Returns the new running slots [0, n). A sample's tokens do not depend on its slot (`sampling`)."""
        count = len(slots)
        movers = [slot for slot in slots if slot >= count]
        targets = [slot for slot in range(count) if self.running[slot] is None]  # as many as movers
        source = torch.tensor(movers, device=self.device)
        dest = torch.tensor(targets, device=self.device)
        for state in (self.lengths, self.pending, self.seeds, self.steps, self.active, self.block_table):
            state[dest] = state[source]
        self.block_table[source] = 0  # an idle row points at the scratch block only (it may write there)
        for old, new in zip(movers, targets):
            self.blocks[new], self.blocks[old] = self.blocks[old], []
        self.active[source] = 0
        self.lengths[source] = 0  # idle slots write only at position 0 (see the module docstring)
        self.steps[source] = 0
        for old, new in zip(movers, targets):
            self.running[new], self.running[old] = self.running[old], None
        self.free = [slot for slot in self.free if slot >= count] + movers
        heapq.heapify(self.free)
        self._settings = None
        self.stats["compactions"] += 1
        self.stats["moved_rows"] += len(movers)
        return list(range(count))

    # ---- MoE routes ------------------------------------------------------------------------------

    @contextmanager
    def _routes(self) -> Iterator[Routing | None]:
        """Record the MoE layers' experts for the forward inside (None when the engine records none)."""
        if not self.record_routes:
            yield None
            return
        with routing(self.model, Routing(record=True)) as seen:
            yield seen

    def _layer_routes(self, seen: Routing, row: int, count: int) -> torch.Tensor:
        """Row `row`'s first `count` positions' experts across the MoE layers: int16 [count, L, k] (CPU)."""
        per_layer = [seen.recorded[layer][row, :count] for layer in self.moe_layers]
        return torch.stack(per_layer, dim=1).to("cpu", torch.int16)

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _record(self, slots: list[int], tokens: list[int], logprobs: list[float]) -> list[Completion]:
        """Append one drawn token per slot; finish (and free) the samples that are done."""
        finished: list[Completion] = []
        for slot, token, logprob in zip(slots, tokens, logprobs):
            state = self._state(slot)
            state.token_ids.append(token)
            state.logprobs.append(logprob)
            reason = self._finish_reason(state)
            if reason is not None:
                finished.append(self._release(slot, reason))
        return finished

    def _finish_reason(self, state: _Running) -> str | None:
        params = state.request.params
        if state.token_ids[-1] in params.stop_token_ids:
            return "stop"
        if params.stop_strings and self._completes_stop_string(state.token_ids, params.stop_strings):
            return "stop"
        if len(state.token_ids) >= params.max_new_tokens:
            return "length"
        return None

    def _completes_stop_string(self, token_ids: list[int], stop_strings: list[str]) -> bool:
        """True when the newest token completes a stop string (checked after every token, so the first
        match is always the newest token's). The window covers a stop string even if every character
        of it were split over 4 byte-level tokens."""
        window = 4 * max(len(s) for s in stop_strings) + 1
        assert self.detokenize is not None  # `add` refuses stop strings without it
        text = self.detokenize(token_ids[-window:])
        return any(s in text for s in stop_strings)

    def _state(self, slot: int) -> _Running:
        """The sample running in `slot` (callers pass running slots only)."""
        state = self.running[slot]
        assert state is not None, f"slot {slot} is not running"
        return state

    def _grow(self) -> None:
        """Give every running sample whose next position starts a new block that block, preempting the youngest
        running sample while none is left (it may be the one asking; one sample alone always fits: `add`)."""
        for slot, state in enumerate(self.running):
            if state is None or len(self.blocks[slot]) > state.length // BLOCK_SIZE:
                continue
            while self.cache.num_obtainable() == 0 and self.running[slot] is not None:
                youngest = max(
                    (s for s, other in enumerate(self.running) if other is not None),
                    key=lambda s: self._state(s).admitted,
                )
                self._preempt(youngest)
            if self.running[slot] is not None:
                self._grant(slot, 1)

    def _preempt(self, slot: int) -> None:
        """Free `slot` and its blocks; its sample goes back to the front of the queue, to start over."""
        state = self._state(slot)
        self._vacate(slot)
        self.waiting.appendleft((state.request, [state.sample]))
        self.stats["preempted"] += 1

    def _vacate(self, slot: int) -> None:
        """The slot and its blocks become free; its device state idle (writes go to the scratch block)."""
        self.running[slot] = None
        heapq.heappush(self.free, slot)
        self.cache.release(self.blocks[slot])
        self.blocks[slot] = []
        self.block_table[slot] = 0
        self.active[slot] = 0
        self.lengths[slot] = 0
        self.steps[slot] = 0
        self._settings = None

    def _release(self, slot: int, reason: str) -> Completion:
        state = self._state(slot)
        self._vacate(slot)
        generation = Generation(
            torch.tensor(state.token_ids, dtype=torch.long),
            torch.tensor(state.logprobs, dtype=torch.float32),
            reason,
            torch.cat(state.routes) if self.record_routes else None,
        )
        return Completion(state.request.tag, state.sample, generation)
