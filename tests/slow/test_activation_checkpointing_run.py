"""Activation checkpointing through the CLI (make test-slow): a dp=2 run with actor.activation_checkpointing trains the numbers of one without."""

import torch

from dockrl.cli import main
from dockrl.models.hf import load_state_dict
from runs import tiny_paths


def test_activation_checkpointing_trains_the_same_numbers(ray_session, tmp_path, tiny_model, arithmetic_data):
    """actor.activation_checkpointing under FSDP2 (dp=2): each layer's forward runs again inside the backward
    pass (with its parameters gathered again); the same ops on the same inputs, so one step's computed metrics
    and the trained weights equal the run without it, bit for bit."""
    from runs import computed_metrics, metric_differences

    config = tmp_path / "grpo.yaml"
    config.write_text(
        "rollout: {samples_per_prompt: 4, max_new_tokens: 6}\n"
        "actor: {dp: 2, lr: 1.0e-3, micro_batch_size: 4, mini_batches: 2}\n"
        "algo: {kl_coef: 0.01}\n"
        "reward: {functions: [{name: exact_answer}]}\n"
        "run: {steps: 1, prompts_per_step: 4, progress: false, worker_timeout_s: 300, log_samples: 0}\n"
    )
    base = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data)]
    base += [f"run.output_dir={tmp_path}"]
    assert main([*base, "run.name=plain"]) == 0
    assert main([*base, "run.name=recompute", "actor.activation_checkpointing=true"]) == 0
    plain, recompute = computed_metrics(tmp_path / "plain"), computed_metrics(tmp_path / "recompute")
    assert recompute == plain, metric_differences(recompute, plain)
    weights = [
        load_state_dict(f"{tmp_path / name}/checkpoints/step_000001/hf") for name in ("plain", "recompute")
    ]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # dockrl export of a training checkpoint root writes its policy, tensor for tensor.
    assert (
        main(["export", str(tmp_path / "plain" / "checkpoints" / "step_000001"), str(tmp_path / "export")])
        == 0
    )
    exported = load_state_dict(tmp_path / "export")
    assert exported.keys() == weights[0].keys() and all(
        torch.equal(exported[k], weights[0][k]) for k in exported
    )
