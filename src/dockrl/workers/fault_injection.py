"""Fault injection for chaos drills and the fault tests: the driver kills or freezes one process on cue.

    DOCKRL_FAULTS="kill:actor-1:update:2:during;hang:reward-0:generate:1:during;kill:driver:save:2:during"

Each fault is ACTION:TARGET:STAGE:STEP[:WHEN]:
- ACTION `kill` (SIGKILL), `hang` (SIGSTOP: the process stays alive and answers nothing) or `pause=SECONDS`
  (SIGSTOP, then SIGCONT that many seconds later: a straggler; e.g. pause=1.5:rollout-0:generate:2);
- TARGET a worker (`actor-1`, `critic-0`, `reward-0`, `reward_model-0`), a dock actor
  (`dockrl-controller`, `dockrl-warehouse-0`) or `driver` (this process, killed only);
- STAGE the stage method the driver starts (generate, compute_ref, compute_old, compute_values, update,
  score, save) at RL step STEP; WHEN `before` it is started, `during` (right after it is started, default) or
  `after` its results are in. The driver's own `save` stage also has `commit` (the workers' shards are
  written, trainer_state.json and the rename are not).

A fault fires at most once per driver process, so a run that restarts (run.max_restarts) replays the step
undisturbed. The processes are real and the kills are real signals: nothing is simulated. Faults need the
target on the driver's node (local Ray): a fault signals a pid on the driver's machine, so a target
registered on another node is refused (RemoteFaultTarget) as soon as it registers. Unset DOCKRL_FAULTS
injects nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ENV = "DOCKRL_FAULTS"
ACTIONS = ("kill", "hang", "pause")
WHENS = ("before", "during", "after", "commit")


class RemoteFaultTarget(ValueError):
    """A fault's target runs on another node than the driver: its pid means nothing here."""


@dataclass(frozen=True)
class Fault:
    """One scheduled fault (see the module docstring)."""

    action: str
    target: str
    stage: str
    step: int
    when: str = "during"
    seconds: float = 0.0  # how long a `pause` lasts


def parse_faults(text: str | None) -> list[Fault]:
    """Faults from the DOCKRL_FAULTS syntax; errors name the malformed entry."""
    faults = []
    for entry in (text or "").replace(",", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        parts = entry.split(":")
        action, _, seconds = parts[0].partition("=")
        if action == "pause":
            try:
                pause_s = float(seconds)
            except ValueError:
                pause_s = -1.0
            if not 0 < pause_s <= 600:
                raise ValueError(f"{ENV} entry {entry!r}: pause=SECONDS needs 0 < SECONDS <= 600")
        if len(parts) not in (4, 5) or action not in ACTIONS or not parts[3].isdigit():
            raise ValueError(
                f"{ENV} entry {entry!r} is not ACTION:TARGET:STAGE:STEP[:WHEN] with ACTION in {ACTIONS} "
                "(pause as pause=SECONDS), e.g. kill:actor-1:update:2:during"
            )
        when = parts[4] if len(parts) == 5 else "during"
        if when not in WHENS:
            raise ValueError(f"{ENV} entry {entry!r}: WHEN must be one of {WHENS}")
        pause = float(seconds) if action == "pause" else 0.0
        faults.append(Fault(action, parts[1], parts[2], int(parts[3]), when, pause))
    return faults


class FaultInjector:
    """Fires the faults of DOCKRL_FAULTS (or `faults`) when the driver reaches their stage and step."""

    def __init__(self, faults: list[Fault] | None = None, driver_ip: str | None = None):
        self.faults = parse_faults(os.environ.get(ENV)) if faults is None else faults
        self.fired: set[Fault] = set()
        self.pids: dict[str, int] = {}  # target name -> pid, registered as processes start
        self._driver_ip = driver_ip  # this process's Ray node address (looked up when first needed)

    def register(self, name: str, pid: int, node_ip: str | None = None) -> None:
        """Make process `pid` on node `node_ip` (None: this one) reachable as target `name`; a target of a
        scheduled fault on another node raises RemoteFaultTarget."""
        if node_ip is not None and any(f.target == name for f in self.faults):
            driver_ip = self.driver_ip()
            if node_ip != driver_ip:
                raise RemoteFaultTarget(
                    f"{ENV} targets {name!r}, which runs on node {node_ip}, not on the driver's node {driver_ip}: "
                    f"a fault signals a pid on the driver's machine; target a process on this node, or unset {ENV}"
                )
        self.pids[name] = pid

    def driver_ip(self) -> str:
        """The driver's Ray node address."""
        if self._driver_ip is None:
            import ray

            self._driver_ip = ray.util.get_node_ip_address()
        return self._driver_ip

    def at(self, stage: str, step: int | None, when: str) -> None:
        """The driver is at `when` of `stage` in `step`: fire what is due."""
        for fault in self.faults:
            if fault in self.fired or (fault.stage, fault.step, fault.when) != (stage, step, when):
                continue
            self.fired.add(fault)
            self._fire(fault)

    def _fire(self, fault: Fault) -> None:
        # `dockrl bench faults` reads this line to time how long the run takes to name the failure.
        log.warning("%s: firing %s (wall clock %.3f)", ENV, fault, time.time())
        if fault.target == "driver":
            if fault.action != "kill":
                raise ValueError(f"{ENV}: the driver can only be killed, not {fault.action}")
            os.kill(os.getpid(), signal.SIGKILL)
        pid = self.pids.get(fault.target)
        if pid is None:
            raise ValueError(f"{ENV}: no process named {fault.target!r}; known: {sorted(self.pids)}")
        os.kill(pid, signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
        if fault.action == "pause":
            resume = threading.Timer(fault.seconds, _continue, (pid,))
            resume.daemon = True
            resume.start()


def _continue(pid: int) -> None:
    """The end of a pause (the process may have been killed meanwhile)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def process_identity(_actor: Any = None) -> dict[str, Any]:
    """Node address and id, and pid, of the calling process (run inside an actor via `__ray_call__`)."""
    import ray

    return {
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
    }
