"""`dockrl plan`: per-phase memory from shapes only, and its errors for impossible layouts."""

import pytest

from dockrl.parallel.memory_plan import (
    GIB,
    PlanInput,
    load_args,
    parse_bytes,
    plan,
    smallest_cp,
    update_peak,
)


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
    with pytest.raises(ValueError, match=r"tp_infer=4 does not divide dp x cp x tp_train = 2"):
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


# ---- context parallelism (cp): the update's peak and the smallest cp that fits


def _tiny_args():
    from dockrl.models.config import ModelArgs

    return ModelArgs(
        family="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
    )


def test_saved_activations_are_what_autograd_saves():
    """update_peak's `saved` at cp = 1, fp32, against the bytes of every tensor autograd saves (storages other
    than the parameters, counted once) in a forward through the fused head scoring every position but the last.
    Left out of the formula: each RMSNorm's [T, 1] rsqrt (2 L + 1 of 4 T bytes); counted there but not here: the
    head's one unscored position (4 H + 16 bytes of hidden state, index and statistics)."""
    import torch

    from dockrl.algos.head_logprobs import head_token_stats
    from dockrl.models.decoder import Transformer

    args, seq = _tiny_args(), 256
    model = Transformer(args)
    ids = torch.randint(0, args.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    storages: dict[int, int] = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    def head(hidden, weight):
        flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # [T-1, H]
        return head_token_stats(flat.index_select(0, torch.arange(seq - 1)), weight, ids[0, 1:], 1.0)[0]

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids, head=head)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(n for ptr, n in storages.items() if ptr not in params)
    predicted = update_peak(args, rows=1, seq_len=seq, cp=1, dtype_bytes=4)["saved"]
    left_out = (2 * args.num_layers + 1) * 4 * seq - 4 * args.hidden_size - 16
    assert saved == predicted + left_out


def test_cp_splits_the_saved_activations_and_shards_the_state_over_dp_x_cp():
    args = load_args("Qwen2.5-7B")
    # cp = 2 on 2T tokens holds T tokens per rank: the same saved set plus the ring's fp32 attention output
    one = update_peak(args, rows=1, seq_len=8192, cp=1)["saved"]
    two = update_peak(args, rows=1, seq_len=16384, cp=2)["saved"]
    assert two - one == 8192 * args.num_layers * 4 * args.num_heads * args.head_dim
    # the zig-zag split pads to a multiple of 2 cp: 8191 tokens at cp = 4 hold 8192 / 4 per rank
    assert update_peak(args, rows=1, seq_len=8191, cp=4) == update_peak(args, rows=1, seq_len=8192, cp=4)
    # FSDP2 shards the training state over dp x cp: cp = 4 holds what dp = 4 does
    by_cp = plan(PlanInput(args, dp=1, cp=4, tp_train=1, tp_infer=1))
    by_dp = plan(PlanInput(args, dp=4, cp=1, tp_train=1, tp_infer=1))
    assert by_cp["train_state_bytes"] == by_dp["train_state_bytes"]
    assert by_cp["train_state_bytes"] == pytest.approx(16 * args.num_params() / 4, rel=0.01)


def test_saved_activations_of_qwen2_5_7b_by_hand():
    """bf16 (e = 2), H = 3584, N = 28, K = 4, D = 128, I = 18944, L = 28, per token and layer: two norms
    2 (2 e H) = 28672, q, k, v and the attention output e (2 N + 2 K) D = 16384, the lse 4 N = 112, the
    MLP 4 e I = 151552: 196720 bytes; outside the layers e H + e H + 2 e D = 14848, and the head's 24."""
    args = load_args("qwen2.5-7b")
    per_token = 28 * 196720 + 14872
    assert update_peak(args, rows=1, seq_len=32768, cp=1)["saved"] == 32768 * per_token
    assert update_peak(args, rows=1, seq_len=32768, cp=8)["saved"] == pytest.approx(
        4096 * (per_token + 28 * 4 * 28 * 128)
    )


def test_smallest_cp_fits_and_one_less_does_not():
    question = PlanInput(load_args("Qwen2.5-7B"), dp=1, tp_train=1, tp_infer=1, train_seq_len=32768)
    device = parse_bytes("80GB")
    cp = smallest_cp(question, device)
    assert cp is not None and cp > 1
    assert plan(PlanInput(**{**question.__dict__, "cp": cp}))["train_bytes"] <= device
    assert plan(PlanInput(**{**question.__dict__, "cp": cp - 1}))["train_bytes"] > device
    # at 10 GiB no cp fits: FSDP2's root (embedding and head, 1.09 B parameters, bf16 with an fp32 gradient: 6.1
    # GiB) is whole on every rank, beside the training state and the activations
    assert smallest_cp(question, 10 * GIB) is None


def test_device_memory_units():
    assert parse_bytes("80GB") == 80e9 and parse_bytes("80GiB") == 80 * GIB and parse_bytes("40") == 40 * GIB
    assert parse_bytes("512MiB") == 2**29
    with pytest.raises(ValueError, match="80 GB bytes"):
        parse_bytes("80 GB bytes")


def test_plan_cli_names_the_smallest_cp(capsys):
    import json

    from dockrl.cli import main

    main(["plan", "--model", "qwen2.5-7b", "--tokens", "32768", "--device-memory", "80GB", "--json"])
    result = json.loads(capsys.readouterr().out)
    question = PlanInput(load_args("Qwen2.5-7B"), dp=1, tp_train=1, tp_infer=1, train_seq_len=32768)
    assert result["smallest_cp"] == smallest_cp(question, 80e9)


def test_fsdp_units_group_consecutive_layers_up_to_the_threshold():
    from dockrl.parallel.fsdp_units import fsdp_units

    # 0: a unit per layer; a group closes once it holds the threshold; the layers after the last group are the root's
    assert fsdp_units([5, 5, 5], 0) == [range(0, 1), range(1, 2), range(2, 3)]
    assert fsdp_units([4, 4, 4, 4, 4], 8) == [range(0, 2), range(2, 4)]
    assert fsdp_units([4, 4, 4, 4, 4], 9) == [range(0, 3)]
    assert fsdp_units([4, 4, 4], 13) == []  # fewer in all: the root is the only unit
    assert fsdp_units([20, 1, 30], 10) == [range(0, 1), range(1, 3)]


def test_plan_counts_fsdp_units_of_grouped_layers():
    """update_peak's `fsdp` term at fp32 (e = 4): two units (the prefetch) plus one unit's fp32 gradient plus the
    root with what no unit took, its gradient beside it."""
    from dataclasses import replace

    from dockrl.parallel.memory_plan import _layer_and_root_params

    args = replace(_tiny_args(), num_layers=6)
    layer, root = _layer_and_root_params(args, 1)

    def fsdp(unit_params: int) -> float:
        return update_peak(args, rows=1, seq_len=16, dtype_bytes=4, unit_params=unit_params)["fsdp"]

    assert fsdp(0) == 2 * 4 * layer + 4 * layer + 8 * root  # a unit per layer
    assert fsdp(2 * layer) == 2 * 4 * (2 * layer) + 4 * (2 * layer) + 8 * root  # three units of two layers
    assert fsdp(4 * layer) == 4 * (4 * layer) + 4 * (4 * layer) + 8 * (root + 2 * layer)  # one unit, two left
    assert fsdp(7 * layer) == 8 * (root + 6 * layer)  # the root alone: the whole model unsharded
