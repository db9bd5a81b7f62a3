"""Qwen2.5-VL's vision side in torch: the dock's uint8 patches -> pixel values -> image embeddings.

    uint8 patches [P, C*t*p*p] --normalize_patches--> pixel values (fp32, the processor's pixel_values)
        --patch embed (Conv3d with stride = kernel, i.e. one linear)--> [P, E]
        --reorder by window (merge units grouped per window_size x window_size window)-->
        --blocks: RMSNorm, attention with 2-D rotary (h, w), RMSNorm, SwiGLU MLP; attention within a window,
          or within the whole image at fullatt_block_indexes-->
        --merger: RMSNorm, fold each merge x merge unit into one vector, MLP (GELU) to the LM's hidden size-->
        --undo the window order--> image embeddings [P / merge**2, H], one per <|image_pad|> token

Parameter names equal transformers' `model.visual.*` (without the `model.visual.` prefix), so state dicts map
1:1. Shape letters: P patches (all images of a row, concatenated), E vision hidden size, H the language
model's hidden size, U merge units (P / merge**2), D vision head dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dockrl.models.config import ModelArgs, VisionArgs
from dockrl.models.rms_norm import RMSNorm
from dockrl.models.vision_processing import PREPROCESSOR_FILE, ProcessorConfig, processor_config

Grid = Sequence[tuple[int, int, int]]
"""Each image's (t, h, w) in patches, in the order of its patches (the dock's image_grid_thw rows)."""


def normalize_patches(patches: torch.Tensor, config: ProcessorConfig | str | Path | Mapping) -> torch.Tensor:
    """uint8 patches [P, 3*t*p*p] (vision_processing.process_images) -> fp32 pixel values [P, 3*t*p*p], equal
    bit for bit to transformers' processor: x * rescale_factor in float64 rounded to fp32 (its rescale), then
    (x - mean) / std per channel in fp32 (its normalize); each patch is channel-major."""
    config = config if isinstance(config, ProcessorConfig) else processor_config(config)
    num_patches = patches.shape[0]
    if config.do_rescale:
        pixels = (patches.to(torch.float64) * config.rescale_factor).to(torch.float32)
    else:
        pixels = patches.to(torch.float32)
    if config.do_normalize:
        mean = torch.tensor(config.image_mean, dtype=torch.float32, device=patches.device)[:, None]
        std = torch.tensor(config.image_std, dtype=torch.float32, device=patches.device)[:, None]
        pixels = (pixels.view(num_patches, 3, -1) - mean) / std
    return pixels.reshape(num_patches, config.patch_dim)


@dataclass(frozen=True)
class Images:
    """The images of one forward pass: every image's patches end to end and its grid.

    pixel_values [P, C*t*p*p] (normalize_patches of the dock's uint8 patches); grid rows (t, h, w), one per
    image, in the order the images' <|image_pad|> runs appear in input_ids (row by row for a batch).
    token_mask: bool, the shape of input_ids: the tokens the embeddings replace (the prompts' image pads: a
    sampled response may hold the pad token too, as text); None: every image-pad token."""

    pixel_values: torch.Tensor
    grid: tuple[tuple[int, int, int], ...]
    token_mask: torch.Tensor | None = None

    @classmethod
    def from_grid_thw(cls, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Grid) -> Images:
        """From a grid tensor [n, 3] (or rows)."""
        rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
        return cls(pixel_values, tuple((int(t), int(h), int(w)) for t, h, w in rows))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class Spans:
    """Where attention is bidirectional within spans of the patches (windows, or whole images), spans of equal
    length batched: each group's token indices [n, L], and `restore` [P], the original order of the groups'
    tokens laid end to end. One attention call per distinct length instead of per span (a Qwen2.5-VL image is
    mostly full windows of one size), each call costing n L^2, never the P^2 of a masked call."""

    groups: tuple[torch.Tensor, ...]
    restore: torch.Tensor

    @classmethod
    def of(cls, bounds: Sequence[int], device: torch.device | str) -> Spans:
        """From cumulative span bounds (0, ..., P)."""
        starts_by_length: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:]):
            starts_by_length.setdefault(end - start, []).append(start)
        groups = tuple(
            torch.tensor(starts)[:, None] + torch.arange(length)
            for length, starts in starts_by_length.items()
        )
        restore = torch.argsort(torch.cat([group.flatten() for group in groups]))
        return cls(tuple(group.to(device) for group in groups), restore.to(device))


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each of `spans`, 2-D rotary on q and k (fp32)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: Spans) -> torch.Tensor:
        """x [P, E]; cos, sin [P, 1, D] fp32 -> [P, E]."""
        num_patches = x.shape[0]
        q, k, v = (
            self.qkv(x).view(num_patches, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        )  # [P, N, D]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [N, P, D]
        parts = []
        for index in spans.groups:  # [n, L]
            q_g, k_g, v_g = (t[:, index].transpose(0, 1) for t in (q, k, v))  # [n, N, L, D]
            out_g = F.scaled_dot_product_attention(q_g, k_g, v_g)  # [n, N, L, D]
            parts.append(out_g.transpose(0, 1).reshape(self.num_heads, -1, out_g.shape[-1]))  # [N, n L, D]
        out = torch.cat(parts, dim=1)[:, spans.restore]  # [N, P, D]
        return self.proj(out.transpose(0, 1).reshape(num_patches, -1))  # [P, E]


class VisionMLP(nn.Module):
    """SwiGLU with biases: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [P, E] -> [P, E]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, 1e-6)
        self.norm2 = RMSNorm(args.hidden_size, 1e-6)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: Spans) -> torch.Tensor:
        """x [P, E] -> [P, E]."""
        x = x + self.attn(self.norm1(x), cos, sin, spans)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Patch embedding: a Conv3d whose stride equals its kernel, applied as the one linear map it is (the
    weight keeps the Conv3d shape [E, C, t, p, p] of Hugging Face's checkpoints)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        kernel = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.in_channels, args.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [P, C*t*p*p] -> [P, E]."""
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class PatchMerger(nn.Module):
    """RMSNorm, then each merge unit's m*m patch vectors side by side through Linear, GELU, Linear."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.merged_size = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = RMSNorm(args.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_size, self.merged_size),
            nn.GELU(),
            nn.Linear(self.merged_size, args.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [P, E] -> [U, H]."""
        return self.mlp(self.ln_q(x).view(-1, self.merged_size))


class VisionTower(nn.Module):
    """Qwen2.5-VL's vision encoder (module docstring): pixel values of a batch's images -> one embedding per
    <|image_pad|> token, in the images' order. Hugging Face's `visual.` prefix."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)

    def blank_images(self) -> Images:
        """One black image of one merge unit (the smallest the tower takes)."""
        m = self.args.spatial_merge_size
        weight = self.patch_embed.proj.weight
        pixels = torch.zeros(m * m, self.args.patch_dim, dtype=weight.dtype, device=weight.device)
        return Images(pixels, ((1, m, m),))

    def forward(self, images: Images) -> torch.Tensor:
        """Image embeddings [U, H] (U = P / m^2) in the dtype of the parameters."""
        args, grid = self.args, images.grid
        unit = args.spatial_merge_size**2
        device = self.patch_embed.proj.weight.device
        window_index, window_bounds = window_order(grid, args)
        order = torch.tensor(window_index, device=device)
        x = self.patch_embed(images.pixel_values.to(device))  # [P, E]
        num_patches = x.shape[0]
        if num_patches != sum(t * h * w for t, h, w in grid):
            raise ValueError(f"{num_patches} patches do not match the image grids {list(grid)}")
        x = x.view(-1, unit, x.shape[-1])[order].reshape(num_patches, -1)  # window order, merge units intact
        freqs = vision_rope_angles(grid, args, device)  # [P, D/2] fp32
        freqs = freqs.view(-1, unit, freqs.shape[-1])[order].reshape(num_patches, -1)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [P, 1, D]
        cos, sin = emb.cos(), emb.sin()
        full = Spans.of(_cumulative([h * w for t, h, w in grid for _ in range(t)]), device)
        windows = Spans.of(window_bounds, device)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if index in args.fullatt_block_indexes else windows)
        merged = self.merger(x)  # [U, H] in window order
        return merged[torch.argsort(order)]


def _cumulative(lengths: Sequence[int]) -> list[int]:
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return bounds


def vision_rope_angles(grid: Grid, args: VisionArgs, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 [P, D/2]: each patch's rotary angles, its row's D/4 frequencies then its column's, for the patches
    in the processor's order (merge units row-major, patches row-major inside a unit)."""
    spatial_dim = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))
    m = args.spatial_merge_size
    rows = []
    for t, h, w in grid:
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // m, m, w // m, m)
        hpos = hpos.reshape(shape).transpose(1, 2).flatten()
        wpos = wpos.reshape(shape).transpose(1, 2).flatten()
        rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    positions = torch.cat(rows).to(device)  # [P, 2]
    freqs = positions[..., None].float() * inv_freq.to(device)  # [P, 2, D/4]
    return torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)


def window_order(grid: Grid, args: VisionArgs) -> tuple[list[int], list[int]]:
    """(the merge units in window order: window by window, row-major inside each, windows row-major per frame;
    cumulative patch bounds of the windows). A window is window_size pixels square; edge windows are cut."""
    m = args.spatial_merge_size
    side = args.window_size // m // args.patch_size  # window side in merge units
    order: list[int] = []
    bounds = [0]
    first = 0
    for t, h, w in grid:
        units_h, units_w = h // m, w // m
        for frame in range(t):
            base = first + frame * units_h * units_w
            for top in range(0, units_h, side):
                for left in range(0, units_w, side):
                    rows = range(top, min(top + side, units_h))
                    cols = range(left, min(left + side, units_w))
                    order += [base + r * units_w + c for r in rows for c in cols]
                    bounds.append(bounds[-1] + len(rows) * len(cols) * m * m)
        first += t * units_h * units_w
    return order, bounds


def mrope_positions(
    token_ids: Sequence[int] | torch.Tensor,
    grid: Grid,
    image_token_id: int,
    merge_size: int,
    num_prompt_tokens: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Multimodal RoPE positions of one sequence (transformers' get_rope_index for images): (int64 [3, T] of
    the temporal, height and width streams, rope delta).

    Text tokens count on from the last position in all three streams. The k-th run of image-pad tokens is
    image grid[k] (t, h, w): starting at s (the next text position), its token (i, j) of frame f gets
    (s + f, s + i, s + j) for a (h / m) x (w / m) unit grid, and the text after it continues at
    s + max(h, w) / m. delta = max position + 1 - T: a token appended at index T + n has position T + n +
    delta in every stream (the rollout's decode). With `num_prompt_tokens`, image runs are read in the first
    that many tokens only: a response is text, whatever tokens it sampled."""
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    prompt_end = len(ids) if num_prompt_tokens is None else num_prompt_tokens
    streams: list[torch.Tensor] = []
    grids = [(int(t), int(h), int(w)) for t, h, w in grid]
    images = iter(enumerate(grids))
    next_position, index = 0, 0
    while index < len(ids):
        end = index
        is_image = ids[index] == image_token_id and index < prompt_end
        while end < len(ids) and (ids[end] == image_token_id and end < prompt_end) == is_image:
            end += 1
        if not is_image:
            streams.append(torch.arange(next_position, next_position + end - index).expand(3, -1))
            next_position += end - index
        else:
            try:
                number, (t, h, w) = next(images)
            except StopIteration:
                raise ValueError(
                    f"more image-pad runs in the sequence than the {len(grids)} image grids"
                ) from None
            units = (t, h // merge_size, w // merge_size)
            if end - index != units[0] * units[1] * units[2]:
                raise ValueError(
                    f"image {number} (grid {(t, h, w)}) takes {units[0] * units[1] * units[2]} image-pad tokens; "
                    f"the sequence has a run of {end - index}"
                )
            frame, row, col = torch.meshgrid(*(torch.arange(n) for n in units), indexing="ij")
            streams.append(torch.stack([frame, row, col]).reshape(3, -1) + next_position)
            next_position += max(units[1], units[2])
        index = end
    if next(images, None) is not None:
        raise ValueError(f"the sequence has fewer image-pad runs than the {len(grids)} image grids")
    positions = torch.cat(streams, dim=1) if streams else torch.zeros(3, 0, dtype=torch.int64)
    delta = int(positions.max()) + 1 - len(ids) if ids else 0
    return positions, delta


@dataclass(frozen=True)
class VisionInputs:
    """How a vision model reads its rows: the image processor (for the dock's uint8 patches), the image-pad
    token and the merge size (for the multimodal positions). `for_model` reads them from a model directory."""

    processor: ProcessorConfig
    image_token_id: int
    merge_size: int

    @classmethod
    def for_model(cls, model_dir: str | Path, args: ModelArgs) -> VisionInputs:
        """From `model_dir`'s preprocessor_config.json and its args; raises FileNotFoundError naming the file."""
        assert args.vision is not None, "VisionInputs are a vision model's"
        path = Path(model_dir) / PREPROCESSOR_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: a vision model's directory holds its image processor's settings "
                "(transformers writes it with the model; dockrl make-tiny --family qwen2_5_vl does too)"
            )
        return cls(processor_config(path), args.image_token_id, args.vision.spatial_merge_size)

    def images(
        self, rows: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str
    ) -> Images | None:
        """The rows' images, row after row ((uint8 patches [N_i, C*t*p*p], grid [n_i, 3]) each; a row without
        images has 0 of both): None when no row has one."""
        patches = [torch.as_tensor(p) for p, grid in rows if len(grid)]
        if not patches:
            return None
        grid = tuple(
            (int(t), int(h), int(w)) for _, row_grid in rows for t, h, w in torch.as_tensor(row_grid).tolist()
        )
        pixel_values = normalize_patches(torch.cat(patches).to(device), self.processor)
        return Images(pixel_values, grid)

    def positions(
        self, token_ids: torch.Tensor, grid: torch.Tensor, num_prompt_tokens: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """mrope_positions of one row (its tokens [L], its images' grid [n, 3], images in its first
        num_prompt_tokens tokens)."""
        rows = [tuple(g) for g in torch.as_tensor(grid).tolist()]
        return mrope_positions(token_ids, rows, self.image_token_id, self.merge_size, num_prompt_tokens)
