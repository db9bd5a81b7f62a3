"""RolloutEngine: continuous batching over a fixed pool of sequence slots, its KV cache in max-length slots or
in blocks handed out as sequences grow.

```
 add(Request: prompt, n seeds, params[, kv_key]) ──▶ waiting (FIFO; preempted samples re-enter at the front)
 step():
   admit   : a request whose kv_key has KV kept and whose prompt extends it (a later turn): its slot (and
             blocks) back; the new positions of all such requests prefilled in ONE forward on top of their
             kept ones (`_prefill_suffixes`: right-padded, each row at its own offset).
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
             slot's row, or through its block table), attending only its own keys.
   finish  : a sample that hits a stop token / stop string / max_new_tokens frees its slot (and blocks) at
             once - or, with a kv_key, keeps its KV: slots park the slot, paged keeps its blocks - and the
             next step's admit hands them to a waiting request.
   compact : once fewer than half the unparked slots below hi run, the running samples move into the lowest
             unparked slots (slots: the cache rows they wrote, copied once; paged: block-table rows, no KV),
             so a long tail decodes a small contiguous batch.
   returns the Completions finished in this step
```

Two cache layouts (`kv_cache`, rollout.kv_cache; "auto" picks slots when they fit kv_cache_tokens):
- slots: per layer k, v [num_slots, K, max_seq_len, D] (the model's `KVCache`), every slot's worst case
  allocated up front. Decode reads the slot range [0, hi) in place (one view, no gather, no copy).
- paged (models/paged_cache.py): per layer k, v [K, num_blocks, BLOCK_SIZE, D]; a slot's block-table row lists
  its blocks in position order. A sequence holds ceil(length / BLOCK_SIZE) blocks, not max_seq_len positions:
  the pool holds what the sequences use, grown by doubling up to `kv_cache_tokens` (samples wait or are
  preempted beyond it). Each decode step gathers the rows' first ceil(S / BLOCK_SIZE) blocks (a copy of the
  keys attended: why slots stay the default where they fit; docs/benchmarks.md).
Both in the weights' dtype on an accelerator and fp32 on a CPU (`cache_dtype`). A slot's sequence always
starts at position 0, so cache position == RoPE position for text models (vision: below). Free slots are handed out lowest index first and
decode runs over the slot range [0, hi) with hi = highest running slot + 1; idle slots inside the range
compute a harmless garbage row (they write only at their position 0, or into the scratch block 0; a parked
slot at its kept length, the position its next turn writes first; their output is dropped). Keys are read up
to the longest running sequence, S = max length + 1, with a causal per-row mask.

Kept KV (multi-turn, engines/rollout/multi_turn.py): a request with a kv_key keeps its sample's KV when it
finishes - the prompt's positions and every drawn token's but the last - until a request with the same key
whose prompt extends those tokens takes it back (its new positions prefilled on top, `kv_reused_tokens`), the
caller `forget`s it, or its room is needed: admission and growth give kept KV up oldest first (`kv_evicted`;
that turn then re-prefills its whole prompt). Kept KV never holds a slot a request is waiting for.

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

Tensor parallelism (issue 3's layouts) touches only `_forward_last`: the model's `hidden_states` and its LM
head. Everything else - slots, cache bookkeeping, sampling - is per rank identical, driven by the same
host-side decisions on every rank of a TP group, and sees full-vocabulary logits.

Seeds: each sample carries its own seed; the uniform of its t-th token is a pure function of (seed, t)
(see `sampling.counter_uniforms`), so results do not depend on the batch or on arrival order.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from dockrl.engines.rollout.sampling import RowSettings, SamplingParams, sample_rows
from dockrl.models.decoder import KVCache, Transformer
from dockrl.models.moe import Routing, routing
from dockrl.models.packed_linear import PackedWeights
from dockrl.models.packed_linear import supported as packing_supported
from dockrl.models.paged_cache import PagedKVCache
from dockrl.models.vision import Images, VisionInputs

_IDLE = SamplingParams(max_new_tokens=1, temperature=0.0)
# Move the running samples into the lowest slots once fewer than this share of the rows [0, hi) run: one copy
# of the movers' written cache rows, after which every decode step reads only running rows (decoding all of
# [0, hi) would attend idle rows' keys at every step; a gather per step would copy the running rows each time).
COMPACT_BELOW = 0.5
# Positions per KV block: a sequence wastes under one block (its last one's unwritten tail); larger blocks mean
# fewer, longer contiguous runs for the per-step gather (32 fp32 positions x D = 32: 4 KiB per key head).
BLOCK_SIZE = 32
# Attention scores one forward over returning turns' suffixes may hold (rows x heads x T x S, fp32: 256 MiB):
# more rows than that run in several forwards, so long observations on a large batch cannot exhaust memory.
SUFFIX_SCORES_MAX = 2**26


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
    kv_key: Any = None
    """One sample only: keep its KV under this key when it finishes, and start from the KV kept under it when
    the prompt extends the kept positions (a trajectory's next turn; see the module docstring)."""
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


@dataclass
class _Kept:
    """KV kept for a later request: the positions of `tokens`, in a parked slot (slots) or in blocks (paged)."""

    tokens: list[int]
    slot: int | None
    blocks: list[int]


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


def same_images(first: tuple | None, second: tuple | None) -> bool:
    """Whether two requests' images (uint8 patches, grid) are the same (None and 0 images: none)."""
    first = None if first is None or not len(first[1]) else first
    second = None if second is None or not len(second[1]) else second
    if first is None or second is None:
        return first is second
    return all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(first, second))


def kv_layout(kv_cache: str, num_slots: int, max_seq_len: int, kv_cache_tokens: int) -> str:
    """The cache layout `kv_cache` resolves to: "auto" is "slots" when num_slots x max_seq_len positions fit
    kv_cache_tokens (0: no bound), "paged" when they do not; raises ValueError naming a layout that cannot be."""
    if kv_cache_tokens < 0:
        raise ValueError(f"rollout engine kv_cache_tokens={kv_cache_tokens} must be >= 0 (0: the worst case)")
    worst = num_slots * max_seq_len
    if kv_cache == "auto":
        return "slots" if not kv_cache_tokens or worst <= kv_cache_tokens else "paged"
    if kv_cache not in ("slots", "paged"):
        raise ValueError(f"rollout engine kv_cache={kv_cache!r}; use auto, slots or paged")
    if kv_cache == "slots" and 0 < kv_cache_tokens < worst:
        raise ValueError(
            f"rollout engine kv_cache=slots needs num_slots x max_seq_len = {num_slots} x {max_seq_len} = {worst} "
            f"positions, over kv_cache_tokens={kv_cache_tokens}; use kv_cache=paged or auto, or raise kv_cache_tokens"
        )
    return kv_cache


class RolloutEngine:
    """Continuous-batching sampler on a dockrl `Transformer` (see the module docstring).

    Lifecycle: build once per model and cache size; `add` requests at any time; call `step` (or iterate
    `run`) until `has_work()` is False. The cache persists across requests; weights may change between
    steps only when no request is running (e.g. after a rollout phase), and KV kept for later turns must be
    dropped then (`load_weights` does; a caller swapping the weights itself calls `weights_changed`).

    Args:
        model: the rollout model (eval mode; its parameter dtype/device set the cache's).
        num_slots: sequences decoded at once.
        max_seq_len: positions per sequence; a request needs len(prompt) + max_new_tokens of them.
        kv_cache: the cache's layout (module docstring): "slots" (num_slots x max_seq_len positions, read in
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
        # CPU: the projections packed and fused for the model calls (models/packed_linear.py), rebuilt after
        # each weight update (`weights_changed`).
        self.packed = PackedWeights(model, num_slots) if pack_weights and packing_supported(model) else None
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

    def forget(self, kv_key: Any) -> None:
        """Drop the KV kept under `kv_key` (its trajectory ended), if any."""
        if kv_key in self.kept:
            self._drop_kept(kv_key)

    def forget_all(self) -> None:
        """Drop every kept KV (the weights that computed it are about to change)."""
        for key in list(self.kept):
            self._drop_kept(key)

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
        index = torch.tensor(row_slots, device=self.device)  # [R]
        self.lengths[index] = torch.tensor([len(r.prompt_ids) for r in requests], device=self.device)
        seeds = [r.seeds[s] for (r, _), samples in zip(admitted, samples_of) for s in samples]
        self.seeds[index] = torch.tensor(seeds + [r.seeds[0] for r, _, _ in resumed], device=self.device)
        self.steps[index] = 0
        self.active[index] = 1
        # returning turns are text models' (`add`): delta 0
        self.rope_deltas[index] = torch.tensor(deltas + [0] * len(resumed), device=self.device)
        self._settings = None
        settings = RowSettings.build([r.params for r in requests], self.device)
        row_logits = torch.cat(pieces) if len(pieces) > 1 else pieces[0]  # [R, V]
        tokens, logprobs = sample_rows(row_logits, settings, self.seeds[index], self.steps[index])
        self.pending[index] = tokens
        self.steps[index] += 1
        return self._record(row_slots, tokens.tolist(), logprobs.tolist())

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

    def _kept_for(self, request: Request) -> _Kept | None:
        """The KV kept under the request's kv_key when its prompt extends the kept positions (a later turn);
        KV kept under that key that the prompt does not extend is dropped (it cannot be used again)."""
        kept = self.kept.get(request.kv_key) if request.kv_key is not None else None
        if kept is None:
            return None
        length, prompt = len(kept.tokens), request.prompt_ids
        if len(prompt) > length and prompt[:length] == kept.tokens and not self.record_routes:
            return kept
        self._drop_kept(request.kv_key)
        return None

    def _resume(self, request: Request, kept: _Kept) -> int | None:
        """Take the kept KV back into a slot for `request`, with the blocks its prompt + first decoded position
        need beyond the kept ones; None when they cannot be had now (the request waits)."""
        key = request.kv_key
        if not self.paged:
            assert kept.slot is not None
            del self.kept[key], self.parked[kept.slot]
            return kept.slot
        pool = self._pool()
        extra = max(0, blocks_for(len(request.prompt_ids) + 1) - len(kept.blocks))
        del self.kept[key]  # not evicted for its own room
        while pool.num_obtainable() < extra and self.kept:
            self._evict_oldest()
        if not self.free or pool.num_obtainable() < extra:
            self.kept[key] = kept
            self.kept.move_to_end(key, last=False)
            return None
        slot = heapq.heappop(self.free)
        self.blocks[slot] = list(kept.blocks)
        self.block_table[slot, : len(kept.blocks)] = torch.tensor(kept.blocks, device=self.device)
        if extra:
            self._grant(slot, extra)
        return slot

    def _grant(self, slot: int, count: int) -> None:
        """Append `count` new blocks to `slot`'s (callers check they can be had)."""
        start = len(self.blocks[slot])
        self.blocks[slot] += self._pool().allocate(count)
        self.block_table[slot, start : start + count] = torch.tensor(self.blocks[slot][start:])

    def _prefill(
        self, requests: list[Request], row_slots: list[int], row_prompt: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """Run each request's prompt once, copy its KV into the slots (or blocks) of its samples; returns last
        logits [G, V] and each prompt's rope delta (0 for text)."""
        prompts = [request.prompt_ids for request in requests]
        num_prompts, longest = len(prompts), max(len(prompt) for prompt in prompts)
        ids = torch.full((num_prompts, longest), self.pad_token_id, dtype=torch.long)  # [G, P]
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        # Right padding: pads sit after every real token, so causal attention alone keeps them unseen.
        scratch = KVCache(self.model.args, num_prompts, longest, self.cache_dtype, self.device)
        last = torch.tensor([len(prompt) - 1 for prompt in prompts], device=self.device)  # [G]
        positions, images, deltas = self._multimodal(requests, ids)
        logits = self._forward_last(
            ids.to(self.device), positions, None, scratch, 0, last, images=images
        )  # [G, V]
        if self.paged:
            self._copy_to_blocks(scratch, [len(p) for p in prompts], row_slots, row_prompt)
        else:
            slots = torch.tensor(row_slots, device=self.device)  # [R]
            sources = torch.tensor(row_prompt, device=self.device)  # [R]
            for layer in range(len(self.cache.k)):
                self.cache.k[layer][slots, :, :longest] = scratch.k[layer][sources]
                self.cache.v[layer][slots, :, :longest] = scratch.v[layer][sources]
        self.stats["prefill_calls"] += 1
        self.stats["prefill_prompts"] += num_prompts
        self.stats["prefill_tokens"] += sum(len(prompt) for prompt in prompts)
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

    def _copy_to_blocks(
        self, scratch: KVCache, lengths: list[int], row_slots: list[int], row_prompt: list[int]
    ) -> None:
        """Every prompt position p of every sample row: (its block, offset in the block) <- (prompt, p)."""
        sources: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        for slot, g in zip(row_slots, row_prompt):
            length = lengths[g]
            sources += [g] * length
            positions += range(length)
            blocks += [self.blocks[slot][p // BLOCK_SIZE] for p in range(length)]
        source = torch.tensor(sources, device=self.device)  # [R P']
        position = torch.tensor(positions, device=self.device)
        block = torch.tensor(blocks, device=self.device)
        offset = position % BLOCK_SIZE
        pool = self._pool()
        for layer in range(len(pool.k)):
            pool.k[layer][:, block, offset] = scratch.k[layer][source, :, position].transpose(0, 1)
            pool.v[layer][:, block, offset] = scratch.v[layer][source, :, position].transpose(0, 1)

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

    def _suffix_forward(self, resumed: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """One forward of `_prefill_suffixes` over rows whose kept + T all fit max_seq_len; logits [R, V]."""
        lengths = [len(prompt) - kept for _, prompt, kept in resumed]
        num_tokens = max(lengths)
        ids = torch.full((len(resumed), num_tokens), self.pad_token_id, dtype=torch.long)  # [R, T]
        for row, (_, prompt, kept) in enumerate(resumed):
            ids[row, : len(prompt) - kept] = torch.tensor(prompt[kept:], dtype=torch.long)
        offsets = torch.tensor([kept for _, _, kept in resumed], device=self.device)  # [R]
        last = torch.tensor([n - 1 for n in lengths], device=self.device)  # [R]
        num_keys = max(kept for _, _, kept in resumed) + num_tokens  # S
        key_mask = self._all_keys[: len(resumed), :num_keys]
        slots = torch.tensor([slot for slot, _, _ in resumed], device=self.device)
        if self.paged:  # every row writes and reads through its own block-table row
            cache, table = self.cache, self.block_table[slots]
        else:  # the slots are anywhere in the cache: their rows copied out, prefilled, written back
            cache, table = self._slots_cache().take(slots, num_keys), None
        logits = self._forward_last(ids.to(self.device), None, key_mask, cache, offsets, last, table)
        if not self.paged:
            self._slots_cache().put(slots, cache)  # type: ignore[arg-type]
        self.stats["prefill_calls"] += 1
        return logits

    def _forward_last(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        key_mask: torch.Tensor | None,
        cache: KVCache | PagedKVCache,
        cache_offset: int | torch.Tensor,
        last: torch.Tensor | None,
        block_table: torch.Tensor | None = None,
        images: Images | None = None,
    ) -> torch.Tensor:
        """The one model call: hidden states, then LM-head logits of token `last[b]` of each row -> [B, V].

        last=None takes the final token. Only these rows go through the LM head (the prefill's other
        positions never need logits). A tensor-parallel model plugs in here.
        """
        # CPU bf16: the projections run packed for this call (models/packed_linear.py)
        with nullcontext() if self.packed is None else self.packed.applied():
            if isinstance(cache_offset, torch.Tensor):  # each row at its own length (continuous batching)
                assert key_mask is not None, "per-row offsets mask the keys of each row"
                hidden = self.model.hidden_states_per_row(
                    input_ids, cache, cache_offset, block_table, key_mask, position_ids
                )
            else:  # prefill: the rows of one prompt's samples at the same offset
                assert isinstance(cache, KVCache), "prefill fills a contiguous scratch cache"
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
        self.lengths[:hi] += self.active[:hi]
        self.steps[:hi] += self.active[:hi]
        self.pending[:hi] = tokens
        for slot in slots:
            self._state(slot).length += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(slots)
        host_tokens, host_logprobs = tokens.tolist(), logprobs.tolist()
        return self._record(slots, [host_tokens[s] for s in slots], [host_logprobs[s] for s in slots])

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

    # ---- KV kept across turns ----------------------------------------------------------------------

    def _keep(self, slot: int, state: _Running) -> None:
        """A finished sample's KV stays for its request's kv_key: the prompt's positions and every drawn
        token's but the last (never fed). Slots: the slot is parked (idle, its length kept, so its garbage
        writes land where the next turn writes first); paged: its blocks move to the kept entry, the slot is
        free."""
        key = state.request.kv_key
        self.forget(key)
        tokens = state.request.prompt_ids + state.token_ids[:-1]
        assert len(tokens) == state.length, (len(tokens), state.length)
        if self.paged:
            self.kept[key] = _Kept(tokens, None, self.blocks[slot])
            self.blocks[slot] = []
            self._vacate(slot)
            return
        self.kept[key] = _Kept(tokens, slot, [])
        self.parked[slot] = key
        self.running[slot] = None
        self.active[slot] = 0
        self.steps[slot] = 0
        self._settings = None

    def _drop_kept(self, key: Any) -> None:
        """Give the room of the KV kept under `key` back: its parked slot or its blocks."""
        kept = self.kept.pop(key)
        if kept.slot is not None:
            del self.parked[kept.slot]
            self.lengths[kept.slot] = 0
            heapq.heappush(self.free, kept.slot)
        else:
            self._pool().release(kept.blocks)

    def _evict_oldest(self) -> None:
        """Drop the KV kept longest (its trajectory re-prefills its prefix when it returns)."""
        self._drop_kept(next(iter(self.kept)))
        self.stats["kv_evicted"] += 1

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
