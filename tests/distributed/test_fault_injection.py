"""DOCKRL_FAULTS signals pids on the driver's machine: a target on another node is refused by name, a local one
is killed for real (no Ray: node addresses are given)."""

import signal
import subprocess
import sys

import pytest

from dockrl.workers.fault_injection import Fault, FaultInjector, RemoteFaultTarget


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def test_a_target_on_another_node_is_refused_and_never_signalled(sleeper):
    faults = FaultInjector([Fault("kill", "actor-1", "update", 2)], driver_ip="10.0.0.1")
    faults.register("reward-0", 4321, node_ip="10.0.0.2")  # not a target: anywhere is fine
    with pytest.raises(
        RemoteFaultTarget, match=r"'actor-1', which runs on node 10.0.0.2, not on the driver's"
    ):
        faults.register("actor-1", sleeper.pid, node_ip="10.0.0.2")
    with pytest.raises(ValueError, match="no process named 'actor-1'"):
        faults.at("update", 2, "during")
    assert sleeper.poll() is None  # the local process that happens to have that pid is untouched


def test_a_target_on_the_drivers_node_is_killed(sleeper):
    faults = FaultInjector([Fault("kill", "actor-1", "update", 2)], driver_ip="10.0.0.1")
    faults.register("actor-1", sleeper.pid, node_ip="10.0.0.1")
    faults.at("update", 2, "during")
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
