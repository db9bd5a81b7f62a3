"""`dockrl plan`: per-phase memory from shapes only, and its errors for impossible layouts."""

import pytest

from dockrl.parallel.memory_plan import PlanInput, load_args, plan


def test_plan_presets_and_offload_effects():
    args = load_args("Qwen2.5-7B")
    full = plan(PlanInput(args, dp=4, tp_train=2, tp_infer=4))
    kept = plan(PlanInput(args, dp=4, tp_train=2, tp_infer=4, offload_params=False, offload_optimizer=False))
    # Training state (fp32 param + grad + Adam = 16 bytes/param) split over dp x tp (replicated norms aside).
    assert full["train_state_bytes"] == pytest.approx(16 * args.num_params() / 8, rel=0.01)
    # bf16 inference shard over tp_infer=4.
    assert full["inference_shard_bytes"] == pytest.approx(2 * args.num_params() / 4, rel=0.01)
    assert kept["rollout_bytes"] - full["rollout_bytes"] == pytest.approx(
        12 * args.num_params() / 8, rel=0.01
    )


def test_plan_rejects_impossible_layouts():
    args = load_args("Qwen2.5-7B")  # 28 heads, 4 kv heads
    with pytest.raises(ValueError, match=r"tp_train=8 does not divide model num_heads=28"):
        plan(PlanInput(args, dp=1, tp_train=8, tp_infer=1))
    with pytest.raises(ValueError, match=r"tp_infer=4 does not divide dp x tp_train = 2"):
        plan(PlanInput(args, dp=1, tp_train=2, tp_infer=4))


def test_plan_switch_transient_and_kv_cache_terms():
    args = load_args("Qwen3-8B")
    base = PlanInput(args, dp=2, tp_train=2, tp_infer=4, bucket_bytes=2**30)
    full = plan(base)
    # Two gather stages (dp and tp_train): three quarter-bucket chunks on top of the inference shard.
    assert full["switch_extra_bytes"] - full["inference_shard_bytes"] == 3 * 2**30 // 4
    one_stage = plan(PlanInput(args, dp=1, tp_train=2, tp_infer=2, bucket_bytes=2**30))
    assert one_stage["switch_extra_bytes"] - one_stage["inference_shard_bytes"] == 2 * 2**30 // 4
    kept = plan(PlanInput(args, dp=2, tp_train=2, tp_infer=4, bucket_bytes=2**30, free_kv_cache=False))
    assert kept["train_bytes"] - full["train_bytes"] == full["kv_cache_bytes"]
