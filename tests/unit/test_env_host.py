"""EnvHost (envs/host.py): an environment call's clock starts when the call starts, queued calls of a trajectory
that gave up never run, a hung call holds neither a thread nor the exit, coroutine environments, and the step's
time and tool calls left reach the tools."""

import asyncio
import subprocess
import sys
import threading
import time

from dockrl.envs.base import Observation, time_left, tool_calls_left
from dockrl.envs.host import RESET, STEP, EnvHost
from dockrl.envs.tool_env import ToolEnvironment

RUNS: list[str] = []  # the keys whose step ran, in order


class Sleepy:
    """Each step sleeps `seconds` and records that it ran."""

    tools: list = []

    def __init__(self, seconds: float = 0.1):
        self.seconds = seconds

    def reset(self, row):
        self.key = row["key"]
        return Observation(messages=[{"role": "user", "content": "go"}])

    def step(self, message):
        RUNS.append(self.key)
        time.sleep(self.seconds)
        return Observation(messages=[{"role": "tool", "content": f"{time_left():.3f} {tool_calls_left()}"}])


def _open(host: EnvHost, keys: list[str]) -> None:
    for key in keys:
        assert host.submit(key, RESET, {"key": key}, 5.0).result(timeout=30).kind == "ok"


def test_the_clock_starts_when_the_call_starts():
    """One thread, 8 calls of 0.15 s each, submitted at once with a 0.5 s limit: the last one starts ~1.05 s
    after it was queued (past its limit, had queueing counted), yet none times out. With a limit under the
    calls' own time (0.05 s) every one does: the limit acts, on each call's running time."""
    host = EnvHost(lambda: Sleepy(0.15), concurrency=1)
    keys = [f"t{i}" for i in range(8)]
    _open(host, keys)
    queued = time.perf_counter()
    futures = [host.submit(k, STEP, "hi", 0.5) for k in keys]
    outcomes = [f.result(timeout=60) for f in futures]
    assert time.perf_counter() - queued > 0.5 + 0.15  # the last call waited past its limit before it ran
    assert [o.kind for o in outcomes] == ["ok"] * 8
    assert all(0.15 <= o.seconds < 0.5 for o in outcomes)
    short = [host.submit(k, STEP, "hi", 0.05) for k in keys]
    assert [f.result(timeout=60).kind for f in short] == ["timeout"] * 8
    host.close()


def test_queued_calls_of_a_dropped_trajectory_never_run():
    RUNS.clear()
    host = EnvHost(lambda: Sleepy(0.3), concurrency=1)
    _open(host, ["a", "b"])
    running = host.submit("a", STEP, "hi", 5.0)
    while not RUNS:  # a's call holds the only thread
        time.sleep(0.01)
    queued = host.submit("b", STEP, "hi", 5.0)
    host.drop("b")
    assert running.result(timeout=30).kind == "ok"
    assert queued.result(timeout=30).kind == "cancelled"
    assert RUNS == ["a"] and host.counts["cancelled"] == 1
    host.close()


class Hangs:
    """A step that never returns (a tool stuck in a call)."""

    tools: list = []
    release = threading.Event()

    def reset(self, row):
        return Observation(messages=[{"role": "user", "content": "go"}])

    def step(self, message):
        if message == "hang":
            Hangs.release.wait()
        return Observation(messages=[{"role": "tool", "content": "done"}])


def test_a_hung_call_times_out_and_its_thread_is_replaced():
    host = EnvHost(Hangs, concurrency=1)
    _open(host, ["h", "n"])
    assert host.submit("h", STEP, "hang", 0.2).result(timeout=30).kind == "timeout"
    # the only thread is still inside the hung call: a fresh one serves the next
    assert host.submit("n", STEP, "fine", 5.0).result(timeout=30).kind == "ok"
    assert host.counts["abandoned_threads"] == 1
    Hangs.release.set()
    host.close()


def test_a_hung_call_does_not_hold_the_process_exit():
    code = (
        "import threading\n"
        "from dockrl.envs.base import Observation\n"
        "from dockrl.envs.host import EnvHost, RESET, STEP\n"
        "class Stuck:\n"
        "    tools = []\n"
        "    def reset(self, row): return Observation('go')\n"
        "    def step(self, message): threading.Event().wait()\n"
        "host = EnvHost(Stuck, concurrency=2)\n"
        "host.submit('k', RESET, {}, 5.0).result()\n"
        "print(host.submit('k', STEP, 'x', 0.2).result().kind)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "timeout", done.stderr


class Coroutines:
    """An environment whose methods are coroutines: they wait without holding a thread."""

    tools: list = []

    async def reset(self, row):
        return Observation(messages=[{"role": "user", "content": "go"}])

    async def step(self, message):
        await asyncio.sleep(float(message))
        return Observation(messages=[{"role": "tool", "content": f"{time_left():.3f}"}])


def test_async_environments_run_concurrently_and_time_out():
    """20 coroutine calls of 0.3 s on a host of one thread all run at once: each ends well within its 2 s limit
    (queued behind one another they would take 6 s); one of 5 s is cancelled at its 0.5 s limit."""
    host = EnvHost(Coroutines, concurrency=1)
    keys = [f"c{i}" for i in range(21)]
    _open(host, keys)
    futures = [host.submit(k, STEP, "0.3", 2.0) for k in keys[:20]]
    slow = host.submit(keys[20], STEP, "5", 0.5)
    outcomes = [f.result(timeout=60) for f in futures]
    assert [o.kind for o in outcomes] == ["ok"] * 20
    assert all(float(o.observation.messages[0]["content"]) > 1.0 for o in outcomes)  # time left after 0.3 s
    assert slow.result(timeout=60).kind == "timeout"
    host.close()


def test_the_call_budget_reaches_the_environment():
    host = EnvHost(lambda: Sleepy(0.0), concurrency=1)
    _open(host, ["b"])
    outcome = host.submit("b", STEP, "hi", 3.0, tool_calls_left=5).result(timeout=30)
    left, calls = outcome.observation.messages[0]["content"].split()
    assert 2.9 < float(left) <= 3.0 and int(calls) == 5
    host.close()


def test_tool_calls_past_the_trajectorys_allowance_never_run():
    """Three calculator calls with two allowed: two answers, the third refused unrun; the step's time left
    bounds each tool call."""
    env = ToolEnvironment(tools=["calculator"], family="qwen2")
    call = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'
    message = "".join(call.format(e) for e in ("1+1", "2*3", "7-5"))
    host = EnvHost(lambda: env, concurrency=1)
    _open_tools = host.submit("k", RESET, {"prompt": "q"}, 5.0).result(timeout=30)
    assert _open_tools.kind == "ok"
    outcome = host.submit("k", STEP, message, 5.0, tool_calls_left=2).result(timeout=30)
    answers = [m["content"] for m in outcome.observation.messages]
    assert answers[:2] == ["2", "6"] and answers[2].startswith(
        "Error: the trajectory's tool calls are used up"
    )
    everything = host.submit("k", STEP, message, 5.0, tool_calls_left=3).result(timeout=30)
    assert [m["content"] for m in everything.observation.messages] == ["2", "6", "2"]
    host.close()
