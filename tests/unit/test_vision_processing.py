"""Images -> dock patches -> pixel values equal transformers' Qwen2-VL PIL image processor bit for bit."""

import numpy as np
import pytest
import torch
from PIL import Image

from dockrl.models.vision import normalize_patches
from dockrl.models.vision_processing import image_token_count, process_images, processor_config

pytestmark = pytest.mark.unit

PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 224 * 224, "patch_size": 14, "merge_size": 2}


def _images() -> list[Image.Image]:
    """Three random images: RGB (upscaled past min_pixels), RGBA (alpha composited on white), grey and large
    (downscaled under max_pixels)."""
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (40, 70, 3), dtype=np.uint8), "RGB")
    rgba = Image.fromarray(rng.integers(0, 256, (90, 60, 4), dtype=np.uint8), "RGBA")
    grey = Image.fromarray(rng.integers(0, 256, (300, 250), dtype=np.uint8), "L")
    return [rgb, rgba, grey]


def _reference(images: list[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Qwen2VLImageProcessorPil(**PROCESSOR)(images=images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def test_patches_normalize_to_the_processors_pixel_values():
    images = _images()
    patches, grid_thw = process_images(PROCESSOR, images)
    pixel_values, reference_grid = _reference(images)
    assert patches.dtype == np.uint8 and grid_thw.dtype == np.int64
    np.testing.assert_array_equal(grid_thw, reference_grid)
    assert patches.shape == pixel_values.shape
    # Exact: the same fp32 operations (rescale in float64 then rounded, subtract, divide) on the same bytes.
    torch.testing.assert_close(
        normalize_patches(torch.from_numpy(patches), PROCESSOR),
        torch.from_numpy(pixel_values),
        rtol=0,
        atol=0,
    )
    counts = image_token_count(grid_thw, merge_size=2)
    assert counts == [int(t * h * w) // 4 for t, h, w in reference_grid]
    assert sum(counts) * 4 == patches.shape[0]


def test_patch_order_matters():
    """The check above sees a patch order other than the processor's (patches of one image transposed)."""
    images = _images()[:1]
    patches, grid_thw = process_images(PROCESSOR, images)
    pixel_values, _ = _reference(images)
    _, h, w = grid_thw[0]
    shuffled = patches.reshape(h // 2, w // 2, 4, -1).transpose(1, 0, 2, 3).reshape(patches.shape)
    normalized = normalize_patches(torch.from_numpy(np.ascontiguousarray(shuffled)), PROCESSOR)
    assert not torch.equal(normalized, torch.from_numpy(pixel_values))


def test_processor_config_reads_a_saved_processor(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(tmp_path)
    config = processor_config(tmp_path)
    assert (config.min_pixels, config.max_pixels, config.patch_dim) == (56 * 56, 224 * 224, 3 * 2 * 14 * 14)
    with pytest.raises(ValueError, match="resample=2"):
        processor_config({**PROCESSOR, "resample": 2})
