"""A Qwen2.5-VL GRPO run with dp=2 resumes bit for bit: the reference run (4 steps, a checkpoint every 2, the
vision tower trained) and the same run resumed from its step-2 checkpoint (step 4's removed) log the same
computed metrics and end with the same weights, tower included. The images are put again from the data pass on
resume (the driver's image columns), so a resume that lost or misplaced them would change the log-probs of
steps 3-4 (tests/unit/test_vision_engines.py: 0.4 with the wrong image; seen here: rotated images on resume
moved step 3's grad_norm from 1.1738 to 1.1543). The data fingerprint covers the pixels: a resume on other images
under the same text is refused before any process starts."""

import shutil

import pytest
import torch

from dockrl.cli import main
from dockrl.data.synthetic_vision import write_vision_task
from dockrl.models.hf import load_state_dict
from runs import computed_metrics, metric_differences

pytestmark = pytest.mark.slow

CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2}\n"
    "actor: {dp: 2, lr: 1.0e-3, micro_batch_size: 4, warmup_steps: 2, min_lr_ratio: 0.5, vision: {freeze: false}}\n"
    "algo: {kl_coef: 0.01}\n"
    "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
    "dock: {num_warehouses: 2, get_timeout_s: 120}\n"
    "run: {steps: 4, prompts_per_step: 4, save_every: 2, progress: false, worker_timeout_s: 300, precision: fp32}\n"
)


def test_a_vision_run_with_dp2_resumes_bit_for_bit(ray_session, tmp_path, capsys):
    from PIL import Image

    from dockrl.models.tiny import make_tiny

    model = make_tiny(tmp_path / "model", family="qwen2_5_vl")
    data = write_vision_task(tmp_path / "data", num_train=32, num_test=4)
    config = tmp_path / "vision.yaml"
    config.write_text(CONFIG)
    args = ["train", str(config), f"model.path={model}", f"data.train_path={data['train']}"]
    args += [f"run.output_dir={tmp_path}"]
    assert main([*args, "run.name=reference"]) == 0
    reference = tmp_path / "reference"
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    assert main([*args, "run.name=resumed", "run.resume=auto"]) == 0
    got, expected = computed_metrics(resumed), computed_metrics(reference)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert got == expected, metric_differences(got, expected)
    final = load_state_dict(resumed / "checkpoints" / "step_000004" / "hf")
    ref = load_state_dict(reference / "checkpoints" / "step_000004" / "hf")
    assert final.keys() == ref.keys() and any(k.startswith("visual.") for k in ref)
    assert all(torch.equal(final[k], ref[k]) for k in ref)
    # the same text with other pixels is other data: its resume is refused, naming the setting
    for png in (tmp_path / "data").rglob("*.png"):
        Image.open(png).transpose(Image.Transpose.ROTATE_90).save(png)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    capsys.readouterr()
    assert main([*args, "run.name=resumed", "run.resume=auto"]) == 2
    assert "data.train_path: the encoded prompts differ" in capsys.readouterr().err
