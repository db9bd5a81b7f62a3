"""Top-k distillation through the CLI (distill.top_k, docs/distillation.md): a tensor-parallel teacher, asynchronous
rollout and an exact resume (in the slow tier: ~2.5 minutes on the 2-core CPU)."""

import json

import pytest
import torch

from dockrl.cli import main
from dockrl.dock.columns import TEACHER_LOGPROBS, TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS
from dockrl.models.tiny import make_tiny
from runs import computed_metrics, metric_differences, tiny_paths

_TRAFFIC = ("dock/bytes_moved", "dock/driver_bytes", "dock/bytes_in_warehouses")


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory):
    """A different tiny model with the policy's tokenizer (make_tiny's tokenizer does not depend on the seed)."""
    return make_tiny(
        tmp_path_factory.mktemp("teacher") / "model", family="qwen2", hidden_size=64, num_layers=2, seed=7
    )


TOP_K_CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2, placement: separate,"
    " max_staleness: 1}\n"
    "actor: {dp: 2, lr: 1.0e-2, micro_batch_size: 4}\n"
    "algo: {name: opd}\n"
    "distill: {coef: 0.5, top_k: 8, num_workers: 2, tp: 2, micro_batch_size: 4}\n"
    "dock: {num_warehouses: 2, get_timeout_s: 120}\n"
    "run: {steps: 3, prompts_per_step: 4, progress: false, worker_timeout_s: 300, log_samples: 0,"
    " save_every: 2, keep_checkpoints: null}\n"
)


def test_top_k_distillation_with_a_tp_teacher_async_rollout_and_resume_through_cli(
    ray_session, tmp_path, tiny_model, teacher_model, arithmetic_data
):
    """opd with distill.top_k=8: the teacher split over 2 tp ranks puts its top-8 ids (int32) and log-probs
    (fp32) per response position, the rollout runs a step ahead, and the actor's loss is 0.5 x the top-k KL (the
    advantages are 0, so the policy loss is 0 and the whole loss is the distillation term). The checkpoint after
    step 2 holds step 3 in flight with its top-k columns; resuming from it repeats step 3 bit for bit."""
    config = tmp_path / "opd_top_k.yaml"
    config.write_text(TOP_K_CONFIG)
    base = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data)]
    base += [f"distill.teacher_path={teacher_model}", f"run.output_dir={tmp_path}"]
    assert main([*base, "run.name=whole"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        kl, loss = row["distill/topk_kl"], row["actor/loss"]
        assert row["actor/pg_loss"] == 0.0 and kl > 0
        # the loss sums 0.5 x each micro-batch's share of the token mean, the metric the shares: one rounding
        # per micro-batch and rank (a few) of an O(1) sum
        assert abs(loss - 0.5 * kl) <= 8 * 2**-24 * kl, (loss, kl)
        assert 0 < row["distill/teacher_tail_mass"] < 1
        assert "distill/reverse_kl" in row and row["actor/grad_norm"] > 0
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]

    checkpoint = tmp_path / "whole" / "checkpoints" / "step_000002"
    inflight = torch.load(checkpoint / "inflight.pt", weights_only=True)["generations"]
    assert [g["step"] for g in inflight] == [3]
    columns = inflight[0]["columns"]
    assert TEACHER_LOGPROBS not in columns  # the top-k form puts its own columns only
    for response, ids, logps in zip(
        columns["response_ids"], columns[TEACHER_TOPK_IDS], columns[TEACHER_TOPK_LOGPROBS]
    ):
        assert ids.dtype == torch.int32 and ids.shape == (len(response), 8)
        assert logps.dtype == torch.float32 and logps.shape == (len(response), 8)
        assert (logps[:, :-1] >= logps[:, 1:]).all() and (logps.exp().sum(-1) <= 1 + 2**-20).all()

    assert main([*base, "run.name=resumed", f"run.resume={checkpoint}"]) == 0
    whole, resumed = (
        [{k: v for k, v in r.items() if k not in _TRAFFIC} for r in computed_metrics(tmp_path / name)]
        for name in ("whole", "resumed")
    )
    assert resumed == whole, metric_differences(resumed, whole)
