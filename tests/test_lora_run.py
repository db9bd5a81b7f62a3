"""LoRA GRPO end to end through the CLI: two steps trained tensor-parallel (tp=2) with adapters on every linear
layer, generated with tp=1 from the merged weights, the KL reference from the adapters switched off; the
checkpoint's hf/ holds the merged model and adapter/ the adapters as a PEFT directory."""

import json
import math

import torch

from dockrl.cli import main
from dockrl.models.hf import load_state_dict
from dockrl.models.lora import read_peft_adapters, read_peft_spec


def test_two_lora_grpo_steps_through_cli(ray_session, tmp_path, tiny_model, arithmetic_data, capsys):
    config = tmp_path / "lora.yaml"
    config.write_text(
        "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2, tp: 1}\n"
        "actor: {dp: 1, tp: 2, lr: 1.0e-2, micro_batch_size: 4, lora: {rank: 4, alpha: 8}}\n"
        "algo: {kl_coef: 0.01}\n"
        "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
        "run: {steps: 2, prompts_per_step: 4, progress: false, worker_timeout_s: 300, precision: fp32}\n"
    )
    paths = [f"model.path={tiny_model}", f"data.train_path={arithmetic_data['train']}"]
    code = main(["train", str(config), *paths, f"run.output_dir={tmp_path}", "run.name=lora"])
    assert code == 0
    run = tmp_path / "lora"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("actor/grad_norm", "actor/kl", "timing/reference", "reward/mean"):
            assert math.isfinite(row[key]), key
        assert row["actor/grad_norm"] > 0
    # Step 1's policy is the base (B = 0): its KL to the reference (the same weights, adapters off) is 0 up to
    # the rounding of two passes batched differently (log-prob gaps ~1e-7, k3 ~ gap^2 / 2).
    assert 0 <= rows[0]["actor/kl"] < 1e-9
    checkpoint = json.loads((run / "summary.json").read_text())["checkpoint"]
    merged, base = load_state_dict(f"{checkpoint}/hf"), load_state_dict(tiny_model)
    adapters = read_peft_adapters(f"{checkpoint}/adapter")
    spec = read_peft_spec(f"{checkpoint}/adapter")
    assert set(merged) == set(base) and spec.rank == 4 and spec.scaling == 2.0
    assert len(adapters) == 2 * 7 * 2  # two factors of 7 linear layers in each of the 2 layers
    moved = 0
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A" not in adapters:
            assert torch.equal(merged[name], weight), name  # frozen: only adapted weights change
            continue
        delta = spec.scaling * (adapters[f"{module}.lora_B"] @ adapters[f"{module}.lora_A"])
        # W + s B A in fp32 on both sides; B A is a dot product of r terms: at most r + 2 roundings of the
        # magnitudes, each of relative size 2^-24.
        magnitude = weight.abs() + spec.scaling * (
            adapters[f"{module}.lora_B"].abs() @ adapters[f"{module}.lora_A"].abs()
        )
        assert ((merged[name] - (weight + delta)).abs() <= (spec.rank + 2) * 2.0**-24 * magnitude).all(), name
        moved += bool(delta.abs().max() > 0)
    assert moved == 14, "every adapter moved in two updates"
