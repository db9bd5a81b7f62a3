"""The roofline's FLOP model (dockrl.bench.roofline) against torch's own count of the model's matmuls."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dockrl.bench import roofline
from dockrl.models.config import ModelArgs
from dockrl.models.decoder import Transformer


def _args(tie: bool) -> ModelArgs:
    return ModelArgs(
        family="qwen2",
        vocab_size=10,
        hidden_size=4,
        intermediate_size=6,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
        attention_bias=True,
        tie_word_embeddings=tie,
    )


def test_known_shape_by_hand():
    # per layer: q 4x4, k and v 4x2 each, o 4x4 -> 48; MLP 3 x 4 x 6 = 72; 2 layers; LM head 10 x 4 = 40
    args = _args(tie=True)
    assert roofline.matmul_params(args) == 2 * (48 + 72) + 40 == 280
    # lengths 3 and 5: 2 x 280 x 8 tokens + 2 layers x 4 x (2 heads x 2) x (9 + 25)
    assert roofline.forward_flops(args, [3, 5]) == 4480 + 1088
    assert roofline.pass_flops(args, "update", [3, 5]) == 3 * 5568
    assert roofline.pass_flops(args, "reference", [3, 5]) == 5568
    # decode: weights once per rank + K and V (2 layers x 1 kv head x 2 dims, x2 = 8 values) per context token
    assert (
        roofline.decode_step_bytes(args, [3, 5], weight_bytes=2, kv_bytes=4, ranks=2)
        == 2 * 2 * 280 + 4 * 8 * 8
    )
    # a rollout of 2 sequences after 3-token prompts, 2 and 4 new tokens: 4 steps of weights; contexts
    # 3 + 4 (first) and 3 + 4 + 5 + 6 (second)
    assert roofline.decode_bytes(args, 3, [2, 4], weight_bytes=4, kv_bytes=4) == 4 * 4 * 280 + 4 * 8 * (
        7 + 18
    )


def test_rollout_seconds_by_hand_below_and_above_the_machine_balance():
    """Each decode step takes max(bytes / bandwidth, FLOPs / peak), the prefill its FLOPs / peak. Peak 1000
    FLOP/s and 500 B/s (a balance of 2 FLOP/byte): one row is bandwidth-bound, eight are compute-bound."""
    args = _args(tie=True)  # 280 matmul params; 2 layers x 2 heads x 2 dims; K and V: 8 values per token
    rates = {"weight_bytes": 2, "kv_bytes": 4, "flops_per_s": 1000.0, "bytes_per_s": 500.0}
    # prefill of one 3-token prompt: 2 x 280 x 3 + 2 layers x 4 x 4 x 3^2 = 1968 FLOPs
    # a decode step's row at context 3: 2 x 280 + 4 x 2 x 2 x 2 x (3 + 1) = 688 FLOPs; bytes 2 x 280 + 4 x 8 x 3
    one = roofline.rollout_seconds(args, 3, [1], **rates)
    assert one == pytest.approx(1968 / 1000 + max((560 + 96) / 500, 688 / 1000), rel=1e-12)
    # 8 rows, one running a second step (context 4: 2 x 280 + 32 x 5 = 720 FLOPs, 560 + 4 x 8 x 4 bytes)
    eight = roofline.rollout_seconds(args, 3, [2] + [1] * 7, **rates)
    step_0 = max((560 + 8 * 96) / 500, 8 * 688 / 1000)  # 5.504 s of compute against 2.656 s of traffic
    step_1 = max((560 + 128) / 500, 720 / 1000)
    assert eight == pytest.approx(8 * 1968 / 1000 + step_0 + step_1, rel=1e-12)
    # the bandwidth term alone is decode_bytes over the bandwidth, which the compute-bound step exceeds
    traffic = roofline.decode_bytes(args, 3, [2] + [1] * 7, weight_bytes=2, kv_bytes=4)
    assert eight - (8 * 1968 / 1000 + traffic / 500) == pytest.approx(8 * 688 / 1000 - 1328 / 500, rel=1e-12)


def _moe_args() -> ModelArgs:
    return ModelArgs(
        family="qwen3_moe",
        vocab_size=10,
        hidden_size=4,
        intermediate_size=6,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
        qk_norm=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=3,
    )


def test_moe_counts_the_routed_experts_and_the_router():
    args = _moe_args()
    # attention 48; 2 routed experts x 3 x 4 x 3 + router 4 x 8; head 40
    assert roofline.matmul_params(args) == 48 + 72 + 32 + 40


@pytest.mark.parametrize("tie", [True, False])
def test_flops_equal_torchs_count_of_the_real_model(tie):
    """torch's FlopCounterMode counts every mm/bmm the model runs (the math attention kernel decomposes into
    counted bmm's): the model's forward, and forward + backward, equal the FLOP model exactly."""
    torch.manual_seed(0)
    args = _args(tie)
    model = Transformer(args)
    ids = torch.randint(0, args.vocab_size, (3, 5))
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward:
            model(ids)
        with FlopCounterMode(display=False) as both:
            model(ids).sum().backward()
    assert forward.get_total_flops() == roofline.forward_flops(args, [5, 5, 5])
    assert both.get_total_flops() == roofline.pass_flops(args, "update", [5, 5, 5])


def test_share():
    assert roofline.share(2e9, 2.0, 1e9) == 1.0
    assert roofline.share(1.0, 0.0, 1e9) is None


def test_measure_peak_reports_positive_rates():
    peak = roofline.measure_peak(1, size=64, repeats=1, stream_mb=1)
    assert peak["threads"] == 1
    assert peak["fp32_gflops"] > 0 and peak["bandwidth_gbs"] > 0
    assert roofline.peak_flops(peak, "fp32") == 1e9 * peak["fp32_gflops"]


def test_shape_bound_is_one_when_every_matmul_runs_at_the_peak(monkeypatch):
    """shape_bound's arithmetic: with each matmul costing exactly its FLOPs at the peak, the update's and the
    reference's bound is 1.0, so its count of the passes' matmuls (seven projections a layer, the head, the
    backward's two per forward one, attention) is pass_flops' count. A matmul left out or counted twice moves it."""
    from types import SimpleNamespace

    def at_peak(rows, n_in, n_out, dtype, repeats, square):
        flops = 2 * rows * n_in * n_out
        return flops, 2 * flops  # the forward; d input and d weight

    monkeypatch.setattr(roofline, "_peak_costs", at_peak)
    monkeypatch.setattr(roofline, "_Square", lambda size, dtype: SimpleNamespace(best_rate=1e9))
    bound = roofline.shape_bound(_args(tie=True), [3, 5], "fp32")
    assert bound == {"peak_gflops": 1.0, "update": pytest.approx(1.0), "reference": pytest.approx(1.0)}
    # two micro-batches of 4 rows (a budget of 4 tokens): the same matmuls over the same 8 rows
    assert roofline.shape_bound(_args(tie=True), [3, 5], "fp32", budget=4)["update"] == pytest.approx(1.0)
    assert (
        roofline.shape_bound(_moe_args(), [3, 5], "fp32") is None
    )  # routed experts: shapes follow the routing


def test_peak_costs_weigh_each_op_by_the_square_timed_beside_it():
    """A real small linear: its three ops' cost is in FLOPs at the peak (seconds x the square's rate: seconds
    alone would be ~1e-6 of it), at most about twice what they compute (a small matmul is not much faster per
    FLOP than the square), and the square's best rate is kept."""
    square = roofline._Square(256, torch.float32)
    forward, backward = roofline._peak_costs(64, 32, 48, torch.float32, 3, square)
    flops = 2 * 64 * 32 * 48
    assert square.best_rate > 0
    assert forward > 0 and backward > 0
    assert forward + backward > 0.5 * 3 * flops  # not off by a factor: at most ~2x the square's rate
