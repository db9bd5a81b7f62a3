"""A hung worker ends the run with a named error after its heartbeat timeout (kept out of `make test`: it waits
the timeout out)."""

from fault_runs import _fails_named


def test_hung_worker_ends_the_run_after_the_heartbeat_timeout(ppo_args, monkeypatch, capsys):
    fault = "hang:actor-0:compute_ref:1:during"
    # 10 s, not the default 30: short for the test, long enough that a busy machine never starves a healthy
    # worker's heartbeat thread that long
    expect = dict(
        target="actor-0",
        stage="compute_ref",
        step=1,
        cause="hung: no heartbeat",
        extra=["run.heartbeat_timeout_s=10"],
    )
    _fails_named(ppo_args, monkeypatch, capsys, fault, "hang-actor", **expect)
