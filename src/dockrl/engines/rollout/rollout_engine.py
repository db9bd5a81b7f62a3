"""RolloutEngine: continuous batching over a fixed pool of sequence slots, its KV cache in max-length slots or
in blocks handed out as sequences grow.

```
 add(Request: prompt, n seeds, params[, kv_key]) ──▶ waiting (FIFO; preempted samples re-enter at the front)
 step():
   admit   : a request whose kv_key has KV kept and whose prompt extends it (a later turn): its slot (and
             blocks) back; the new positions of all such requests run on top of their kept ones - with the
             native kernels inside this step's decode forward, a query row per new position (`_join`,
             `_mixed_forward`: a mixed batch, no forward of their own); without them in ONE forward of their
             own (`_prefill_suffixes`: right-padded, each row at its own offset).
             Others: while the head request's n samples fit in free slots (slots given up by kept KV, oldest
             first, count; paged: AND the blocks of their prompts + the first decoded position can be had):
             take the n lowest free slots (and those blocks). Prefill all admitted prompts together ONCE
             (right-padded, causal; requests with the same prompt share its row) into a scratch cache, copy
             each prompt's KV into its samples' slots (or blocks) (shared prefill), draw every sample's first
             token.
   grow    : paged: a running sample whose next position starts a new block gets one; when none can be had,
             kept KV is given up (oldest first), then the youngest running sample is preempted: its blocks
             are freed and it re-queues (to restart from its prompt: its tokens are a function of (prompt,
             seed), so it draws the same ones again).
   decode  : one token for every running slot: input = its last token, written at its own position (its
             slot's row, or through its block table), attending only its own keys; a joining returning turn's
             row draws its first token from its last new position instead.
   finish  : a sample that hits a stop token / stop string / max_new_tokens frees its slot (and blocks) at
             once - or, with a kv_key, keeps its KV: slots park the slot, paged keeps its blocks - and the
             next step's admit hands them to a waiting request.
   compact : once fewer than half the unparked slots below hi run, the running samples move into the lowest
             unparked slots (slots: the cache rows they wrote, copied once; paged: block-table rows, no KV),
             so a long tail decodes a small contiguous batch.
   returns the Completions finished in this step
```

Two cache layouts (`kv_cache`, rollout.kv_cache; kv_layouts.py says what each holds): slots, every slot's
worst case allocated up front and read in place, or paged, blocks handed out as sequences grow. A slot's
sequence always starts at position 0, so cache position == RoPE position for text models (vision: below). Free
slots are handed out lowest index first and decode runs over the slot range [0, hi) with hi = highest running
slot + 1; idle slots inside the range compute a harmless garbage row (they write only at their position 0, or
into the scratch block 0; a parked slot at its kept length, the position its next turn writes first; their
output is dropped). Keys are read up to the longest running sequence, S = max length + 1, with a causal
per-row mask.

Kept KV (multi-turn, engines/rollout/multi_turn.py): a request with a kv_key keeps its sample's KV when it
finishes, for a later request with the same key whose prompt extends it; how it is kept, taken back and given
up is kept_kv.py's (`KeptKV`, a base of RolloutEngine).

Vision models (qwen2_5_vl): a request may carry images (`Request.images`: the dock's uint8 patches and grid).
The prefill runs the vision tower over the admitted prompts' images and computes with multimodal positions
(models/vision.py `mrope_positions`: 3 streams, an image's tokens placed on its grid); each slot keeps its
prompt's rope delta, and a decoded token at cache position c has position c + delta in all three streams.
Both layouts hold the same keys (RoPE is applied before the cache write): the prefill fills a scratch cache
either way. Requests share a prefilled row only when their prompts and their images are the same. KV kept
across turns is for text models (multi-turn is refused for vision models, recipes/preflight.py): `add`
refuses a kv_key on a vision model.

Shape letters: G prompts prefilled together, P longest of them, R sample rows, B decode rows (slot range
[0, hi)), S key slots read, H hidden size, V vocabulary.

Tensor parallelism touches only the model calls (model_calls.py, `ModelCalls._forward_last`, a base of
RolloutEngine); everything else is per rank identical.

Seeds: each sample carries its own seed; the uniform of its t-th token is a pure function of (seed, t)
(see `sampling.counter_uniforms`), so results do not depend on the batch or on arrival order.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from dockrl.engines.rollout.kept_kv import KeptKV, _Kept
from dockrl.engines.rollout.kv_layouts import BLOCK_SIZE, blocks_for, cache_dtype, kv_layout
from dockrl.engines.rollout.model_calls import ModelCalls
from dockrl.engines.rollout.requests import Completion, Generation, Request, _Running, same_images
from dockrl.engines.rollout.sampling import RowSettings, SamplingParams, sample_rows
from dockrl.models.decoder import Transformer, natively_decodable
from dockrl.models.kv_cache import KVCache
from dockrl.models.packed_linear import PackedWeights
from dockrl.models.packed_linear import supported as packing_supported
from dockrl.models.paged_cache import PagedKVCache
from dockrl.models.vision import VisionInputs

_IDLE = SamplingParams(max_new_tokens=1, temperature=0.0)
# Move the running samples into the lowest slots once fewer than this share of the rows [0, hi) run: one copy
# of the movers' written cache rows, after which every decode step reads only running rows (decoding all of
# [0, hi) would attend idle rows' keys at every step; a gather per step would copy the running rows each time).
COMPACT_BELOW = 0.5
# Attention scores one forward over returning turns' suffixes may hold (rows x heads x T x S, fp32: 256 MiB):
# more rows than that run in several forwards, so long observations on a large batch cannot exhaust memory.
# The mixed batch (`_joins_decode`) holds its rows x S to the same bound (the additive mask it would need
# for a key mask with keys left out; the engine's masks hold every key, so none is built: DecoderModel.forward).
SUFFIX_SCORES_MAX = 2**26


def _shared_prompts(requests: list[Request]) -> tuple[list[int], list[Request]]:
    """Which prefilled row each request reads ([A] -> G) and the G requests whose prompts are prefilled: one row
    per distinct (prompt, images); two images of one size give the same prompt ids, so rows with different
    images never share."""
    rows: dict[tuple[int, ...], list[int]] = {}  # prompt -> its rows in `unique`
    unique: list[Request] = []
    prompt_of: list[int] = []
    for request in requests:
        candidates = rows.setdefault(tuple(request.prompt_ids), [])
        g = next((g for g in candidates if same_images(unique[g].images, request.images)), None)
        if g is None:
            g = len(unique)
            candidates.append(g)
            unique.append(request)
        prompt_of.append(g)
    return prompt_of, unique


class RolloutEngine(KeptKV, ModelCalls):
    """Continuous-batching sampler on a dockrl `Transformer` (see the module docstring). KV kept across turns
    (`forget`, `forget_all`) is its base KeptKV's (kept_kv.py), the model calls its base ModelCalls'
    (model_calls.py).

    Lifecycle: build once per model and cache size; `add` requests at any time; call `step` (or iterate
    `run`) until `has_work()` is False. The cache persists across requests; weights may change between
    steps only when no request is running (e.g. after a rollout phase), and KV kept for later turns must be
    dropped then (`load_weights` does; a caller swapping the weights itself calls `weights_changed`).

    Args:
        model: the rollout model (eval mode; its parameter dtype/device set the cache's).
        num_slots: sequences decoded at once.
        max_seq_len: positions per sequence; a request needs len(prompt) + max_new_tokens of them.
        kv_cache: the cache's layout (kv_layouts.py): "slots" (num_slots x max_seq_len positions, read in
            place), "paged" (blocks handed out as sequences grow), or "auto": slots when they fit in
            kv_cache_tokens (or kv_cache_tokens is 0), paged when they do not.
        kv_cache_tokens: positions the cache may hold over all sequences (paged: rounded up to whole blocks,
            the pool growing to it as sequences need); 0: num_slots x max_seq_len, every slot's worst case.
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
        kv_cache: str = "auto",
        kv_cache_tokens: int = 0,
        vision: VisionInputs | None = None,
        pack_weights: bool = True,
        native_kernels: bool = True,
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
        # CPU: the projections packed and fused for the model calls (models/packed_linear.py), rebuilt after
        # each weight update (`weights_changed`); with the native kernels asked for, on AMX tiles where the
        # host has them (native.TiledLinear).
        self.packed = (
            PackedWeights(model, num_slots, tiled=native_kernels)
            if pack_weights and packing_supported(model)
            else None
        )
        # CPU: a decode step's layers run with the native kernels between the projections (models/native),
        # where they apply and build; they read a cache in the weights' dtype (kv_layouts.cache_dtype).
        self.native_kernels = native_kernels and natively_decodable(model)
        self.cache_dtype = cache_dtype(self.dtype, self.device, self.native_kernels)
        self.layout = kv_layout(kv_cache, num_slots, max_seq_len, kv_cache_tokens)
        self.paged = self.layout == "paged"
        self.cache: KVCache | PagedKVCache
        if self.paged:  # default: every slot's worst case, in whole blocks
            max_blocks = (
                blocks_for(kv_cache_tokens) if kv_cache_tokens else num_slots * blocks_for(max_seq_len)
            )
            self.kv_cache_tokens = kv_cache_tokens or max_blocks * BLOCK_SIZE
            self.cache = PagedKVCache(
                model.args, BLOCK_SIZE, min(max_blocks, num_slots), max_blocks, self.cache_dtype, self.device
            )
        else:
            self.kv_cache_tokens = num_slots * max_seq_len
            self.cache = KVCache(model.args, num_slots, max_seq_len, self.cache_dtype, self.device)
        # Paged: each slot's blocks in position order (host), and as a table the decode reads (device; 0 =
        # scratch). Slots: unused (a slot's positions are its own cache row).
        self.blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self.block_table = torch.zeros(
            num_slots, blocks_for(max_seq_len) if self.paged else 1, dtype=torch.long, device=self.device
        )
        # KV kept after a request with a kv_key finished (oldest first: evicted first), and, with slots, the
        # slots that hold it (parked: neither free nor running).
        self.kept: OrderedDict[Any, _Kept] = OrderedDict()
        self.parked: dict[int, Any] = {}
        self._admissions = 0
        self.waiting: deque[tuple[Request, list[int]]] = deque()  # a request and which of its samples to draw
        self.free: list[int] = list(range(num_slots))  # a heap: lowest slot first keeps `hi` small
        self.running: list[_Running | None] = [None] * num_slots
        # Per-slot device state; idle slots keep length 0 so their garbage writes stay in bounds (a parked slot
        # keeps its kept length: its garbage goes to the position its next turn writes first).
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
            "prefill_tokens": 0,  # positions run through a prefill (a shared prompt once)
            "kv_reused_tokens": 0,  # positions a returning request found kept instead of prefilling them
            # positions a request found prefilled for another one admitted with the same prompt: prefill_tokens
            # + kv_reused_tokens + shared_prompt_tokens = the admitted requests' prompt positions
            "shared_prompt_tokens": 0,
            "kv_evicted": 0,  # kept KV dropped because its room was needed
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
        if request.kv_key is not None and num_samples != 1:
            raise ValueError(
                f"request {request.tag!r} has kv_key={request.kv_key!r} and {num_samples} samples; KV is kept "
                "for one sample only"
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
        if self.paged and blocks_for(needed) > self._pool().max_blocks:
            raise ValueError(
                f"request {request.tag!r}: prompt of {prompt_len} tokens + max_new_tokens="
                f"{params.max_new_tokens} = {needed} positions exceed the KV cache's "
                f"kv_cache_tokens={self.kv_cache_tokens} (rollout.kv_cache_tokens, in blocks of {BLOCK_SIZE}): "
                "one sequence must fit; raise kv_cache_tokens to at least "
                f"{blocks_for(needed) * BLOCK_SIZE} or lower max_new_tokens"
            )
        if params.stop_strings and self.detokenize is None:
            raise ValueError(f"request {request.tag!r} has stop_strings but the engine has no detokenize")
        if request.images is not None and len(request.images[1]) and self.vision is None:
            raise ValueError(f"request {request.tag!r} has images but the model has no vision tower")
        if request.kv_key is not None and self.vision is not None:
            raise ValueError(
                f"request {request.tag!r} has kv_key={request.kv_key!r} on a vision model; KV kept across turns "
                "is for text models (multi-turn rollouts of vision models are refused): send it without kv_key"
            )
        self.waiting.append((request, list(range(num_samples))))

    def has_work(self) -> bool:
        """True while a request is waiting or a sample is running."""
        return bool(self.waiting) or self._num_running() > 0

    def num_free_slots(self) -> int:
        """Slots not running and not claimed by waiting requests: room for new requests to start now (a slot
        parked with kept KV counts: it is given up when a request needs it)."""
        return len(self.free) + len(self.parked) - sum(len(samples) for _, samples in self.waiting)

    def weights_changed(self) -> None:
        """The model's weights were replaced or rewritten in place: kept KV is dropped and the packed weights
        are rebuilt at the next model call. Only while nothing runs."""
        self.forget_all()
        if self.packed is not None:
            self.packed.invalidate()

    def kv_cache_bytes(self) -> dict[str, int]:
        """The KV cache's bytes: allocated now, held by sequences at the peak so far, and what max-length slots
        (num_slots x max_seq_len positions) take."""
        args = self.model.args
        per_position = 2 * args.num_layers * args.num_kv_heads * args.head_dim * self.cache_dtype.itemsize
        max_length_slots = self.num_slots * self.max_seq_len * per_position
        if not isinstance(self.cache, PagedKVCache):
            return {
                "allocated": max_length_slots,
                "peak_used": max_length_slots,
                "max_length_slots": max_length_slots,
            }
        return {
            "allocated": self.cache.nbytes(),
            "peak_used": self.cache.peak_used * self.cache.block_bytes(),
            "max_length_slots": max_length_slots,
        }

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, full tensor) pairs into the model's parameters (RolloutBackend.load_weights); raises
        ValueError naming a parameter the model lacks or a shape that differs. Only while nothing runs; kept KV
        is dropped. The colocated switch and the replicas point parameters at their bucket buffers instead (no
        copy)."""
        if self.has_work():
            raise RuntimeError("rollout engine: load_weights while requests run; finish them first")
        self.weights_changed()
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
        if self._num_running() > 0:
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
        resumed: list[tuple[Request, int, int]] = []  # a request, its slot, the kept positions it extends
        while self.waiting:
            request, samples = self.waiting[0]
            kept = self._kept_for(request)
            if kept is not None:  # a returning turn: its slot (and blocks) with the KV of its prefix
                slot = self._resume(request, kept)
                if slot is None:
                    break
                self.waiting.popleft()
                resumed.append((request, slot, len(kept.tokens)))
                continue
            count = self._room(request, len(samples))
            if count == 0:
                break
            if count == len(samples):
                self.waiting.popleft()
            else:
                self.waiting[0] = (request, samples[count:])
            slots = [heapq.heappop(self.free) for _ in range(count)]
            if self.paged:
                for slot in slots:
                    self._grant(slot, blocks_for(len(request.prompt_ids) + 1))
            admitted.append((request, slots))
            samples_of.append(samples[:count])
        if resumed and self._joins_decode(resumed):  # run in this step's decode forward (a mixed batch)
            self._join(resumed)
            resumed = []
        if not admitted and not resumed:
            return []
        row_slots = [slot for _, slots in admitted for slot in slots]
        # Requests with the same prompt and images (a group's samples sent one request each, as multi-turn
        # trajectories are) share one prefilled row, like the samples of one request.
        prompt_of, unique = _shared_prompts([request for request, _ in admitted])  # [A] -> G, G requests
        row_prompt = [prompt_of[i] for i, (_, slots) in enumerate(admitted) for _ in slots]
        pieces = []
        deltas: list[int] = []
        if admitted:
            with self._routes() as seen:
                logits, prompt_deltas = self._prefill(unique, row_slots, row_prompt)
            self.stats["shared_prompt_tokens"] += sum(len(r.prompt_ids) for r, _ in admitted) - sum(
                len(r.prompt_ids) for r in unique
            )
            deltas = [prompt_deltas[g] for g in row_prompt]
            pieces.append(logits[torch.tensor(row_prompt, device=self.device)])  # [R, V]
            for g, (request, slots) in enumerate(admitted):
                prefix = (
                    self._layer_routes(seen, prompt_of[g], len(request.prompt_ids))
                    if seen is not None
                    else None
                )
                for sample, slot in zip(samples_of[g], slots):
                    self._start(slot, request, sample)
                    if prefix is not None:
                        self._state(slot).routes.append(prefix)
        if resumed:
            pieces.append(
                self._prefill_suffixes([(slot, r.prompt_ids, reused) for r, slot, reused in resumed])
            )
        for request, slot, _ in resumed:
            self._start(slot, request, 0)
        row_slots += [slot for _, slot, _ in resumed]
        requests = [request for request, slots in admitted for _ in slots] + [
            request for request, _, _ in resumed
        ]
        seeds = [r.seeds[s] for (r, _), samples in zip(admitted, samples_of) for s in samples]
        # returning turns are text models' (`add`): delta 0
        index = self._activate(
            row_slots, requests, seeds + [r.seeds[0] for r, _, _ in resumed], deltas + [0] * len(resumed)
        )
        settings = RowSettings.build([r.params for r in requests], self.device)
        row_logits = torch.cat(pieces) if len(pieces) > 1 else pieces[0]  # [R, V]
        tokens, logprobs = sample_rows(row_logits, settings, self.seeds[index], self.steps[index])
        self.pending[index] = tokens
        self.steps[index] += 1
        return self._record(row_slots, tokens.tolist(), logprobs.tolist())

    def _joins_decode(self, resumed: list[tuple[Request, int, int]]) -> bool:
        """Whether returning turns run their new positions inside the decode step's forward (`_mixed_forward`)
        instead of a forward of their own: with the native kernels (query rows of any slot at any offset), for
        text models, without MoE routes to record, and with the forward's rows (one per decode slot and per new
        position) x max_seq_len keys within SUFFIX_SCORES_MAX (the size of the additive mask it would need)."""
        if not self.native_kernels or self.vision is not None or self.record_routes:
            return False
        rows = self.num_slots + sum(len(request.prompt_ids) - kept for request, _, kept in resumed)
        return rows * self.max_seq_len <= SUFFIX_SCORES_MAX

    def _join(self, resumed: list[tuple[Request, int, int]]) -> None:
        """Start returning turns (request, slot, kept positions) whose new positions the next decode step's
        forward runs (`_mixed_forward`): it draws their first tokens as `_admit` would (step 0 of their seeds)."""
        for request, slot, kept in resumed:
            self._start(slot, request, 0)
            self._state(slot).joining = kept
        requests = [request for request, _, _ in resumed]
        slots = [slot for _, slot, _ in resumed]
        self._activate(slots, requests, [r.seeds[0] for r in requests], [0] * len(requests))
        self.stats["prefill_tokens"] += sum(len(r.prompt_ids) - kept for r, _, kept in resumed)
        self.stats["kv_reused_tokens"] += sum(kept for _, _, kept in resumed)

    def _activate(
        self, slots: list[int], requests: list[Request], seeds: list[int], deltas: list[int]
    ) -> torch.Tensor:
        """The device state of samples starting in `slots` (one request, seed and rope delta each): at their
        prompts' ends, step 0, running; returns the slots as an index."""
        index = torch.tensor(slots, device=self.device)  # [R]
        self.lengths[index] = torch.tensor([len(r.prompt_ids) for r in requests], device=self.device)
        self.seeds[index] = torch.tensor(seeds, device=self.device)
        self.steps[index] = 0
        self.active[index] = 1
        self.rope_deltas[index] = torch.tensor(deltas, device=self.device)
        self._settings = None
        return index

    def _start(self, slot: int, request: Request, sample: int) -> None:
        """Host state of a sample admitted into `slot`."""
        self._admissions += 1
        self.running[slot] = _Running(request, sample, len(request.prompt_ids), self._admissions)

    def _room(self, request: Request, count: int) -> int:
        """How many of a request's `count` samples can start now (slots, and with paging the blocks of their
        prompts + the first decoded position), giving up kept KV, oldest first, to make that room."""
        if not self.paged:  # a group starts whole, in free slots or parked ones given up
            if count > len(self.free) + len(self.parked):
                return 0
            while len(self.free) < count:
                self._evict_oldest()
            return count
        if count > len(self.free):
            return 0
        # Samples that find no blocks wait at the head of the queue (with a small pool, a group starts as
        # blocks free up).
        num_blocks = blocks_for(len(request.prompt_ids) + 1)
        pool = self._pool()
        kept_blocks = sum(len(kept.blocks) for kept in self.kept.values())
        count = min(count, (pool.num_obtainable() + kept_blocks) // num_blocks)
        while pool.num_obtainable() < count * num_blocks:
            self._evict_oldest()
        return count

    def _grant(self, slot: int, count: int) -> None:
        """Append `count` new blocks to `slot`'s (callers check they can be had)."""
        start = len(self.blocks[slot])
        self.blocks[slot] += self._pool().allocate(count)
        self.block_table[slot, start : start + count] = torch.tensor(self.blocks[slot][start:])

    def _prefill_suffixes(self, resumed: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Returning turns (slot, prompt, kept): run each prompt's positions [kept, len(prompt)) on top of the
        KV of its first `kept` positions kept in its slot, all in one forward (right-padded to the longest
        suffix T, each row at its own offset, attending its own kept keys); returns the last position's logits
        of each, [R, V] in the order given. A pad writes past its row's prompt, where its next token is written
        before any query reads it; a row whose kept + T would pass max_seq_len runs alone instead, and rows
        whose attention scores would pass SUFFIX_SCORES_MAX run in several forwards."""
        longest = max(len(prompt) - kept for _, prompt, kept in resumed)
        fits = [i for i, (_, _, kept) in enumerate(resumed) if kept + longest <= self.max_seq_len]
        num_keys = max(resumed[i][2] for i in fits) + longest
        per_forward = max(1, SUFFIX_SCORES_MAX // (self.model.args.num_heads * longest * num_keys))
        groups = [fits[start : start + per_forward] for start in range(0, len(fits), per_forward)]
        groups += [[i] for i in range(len(resumed)) if i not in set(fits)]  # fits holds the longest
        logits: list[torch.Tensor | None] = [None] * len(resumed)
        for group in groups:
            rows = self._suffix_forward([resumed[i] for i in group])  # [len(group), V]
            for row, i in enumerate(group):
                logits[i] = rows[row]
        self.stats["prefill_tokens"] += sum(len(prompt) - kept for _, prompt, kept in resumed)
        self.stats["kv_reused_tokens"] += sum(kept for _, _, kept in resumed)
        return torch.stack(logits)  # type: ignore[arg-type]

    # ---- decode ----------------------------------------------------------------------------------

    def _decode(self) -> list[Completion]:
        """One token for every running sample, as one batch over the slot range [0, hi). Once fewer than
        COMPACT_BELOW of the slots below hi are running, `_compact` first moves the running samples into the
        lowest slots, so a long tail of a few late samples does not pay for the idle slots between them."""
        if self.paged:
            self._grow()
        slots = [slot for slot, state in enumerate(self.running) if state is not None]
        movable = [slot for slot in range(slots[-1] + 1) if slot not in self.parked]  # running or free
        if len(slots) < COMPACT_BELOW * len(movable):
            slots = self._compact(slots, movable)
        hi = slots[-1] + 1
        num_keys = max(self._state(slot).length for slot in slots) + 1
        if self._settings is None or self._settings_key != hi:
            params = [_IDLE if state is None else state.request.params for state in self.running[:hi]]
            self._settings, self._settings_key = RowSettings.build(params, self.device), hi
        offsets = self.lengths[:hi]
        cache, table = (self.cache, self.block_table[:hi]) if self.paged else (self._rows(0, hi), None)
        joining = [slot for slot in slots if self._state(slot).joining is not None]
        if joining:
            logits = self._mixed_forward(hi, num_keys, cache, table)  # [B, V]
        else:
            with self._routes() as seen:
                logits = self._forward_last(
                    self.pending[:hi][:, None],
                    offsets[:, None] if self.vision is None else (offsets + self.rope_deltas[:hi])[:, None],
                    self._all_keys[:hi, :num_keys],
                    cache,
                    offsets,
                    None,
                    table,
                )  # [B, V]
            if seen is not None:
                for slot in slots:
                    self._state(slot).routes.append(self._layer_routes(seen, slot, 1))
        tokens, logprobs = sample_rows(logits, self._settings, self.seeds[:hi], self.steps[:hi])
        grown = self.active[:hi]
        if joining:  # their first tokens: written at their prompts' ends by the next step
            grown = grown.clone()
            grown[torch.tensor(joining, device=self.device)] = 0
        self.lengths[:hi] += grown
        self.steps[:hi] += self.active[:hi]
        self.pending[:hi] = tokens
        for slot in slots:
            if slot not in joining:
                self._state(slot).length += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(slots)
        host_tokens, host_logprobs = tokens.tolist(), logprobs.tolist()
        return self._record(slots, [host_tokens[s] for s in slots], [host_logprobs[s] for s in slots])

    def _mixed_forward(
        self, hi: int, num_keys: int, cache: KVCache | PagedKVCache, table: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits [hi, V] of one forward over the decode slots [0, hi) and the joining returning turns' new
        positions (`_join`): a query row per decode slot (its pending token at its length, as `_decode`) and per
        new position of a joining slot (its prompt from its kept length on, each at its own offset), each in its
        own slot's cache (the native kernels' cache_rows: every row's keys are written before any row attends,
        so a turn's new positions see each other as a prefill's would); a slot's logits are its last row's.
        num_keys: `_decode`'s (a joining slot's length is its prompt's, so its last new position is in range)."""
        ids: list[int] = []
        offsets: list[int] = []
        rows: list[int] = []
        last: list[int] = []
        pending, lengths = self.pending[:hi].tolist(), self.lengths[:hi].tolist()
        for slot in range(hi):
            state = self.running[slot]
            if state is not None and state.joining is not None:
                new = state.request.prompt_ids[state.joining :]
                ids += new
                offsets += range(state.joining, state.joining + len(new))
                rows += [slot] * len(new)
                state.joining = None
            else:  # a decode slot, or an idle one (its garbage row at its length, as `_decode`'s)
                ids.append(pending[slot])
                offsets.append(lengths[slot])
                rows.append(slot)
            last.append(len(ids) - 1)
        at = torch.tensor(offsets, device=self.device)
        logits = self._forward_last(
            torch.tensor(ids, device=self.device)[:, None],
            at[:, None],
            self._all_keys[:1, :num_keys].expand(len(ids), num_keys),
            cache,
            at,
            None,
            table,
            cache_rows=torch.tensor(rows, device=self.device),
            picked_rows=torch.tensor(last, device=self.device),
        )
        self.stats["prefill_calls"] += 1
        return logits

    def _compact(self, slots: list[int], movable: list[int]) -> list[int]:
        """Move the running samples `slots` into the lowest n = len(slots) of the slots `movable` (running or
        free, ascending; parked slots keep their KV where it is): each running one above them takes a free one
        among them, with its KV (slots: the cache rows it has written; paged: its block-table row, no KV
        copied), its device state and its host state. Returns the new running slots. A sample's tokens do not
        depend on its slot (`sampling`)."""
        count = len(slots)
        lowest = set(movable[:count])
        movers = [slot for slot in slots if slot not in lowest]
        targets = [slot for slot in movable[:count] if self.running[slot] is None]  # as many as movers
        source = torch.tensor(movers, device=self.device)
        dest = torch.tensor(targets, device=self.device)
        if self.paged:
            self.block_table[dest] = self.block_table[source]
            self.block_table[source] = 0  # an idle row points at the scratch block only (it may write there)
            for old, new in zip(movers, targets):
                self.blocks[new], self.blocks[old] = self.blocks[old], []
        else:
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
        moved_in = set(targets)
        self.free = [slot for slot in self.free if slot not in moved_in] + movers
        heapq.heapify(self.free)
        self._settings = None
        self.stats["compactions"] += 1
        self.stats["moved_rows"] += len(movers)
        return sorted(movable[:count])

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
        """Give every running sample whose next position starts a new block that block, giving up kept KV
        (oldest first) and then preempting the youngest running sample while none is left (it may be the one
        asking; one sample alone always fits: `add`)."""
        pool = self._pool()
        for slot, state in enumerate(self.running):
            if state is None or len(self.blocks[slot]) > state.length // BLOCK_SIZE:
                continue
            while pool.num_obtainable() == 0 and self.kept:
                self._evict_oldest()
            while pool.num_obtainable() == 0 and self.running[slot] is not None:
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
        """The slot (and its blocks) become free; its device state idle (writes go to position 0 of its row,
        or to the scratch block)."""
        self.running[slot] = None
        heapq.heappush(self.free, slot)
        if self.paged:
            self._pool().release(self.blocks[slot])
            self.blocks[slot] = []
            self.block_table[slot] = 0
        self.active[slot] = 0
        self.lengths[slot] = 0
        self.steps[slot] = 0
        self.rope_deltas[slot] = 0
        self._settings = None

    def _release(self, slot: int, reason: str) -> Completion:
        state = self._state(slot)
        if state.request.kv_key is not None and not self.record_routes:
            self._keep(slot, state)
        else:
            self._vacate(slot)
        generation = Generation(
            torch.tensor(state.token_ids, dtype=torch.long),
            torch.tensor(state.logprobs, dtype=torch.float32),
            reason,
            torch.cat(state.routes) if self.record_routes else None,
        )
        return Completion(state.request.tag, state.sample, generation)

    # ---- layouts -----------------------------------------------------------------------------------

    def _num_running(self) -> int:
        return self.num_slots - len(self.free) - len(self.parked)

    def _pool(self) -> PagedKVCache:
        """The paged layout's block pool."""
        assert isinstance(self.cache, PagedKVCache), "paged layout only"
        return self.cache

    def _slots_cache(self) -> KVCache:
        """The slots layout's cache."""
        assert isinstance(self.cache, KVCache), "slots layout only"
        return self.cache

    def _rows(self, start: int, stop: int | None = None) -> KVCache:
        """The slots layout's cache rows [start, stop) (default: the one row `start`), a view."""
        assert isinstance(self.cache, KVCache), "slots layout only"
        return self.cache.rows((start + 1 if stop is None else stop) - start, start)
