"""The rollout engine's model calls: the part of RolloutEngine (rollout_engine.py) that runs the model and puts
the KV it computes where the samples read it; RolloutEngine inherits `ModelCalls`' methods. Which rows run, and
when, is the engine's (its module docstring).

- `_prefill`: the admitted prompts once each (right-padded, causal) into a scratch cache, their KV copied into
  their samples' slots (or blocks); a vision model's positions and images (`_multimodal`).
- `_suffix_forward`: returning turns' new positions on top of their kept KV, each row at its own offset.
- `_forward_last`: the one model call every forward (prefill, suffix, decode) goes through.
- `_routes`, `_layer_routes`: the MoE experts a forward routed each token to (record_routes).

Tensor parallelism (issue 3's layouts) touches only `_forward_last`: the model's `hidden_states` and its LM
head. Everything else - slots, cache bookkeeping, sampling - is per rank identical, driven by the same
host-side decisions on every rank of a TP group, and sees full-vocabulary logits.

Shape letters: G prompts prefilled together, P longest of them, R sample rows, T longest suffix of returning
turns, B rows of one model call, S key slots read, H hidden size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from dockrl.engines.rollout.kv_layouts import BLOCK_SIZE
from dockrl.engines.rollout.requests import Request
from dockrl.models.decoder import Transformer
from dockrl.models.kv_cache import KVCache
from dockrl.models.moe import Routing, routing
from dockrl.models.packed_linear import PackedWeights
from dockrl.models.paged_cache import PagedKVCache
from dockrl.models.vision import Images, VisionInputs


class ModelCalls:
    """The model calls of RolloutEngine (see the module docstring), a base of it."""

    # RolloutEngine's state these methods read and write (set in its __init__), and its methods they call.
    model: Transformer
    vision: VisionInputs | None
    packed: PackedWeights | None
    pad_token_id: int
    device: torch.device
    cache_dtype: torch.dtype
    native_kernels: bool
    paged: bool
    cache: KVCache | PagedKVCache
    blocks: list[list[int]]
    block_table: torch.Tensor
    _all_keys: torch.Tensor
    record_routes: bool
    moe_layers: list[int]
    stats: dict[str, int]
    _pool: Callable[[], PagedKVCache]
    _slots_cache: Callable[[], KVCache]

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
        rows = None
        if self.paged:  # every row writes and reads through its own block-table row
            cache, table = self.cache, self.block_table[slots]
        elif self.native_kernels:  # the native kernels read and write each row's slot in place
            cache, table, rows = self._slots_cache(), None, slots
        else:  # the slots are anywhere in the cache: their rows copied out, prefilled, written back
            cache, table = self._slots_cache().take(slots, num_keys), None
        logits = self._forward_last(
            ids.to(self.device), None, key_mask, cache, offsets, last, table, cache_rows=rows
        )
        if not self.paged and rows is None:
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
        cache_rows: torch.Tensor | None = None,
        picked_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The one model call: hidden states, then LM-head logits of token `last[b]` of each row -> [B, V].

        last=None takes the final token. Only these rows go through the LM head (the prefill's other
        positions never need logits). cache_rows: each row's sequence in the cache (the native kernels only;
        `hidden_states_per_row`); picked_rows: only these rows' logits, in this order. A tensor-parallel model
        plugs in here.
        """
        # CPU bf16: the projections run packed for this call (models/packed_linear.py)
        with nullcontext() if self.packed is None else self.packed.applied():
            if isinstance(cache_offset, torch.Tensor):  # each row at its own length (continuous batching)
                assert key_mask is not None, "per-row offsets mask the keys of each row"
                hidden = self.model.hidden_states_per_row(
                    input_ids,
                    cache,
                    cache_offset,
                    block_table,
                    key_mask,
                    position_ids,
                    native=self.native_kernels,
                    cache_rows=cache_rows,
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
            if picked_rows is not None:
                picked = picked[picked_rows]
            return self.model.lm_logits(picked)  # full vocabulary, also for a tensor-parallel model

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
