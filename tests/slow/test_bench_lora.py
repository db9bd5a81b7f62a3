"""`dockrl bench lora` at a small size: what it counts (kept out of `make test`: ~20 s of training passes)."""


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
