"""Benchmark command lines that cannot work fail at once with the conflicting flags named."""

import pytest

from dockrl.cli import build_parser


@pytest.mark.parametrize("flag", ["--emulate-nodes=4", "--ray-address=auto"])
def test_bench_dock_nodes_conflicts_with_a_multi_node_cluster(flag):
    from dockrl.bench.dock import run

    args = build_parser().parse_args(["bench", "dock", "--nodes=1,2", flag])
    with pytest.raises(SystemExit, match=f"--nodes=1,2 conflicts with {flag.split('=')[0]}; drop --nodes"):
        run(args)


def test_bench_train_needs_three_nodes():
    from dockrl.bench.cluster_train import placement

    assert placement(3) == {"actor": ["node1", "node2"], "reward": ["node0"]}
    assert placement(4) == {"actor": ["node1", "node2"], "reward": ["node3"]}
    with pytest.raises(SystemExit, match="--emulate-nodes=2; the layout needs at least 3 nodes"):
        placement(2)


def test_bench_e2e_names_an_unknown_system():
    from dockrl.bench.e2e import run

    args = build_parser().parse_args(["bench", "e2e", "--systems=dockrl,verl"])
    with pytest.raises(SystemExit, match=r"--systems=dockrl,verl: unknown \['verl'\]"):
        run(args)


@pytest.mark.parametrize("engines", ["dockrl,sglang", "vllm,transformers"])
def test_bench_rollout_names_its_engines(engines):
    from dockrl.bench.rollout import run

    args = build_parser().parse_args(["bench", "rollout", f"--engines={engines}"])
    with pytest.raises(SystemExit, match=f"--engines={engines}: use dockrl and any of"):
        run(args)


def test_bench_kernels_times_every_variant_at_a_small_shape():
    """Figures, not assertions on them: every stage and op row is there, each variant against its first."""
    from dockrl.bench.kernels import run

    args = build_parser().parse_args(
        ["bench", "kernels", "--hidden-size=64", "--num-layers=1", "--rows=2", "--tokens=9", "--repeats=1"]
    )
    rows = run(args)
    variants = {(row["what"], row["variant"]) for row in rows}
    assert ("stage update", "bf16") in variants and (
        "attention fwd+bwd (bf16)",
        "dockrl backward",
    ) in variants
    assert len(rows) == 11 and all(row["ms"] > 0 for row in rows)
    assert all(row["speedup"] == 1.0 for row in rows if row["variant"] in ("fp32", "torch SDPA", "eager"))


def test_bench_lora_counts_trainable_parameters_and_optimizer_state():
    """LoRA r=2 on all 7 linear layers of 2 layers (hidden 64, intermediate 128, 4 heads of 16, 2 kv heads):
    r x (in + out) per layer; AdamW keeps two fp32 moments per trainable parameter in both modes."""
    import argparse

    from dockrl.bench import lora

    parser = argparse.ArgumentParser()
    lora.add_arguments(parser)
    args = parser.parse_args(
        [
            "--small",
            "--dp",
            "1",
            "--vocab-size",
            "256",
            "--rank",
            "2",
            "--rows",
            "2",
            "--tokens",
            "16",
            "--steps",
            "1",
        ]
    )
    full, adapted = lora.run(args)
    hidden, inter, kv = 64, 128, 32
    per_layer = sum(
        in_ + out
        for in_, out in [
            (hidden, hidden),
            (hidden, kv),
            (hidden, kv),
            (hidden, hidden),
            (hidden, inter),
            (hidden, inter),
            (inter, hidden),
        ]
    )
    assert adapted["trainable_params"] == 2 * 2 * per_layer
    assert full["trainable_params"] == full["model_params"]
    for row in (full, adapted):
        assert row["optimizer_state_mb"] * 2**20 == 2 * 4 * row["trainable_params"]
    # Measured through broadcast_weights / broadcast_adapters into a replica: every weight in the rollout dtype,
    # or the adapters in fp32.
    assert adapted["sync_mb"] * 2**20 == 4 * adapted["trainable_params"]
    assert full["sync_mb"] * 2**20 == (2 if full["precision"] == "bf16" else 4) * full["model_params"]
    assert adapted["model_state_mb"] < full["model_state_mb"]
