"""RolloutEngine: continuous batching over a fixed pool of sequence slots with a preallocated KV cache.

```
 add(Request: prompt, n seeds, params) ──▶ waiting (FIFO)
 step():
   admit   : while the head request's n samples fit in free slots: take the n lowest free slots.
             Prefill all admitted prompts together ONCE (right-padded, causal) into a scratch cache, copy
             each prompt's KV into its n slots (shared prefill), draw every sample's first token.
   decode  : one token for every running slot: input = its last token, written at its own cache position
             (per-row offsets), attending only its own slot's keys.
   finish  : a sample that hits a stop token / stop string / max_new_tokens frees its slot at once; the
             next step's admit hands the slot to a waiting request.
   compact : once fewer than half the slots below hi run, the running samples move into the lowest slots
             (cache rows and state copied once), so a long tail decodes a small contiguous batch.
   returns the Completions finished in this step
```

Cache layout: contiguous per slot - per layer k, v [num_slots, K, max_seq_len, D] (the model's `KVCache`), in
the weights' dtype on an accelerator and fp32 on a CPU (`cache_dtype`).
A slot's sequence always starts at cache position 0, so cache position == RoPE position. Free slots are
handed out lowest index first and decode runs over the slot range [0, hi) with hi = highest running slot
+ 1, as one view of the cache (no gather, no copy); idle slots inside the range compute a harmless garbage
row (they write only at their position 0 and their output is dropped). Keys are read up to the longest
running sequence, S = max length + 1, with a causal per-row mask.

Shape letters: G prompts prefilled together, P longest of them, R sample rows, B decode rows (slot range
[0, hi)), S key slots read, H hidden size, V vocabulary.

Tensor parallelism (issue 3's layouts) touches only `_forward_last`: the model's `hidden_states` and its LM
head. Everything else - slots, cache bookkeeping, sampling - is per rank identical, driven by the same
host-side decisions on every rank of a TP group, and sees full-vocabulary logits.

Vision models (qwen2_5_vl): a request may carry images (`Request.images`: the dock's uint8 patches and grid).
The prefill runs the vision tower over the admitted prompts' images and computes with multimodal positions
(models/vision.py `mrope_positions`: 3 streams, an image's tokens placed on its grid); each slot keeps its
prompt's rope delta, and a decoded token at cache position c has position c + delta in all three streams.
So cache position == RoPE position holds for text models only.

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
from dockrl.models.vision import Images, VisionInputs

_IDLE = SamplingParams(max_new_tokens=1, temperature=0.0)
# Move the running samples into the lowest slots once fewer than this share of the rows [0, hi) run: one copy
# of the movers' written cache rows, after which every decode step reads only running rows (decoding all of
# [0, hi) would attend idle rows' keys at every step; a gather per step would copy the running rows each time).
COMPACT_BELOW = 0.5


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
        num_slots: sequences decoded at once (the preallocated cache holds this many).
        max_seq_len: cache positions per slot; a request needs len(prompt) + max_new_tokens of them.
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
        vision: VisionInputs | None = None,
    ) -> None:
        limit = model.args.max_position_embeddings
        if num_slots < 1:
            raise ValueError(f"rollout engine num_slots={num_slots} must be >= 1")
        if not 1 <= max_seq_len <= limit:
            raise ValueError(
                f"rollout engine max_seq_len={max_seq_len} must be in [1, max_position_embeddings={limit}]"
            )
        self.model, self.num_slots, self.max_seq_len = model, num_slots, max_seq_len
        self.pad_token_id, self.detokenize = pad_token_id, detokenize
        if (vision is None) != (model.args.vision is None):
            raise ValueError(
                f"rollout engine: model family={model.args.family!r} with vision inputs={vision is not None}; a "
                "vision model needs them (VisionInputs.for_model) and a text model takes none"
            )
        self.vision = vision
        # MoE: each Generation carries the experts its tokens were routed to (routing replay, routing stats).
        self.record_routes = record_routes and model.args.is_moe
        self.moe_layers = model.args.moe_layers
        weight = model.output_weight()
        self.device, self.dtype = weight.device, weight.dtype
        self.cache_dtype = cache_dtype(self.dtype, self.device)
        self.cache = KVCache(model.args, num_slots, max_seq_len, self.cache_dtype, self.device)
        self.waiting: deque[Request] = deque()
        self.free: list[int] = list(range(num_slots))  # a heap: lowest slot first keeps `hi` small
        self.running: list[_Running | None] = [None] * num_slots
        # Per-slot device state; idle slots keep length 0 so their garbage writes stay in bounds.
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # [num_slots]
        self.pending = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # last drawn token
        self.seeds = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.steps = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # tokens drawn so far
        self.active = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # 1 = running
        # Vision models: RoPE position - cache position of each slot's decoded tokens (its prompt's rope delta)
        self.rope_deltas = torch.zeros(num_slots, dtype=torch.long, device=self.device)
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
        if params.stop_strings and self.detokenize is None:
            raise ValueError(f"request {request.tag!r} has stop_strings but the engine has no detokenize")
        if request.images is not None and len(request.images[1]) and self.vision is None:
            raise ValueError(f"request {request.tag!r} has images but the model has no vision tower")
        self.waiting.append(request)

    def has_work(self) -> bool:
        """True while a request is waiting or a sample is running."""
        return bool(self.waiting) or len(self.free) < self.num_slots

    def num_free_slots(self) -> int:
        """Slots not running and not claimed by waiting requests: room for new requests to start now."""
        return len(self.free) - sum(len(request.seeds) for request in self.waiting)

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
        while self.waiting and len(self.waiting[0].seeds) <= len(self.free):
            request = self.waiting.popleft()
            slots = [heapq.heappop(self.free) for _ in request.seeds]
            admitted.append((request, slots))
        if not admitted:
            return []
        row_slots = [slot for _, slots in admitted for slot in slots]
        row_prompt = [i for i, (_, slots) in enumerate(admitted) for _ in slots]
        with self._routes() as seen:
            logits, deltas = self._prefill([request for request, _ in admitted], row_slots, row_prompt)
        for g, (request, slots) in enumerate(admitted):
            prefix = self._layer_routes(seen, g, len(request.prompt_ids)) if seen is not None else None
            for sample, slot in enumerate(slots):
                self.running[slot] = _Running(request, sample, len(request.prompt_ids))
                if prefix is not None:
                    self.running[slot].routes.append(prefix)  # type: ignore[union-attr]
        index = torch.tensor(row_slots, device=self.device)  # [R]
        self.lengths[index] = torch.tensor(
            [len(admitted[i][0].prompt_ids) for i in row_prompt], device=self.device
        )
        self.seeds[index] = torch.tensor(
            [r.seeds[s] for r, slots in admitted for s in range(len(slots))], device=self.device
        )
        self.steps[index] = 0
        self.active[index] = 1
        self.rope_deltas[index] = torch.tensor([deltas[i] for i in row_prompt], device=self.device)
        self._settings = None
        settings = RowSettings.build([admitted[i][0].params for i in row_prompt], self.device)
        row_logits = logits[torch.tensor(row_prompt, device=self.device)]  # [R, V]
        tokens, logprobs = sample_rows(row_logits, settings, self.seeds[index], self.steps[index])
        self.pending[index] = tokens
        self.steps[index] += 1
        return self._record(row_slots, tokens.tolist(), logprobs.tolist())

    def _prefill(
        self, requests: list[Request], row_slots: list[int], row_prompt: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """Run each prompt once, copy its KV into the slots of its samples; returns last logits [G, V] and each
        prompt's rope delta (0 for text)."""
        prompts = [request.prompt_ids for request in requests]
        num_prompts, longest = len(prompts), max(len(prompt) for prompt in prompts)
        ids = torch.full((num_prompts, longest), self.pad_token_id, dtype=torch.long)  # [G, P]
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        # Right padding: pads sit after every real token, so causal attention alone keeps them unseen.
        scratch = KVCache(self.model.args, num_prompts, longest, self.cache_dtype, self.device)
        last = torch.tensor([len(prompt) - 1 for prompt in prompts], device=self.device)  # [G]
        positions, images, deltas = self._multimodal(requests, ids)
        logits = self._forward_last(ids.to(self.device), positions, None, scratch, 0, last, images)  # [G, V]
        slots = torch.tensor(row_slots, device=self.device)  # [R]
        sources = torch.tensor(row_prompt, device=self.device)  # [R]
        for layer in range(len(self.cache.k)):
            self.cache.k[layer][slots, :, :longest] = scratch.k[layer][sources]
            self.cache.v[layer][slots, :, :longest] = scratch.v[layer][sources]
        self.stats["prefill_calls"] += 1
        self.stats["prefill_prompts"] += num_prompts
        return logits, deltas

    def _multimodal(
        self, requests: list[Request], ids: torch.Tensor
    ) -> tuple[torch.Tensor | None, Images | None, list[int]]:
        """A vision model's prefill inputs: positions [3, G, P] (a prompt's right padding continues its text
        positions; never attended), the prompts' images in row order, each prompt's rope delta. Text
        models: (None, None, zeros)."""
        if self.vision is None:
            return None, None, [0] * len(requests)
        empty = (torch.zeros(0, self.vision.processor.patch_dim, dtype=torch.uint8), torch.zeros(0, 3))
        rows = [request.images if request.images is not None else empty for request in requests]
        positions = torch.zeros(3, *ids.shape, dtype=torch.long)
        deltas = []
        for row, (request, (_, grid)) in enumerate(zip(requests, rows)):
            length = len(request.prompt_ids)
            row_positions, delta = self.vision.positions(ids[row, :length], grid)
            positions[:, row, :length] = row_positions
            positions[:, row, length:] = torch.arange(length, ids.shape[1]) + delta
            deltas.append(delta)
        return positions.to(self.device), self.vision.images(rows, self.device), deltas

    def _forward_last(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        key_mask: torch.Tensor | None,
        cache: KVCache,
        cache_offset: int | torch.Tensor,
        last: torch.Tensor | None,
        images: Images | None = None,
    ) -> torch.Tensor:
        """The one model call: hidden states, then LM-head logits of token `last[b]` of each row -> [B, V].

        last=None takes the final token. Only these rows go through the LM head (the prefill's other
        positions never need logits). A tensor-parallel model plugs in here.
        """
        if isinstance(cache_offset, torch.Tensor):  # decode: each row at its own length (continuous batching)
            assert key_mask is not None, "decode masks the keys of each row"
            hidden = self.model.hidden_states_per_row(input_ids, cache, cache_offset, key_mask, position_ids)
        else:  # prefill: the rows of one prompt's samples at the same offset
            hidden = self.model.hidden_states(
                input_ids, position_ids, key_mask, cache, cache_offset, images=images
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
                offsets[:, None] if self.vision is None else (offsets + self.rope_deltas[:hi])[:, None],
                self._all_keys[:hi, :num_keys],
                self.cache.rows(hi),
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
        below n, with its cache rows (the positions it has written), its device state and its host state.
        Returns the new running slots [0, n). A sample's tokens do not depend on its slot (see `sampling`)."""
        count = len(slots)
        movers = [slot for slot in slots if slot >= count]
        targets = [slot for slot in range(count) if self.running[slot] is None]  # as many as movers
        source = torch.tensor(movers, device=self.device)
        dest = torch.tensor(targets, device=self.device)
        written = max(self._state(slot).length for slot in movers)
        for layer in range(len(self.cache.k)):
            self.cache.k[layer][dest, :, :written] = self.cache.k[layer][source, :, :written]
            self.cache.v[layer][dest, :, :written] = self.cache.v[layer][source, :, :written]
        for state in (self.lengths, self.pending, self.seeds, self.steps, self.active, self.rope_deltas):
            state[dest] = state[source]
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

    def _release(self, slot: int, reason: str) -> Completion:
        state = self._state(slot)
        self.running[slot] = None
        heapq.heappush(self.free, slot)
        self.active[slot] = 0
        self.lengths[slot] = 0
        self.steps[slot] = 0
        self.rope_deltas[slot] = 0
        self._settings = None
        generation = Generation(
            torch.tensor(state.token_ids, dtype=torch.long),
            torch.tensor(state.logprobs, dtype=torch.float32),
            reason,
            torch.cat(state.routes) if self.record_routes else None,
        )
        return Completion(state.request.tag, state.sample, generation)
