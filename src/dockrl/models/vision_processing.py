"""Images -> the uint8 patches a Qwen2.5-VL row carries in the dock, without torch (the data side calls it).

    PIL image --RGB (alpha on white)--> smart_resize (multiple of patch*merge, min/max pixels)
              --PIL bicubic--> uint8 [3, H, W] --patchify--> uint8 [n_patches, 3*temporal*patch*patch]

This is transformers' PIL image processor (Qwen2VLImageProcessorPil, image_processing_pil_qwen2_vl) stopped
before its rescale and normalize: its resize goes through PIL and back to uint8, so the pixels here are exactly
the ones it rescales, and models/vision.py `normalize_patches` finishes the job in torch (4x smaller in the
dock than fp32 and exact). Patch order is the processor's: merge windows row-major, the merge_size x merge_size
patches of a window row-major inside it, each patch channel-major then the repeated temporal frame.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

PREPROCESSOR_FILE = "preprocessor_config.json"
"""The image processor's settings beside a checkpoint (transformers' file name)."""
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""The processor's default per-channel mean and std (OpenAI CLIP's)."""


@dataclass(frozen=True)
class ProcessorConfig:
    """The image processor settings patches depend on (transformers' Qwen2VLImageProcessor keys)."""

    min_pixels: int
    """Fewest pixels of a resized image (config key min_pixels or size.shortest_edge)."""
    max_pixels: int
    """Most pixels of a resized image (config key max_pixels or size.longest_edge)."""
    patch_size: int
    """Side of a vision patch in pixels."""
    temporal_patch_size: int
    """Frames per patch; a still image repeats its frame this many times."""
    merge_size: int
    """Side of the window of patches the merger folds into one language-model token."""
    image_mean: tuple[float, float, float]
    """Per-channel mean subtracted after rescaling."""
    image_std: tuple[float, float, float]
    """Per-channel standard deviation divided by after the mean."""
    rescale_factor: float
    """uint8 -> [0, 1] factor (1/255)."""
    do_rescale: bool
    """Multiply by rescale_factor."""
    do_normalize: bool
    """Subtract the mean and divide by the std."""

    @property
    def patch_dim(self) -> int:
        """Values per patch: 3 channels x temporal frames x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


def processor_config(source: str | Path | Mapping) -> ProcessorConfig:
    """A `ProcessorConfig` from a checkpoint directory (its preprocessor_config.json), the file itself, or the
    dict it holds. Raises ValueError for settings this module does not reproduce (no resize, another
    resampling filter than bicubic, no RGB conversion)."""
    if isinstance(source, Mapping):
        raw = dict(source)
    else:
        path = Path(source)
        if path.is_dir():
            path = path / PREPROCESSOR_FILE
        raw = json.loads(path.read_text())
    size = raw.get("size") or {}
    for key, wanted in (("do_resize", True), ("do_convert_rgb", True), ("resample", 3)):
        if raw.get(key, wanted) != wanted:
            raise ValueError(
                f"preprocessor_config.json {key}={raw[key]!r} is not supported; dockrl uses {wanted}"
            )
    return ProcessorConfig(
        min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
        max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        patch_size=int(raw.get("patch_size", 14)),
        temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
        merge_size=int(raw.get("merge_size", 2)),
        image_mean=_three(raw.get("image_mean", CLIP_MEAN)),
        image_std=_three(raw.get("image_std", CLIP_STD)),
        rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
        do_rescale=bool(raw.get("do_rescale", True)),
        do_normalize=bool(raw.get("do_normalize", True)),
    )


def _three(values: Sequence[float]) -> tuple[float, float, float]:
    red, green, blue = (float(v) for v in values)
    return red, green, blue


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's target size: both sides multiples of `factor` (patch * merge), pixels within
    [min_pixels, max_pixels], aspect ratio kept as closely as that allows (transformers' smart_resize)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {width}x{height}: aspect ratio over 200 is not supported")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white, as the processor's convert_to_rgb does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _patchify(pixels: np.ndarray, config: ProcessorConfig) -> np.ndarray:
    """uint8 [3, H, W] -> uint8 [grid_h * grid_w, patch_dim] in the processor's order (module docstring)."""
    channels, height, width = pixels.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    windows = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    windows = windows.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
    frames = np.broadcast_to(windows[:, :, :, :, :, None], (*windows.shape[:5], t, p, p))
    return np.ascontiguousarray(frames).reshape(grid_h * grid_w, config.patch_dim)


def process_images(
    source: str | Path | Mapping | ProcessorConfig, images: Sequence[Image.Image]
) -> tuple[np.ndarray, np.ndarray]:
    """Images -> (uint8 patches [n_patches, patch_dim], int64 grid_thw [n_images, 3]), the images' patches
    concatenated in order. `source` is a checkpoint directory, a preprocessor_config.json (path or dict) or a
    ProcessorConfig. models/vision.py `normalize_patches` turns the patches into the processor's pixel_values."""
    config = source if isinstance(source, ProcessorConfig) else processor_config(source)
    factor = config.patch_size * config.merge_size
    all_patches, grids = [], []
    for image in images:
        rgb = _rgb(image)
        height, width = smart_resize(rgb.height, rgb.width, factor, config.min_pixels, config.max_pixels)
        resized = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
        pixels = np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1)  # [3, H, W]
        all_patches.append(_patchify(pixels, config))
        grids.append((1, height // config.patch_size, width // config.patch_size))
    if not all_patches:
        return np.zeros((0, config.patch_dim), dtype=np.uint8), np.zeros((0, 3), dtype=np.int64)
    return np.concatenate(all_patches), np.asarray(grids, dtype=np.int64)


def image_token_count(grid_thw: np.ndarray | Sequence[Sequence[int]], merge_size: int) -> list[int]:
    """The number of <|image_pad|> tokens each image takes in the prompt: its patches over merge_size**2
    (the merger folds each merge_size x merge_size window into one token)."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return [int(n) // (merge_size * merge_size) for n in grid.prod(axis=1)]


def expand_image_pads(token_ids: Sequence[int], counts: Sequence[int], image_token_id: int) -> list[int]:
    """A prompt's ids as the chat template wrote them (one <|image_pad|> per image) with the k-th pad repeated
    counts[k] times (image_token_count), as transformers' Qwen2.5-VL processor expands them. Raises
    ValueError when the prompt's pads and the images disagree in number."""
    pads = sum(1 for token in token_ids if token == image_token_id)
    if pads != len(counts):
        raise ValueError(
            f"the prompt has {pads} image-pad tokens for {len(counts)} images; use one per image"
        )
    out: list[int] = []
    remaining = iter(counts)
    for token in token_ids:
        out += [token] * next(remaining) if token == image_token_id else [token]
    return out
