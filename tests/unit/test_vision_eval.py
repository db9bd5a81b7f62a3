"""Held-out evaluation of a vision-language model (`dockrl eval`, recipes/eval.evaluate_model_dir) answers each
prompt with its own image: its greedy answers equal `generate` given each prompt's images, and differ from
`generate` given the same prompts with their images swapped (so an evaluation that dropped or mixed up the
images would fail here). The images are the synthetic vision task's (data/synthetic_vision.py); the model is
make-tiny's qwen2_5_vl with peaked weights, whose image features move the greedy tokens."""

import shutil

import pytest
import torch

from dockrl.data.images import vision_processor
from dockrl.data.synthetic_vision import write_vision_task
from dockrl.engines.rollout.sampler import generate
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.models.hf import load_model, save_model
from dockrl.models.tiny import make_tiny, peaked_state_dict
from dockrl.models.tokenizer import Tokenizer
from dockrl.models.vision import VisionInputs
from dockrl.models.vision_processing import PREPROCESSOR_FILE
from dockrl.recipes.common import encode_prompts
from dockrl.recipes.eval import evaluate_model_dir
from dockrl.rewards.runner import RewardSpec

pytestmark = pytest.mark.unit

MAX_NEW_TOKENS = 4


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    random_dir = make_tiny(tmp_path_factory.mktemp("vl"), family="qwen2_5_vl", num_layers=2)
    model = load_model(random_dir)
    model.load_state_dict(peaked_state_dict(random_dir, seed=1))
    out = tmp_path_factory.mktemp("peaked")
    save_model(model, model.args, out, tokenizer_dir=random_dir)
    shutil.copy(random_dir / PREPROCESSOR_FILE, out / PREPROCESSOR_FILE)
    return out


@torch.no_grad()
def _direct(model_dir, prompts, images) -> list[str]:
    model = load_model(model_dir).eval()
    tokenizer = Tokenizer.from_dir(model_dir)
    params = SamplingParams(
        max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=[tokenizer.eos_token_id]
    )
    outs = generate(
        model,
        [p.ids for p in prompts],
        params,
        [0] * len(prompts),
        pad_token_id=tokenizer.pad_token_id,
        vision=VisionInputs.for_model(model_dir, model.args),
        images=images,
    )
    return [tokenizer.decode(o.token_ids.tolist()) for o in outs]


def test_eval_answers_each_prompt_with_its_own_image(tiny_vl, tmp_path):
    # One kind, so every prompt has the same ids and only the image tells them apart.
    data = write_vision_task(tmp_path, num_train=0, num_test=12, kinds=("count",))
    result = evaluate_model_dir(
        str(tiny_vl), str(data["test"]), [RewardSpec(name="exact_answer")], max_new_tokens=MAX_NEW_TOKENS
    )
    answers = [r["response"] for r in result["records"]]
    prompts, _ = encode_prompts(
        str(data["test"]),
        Tokenizer.from_dir(tiny_vl),
        prompt_field="prompt",
        label_field="answer",
        system_prompt=None,
        use_chat_template=True,
        max_prompt_len=512,
        processor=vision_processor(tiny_vl),
        model_path=str(tiny_vl),
    )
    assert len({tuple(p.ids) for p in prompts}) == 1
    own = [(p.image_patches, p.image_grid_thw) for p in prompts]
    assert answers == _direct(tiny_vl, prompts, own)
    swapped = own[1:] + own[:1]
    assert answers != _direct(tiny_vl, prompts, swapped)
