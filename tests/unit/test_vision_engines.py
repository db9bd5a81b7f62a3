"""A vision-language model (qwen2_5_vl) through dockrl's engines: the rollout's prefill and decode, and the
training passes (packed and padded), give the log-probs of one full forward of the model over the row.

Bounds: as tests/unit/test_vision_model.py derives them (u * L * M for a logit, u = 2^-24, L the summed
reduction lengths from pixels to a logit, M = max(1, max |logit|)); a log-prob is a logit minus a
log-sum-exp of logits, so twice that.
"""

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from dockrl.engines.rollout.dock_feed import serve_from_dock
from dockrl.engines.rollout.rollout_engine import Request, RolloutEngine
from dockrl.engines.rollout.sampler import generate
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.engines.train.train_engine import TrainEngine
from dockrl.models.hf import load_model, save_model
from dockrl.models.tiny import make_tiny, peaked_state_dict
from dockrl.models.tokenizer import Tokenizer
from dockrl.models.vision import Images, VisionInputs
from dockrl.models.vision_processing import (
    PREPROCESSOR_FILE,
    expand_image_pads,
    image_token_count,
    process_images,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    """make-tiny's qwen2_5_vl with peaked weights (tiny.peaked_state_dict): whole nats between the top tokens,
    so positions and images move the log-probs far past the bounds."""
    random_dir = make_tiny(tmp_path_factory.mktemp("vl"), family="qwen2_5_vl", num_layers=2)
    model = load_model(random_dir)
    model.load_state_dict(peaked_state_dict(random_dir, seed=1))
    out = tmp_path_factory.mktemp("peaked")
    save_model(model, model.args, out, tokenizer_dir=random_dir)
    shutil.copy(random_dir / PREPROCESSOR_FILE, out / PREPROCESSOR_FILE)
    return out


def _image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _row(
    model_dir, question: str, images: list[Image.Image]
) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor]]:
    """A chat prompt with `images` in the user turn (ids with expanded pads) and its (uint8 patches, grid)."""
    tokenizer = Tokenizer.from_dir(model_dir)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    patches, grid = process_images(model_dir, images)
    image_pad = tokenizer.encode("<|image_pad|>")[0]
    ids = expand_image_pads(tokenizer.encode(prompt), image_token_count(grid, 2), image_pad)
    return ids, (torch.from_numpy(patches), torch.from_numpy(grid))


def _rows(model_dir):
    return [
        _row(model_dir, "What is 2+3?", [_image(0, 84, 112)]),
        _row(model_dir, "Which one is bigger?", [_image(1, 224, 56), _image(2, 60, 60)]),
        _row(model_dir, "What is 7+1?", []),
    ]


@torch.no_grad()
def _full_logprobs(model, vision: VisionInputs, ids: list[int], images, mrope: bool = True, prompt_len=None):
    """log_softmax of one forward over the whole row [T, V] (images in its first prompt_len tokens), and its
    largest |logit|."""
    input_ids = torch.tensor([ids])
    prompt_len = len(ids) if prompt_len is None else prompt_len
    positions, _ = vision.positions(input_ids[0], images[1], prompt_len)
    position_ids = positions[:, None] if mrope else None
    found = vision.images([images], "cpu")
    if found is not None:
        mask = (input_ids == vision.image_token_id) & (torch.arange(len(ids)) < prompt_len)
        found = dataclasses.replace(found, token_mask=mask)
    logits = model(input_ids, position_ids=position_ids, images=found)
    return torch.log_softmax(logits[0].float(), dim=-1), logits.abs().max().item()


def _bound(model, max_logit: float, num_tokens: int, num_patches: int) -> float:
    args, v = model.args, model.args.vision
    merged = v.hidden_size * v.spatial_merge_size**2
    block = 3 * v.hidden_size + num_patches + 2 * v.hidden_size + v.intermediate_size
    layer = 3 * args.hidden_size + num_tokens + 2 * args.hidden_size + args.intermediate_size
    length = v.patch_dim + v.depth * block + v.hidden_size + 2 * merged + args.num_layers * layer
    length += 2 * args.hidden_size
    return 2 * 2.0**-24 * length * max(1.0, max_logit)


@pytest.mark.parametrize("kv_cache, kv_cache_tokens", [("slots", 0), ("paged", 0), ("paged", 96)])
def test_rollout_logprobs_equal_a_full_forward(tiny_vl, kv_cache, kv_cache_tokens):
    """Prefill (vision tower, mrope positions; an image row batched with a text row) and decode (text
    positions continued with the rope delta) give each sampled token the log-prob of a full forward, in
    either cache layout (paged with a pool of 3 blocks: the image row of 46 tokens is preempted and starts
    over with its images)."""
    model = load_model(tiny_vl).eval()
    vision = VisionInputs.for_model(tiny_vl, model.args)
    rows = _rows(tiny_vl)
    engine = RolloutEngine(
        model, num_slots=4, max_seq_len=256, vision=vision, kv_cache=kv_cache, kv_cache_tokens=kv_cache_tokens
    )
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    for i, (ids, images) in enumerate(rows):
        engine.add(Request(ids, [10 + i], params, tag=i, images=images))
    done = {c.tag: c.generation for c in engine.run()}
    assert engine.stats["preempted"] == (1 if kv_cache_tokens else 0)
    for i, (ids, images) in enumerate(rows):
        generation = done[i]
        full, max_logit = _full_logprobs(model, vision, ids + generation.token_ids.tolist(), images)
        targets = generation.token_ids
        expected = full[len(ids) - 1 : len(ids) - 1 + len(targets)].gather(1, targets[:, None])[:, 0]
        bound = _bound(model, max_logit, len(ids) + len(targets), images[0].shape[0])
        assert (generation.logprobs - expected).abs().max().item() <= bound, i
    # The check sees positions: 1-D positions (no mrope) score the image rows' tokens differently.
    ids, images = rows[1]
    plain, max_logit = _full_logprobs(model, vision, ids + done[1].token_ids.tolist(), images, mrope=False)
    targets = done[1].token_ids
    moved = plain[len(ids) - 1 : len(ids) - 1 + len(targets)].gather(1, targets[:, None])[:, 0]
    bound = _bound(model, max_logit, len(ids) + len(targets), images[0].shape[0])
    assert (done[1].logprobs - moved).abs().max().item() > 100 * bound


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_requests_share_a_prefill_only_with_the_same_images(tiny_vl, kv_cache):
    """Requests with the same prompt share one prefilled row (as a group sent one request per sample is) only
    when their images are the same too: the same question about two images of one size is two prefills, and
    each sample's log-probs are those of its own image."""
    model = load_model(tiny_vl).eval()
    vision = VisionInputs.for_model(tiny_vl, model.args)
    rows = [_row(tiny_vl, "What is 2+3?", [_image(seed, 84, 112)]) for seed in (5, 6, 5)]
    assert rows[0][0] == rows[1][0] and not torch.equal(rows[0][1][0], rows[1][1][0])
    engine = RolloutEngine(model, num_slots=4, max_seq_len=256, vision=vision, kv_cache=kv_cache)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    for i, (ids, images) in enumerate(rows):
        engine.add(Request(ids, [20 + i], params, tag=i, images=images))
    done = {c.tag: c.generation for c in engine.run()}
    assert engine.stats["prefill_calls"] == 1 and engine.stats["prefill_prompts"] == 2  # rows 0 and 2 share
    for i, (ids, images) in enumerate(rows):
        targets = done[i].token_ids
        full, max_logit = _full_logprobs(model, vision, ids + targets.tolist(), images)
        expected = full[len(ids) - 1 : len(ids) - 1 + len(targets)].gather(1, targets[:, None])[:, 0]
        assert (done[i].logprobs - expected).abs().max().item() <= _bound(
            model, max_logit, len(full), images[0].shape[0]
        ), i


def test_vision_model_requests_keep_no_kv_across_turns(tiny_vl):
    """KV kept across turns is for text models (multi-turn vision runs are refused by preflight)."""
    model = load_model(tiny_vl).eval()
    engine = RolloutEngine(
        model,
        num_slots=2,
        max_seq_len=64,
        vision=VisionInputs.for_model(tiny_vl, model.args),
        kv_cache="paged",
    )
    with pytest.raises(ValueError, match="kv_key='t0' on a vision model"):
        engine.add(Request([1, 2, 3], [0], SamplingParams(max_new_tokens=2), kv_key="t0"))


def test_rollout_engine_needs_vision_inputs_for_a_vision_model(tiny_vl):
    model = load_model(tiny_vl).eval()
    with pytest.raises(ValueError, match="vision inputs=False"):
        RolloutEngine(model, num_slots=1, max_seq_len=64)


@pytest.mark.parametrize("packing", [True, False])
def test_training_pass_logprobs_equal_a_full_forward(tiny_vl, packing):
    """The reference / old-log-prob pass (TrainEngine.logprobs): rows with images of different sizes and a
    text row in one micro-batch, packed ([3, 1, S] positions) or padded ([3, B, T]); a response that sampled
    the image-pad token scores it as text."""
    engine = TrainEngine(str(tiny_vl), device="cpu", precision="fp32", trainable=False, packing=packing)
    model = load_model(tiny_vl).eval()
    vision = VisionInputs.for_model(tiny_vl, model.args)
    rows = _rows(tiny_vl)
    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 400, (n,), generator=generator) for n in (5, 3, 7)]
    responses[0][2] = vision.image_token_id
    logps, _ = engine.logprobs(
        [torch.tensor(ids) for ids, _ in rows],
        responses,
        temperature=1.0,
        micro_batch_size=3,
        pad_token_id=0,
        max_tokens_per_micro_batch=0,
        images=[images for _, images in rows],
    )
    for (ids, images), response, row_logps in zip(rows, responses, logps):
        full, max_logit = _full_logprobs(model, vision, ids + response.tolist(), images, prompt_len=len(ids))
        expected = full[len(ids) - 1 : len(ids) - 1 + len(response)].gather(1, response[:, None])[:, 0]
        bound = _bound(model, max_logit, len(ids) + len(response), images[0].shape[0])
        assert (row_logps - expected).abs().max().item() <= bound


def test_frozen_tower_takes_no_gradient_and_a_trained_one_does(tiny_vl):
    model = load_model(tiny_vl)
    vision = VisionInputs.for_model(tiny_vl, model.args)
    ids, images = _rows(tiny_vl)[0]
    input_ids = torch.tensor([ids])
    positions, _ = vision.positions(input_ids[0], images[1])
    model(input_ids, position_ids=positions[:, None], images=vision.images([images], "cpu")).sum().backward()
    assert model.visual.patch_embed.proj.weight.grad is not None
    model.zero_grad(set_to_none=True)
    model.visual.requires_grad_(False)
    model(input_ids, position_ids=positions[:, None], images=vision.images([images], "cpu")).sum().backward()
    assert (
        model.visual.patch_embed.proj.weight.grad is None and model.model.embed_tokens.weight.grad is not None
    )
    # A trainable tower joins a text-only backward with zero gradients (every FSDP2 rank reduces the same).
    model.visual.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    model(torch.tensor([[5, 6, 7]])).sum().backward()
    assert torch.count_nonzero(model.visual.patch_embed.proj.weight.grad) == 0


def test_images_of_an_images_batch_go_in_row_order(tiny_vl):
    """Images.from_grid_thw keeps the rows' order; VisionInputs.images skips rows without images."""
    model = load_model(tiny_vl)
    vision = VisionInputs.for_model(tiny_vl, model.args)
    rows = _rows(tiny_vl)
    images = vision.images([r[1] for r in rows], "cpu")
    assert isinstance(images, Images)
    assert images.grid == tuple(tuple(g) for r in rows for g in r[1][1].tolist())
    assert vision.images([rows[2][1]], "cpu") is None


def test_generate_takes_a_vision_models_images(tiny_vl):
    """The batch API (held-out evaluation, `dockrl eval`): image and text prompts of a vision model."""
    model = load_model(tiny_vl).eval()
    vision = VisionInputs.for_model(tiny_vl, model.args)
    (ids, images), _, (text_ids, _) = _rows(tiny_vl)
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    image_out, text_out = generate(
        model, [ids, text_ids], params, [0, 0], vision=vision, images=[images, None]
    )
    full, max_logit = _full_logprobs(model, vision, ids + image_out.token_ids.tolist(), images)
    targets = image_out.token_ids
    expected = full[len(ids) - 1 : len(ids) - 1 + len(targets)].gather(1, targets[:, None])[:, 0]
    bound = _bound(model, max_logit, len(full), images[0].shape[0])
    assert (image_out.logprobs - expected).abs().max().item() <= bound
    assert len(text_out.token_ids) == 3


class _ImageDock:
    """DockClient's get/put for the rollout over whole groups of two rows with image columns."""

    def __init__(self, rows: list[tuple[list[int], tuple[torch.Tensor, torch.Tensor]]]) -> None:
        self.rows = [row for row in rows for _ in range(2)]
        self.served = 0
        self.responses: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, consumer, columns, count, *, whole_groups, min_count, timeout_s=None):
        assert columns == ["prompt_ids", "image_patches", "image_grid_thw"] and whole_groups
        if self.served == len(self.rows):
            return None
        rows = list(range(self.served, min(self.served + count, len(self.rows))))
        self.served = rows[-1] + 1
        picked = [self.rows[r] for r in rows]
        return rows, {
            "prompt_ids": [torch.tensor(ids) for ids, _ in picked],
            "image_patches": [images[0] for _, images in picked],
            "image_grid_thw": [images[1] for _, images in picked],
        }

    def put(self, producer, rows, batch):
        for row, ids, logprobs in zip(rows, batch["response_ids"], batch["rollout_logprobs"]):
            self.responses[row] = (ids, logprobs)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_dock_rows_bring_their_images_to_the_rollout(tiny_vl, kv_cache):
    """serve_from_dock pulls the image columns with the prompts: two groups ask the same question about two
    images of one size (the same prompt ids), and each row's log-probs are those of its own image."""
    model = load_model(tiny_vl).eval()
    vision = VisionInputs.for_model(tiny_vl, model.args)
    rows = [_row(tiny_vl, "What is 2+3?", [_image(seed, 84, 112)]) for seed in (5, 6)]
    assert rows[0][0] == rows[1][0] and not torch.equal(rows[0][1][0], rows[1][1][0])
    dock = _ImageDock(rows)
    engine = RolloutEngine(model, num_slots=4, max_seq_len=256, vision=vision, kv_cache=kv_cache)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    stats = serve_from_dock(
        engine, dock, consumer="rollout", params=params, group_size=2, groups_per_pull=2, row_seed=lambda r: r
    )
    assert stats["prefill_prompts"] == 2 and sorted(dock.responses) == [0, 1, 2, 3]
    for row, (ids, logprobs) in dock.responses.items():
        prompt, images = dock.rows[row]
        full, max_logit = _full_logprobs(model, vision, prompt + ids.tolist(), images)
        expected = full[len(prompt) - 1 : len(prompt) - 1 + len(ids)].gather(1, ids[:, None])[:, 0]
        assert (logprobs - expected).abs().max().item() <= _bound(
            model, max_logit, len(full), images[0].shape[0]
        )
