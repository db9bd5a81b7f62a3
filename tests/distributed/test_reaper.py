"""The reaper kills every process of a dead driver's run, including one that appears after its first sweep
(a daemon a dying raylet was still starting), and nothing else."""

import os
import subprocess
import sys
import time
import uuid

from dockrl.workers.reaper import RUN_ID_ENV, reap

SLEEPER = "import time; time.sleep(120)"


def _gone(proc: subprocess.Popen, within_s: float = 10.0) -> bool:
    try:
        proc.wait(timeout=within_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_reap_kills_late_processes_of_the_run_and_spares_others(tmp_path):
    run_id = uuid.uuid4().hex
    ours = {**os.environ, RUN_ID_ENV: run_id}
    theirs = {k: v for k, v in os.environ.items() if k != RUN_ID_ENV}
    pid_file = tmp_path / "late.pid"
    early = subprocess.Popen([sys.executable, "-c", SLEEPER], env=ours)
    # Not the run's: starts one of the run's processes half a second after the reaper begins.
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time; time.sleep(0.5); "
            f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], env={{**os.environ, {RUN_ID_ENV!r}: {run_id!r}}}); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)",
        ],
        env=theirs,
    )
    try:
        # quiet_s well above the starter's delay: the sweep outlives it however loaded the machine is
        signalled = reap(run_id, sweep_s=30.0, quiet_s=5.0)
        assert _gone(early)
        late_pid = int(pid_file.read_text())
        assert signalled == 2
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the late one is the starter's child: a zombie until reaped
            state = (
                open(f"/proc/{late_pid}/stat").read().split()[2]
                if os.path.exists(f"/proc/{late_pid}")
                else "X"
            )
            if state in ("Z", "X"):
                break
            time.sleep(0.1)
        assert state in ("Z", "X")
        assert starter.poll() is None  # not the run's: untouched
    finally:
        starter.kill()
        starter.wait(timeout=10)
        early.kill()


def test_a_dead_drivers_descendants_die_even_without_the_run_id(tmp_path):
    """A process the driver's tree started without the run id in its environment (as the raylet sometimes
    starts Ray's dashboard and runtime-env agents) is noted by the reaper while the driver lives and killed when
    the driver is SIGKILLed; the reaper itself exits."""
    import signal

    pid_file = tmp_path / "orphan.pid"
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "from dockrl.workers.reaper import RUN_ID_ENV, start_reaper\n"
            "start_reaper()\n"
            "env = {k: v for k, v in os.environ.items() if k != RUN_ID_ENV}\n"
            f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], env=env, start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(120)\n",
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        orphan = int(pid_file.read_text())
        time.sleep(3 * 1.0)  # a few of the reaper's WATCH_S rounds: it has noted the orphan
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        deadline = time.monotonic() + 20  # the reaper's sweep (SWEEP_S = 10) with room for a loaded machine
        state = "S"
        while time.monotonic() < deadline:
            state = (
                open(f"/proc/{orphan}/stat").read().split()[2] if os.path.exists(f"/proc/{orphan}") else "X"
            )
            if state in ("Z", "X"):
                break
            time.sleep(0.1)
        assert state in ("Z", "X")
    finally:
        driver.kill()
        if pid_file.exists() and os.path.exists(f"/proc/{pid_file.read_text()}"):
            os.kill(int(pid_file.read_text()), 9)


def _env_of_a_child() -> str:
    """DOCKRL_RUN_ID as a new child process of this interpreter sees it."""
    code = f"import os; print(os.environ.get({RUN_ID_ENV!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_run_id_marks_rays_processes_but_not_the_drivers_later_children(monkeypatch):
    """init_ray's local Ray: the processes ray.init starts (its daemons, which start the workers) carry the run
    id, so the reaper finds them; afterwards the id is gone from the driver's environment, so a process the
    interpreter starts later (a notebook's subprocess) is not the run's. ray.init is a stand-in that starts one
    process, and the reaper process is not started (its id is set as start_reaper sets it)."""
    import ray

    from dockrl.recipes import common
    from dockrl.workers import reaper

    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    run_id = uuid.uuid4().hex
    monkeypatch.setattr(reaper, "start_reaper", lambda: os.environ.__setitem__(RUN_ID_ENV, run_id) or run_id)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    daemons: list[str] = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: daemons.append(_env_of_a_child()))
    common.init_ray(None)
    assert daemons == [run_id]
    assert RUN_ID_ENV not in os.environ and _env_of_a_child() == "None"
