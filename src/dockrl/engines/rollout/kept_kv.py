"""KV kept across turns: the part of RolloutEngine (rollout_engine.py) that keeps a finished sample's KV for its
request's kv_key and hands it back to the next turn; RolloutEngine inherits `KeptKV`'s methods.

Kept KV (multi-turn, engines/rollout/multi_turn.py): a request with a kv_key keeps its sample's KV when it
finishes - the prompt's positions and every drawn token's but the last - until a request with the same key
whose prompt extends those tokens takes it back (its new positions prefilled on top, `kv_reused_tokens`), the
caller `forget`s it, or its room is needed: admission and growth give kept KV up oldest first (`kv_evicted`;
that turn then re-prefills its whole prompt). Kept KV never holds a slot a request is waiting for.

Where it is kept: slots park the slot (neither free nor running, its length kept), paged keeps the blocks (the
slot is free). Prefilling a returning turn's new positions on top is the engine's admission
(`RolloutEngine._prefill_suffixes`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dockrl.engines.rollout.kv_layouts import blocks_for
from dockrl.engines.rollout.requests import Request, _Running
from dockrl.engines.rollout.sampling import RowSettings
from dockrl.models.paged_cache import PagedKVCache


@dataclass
class _Kept:
    """KV kept for a later request: the positions of `tokens`, in a parked slot (slots) or in blocks (paged)."""

    tokens: list[int]
    slot: int | None
    blocks: list[int]


class KeptKV:
    """KV kept across turns (see the module docstring), a base of RolloutEngine: `forget`, `forget_all`, and
    the admission, release and eviction steps of kept KV that the engine's own methods call."""

    # RolloutEngine's state these methods read and write (set in its __init__), and its methods they call.
    kept: OrderedDict[Any, _Kept]
    parked: dict[int, Any]
    paged: bool
    record_routes: bool
    device: torch.device
    free: list[int]
    running: list[_Running | None]
    blocks: list[list[int]]
    block_table: torch.Tensor
    lengths: torch.Tensor
    active: torch.Tensor
    steps: torch.Tensor
    _settings: RowSettings | None
    stats: dict[str, int]
    _pool: Callable[[], PagedKVCache]
    _grant: Callable[[int, int], None]
    _vacate: Callable[[int], None]

    def forget(self, kv_key: Any) -> None:
        """Drop the KV kept under `kv_key` (its trajectory ended), if any."""
        if kv_key in self.kept:
            self._drop_kept(kv_key)

    def forget_all(self) -> None:
        """Drop every kept KV (the weights that computed it are about to change)."""
        for key in list(self.kept):
            self._drop_kept(key)

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
