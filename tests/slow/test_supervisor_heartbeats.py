"""The supervisor names a frozen worker of another group from its heartbeats (make test-slow; tests/e2e/test_faults.py keeps a hung worker ending a run in make test)."""

import os
import time

import pytest

from dockrl.workers.group import WorkerGroup
from echo_worker import EchoWorker


def test_supervisor_names_a_frozen_worker_of_another_group_from_its_heartbeats(ray_session):
    import signal

    from dockrl.workers.group import WorkerFailure
    from dockrl.workers.supervisor import Supervisor

    supervisor = Supervisor(heartbeat_timeout_s=3.0)
    suffix = time.monotonic_ns()
    busy = WorkerGroup(EchoWorker, 1, name=f"busy{suffix}", timeout_s=60.0, supervisor=supervisor)
    frozen = WorkerGroup(EchoWorker, 1, name=f"frozen{suffix}", timeout_s=60.0, supervisor=supervisor)
    supervisor.step = 7
    try:
        assert busy.call("rank_times", 2) == [0]  # heartbeats answer on their own thread
        os.kill(frozen.identities[0]["pid"], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(
            WorkerFailure, match=rf"frozen{suffix}-0 \(frozen{suffix} rank 0, node .* hung: no heartbeat"
        ):
            busy.call("sleep", 30)
        assert time.monotonic() - start < 30  # the heartbeat timeout ended the wait, not the call's end
        late = WorkerGroup(EchoWorker, 1, name=f"late{suffix}", timeout_s=1.0, supervisor=Supervisor(step=7))
        with pytest.raises(
            WorkerFailure,
            match=r"late\d+-0 \(.* hung: sleep still running after 1 s .*at step 7, stage sleep",
        ):
            late.call("sleep", 30)
        late.supervisor.kill_all()
    finally:
        supervisor.kill_all()
