"""On-policy distillation through the CLI: opd with LoRA and asynchronous rollout, the importance correction of
its stale rows (algo.rollout_is=tis), and its exact resume; the top-k form (distill.top_k) with a
tensor-parallel teacher, asynchronous rollout and its exact resume."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dockrl.algos.logprobs import token_logprobs
from dockrl.cli import main
from dockrl.dock.columns import (
    PROMPT_IDS,
    RESPONSE_IDS,
    ROLLOUT_LOGPROBS,
    TEACHER_LOGPROBS,
)
from dockrl.models.hf import load_model
from dockrl.models.lora import load_peft
from dockrl.models.tiny import make_tiny
from runs import computed_metrics, metric_differences, tiny_paths


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory):
    """A different tiny model with the policy's tokenizer (make_tiny's tokenizer does not depend on the seed)."""
    return make_tiny(
        tmp_path_factory.mktemp("teacher") / "model", family="qwen2", hidden_size=64, num_layers=2, seed=7
    )


CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2, placement: separate,"
    " max_staleness: 1}\n"
    "actor: {dp: 2, lr: 1.0e-2, micro_batch_size: 4, lora: {rank: 4}}\n"
    "algo: {name: opd, rollout_is: tis, rollout_is_cap: 2.0}\n"
    "distill: {coef: 0.5, num_workers: 2, micro_batch_size: 4}\n"
    "dock: {num_warehouses: 2, get_timeout_s: 120}\n"
    "run: {steps: 3, prompts_per_step: 4, progress: false, worker_timeout_s: 300, log_samples: 0,"
    " save_every: 2, keep_checkpoints: null, precision: fp32}\n"
)


_TRAFFIC = ("dock/bytes_moved", "dock/driver_bytes", "dock/bytes_in_warehouses")


# A rank's log-probs against another process's forward of the same fp32 weights: the rollout-trainer bound of the
# dense and MoE runs (1e-5 per token, ~100x fp32 rounding).
LOGPROB_BOUND = 1e-5


def _corrected_pg_loss(
    inflight: dict, base: Path, adapter: Path, coef: float, cap: float
) -> tuple[float, float]:
    """Step 3's policy loss from its rows in flight, recomputed here: -mean_t(w_t A_t) with the teacher term
    A_t = coef x (teacher - rollout) and w_t = min(exp(old_t - rollout_t), cap), old the log-probs of the weights
    step 3 starts from (the checkpoint's adapter) and rollout those of the step-1 weights that sampled the rows
    (one step stale); also sum_t w_t |A_t| / tokens, the scale of the rounding bound. One update per step: the
    PPO ratio is 1, the clip is idle."""
    student = load_model(base)
    load_peft(student, adapter)
    student.eval()
    columns = inflight["columns"]
    weighted, scale, tokens = 0.0, 0.0, 0
    for prompt, response, rollout, teacher in zip(
        columns[PROMPT_IDS], columns[RESPONSE_IDS], columns[ROLLOUT_LOGPROBS], columns[TEACHER_LOGPROBS]
    ):
        prompt, response = torch.as_tensor(prompt), torch.as_tensor(response)
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            logits = student(ids)[0, len(prompt) - 1 : -1]  # [R, V]: the positions that score the response
        old = token_logprobs(logits, response).double()  # temperature 1 (rollout.temperature)
        rollout, teacher = torch.as_tensor(rollout).double(), torch.as_tensor(teacher).double()
        weight = (old - rollout).exp().clamp(max=cap)
        advantage = coef * (teacher - rollout)
        weighted += float((weight * advantage).sum())
        scale += float((weight * advantage.abs()).sum())
        tokens += len(response)
    return -weighted / tokens, scale / tokens


def test_opd_with_lora_and_async_rollout_through_cli(
    ray_session, tmp_path, tiny_model, teacher_model, arithmetic_data
):
    """opd with distill.coef=0.5, LoRA adapters, a teacher sharded over 2 ranks (FSDP2), a separate rollout one
    step ahead and truncated importance sampling (algo.rollout_is=tis). Step 1's rows are on-policy: the weights
    are 1 to rounding, so the token-mean policy loss is -mean(advantage) = 0.5 x distill/reverse_kl, the teacher
    term of the very tokens the metric averages. Steps 2-3 train on rows one update stale: the loss weighs each
    token by min(exp(old - rollout), cap), recomputed here for step 3 from its rows in flight and the step-2
    checkpoint, and the uncorrected 0.5 x reverse_kl lies outside the bound (the check sees the correction). The
    checkpoint holds step 3 in flight with its teacher_logprobs; resuming from it repeats step 3 bit for bit."""
    config = tmp_path / "opd.yaml"
    config.write_text(CONFIG)
    base = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data)]
    base += [f"distill.teacher_path={teacher_model}", f"run.output_dir={tmp_path}"]
    assert main([*base, "run.name=whole"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    kl, pg_loss = rows[0]["distill/reverse_kl"], rows[0]["actor/pg_loss"]
    # The fp32 token-mean of 0.5 x (rollout - teacher) against the fp64 mean of the same fp32 log-probs: one
    # rounding of each difference (|log-prob| < 8: 2**-21) plus a sum of ~100 terms (100 x 2**-24 relative); and
    # weights exp(old - rollout) within LOGPROB_BOUND of 1 (on-policy: the same weights, another forward), times
    # mean |A| <= 0.5 x (mean |teacher| + mean |rollout|) = 0.5 x (-2 teacher_logprob - reverse_kl).
    mean_abs_advantage = 0.5 * (-2 * rows[0]["distill/teacher_logprob"] - kl)
    bound = 2**-21 + 1e-5 * abs(kl) + LOGPROB_BOUND * mean_abs_advantage
    assert abs(pg_loss - 0.5 * kl) <= bound, (pg_loss, kl, bound)
    for row in rows:
        assert -math.log(512) - 1 < row["distill/teacher_logprob"] < 0
        assert row["actor/grad_norm"] > 0 and row["timing/teacher_busy"] > 0
    assert "timing/teacher" not in rows[0]  # asynchronous: the teacher's time is inside the rollout's
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]

    checkpoint = tmp_path / "whole" / "checkpoints" / "step_000002"
    inflight = torch.load(checkpoint / "inflight.pt", weights_only=True)["generations"]
    assert [g["step"] for g in inflight] == [3]
    lengths = [len(ids) for ids in inflight[0]["columns"]["response_ids"]]
    assert [len(t) for t in inflight[0]["columns"][TEACHER_LOGPROBS]] == lengths
    assert sum(t["rows"] for t in inflight[0]["teacher"]) == 16
    adapters = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapters.items())
    # Step 3 trains on rows sampled before step 2's update: its loss is the corrected one. Bound: each weight
    # within LOGPROB_BOUND (relative) of the run's (another process's forward), plus the fp32 sums as above.
    expected, scale = _corrected_pg_loss(inflight[0], tiny_model, checkpoint / "adapter", coef=0.5, cap=2.0)
    kl, pg_loss = rows[2]["distill/reverse_kl"], rows[2]["actor/pg_loss"]
    bound = 2**-21 + 1e-5 * abs(expected) + LOGPROB_BOUND * scale
    assert abs(pg_loss - expected) <= bound, (pg_loss, expected, bound)
    assert abs(0.5 * kl - expected) > bound, (kl, expected, bound)  # uncorrected, it would fail

    assert main([*base, "run.name=resumed", f"run.resume={checkpoint}"]) == 0
    whole, resumed = (
        [{k: v for k, v in r.items() if k not in _TRAFFIC} for r in computed_metrics(tmp_path / name)]
        for name in ("whole", "resumed")
    )
    assert resumed == whole, metric_differences(resumed, whole)
