"""Benchmark command lines that cannot work fail at once with the conflicting flags named."""

import pytest

from dockrl.cli import build_parser
from helpers import scaling_model_args


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
        + ["--decode-rows=3", "--decode-keys=20"]
    )
    rows = run(args)
    variants = {(row["what"], row["variant"]) for row in rows}
    assert ("stage update", "bf16") in variants and (
        "attention fwd+bwd (bf16)",
        "dockrl backward",
    ) in variants
    # 12 + the native attention backward, RMSNorm and RoPE + 2 LM head rows + 2 mixes x 2 dtypes x 2 variants +
    # torch's and the native decode attention + 2 x 2 projection rows
    assert len(rows) == 31
    # a variant the host cannot run (the AMX tiles' on a CPU without them, the native kernels without a compiler)
    # says why instead of a time
    assert all(row["ms"] > 0 for row in rows if "ms" in row)
    assert all("ms" in row or row["variant"].startswith(("AMX tiles: off", "native: off")) for row in rows)
    assert all(
        row["speedup"] == 1.0
        for row in rows
        if row["variant"]
        in ("fp32", "torch SDPA", "eager", "torch (fp32 cache)", "oneDNN packed", "torch linear", "torch ops")
    )


def test_bench_scaling_names_an_unknown_size():
    from dockrl.bench.scaling import run

    args = build_parser().parse_args(["bench", "scaling", "--sizes=1m,7b"])
    with pytest.raises(SystemExit, match=r"--sizes=1m,7b: unknown \['7b'\]"):
        run(args)


def test_bench_scaling_sizes_work_and_speedups(tmp_path):
    """The grid's shapes have about the parameters their names say (8,000-row tied head); the work is
    5 forwards of 2 x matmul params per token plus attention's full square; speedup pairs each dockrl row with TRL's."""
    from dockrl.bench.scaling import SIZES, _speedups, work_tflop
    from dockrl.observe.report import scaling_plot

    shapes = {name: scaling_model_args(name) for name in SIZES}
    counts = {name: args.num_params() / 1e6 for name, args in shapes.items()}
    assert counts == pytest.approx({"1m": 1.20, "6m": 8.35, "25m": 28.2, "50m": 51.8}, rel=0.01)
    # 16 sequences of 128 tokens on "1m" (hidden 96, 4 layers, 3 heads of 32, 1 kv head, MLP 288, head 8000):
    # matmul params 4 x (96 x (96 + 2 x 32) + 96 x 96 + 3 x 96 x 288) + 8000 x 96 = 1,198,080;
    # 5 x (2 x params x 2048 tokens + 4 layers x 4 x 96 x 16 x 128^2)
    assert work_tflop(shapes["1m"], 16, 128) == pytest.approx(
        5 * (2 * 1_198_080 * 2048 + 4 * 4 * 96 * 16 * 128**2) / 1e12
    )
    rows = [
        {"size": "roofline", "system": "host", "fp32_gflops": 40.0, "bandwidth_gbs": 10.0},
        {"size": "1m", "params_m": 1.2, "length": 128, "system": "dockrl", "step_s": 2.0},
        {"size": "1m", "params_m": 1.2, "length": 128, "system": "trl", "step_s": 3.0},
        {"size": "1m", "params_m": 1.2, "length": 512, "system": "dockrl", "step_s": 6.0},
    ]
    for row, tokens_per_s in zip(rows[1:], (300.0, 100.0, 250.0)):
        row.update(response_tokens_per_s=tokens_per_s, s_per_tflop=row["step_s"] / 0.1)
    _speedups(rows)
    assert rows[1]["speedup"] == 3.0 and "speedup" not in rows[2] and "speedup" not in rows[3]
    assert scaling_plot(rows, tmp_path / "scaling.png") and (tmp_path / "scaling.png").stat().st_size > 0


def test_bench_env_names_an_unknown_mode():
    from dockrl.bench.env_tier import run

    args = build_parser().parse_args(["bench", "env", "--modes=tier,serial"])
    with pytest.raises(SystemExit, match=r"--modes=tier,serial: unknown \['serial'\]; use any of one-by-one"):
        run(args)


def test_bench_env_quick_sizes_and_a_baseline_no_larger_than_the_run():
    from dockrl.bench.env_tier import resolve_sizes

    args = build_parser().parse_args(["bench", "env", "--quick", "--trajectories=4"])
    resolve_sizes(args)
    assert (args.trajectories, args.tool_seconds, args.baseline_trajectories) == (4, 0.5, 4)
    args = build_parser().parse_args(["bench", "env"])
    resolve_sizes(args)
    assert (args.trajectories, args.tool_seconds, args.baseline_trajectories) == (256, 1.0, 16)


def test_bench_multiturn_counts_the_same_trajectories_three_ways():
    """A small shape: every trajectory has its turns in both multi-turn modes, with the same tokens; KV kept
    prefills exactly what re-prefill does minus what it found kept, its returning turns batched (fewer
    prefill forwards than later turns); single-turn prefills each distinct prompt once."""
    from dockrl.bench.rollout_turns import run

    args = build_parser().parse_args(
        ["bench", "multiturn", "--prompts=2", "--samples=3", "--turns=2", "--new-tokens=4"]
        + ["--hidden-size=32", "--num-layers=1", "--rounds=1", "--no-trl"]
    )
    single, reprefill, kept, load, cpu = run(args)
    assert [single["mode"], reprefill["mode"], kept["mode"], load["mode"], cpu["mode"]] == [
        "single",
        "multi_reprefill",
        "multi_kept",
        "load",
        "cpu",
    ]
    assert single["turns"] == 6 and reprefill["turns"] == kept["turns"] == 12
    assert kept["same_tokens"] == "6/6" and kept["sampled_tokens"] == reprefill["sampled_tokens"]
    assert kept["prefill_tokens"] + kept["kv_reused_tokens"] == reprefill["prefill_tokens"]
    assert kept["kv_reused_tokens"] > 0 and reprefill["kv_reused_tokens"] == 0
    assert kept["prefill_calls"] < 1 + 6  # the first turns' forward, then fewer than one per returning turn
    assert single["prefill_calls"] == 1 and single["ratio_to_single"] == 1.0


def test_trl_config_best_is_one_micro_batch_unless_memory_says_otherwise(tmp_path):
    """--trl-config best puts the whole step in one micro-batch when TRL's memory estimate fits in the memory
    available, else the fewest micro-batches of whole prompt groups that fit, saying so; micro is the old
    configuration."""
    from dockrl.bench.e2e import _MAX_PROMPT_LEN, trl_config
    from dockrl.bench.trl_memory import trl_step_bytes
    from dockrl.models.hf import read_config
    from dockrl.models.tiny import make_tiny

    model = make_tiny(tmp_path / "m", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)
    args = build_parser().parse_args(["bench", "e2e", "--prompts=16", "--samples=8", "--max-new-tokens=32"])
    best = trl_config(args, model, available_bytes=2**40)
    assert (best["per_device_train_batch_size"], best["gradient_accumulation_steps"]) == (128, 1)
    assert best["fell_back"] is None and best["attn_implementation"] == "sdpa"
    assert best["gradient_checkpointing"] is False  # GRPOConfig's default recomputes every forward
    # memory for a quarter of the step (32 rows) without checkpointing and no more: 4 micro-batches of 32
    margs = read_config(model)
    quarter = trl_step_bytes(margs, 32, _MAX_PROMPT_LEN + 32, best["precision"], 128, checkpointing=False)
    tight = trl_config(
        args, model, available_bytes=int(quarter["total"]) + 1
    )  # the float estimate rounded up
    assert (tight["per_device_train_batch_size"], tight["gradient_accumulation_steps"]) == (32, 4)
    assert "4 micro-batches of 32, gradient checkpointing off" in tight["fell_back"]
    args.trl_config = "micro"
    micro = trl_config(args, model, available_bytes=2**40)
    assert (micro["per_device_train_batch_size"], micro["gradient_accumulation_steps"]) == (8, 16)
