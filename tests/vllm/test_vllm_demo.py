"""`dockrl demo rollout.backend=vllm`: the demo (SFT warm start, 40 GRPO steps, held-out eval) learns with vLLM
generating every rollout, each weight update checked on the probe sequence."""

import json

from dockrl.recipes.demo import run_demo


def test_demo_with_vllm_raises_held_out_accuracy(ray_session, tmp_path):
    # fp32 on every host (run.precision=auto is bf16 where the CPU computes it): the bounds below are fp32's
    overrides = ["run.progress=false", "rollout.backend=vllm", "run.precision=fp32"]
    summary = run_demo(tmp_path / "demo", overrides=overrides)
    assert summary["grpo_steps"] == 40
    # The floor: +15 held-out points (measured over seeds in docs/vllm.md).
    assert summary["accuracy_after_grpo"] >= summary["accuracy_before_grpo"] + 0.15, summary
    rows = [
        json.loads(line) for line in (tmp_path / "demo" / "grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(r["rollout/probe_abs_diff"] < 1e-3 for r in rows)  # fp32: vllm_backend.PROBE_TOL
    assert all(r["rollout/logprob_abs_diff"] < 1e-5 for r in rows)  # the trainer and vLLM agree to rounding
