"""`dockrl bench env` at a tiny size: every mode makes the calls its trajectories need, each tool call's seconds
are counted, and the one-by-one mode runs its calls one after the other (figures, not speed comparisons)."""

import pytest

from dockrl.cli import build_parser

TRAJECTORIES, TURNS, TOOL_S = 8, 3, 0.1


def test_bench_env_counts_every_call_and_its_seconds(ray_session):
    from dockrl.bench.env_tier import run

    args = build_parser().parse_args(
        [
            "bench",
            "env",
            "--quick",
            f"--trajectories={TRAJECTORIES}",
            f"--tool-seconds={TOOL_S}",
            f"--turns={TURNS}",
            "--baseline-trajectories=4",
            "--workers=2",
            "--concurrency=4",
            "--slots=8",
            "--python-calls=3",
            "--python-parallel=2",
        ]
    )
    rows = run(args)
    measured = {row["mode"]: row for row in rows if row.get("basis") == "measured"}
    assert sorted(measured) == ["local", "one-by-one", "tier"]
    for mode, row in measured.items():
        n = row["trajectories"]
        assert n == (4 if mode == "one-by-one" else TRAJECTORIES)
        # Each trajectory: its reset and one step per turn; every step but the last calls the tool.
        assert row["calls"] == n * (1 + TURNS) and row["turns"] == n * TURNS
        assert row["tool_calls"] == n * (TURNS - 1)
        assert row["timeouts"] == row["errors"] == row["truncated"] == 0
        # A call is timed from its start to its answer, which comes after the tool's sleep.
        assert row["env_s"] >= row["tool_calls"] * TOOL_S
    # One by one, no call starts before the previous one answered: the calls' seconds lie end to end inside
    # the rollout's wall time.
    one = measured["one-by-one"]
    assert one["wall_s"] >= one["tool_calls"] * TOOL_S
    scaled = next(row for row in rows if row["mode"] == "one-by-one" and row["basis"] != "measured")
    assert scaled["basis"] == "4 x 2" and scaled["trajectories"] == TRAJECTORIES
    assert scaled["wall_s"] == pytest.approx(2 * one["wall_s"])
    for mode in ("tier", "local"):
        assert measured[mode]["speedup"] == pytest.approx(scaled["wall_s"] / measured[mode]["wall_s"])
    python = [row for row in rows if row["mode"].startswith("python")]
    assert [row["mode"] for row in python] == ["python one-by-one", "python x2"]
    assert all(row["calls"] == row["ok"] == 3 and row["sandbox"] in ("bwrap", "none") for row in python)
    assert rows[-1]["mode"] == "cpu" and rows[-1]["cores"] >= 1
