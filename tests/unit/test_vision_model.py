"""Qwen2.5-VL in dockrl (models/vision.py, the decoder's mrope): logits equal transformers'
Qwen2_5_VLForConditionalGeneration on a tiny random model with two images of different sizes and text, through
a checkpoint transformers saved (hub in) and one dockrl saved (hub out).

The bound. Both sides compute in fp32 the same sums in other orders (Conv3d against one linear map, SDPA
kernels, fused against split rotary). A dot product of length n summed in any order is off by at most
n * u * sum |a_i b_i| (u = 2^-24, first order); the error a layer adds reaches the logits through layers whose
gain at these random weights is about one (RMSNorm rescales, residual adds), so the logits differ by at most
u * L * M, L the summed reduction lengths on the longest path from pixels to a logit (`_reduction_length`) and
M = max(1, max |logit|). A broken model is off by orders more (the checks at the end of each test).
"""

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from dockrl.models.config import ModelArgs
from dockrl.models.hf import load_model, save_model
from dockrl.models.tiny import make_tiny
from dockrl.models.tokenizer import Tokenizer
from dockrl.models.vision import Images, mrope_positions, normalize_patches
from dockrl.models.vision_processing import expand_image_pads, image_token_count, process_images
from helpers import perturb_

pytestmark = pytest.mark.unit

VOCAB, IMAGE, VIDEO, START, END = 128, 120, 121, 122, 123
PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 224 * 224, "patch_size": 14, "merge_size": 2}
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
)
# window_size 56 = 2 x 2 merge units per window: the 6 x 8 and 10 x 4 patch grids below have several windows,
# cut at the edges; block 1 attends over the whole image.
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56)
VISION["fullatt_block_indexes"] = [1]


def _hf_model() -> Qwen2_5_VLForConditionalGeneration:
    config = Qwen2_5_VLConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    perturb_(model, seed=1)
    with (
        torch.no_grad()
    ):  # vision norms around 1 as the text ones (perturb_ knows `norm.weight` only), so the
        for name, param in model.named_parameters():  # images weigh in the logits as much as the text
            if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
                param.add_(1.0)
    return model.eval()


def _sample() -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """input_ids [1, T] with two images (112 x 84 and 56 x 140 pixels, w x h: patch grids 6 x 8 and 10 x 4,
    h x w) among text."""
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(0, 256, (140, 56, 3), dtype=np.uint8)),
    ]
    patches, grid = process_images(PROCESSOR, images)
    first, second = image_token_count(grid, merge_size=2)
    ids = [5, 6, 7, START] + [IMAGE] * first + [END, 8, 9, START] + [IMAGE] * second + [END, 10, 11, 12, 13]
    return torch.tensor([ids]), patches, grid


def _reduction_length(args: ModelArgs, num_tokens: int, num_patches: int) -> int:
    """Summed lengths of the dot products on the longest path from a pixel to a logit (module docstring)."""
    v = args.vision
    assert v is not None
    merged = v.hidden_size * v.spatial_merge_size**2
    block = 3 * v.hidden_size + num_patches + v.hidden_size + v.hidden_size + v.intermediate_size
    layer = 3 * args.hidden_size + num_tokens + args.hidden_size + args.hidden_size + args.intermediate_size
    return (
        v.patch_dim
        + v.depth * block
        + v.hidden_size
        + 2 * merged
        + args.num_layers * layer
        + 2 * args.hidden_size
    )


@torch.no_grad()
def _hf_logits(model, ids: torch.Tensor, patches: np.ndarray, grid: np.ndarray) -> torch.Tensor:
    pixel_values = normalize_patches(torch.from_numpy(patches), PROCESSOR)
    return model(
        input_ids=ids,
        pixel_values=pixel_values,
        image_grid_thw=torch.from_numpy(grid),
        mm_token_type_ids=(ids == IMAGE).int(),
    ).logits


@torch.no_grad()
def _dockrl_logits(model, ids: torch.Tensor, patches: np.ndarray, grid: np.ndarray, mrope: bool = True):
    images = Images.from_grid_thw(normalize_patches(torch.from_numpy(patches), PROCESSOR), grid)
    positions, _ = mrope_positions(ids[0], images.grid, IMAGE, merge_size=2)
    position_ids = positions[:, None] if mrope else torch.arange(ids.shape[1])[None]
    return model(ids, position_ids=position_ids, images=images)


def _bound(args: ModelArgs, logits: torch.Tensor, num_patches: int) -> float:
    length = _reduction_length(args, logits.shape[1], num_patches)
    return 2.0**-24 * length * max(1.0, logits.abs().max().item())


def test_hf_checkpoint_loads_with_transformers_logits(tmp_path):
    hf_model = _hf_model()
    hf_model.save_pretrained(tmp_path)
    model = load_model(tmp_path).eval()
    assert model.args.family == "qwen2_5_vl" and model.args.mrope_section == (2, 3, 3)
    assert model.args.num_params() == sum(p.numel() for p in model.parameters())
    ids, patches, grid = _sample()
    expected = _hf_logits(hf_model, ids, patches, grid)
    logits = _dockrl_logits(model, ids, patches, grid)
    bound = _bound(model.args, expected, patches.shape[0])
    assert (logits - expected).abs().max().item() <= bound
    # The check sees a model without multimodal positions: 1-D positions move the logits far past the bound.
    plain = _dockrl_logits(model, ids, patches, grid, mrope=False)
    assert (plain - expected).abs().max().item() > 100 * bound


def test_saved_model_loads_in_transformers_with_dockrl_logits(tmp_path):
    hf_model = _hf_model()
    hf_model.save_pretrained(tmp_path / "hf")
    model = load_model(tmp_path / "hf").eval()
    perturb_(model, seed=3)  # weights of dockrl's own, so a load that reads the old file cannot pass
    save_model(model, model.args, tmp_path / "out")
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(exported) is Qwen2_5_VLForConditionalGeneration
    ids, patches, grid = _sample()
    logits = _dockrl_logits(model, ids, patches, grid)
    expected = _hf_logits(exported, ids, patches, grid)
    assert (logits - expected).abs().max().item() <= _bound(model.args, expected, patches.shape[0])
    assert (logits - _hf_logits(hf_model, ids, patches, grid)).abs().max().item() > 1.0


def test_rope_delta_continues_text_positions():
    ids, patches, grid = _sample()
    positions, delta = mrope_positions(ids[0], [tuple(g) for g in grid.tolist()], IMAGE, merge_size=2)
    # image 1: 3 x 4 units (h x w) from position 4, its last unit (2, 3); text resumes at 4 + max(3, 4) = 8;
    # image 2 (5 x 2 units) starts at 8 + 1 (END) + 2 + 1 (START) = 12, text resumes at 12 + 5 = 17; the last
    # text token is 17 + 1 + 3 = 21.
    assert positions[:, 4].tolist() == [4, 4, 4] and positions[:, 15].tolist() == [4, 6, 7]
    assert positions[:, -1].tolist() == [21, 21, 21]
    assert delta == 22 - ids.shape[1]
    with pytest.raises(ValueError, match="run of"):
        mrope_positions(ids[0, :-8], [tuple(g) for g in grid.tolist()], IMAGE, merge_size=2)


def test_make_tiny_vision_model_loads_in_transformers_with_dockrl_logits(tmp_path):
    """make-tiny's qwen2_5_vl directory: its chat template puts the image in the user turn, its processor
    config gives the patches, and transformers computes dockrl's logits from the files."""
    out = make_tiny(tmp_path / "tiny", family="qwen2_5_vl")
    model = load_model(out).eval()
    save_model(model, model.args, tmp_path / "export", tokenizer_dir=out)  # an export keeps the processor
    assert (tmp_path / "export" / "preprocessor_config.json").read_text() == (
        out / "preprocessor_config.json"
    ).read_text()
    tokenizer = Tokenizer.from_dir(out)
    assert 0.3e6 < model.args.num_params() < 2e6
    message = [{"type": "image"}, {"type": "text", "text": "What is 2+3?"}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is 2+3?" in prompt
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (70, 150, 3), dtype=np.uint8))
    patches, grid = process_images(out, [image])
    image_pad = model.args.image_token_id
    ids = expand_image_pads(tokenizer.encode(prompt), image_token_count(grid, 2), image_pad)
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer.encode(prompt, add_special_tokens=False) == tokenizer.encode(prompt)
    hf_model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    pixel_values = normalize_patches(torch.from_numpy(patches), out)
    with torch.no_grad():
        expected = hf_model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            image_grid_thw=torch.from_numpy(grid),
            mm_token_type_ids=(input_ids == image_pad).int(),
        ).logits
        positions, _ = mrope_positions(ids, grid.tolist(), image_pad, merge_size=2)
        images = Images.from_grid_thw(pixel_values, grid)
        logits = model(input_ids, position_ids=positions[:, None], images=images)
    assert (logits - expected).abs().max().item() <= _bound(model.args, expected, patches.shape[0])


def test_transformers_4_layout_loads(tmp_path):
    """Checkpoints written by transformers 4.5x name the parts model.language_model.* and model.visual.*."""
    hf_model = _hf_model()
    hf_model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    renamed = {_transformers_4_name(name): tensor for name, tensor in weights.items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(tmp_path).eval()
    ids, patches, grid = _sample()
    expected = _hf_logits(hf_model, ids, patches, grid)
    logits = _dockrl_logits(model, ids, patches, grid)
    assert (logits - expected).abs().max().item() <= _bound(model.args, expected, patches.shape[0])


def _transformers_4_name(name: str) -> str:
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name.removeprefix("model.")
    return name  # lm_head.weight
