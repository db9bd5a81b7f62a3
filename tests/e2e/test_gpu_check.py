"""scripts/gpu_check.py: the single-process GPU checks run on CPU (--quick), every part passes, no Ray."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("bf16_parity", "dcp_round_trip", "rollout_tokens_per_s", "switch_offload", "vllm_update")


def test_gpu_check_quick_on_cpu(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    records = {}
    for line in result.stdout.splitlines():
        record = json.loads(line)  # stdout holds JSON lines only; logs go to stderr
        records[record["part"]] = record
    assert set(records) == {*PARTS, "summary"}, result.stdout
    for part in PARTS:
        assert "error" not in records[part], records[part]
        assert records[part]["ok"] is True, records[part]

    dcp = records["dcp_round_trip"]
    assert dcp["bitwise_equal"] is True
    assert dcp["loaded_bitwise_equal"] and dcp["params_bitwise_equal"] and dcp["metrics_bitwise_equal"]
    assert dcp["export_equal"] and dcp["checkpoint_bytes"] > 0
    switch = records["switch_offload"]
    assert switch["params_restored"] is True
    assert switch["rollout_logits_max_abs_diff"] == 0.0  # fp32 rollout weights are the training weights
    parity = records["bf16_parity"]
    assert parity["max_abs_diff_fp32"] <= 1e-4 * max(1.0, parity["logit_scale"])
    for mode in ("fixed", "longtail"):
        assert records["rollout_tokens_per_s"][mode]["tokens_per_s_dockrl"] > 0

    summary = records["summary"]
    assert summary["ok"] is True and summary["failed"] == []
    assert summary["ray_imported"] is False  # the GPU machine has no Ray
    assert (tmp_path / "gpu_check" / "dcp_ckpt").is_dir()
