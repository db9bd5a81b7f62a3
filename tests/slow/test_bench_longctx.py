"""`dockrl bench longctx` at a small size: the same update under every cp and packing, and its prediction (kept out
of `make test`: four spawned layouts)."""

import pytest


def test_bench_longctx_trains_the_same_update_under_cp_and_packing():
    """One row of 64 + 192 tokens, hidden 64, one layer: cp = 1 with packing off and on, cp = 2 and 4. The loss is
    one token mean of O(1) terms, its cp parts summed in another order: 1e-5 relative (fp32 reassociation of a few
    hundred terms, as tests/slow/test_cp_run.py). Packing is not run twice under cp > 1 (rows are padded there).
    `predicted_mb` is update_peak's figure for the row, shrinking with cp."""
    import argparse

    from dockrl.bench import longctx
    from dockrl.parallel.memory_plan import update_peak

    parser = argparse.ArgumentParser()
    longctx.add_arguments(parser)
    args = parser.parse_args(
        ["--hidden-size", "64", "--num-layers", "1", "--vocab-size", "256", "--lengths", "192"]
        + ["--cp", "1,2,4", "--packing", "off,on", "--repeats", "1", "--threads", "1"]
    )
    rows = longctx.run(args)
    assert [(r["cp"], r["packing"]) for r in rows] == [(1, False), (1, True), (2, False), (4, False)]
    for row in rows:
        assert row["tokens"] == 256 and row["peak_mb"] > 0
        assert row["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5)
        expected = update_peak(longctx._model_args(args), rows=1, seq_len=256, cp=row["cp"], dtype_bytes=4)
        assert row["predicted_mb"] == expected["total"] / 2**20
    assert rows[0]["vs_cp1"] == 1.0 and rows[2]["predicted_mb"] < rows[0]["predicted_mb"]
