"""TRL's memory estimate (bench/trl_memory.py) term by term against hand arithmetic, the micro-batch choice it
drives, and the benches reading the available memory once, before any system runs."""

import json

import pytest

from dockrl.bench.trl_memory import MARGIN, PROCESS_BYTES, layer_bytes_per_token, trl_step_bytes
from dockrl.cli import build_parser
from dockrl.models.config import ModelArgs
from helpers import scaling_model_args

GIB = 2**30


def test_layer_bytes_per_token_by_hand():
    """The 6m shape (h 256, 8 heads of 32, MLP 768) at L = 64 + 512 = 576, bf16 and fp32."""
    margs = scaling_model_args("6m")
    # norms 2 x (4h + 4h + 4) = 4,104; five bf16 projection inputs 5 x 2 x 256 = 2,560; sdpa's q, k, v, out
    # 4 x 2 x 256 = 2,048 (o_proj's input is a view of out), logsumexp 4 x 8 = 32, mask 2 x 576 = 1,152;
    # MLP 4 x 2 x 768 = 6,144
    assert layer_bytes_per_token(margs, 576, 2) == 4104 + 2560 + 2048 + 32 + 1152 + 6144 == 16040
    # fp32: the two norm outputs once each 2 x 4 x 256 = 2,048; sdpa 4 x 4 x 256 + 32 + 4 x 576 = 6,432;
    # MLP 4 x 4 x 768 = 12,288
    assert layer_bytes_per_token(margs, 576, 4) == 4104 + 2048 + 6432 + 12288 == 24872


def test_trl_step_bytes_terms_by_hand():
    """Each term of the 6m x 512 point (16 rows of 576 tokens, bf16, KL on) from the module's arithmetic."""
    margs = scaling_model_args("6m")
    params = margs.num_params()
    terms = trl_step_bytes(margs, 16, 576, "bf16", step_rows=16)
    assert terms["process"] == PROCESS_BYTES
    # policy 4 + gradients 4 + Adam 8 + reference 4 + autocast copies 2 bytes per parameter; head accumulator
    assert terms["weights"] == 22 * params + 4 * 8000 * 256
    tokens = 16 * 576  # 9,216
    # checkpointing: 8 layer inputs of 4 x 256, the final norm and head input 12 x 256
    assert terms["saved"] == tokens * (8 * 1024 + 3072)
    # 9,216 tokens fill one 4,096-token tile: 31 bytes per element, and the hidden states' fp32 gradient
    assert terms["head"] == 4096 * 8000 * 31 + tokens * 1024
    # one recomputed layer (16,040 per token) and its gradients, two fp32 residual gradients
    assert terms["layers"] == tokens * (2 * 16040 + 2048)
    # the KV cache of 16 rows, 8 layers, k and v of 4 x 32, fp32, twice; the reference forward's tile
    assert terms["generation"] == 2 * 16 * 576 * 8 * 2 * 128 * 4 + 4096 * 8000 * 14
    parts = sum(v for k, v in terms.items() if k != "total")
    assert terms["total"] == pytest.approx(MARGIN * parts, rel=1e-12)
    # no reference model without KL: 4 bytes per parameter less
    assert trl_step_bytes(margs, 16, 576, "bf16", 16, kl=False)["weights"] == terms["weights"] - 4 * params
    # without checkpointing every layer's tensors stay saved, and the backward recomputes none
    plain = trl_step_bytes(margs, 16, 576, "bf16", 16, checkpointing=False)
    assert plain["saved"] == tokens * (8 * 16040 + 3072) and plain["layers"] == tokens * (16040 + 2048)


def test_measured_peaks_are_under_the_bound():
    """TRL's peak resident memory measured by `dockrl bench scaling --systems trl --sizes 1m,6m --lengths
    128,512 --steps 2` (peak_rss_gib; two runs, the higher kept) and `--sizes 1m --lengths 2048` (one run) at
    the padded length the steps ran (padded_length: 17-token prompts + the longest response), each under the
    bound at that length."""
    measured = {
        ("1m", 145): 1.128,
        ("1m", 529): 1.674,
        ("6m", 145): 1.375,
        ("6m", 529): 2.237,
        ("1m", 2065): 2.047,
    }
    for (size, length), peak_gib in measured.items():
        bound = trl_step_bytes(scaling_model_args(size), 16, length, "bf16", 16)["total"]
        assert bound / GIB >= peak_gib, (size, length)


def _write_config(tmp_path, margs: ModelArgs):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(margs.to_hf_config()))
    return model


def test_fifty_m_at_2048_runs_without_checkpointing_in_the_fewest_micro_batches_that_fit(
    tmp_path, monkeypatch
):
    """bench scaling's 50M x 2,048 point (4 x 4 rows of 64 + 2,048 tokens), which fell back to 4 micro-batches
    under the old estimate (129 GiB for one batch, against half the memory). By the bound: one batch without
    gradient checkpointing 20.27 GiB, 2 x 8 rows 12.11, 4 x 4 8.04; with it 8.25, 6.10, 5.03. At 24 GiB one
    batch as it is; at 20 GiB two micro-batches without checkpointing (not one batch recomputing every
    forward); at 7 GiB two micro-batches with checkpointing; at 4 GiB, short even for that, the most micro-batches there
    are, checkpointing on, saying so."""
    from dockrl.bench import e2e

    monkeypatch.setattr("dockrl.recipes.preflight.cpu_has_native_bf16", lambda: True)
    model = _write_config(tmp_path, scaling_model_args("50m"))
    args = build_parser().parse_args(["bench", "e2e", "--prompts=4", "--samples=4", "--max-new-tokens=2048"])

    def picked(gib: float) -> tuple[int, int, bool]:
        config = e2e.trl_config(args, model, available_bytes=int(gib * GIB))
        return (
            config["per_device_train_batch_size"],
            config["gradient_accumulation_steps"],
            config["gradient_checkpointing"],
        )

    assert picked(24) == (16, 1, False)
    assert e2e.trl_config(args, model, available_bytes=24 * GIB)["fell_back"] is None
    assert picked(20) == (8, 2, False)
    assert (
        "2 micro-batches of 8, gradient checkpointing off"
        in e2e.trl_config(args, model, 20 * GIB)["fell_back"]
    )
    assert picked(9) == (4, 4, False)
    assert picked(7) == (8, 2, True)
    starved = e2e.trl_config(args, model, available_bytes=4 * GIB)
    assert (starved["per_device_train_batch_size"], starved["gradient_accumulation_steps"]) == (4, 4)
    assert "4 micro-batches of 4, gradient checkpointing on" in starved["fell_back"]
    assert starved["memory_estimate_gib"] == pytest.approx(5.03, abs=0.005)


def _fake_systems(monkeypatch, events: list):
    """bench e2e's systems and roofline replaced by recorders (the orchestration is what is tested): memory
    reads 20 GiB until a system has run, then 1 GiB (a run that has not yet returned its memory)."""
    from dockrl.bench import e2e

    def available():
        events.append(("read", 1 * GIB if any(e[0] == "dockrl" for e in events) else 20 * GIB))
        return events[-1][1]

    def dockrl(args, root, model, train, peak):
        events.append(("dockrl", None))
        return {"step_s": 1.0, "response_tokens_per_s": 1.0}

    def trl(args, root, model, train, available_bytes, peak=None):
        events.append(("trl", available_bytes))
        return "recorded"

    monkeypatch.setattr(e2e, "available_memory_bytes", available)
    monkeypatch.setattr(e2e, "measure_peak", lambda: {})
    monkeypatch.setattr(e2e, "_dockrl", dockrl)
    monkeypatch.setattr(e2e, "_trl", trl)


def test_bench_e2e_reads_available_memory_before_either_system(monkeypatch):
    from dockrl.bench import e2e

    events: list = []
    _fake_systems(monkeypatch, events)
    e2e.run(build_parser().parse_args(["bench", "e2e", "--small", "--steps=2"]))
    assert events == [("read", 20 * GIB), ("dockrl", None), ("trl", 20 * GIB)]


def test_bench_scaling_reads_available_memory_once_for_every_point(monkeypatch):
    from dockrl.bench import scaling

    events: list = []
    _fake_systems(monkeypatch, events)
    scaling.run(build_parser().parse_args(["bench", "scaling", "--sizes=1m", "--lengths=8,16"]))
    assert events == [("read", 20 * GIB)] + [("dockrl", None), ("trl", 20 * GIB)] * 2
