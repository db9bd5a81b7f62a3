"""Turn ragged dock rows (prompt_ids [P], response_ids [R], per-token columns [R]) into micro-batches.

Shapes: B rows, T = max(P + R) tokens, S = sum(P + R) packed tokens. Logits at position t predict token t + 1,
so per-token training tensors live on the shifted grid [B, T-1]: row i's response occupies columns
P_i - 1 ... P_i + R_i - 2. Padding is on the right; causal attention means pad tokens never influence real ones.

Packed micro-batches (actor.packing, critic.packing; `Packing`): the model computes the rows laid end to end
in one [1, S] row, with cumulative lengths (0, L_0, L_0 + L_1, ..., S): block-diagonal causal attention, and
positions restarting at each row (models/decoder.py `segments`), so no padding token goes through a layer.
The per-token tensors stay on the [B, T-1] grid (the losses are elementwise there); the model's outputs go
onto it by `packed_response_positions` / `MicroBatch.from_packed`.

Vision models (qwen2_5_vl, `vision=`): each row may carry images (the dock's uint8 patches and grid); the
micro-batch holds them all, row after row (`images`), and the multimodal positions of its tokens
(`position_ids`: [3, B, T], padding continuing each row's last position, or packed [3, 1, S]), which the
model's forward takes with the ids.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from dockrl.models.vision import Images, VisionInputs


@dataclass(frozen=True)
class Packing:
    """What the model computes for a packed micro-batch: its rows end to end (module docstring)."""

    input_ids: torch.Tensor  # [1, S] int64
    segments: tuple[
        int, ...
    ]  # cumulative lengths [B + 1]: row i holds packed tokens [segments[i], segments[i+1])

    def grid_to_packed(self, starts: list[int], lengths: list[int]) -> torch.Tensor:
        """int64 [N] packed token indices of each row's columns [starts[i], starts[i] + lengths[i]) of the
        shifted grid, row by row (the position of grid column t of row i is segments[i] + t)."""
        index = [torch.arange(a + s, a + s + n) for a, s, n in zip(self.segments, starts, lengths)]
        return torch.cat(index).to(self.input_ids.device) if index else torch.zeros(0, dtype=torch.long)


@dataclass
class MicroBatch:
    """One forward/backward unit: padded inputs plus response-aligned tensors on the [B, T-1] grid."""

    input_ids: torch.Tensor  # [B, T] int64
    response_mask: torch.Tensor  # [B, T-1] float32, 1 where the target is a (trainable) response token
    starts: list[int]  # per row: first column of the response on the shifted grid (P_i - 1)
    lengths: list[int]  # per row: response length R_i
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B, T-1] float32
    # MoE routing replay: MoE layer index -> experts [B, T, k] int64 for every input position (a row's last
    # token and its padding, which score nothing, get experts 0..k-1); None without replay
    routes: dict[int, torch.Tensor] | None = None
    route_mask: torch.Tensor | None = None  # [B, T] bool: positions whose experts came from the rollout
    # top-k distillation (distill.top_k = k): the teacher's top-k ids [B, T-1, k] int64 and their log-probs
    # [B, T-1, k] fp32 on the shifted grid (0 off the responses); None without
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    # Padding-free: the rows end to end, what the model computes (then routes and route_mask are [1, S, k]
    # and [1, S], in the packed layout the model's forward sees); None: the model computes input_ids
    packing: Packing | None = None
    # Vision models: every row's images in row order, and the positions the model computes with (module
    # docstring); None: text rows (the model's default positions)
    images: Images | None = None
    position_ids: torch.Tensor | None = None

    def model_inputs(self) -> dict:
        """What the model's forward takes beside the ids: packed segments, positions and images (those set)."""
        inputs: dict = {}
        if self.packing is not None:
            inputs["segments"] = self.packing.segments
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        if self.images is not None:
            inputs["images"] = self.images
        return inputs

    @property
    def num_rows(self) -> int:
        """Rows in this micro-batch."""
        return len(self.lengths)

    def token_mask(self) -> torch.Tensor:
        """[B, T] bool: the positions holding a row's tokens (prompt and response), not padding; packed: [1, S]
        of True (the layout of the model's forward)."""
        if self.packing is not None:
            return torch.ones(self.packing.input_ids.shape, dtype=torch.bool, device=self.input_ids.device)
        ends = torch.tensor(
            [s + 1 + n for s, n in zip(self.starts, self.lengths)], device=self.input_ids.device
        )
        return torch.arange(self.input_ids.shape[1], device=ends.device)[None, :] < ends[:, None]

    def model_input_ids(self) -> torch.Tensor:
        """What the model's forward computes: the packed [1, S] ids, or the padded [B, T] ones."""
        return self.input_ids if self.packing is None else self.packing.input_ids

    def from_packed(self, values: torch.Tensor) -> torch.Tensor:
        """The model's outputs [1, S, ...] of a packed micro-batch on the shifted grid [B, T-1, ...] (each row's
        first L_i - 1 positions; 0 elsewhere)."""
        assert self.packing is not None, "from_packed is for packed micro-batches"
        rows, width = self.input_ids.shape[0], self.input_ids.shape[1] - 1
        seq_lens = [s + n for s, n in zip(self.starts, self.lengths)]  # L_i - 1: positions predicting a token
        grid = values.new_zeros((rows * width, *values.shape[2:]))
        where = torch.cat([torch.arange(i * width, i * width + n) for i, n in enumerate(seq_lens)])
        picked = values[0].index_select(0, self.packing.grid_to_packed([0] * rows, seq_lens))
        return grid.index_copy(0, where.to(values.device), picked).view(rows, width, *values.shape[2:])

    def unpad(self, values: torch.Tensor) -> list[torch.Tensor]:
        """[B, T-1] grid -> one [R_i] tensor per row (detached, on CPU)."""
        values = values.detach().cpu()
        return [values[i, s : s + n].clone() for i, (s, n) in enumerate(zip(self.starts, self.lengths))]


def response_positions(mb: MicroBatch) -> torch.Tensor:
    """int64 [N] indices into the flattened [B (T-1)] grid of every row's response columns (N = sum R_i), row
    by row: the positions whose next token a log-prob pass scores."""
    width = mb.input_ids.shape[1] - 1
    index = [
        torch.arange(i * width + s, i * width + s + n) for i, (s, n) in enumerate(zip(mb.starts, mb.lengths))
    ]
    return torch.cat(index).to(mb.input_ids.device) if index else torch.zeros(0, dtype=torch.long)


def packed_response_positions(mb: MicroBatch) -> torch.Tensor:
    """int64 [N] indices into the packed [S] tokens of every row's response columns, in the order of
    `response_positions` (a packed micro-batch's hidden states there score the same next tokens)."""
    assert mb.packing is not None, "packed_response_positions is for packed micro-batches"
    return mb.packing.grid_to_packed(mb.starts, mb.lengths)


def make_micro_batch(
    prompts: list[torch.Tensor],
    responses: list[torch.Tensor],
    *,
    pad_token_id: int,
    device: torch.device | str = "cpu",
    per_token: dict[str, list[torch.Tensor]] | None = None,
    response_masks: list[torch.Tensor] | None = None,
    routes: list[torch.Tensor] | None = None,
    moe_layers: list[int] | None = None,
    teacher_topk: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    packed: bool = False,
    images: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    vision: VisionInputs | None = None,
) -> MicroBatch:
    """Pad rows to one tensor; per-token columns (advantages, old/ref log-probs) are placed on the shifted grid.
    `routes` (MoE): per row the rollout's experts [P + R - 1, L, k] of the MoE layers `moe_layers`.
    `teacher_topk` (top-k distillation): per row the teacher's top-k ids [R, k] and log-probs [R, k]. `packed`:
    the model computes the rows end to end instead (`Packing`, module docstring). `images` (a vision model,
    read through `vision`): per row its uint8 patches [N_i, C*t*p*p] and grid [n_i, 3]."""
    seqs = [torch.cat([p.long(), r.long()]) for p, r in zip(prompts, responses)]
    num_rows, max_len = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((num_rows, max_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros(num_rows, max_len - 1)
    starts, lengths = [], []
    for i, (seq, prompt, resp) in enumerate(zip(seqs, prompts, responses)):
        input_ids[i, : len(seq)] = seq
        start, length = len(prompt) - 1, len(resp)
        mask[i, start : start + length] = 1.0 if response_masks is None else response_masks[i].float()
        starts.append(start)
        lengths.append(length)
    grids = {}
    for name, rows in (per_token or {}).items():
        grid = torch.zeros(num_rows, max_len - 1)
        for i, values in enumerate(rows):
            grid[i, starts[i] : starts[i] + lengths[i]] = values.float()
        grids[name] = grid.to(device)
    batch = MicroBatch(input_ids.to(device), mask.to(device), starts, lengths, grids)
    if teacher_topk is not None:
        ids, logps = teacher_topk
        k = ids[0].shape[-1]
        id_grid = torch.zeros(num_rows, max_len - 1, k, dtype=torch.long)
        logp_grid = torch.zeros(num_rows, max_len - 1, k)
        for i, (row_ids, row_logps) in enumerate(zip(ids, logps)):
            id_grid[i, starts[i] : starts[i] + lengths[i]] = row_ids.long()
            logp_grid[i, starts[i] : starts[i] + lengths[i]] = row_logps.float()
        batch.topk_ids, batch.topk_logprobs = id_grid.to(device), logp_grid.to(device)
    if packed:
        segments = (0, *itertools.accumulate(len(seq) for seq in seqs))
        batch.packing = Packing(torch.cat(seqs)[None].to(device), segments)
    if vision is not None and images is not None:
        _add_images(batch, seqs, images, vision, device)
    if routes is not None:
        assert moe_layers is not None, "routes come with the model's MoE layer indices"
        if batch.packing is None:
            batch.routes, batch.route_mask = _route_grids(routes, moe_layers, max_len, device)
        else:  # the layout of the packed forward: one row of S tokens, each row's routes at its own tokens
            batch.routes, batch.route_mask = _route_grids(
                routes, moe_layers, batch.packing.segments[-1], device, batch.packing.segments[:-1]
            )
    return batch


def _add_images(
    batch: MicroBatch,
    seqs: list[torch.Tensor],
    images: list[tuple[torch.Tensor, torch.Tensor]],
    vision: VisionInputs,
    device: torch.device | str,
) -> None:
    """Set `batch.images` and its multimodal `position_ids` (module docstring) from the rows' images: image
    tokens are read in each row's prompt only (a response that sampled the image-pad token holds it as text)."""
    prompt_lens = [s + 1 for s in batch.starts]
    rows = [
        vision.positions(seq, grid, n)[0] for seq, (_, grid), n in zip(seqs, images, prompt_lens)
    ]  # [3, L_i]
    is_image = [
        (seq == vision.image_token_id) & (torch.arange(len(seq)) < n) for seq, n in zip(seqs, prompt_lens)
    ]
    found = vision.images(images, device)
    if batch.packing is not None:
        batch.position_ids = torch.cat(rows, dim=1)[:, None].to(device)  # [3, 1, S]
        mask = torch.cat(is_image)[None]  # [1, S]
    else:
        mask = torch.zeros(batch.input_ids.shape, dtype=torch.bool)  # [B, T]
        for i, row_mask in enumerate(is_image):
            mask[i, : len(row_mask)] = row_mask
    batch.images = None if found is None else dataclasses.replace(found, token_mask=mask.to(device))
    if batch.packing is not None:
        return
    width = batch.input_ids.shape[1]
    grid = torch.zeros(3, len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        grid[:, i, : row.shape[1]] = row
        last = int(row.max()) if row.numel() else -1  # padding continues the row's text positions
        grid[:, i, row.shape[1] :] = torch.arange(last + 1, last + 1 + width - row.shape[1])
    batch.position_ids = grid.to(device)


def _route_grids(
    routes: list[torch.Tensor],
    moe_layers: list[int],
    width: int,
    device: torch.device | str,
    packed_starts: tuple[int, ...] | None = None,
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Per MoE layer [B, T, k] experts from per-row [n_i, L, k] routes, and the [B, T] mask of given ones;
    with `packed_starts` (row i's first packed token) one [1, S] row holding every row's routes instead."""
    top_k = routes[0].shape[-1]
    num_rows = len(routes) if packed_starts is None else 1
    grid = torch.arange(top_k).expand(num_rows, width, len(moe_layers), top_k).clone()  # fill: 0..k-1
    given = torch.zeros(num_rows, width, dtype=torch.bool)
    for i, row in enumerate(routes):
        at, first = (i, 0) if packed_starts is None else (0, packed_starts[i])
        grid[at, first : first + row.shape[0]] = row.long()
        given[at, first : first + row.shape[0]] = True
    return {layer: grid[:, :, j].to(device) for j, layer in enumerate(moe_layers)}, given.to(device)


def split_indices(num_rows: int, size: int) -> list[list[int]]:
    """Consecutive index chunks of at most `size`."""
    return [list(range(i, min(i + size, num_rows))) for i in range(0, num_rows, size)]


def micro_batch_rows(
    lengths: list[int], micro_batch_size: int, max_tokens: int, packed: bool = False
) -> list[list[int]]:
    """Which rows (positions into `lengths`, each row's prompt + response tokens) form each micro-batch.

    max_tokens > 0 (a token budget, actor.max_tokens_per_micro_batch): rows sorted longest first, and each
    micro-batch takes rows while the tokens it computes stay within max_tokens: rows x its longest row (the
    padded size), or with `packed` the sum of its rows' lengths; a row longer than the budget goes alone. Rows
    of like length share a micro-batch, so little padding is computed, and a small model's whole batch can be
    one pass. micro_batch_size is not used. max_tokens = 0: consecutive chunks of micro_batch_size rows, in
    order. The same rows give the same micro-batches (a resumed run's passes are the original's).
    """
    if max_tokens <= 0:
        return split_indices(len(lengths), micro_batch_size)
    chunks: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep their order
        if chunks and _computed(chunks[-1] + [row], lengths, packed) <= max_tokens:
            chunks[-1].append(row)
        else:
            chunks.append([row])
    return chunks


def _computed(rows: list[int], lengths: list[int], packed: bool) -> int:
    """Tokens a micro-batch of `rows` (longest first) computes: their sum packed, else rows x the longest."""
    return sum(lengths[i] for i in rows) if packed else len(rows) * lengths[rows[0]]
