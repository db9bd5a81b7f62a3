"""`dockrl bench env`: multi-turn rollout against a slow tool, its calls one by one against the environment tier;
the isolated `python` tool's calls per second.

```
 N prompts ─▶ run_trajectories (RolloutEngine, tiny random model, --slots slots)
     per trajectory: reset (instant) ─▶ turn 1 ─▶ step: the tool, --tool-seconds ─▶ ... ─▶ turn T ─▶ step: done
     environment calls through one of:
       one by one   LocalEnvs(EnvHost(concurrency=1)): every call after the previous one, in this process
       tier         TierEnvs over --workers EnvWorker processes (Ray), --concurrency calls at once each
       local        LocalEnvs(EnvHost(concurrency=workers x concurrency)), in this process
```

Each trajectory makes 1 + T calls (its reset and T steps) of which T - 1 are tool calls of --tool-seconds (the
last step says done at once), so the calls of N trajectories take N x (T - 1) x tool_seconds one after the
other. The one-by-one mode is measured on --baseline-trajectories of them (all of them when that is N or more)
and, when fewer, its wall time for N is given on a row of its own as that measured wall time scaled by N / n
(the calls run one after the other, so the time grows with their number); its `basis` column says which. Each
mode's row: wall seconds of run_trajectories (engine and workers built before the clock starts), env_s (the
seconds calls ran, summed), env_wait_s (the seconds the loop waited on calls with nothing to decode), calls and
timeouts (the outcomes that came back), tool calls, turns, truncated trajectories, trajectories/s; the tier's
and local's `speedup` is the one-by-one wall time for N (measured or scaled, as its row says) over theirs.

Then `Python().run(...)` (envs/tools.py: a subprocess per call, sandboxed) --python-calls times, one after the
other and on a pool of --python-parallel threads: calls/s and the median latency, `sandbox` says whether bwrap
is on PATH. The last row names the CPU (model, cores, vector flags). Module-level imports stay light.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from typing import Any

from dockrl.envs.base import Observation

MODES = ("one-by-one", "tier", "local")
PYTHON_CODE = "print(sum(range(1000)))"


class SlowToolEnv:
    """A trajectory of `turns` policy turns: each of the first turns - 1 answers get a tool result that takes
    `tool_seconds` (a sleep: the tool waits, it does not compute), the last one ends the trajectory."""

    tools: list[dict[str, Any]] = []

    def __init__(self, tool_seconds: float, turns: int):
        self.tool_seconds, self.turns, self.turn = tool_seconds, turns, 0

    def reset(self, row: dict[str, Any]) -> Observation:
        """The row's prompt as the first user turn."""
        return Observation(messages=[{"role": "user", "content": row["prompt"]}])

    def step(self, message: str) -> Observation:
        """A tool result after `tool_seconds`, or done with reward 1 on the last turn."""
        self.turn += 1
        if self.turn >= self.turns:
            return Observation(done=True, reward=1.0)
        time.sleep(self.tool_seconds)
        return Observation(messages=[{"role": "tool", "content": "done"}], info={"tool_calls": 1})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dockrl bench env`."""
    parser.add_argument(
        "--trajectories", type=int, default=None, help="trajectories (default 256; --quick 32)"
    )
    parser.add_argument(
        "--tool-seconds",
        type=float,
        default=None,
        help="seconds one tool call takes (default 1.0; --quick 0.5)",
    )
    parser.add_argument(
        "--turns", type=int, default=2, help="policy turns per trajectory (turns - 1 tool calls)"
    )
    parser.add_argument(
        "--baseline-trajectories",
        type=int,
        default=None,
        help="trajectories the one-by-one mode is measured on (default 16; --quick 8); its wall time for "
        "--trajectories is scaled from them",
    )
    parser.add_argument("--workers", type=int, default=2, help="environment worker processes of the tier")
    parser.add_argument("--concurrency", type=int, default=64, help="calls at once per environment worker")
    parser.add_argument("--slots", type=int, default=64, help="the rollout engine's slots")
    parser.add_argument(
        "--new-tokens", type=int, default=4, help="tokens the policy samples per turn (at most)"
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--python-calls", type=int, default=20, help="calls of the python tool per pass")
    parser.add_argument("--python-parallel", type=int, default=4, help="threads of the parallel pass")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the rollout engine")
    parser.add_argument("--ray-address", default=None, help="a running Ray cluster (default: a local Ray)")
    parser.add_argument("--quick", action="store_true", help="32 trajectories, 0.5 s tool calls (tests)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The modes' rows, the python tool's rows, the CPU's row."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise SystemExit(f"--modes={args.modes}: unknown {unknown}; use any of {', '.join(MODES)}")
    if args.turns < 1:
        raise SystemExit(f"--turns={args.turns}: a trajectory has at least one turn")
    resolve_sizes(args)
    rows = rollout_rows(args, modes)
    rows += python_rows(args.python_calls, args.python_parallel)
    rows.append(cpu_row())
    return rows


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fill the sizes left unset: the defaults, or --quick's."""
    if args.trajectories is None:
        args.trajectories = 32 if args.quick else 256
    if args.tool_seconds is None:
        args.tool_seconds = 0.5 if args.quick else 1.0
    if args.baseline_trajectories is None:
        args.baseline_trajectories = 8 if args.quick else 16
    args.baseline_trajectories = max(1, min(args.baseline_trajectories, args.trajectories))


# ---- rollout against the slow tool ----------------------------------------------------------------------------


def rollout_rows(args: argparse.Namespace, modes: list[str]) -> list[dict[str, Any]]:
    """Each mode's row (module docstring); one-by-one's scaled row when it ran on fewer trajectories."""
    import tempfile

    import torch

    from dockrl.models.hf import load_model
    from dockrl.models.tiny import make_tiny
    from dockrl.models.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dockrl-bench-env-") as tmp:
        path = make_tiny(
            tmp,
            family="qwen2",
            hidden_size=64,
            num_layers=2,
            seed=args.seed,
            max_position_embeddings=max(512, 64 + _response_budget(args)),
        )
        tokenizer = Tokenizer.from_dir(path)
        model = load_model(path).eval()
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": f"task {i}"}], add_generation_prompt=True
                )
            )
            for i in range(args.trajectories)
        ]
        for mode in modes:
            count = args.baseline_trajectories if mode == "one-by-one" else args.trajectories
            with _env_calls(mode, args) as envs:
                row = _rollout(model, tokenizer, prompts[:count], envs, args)
            rows.append({"mode": mode, "basis": "measured", **row})
            if mode == "one-by-one" and count < args.trajectories:
                rows.append(_scaled(rows[-1], args.trajectories))
    _speedups(rows, args.trajectories)
    return rows


class _CountedEnvs:
    """EnvCalls that counts the outcomes coming back by kind."""

    def __init__(self, envs: Any):
        self.envs, self.kinds = envs, {"ok": 0, "error": 0, "timeout": 0, "cancelled": 0}

    def reset(self, row: int, env_row: dict[str, Any], limit_s: float) -> None:
        self.envs.reset(row, env_row, limit_s)

    def step(self, row: int, message: str, limit_s: float, tool_calls_left: int) -> None:
        self.envs.step(row, message, limit_s, tool_calls_left)

    def drop(self, row: int) -> None:
        self.envs.drop(row)

    def ready(self, wait_s: float) -> list:
        got = self.envs.ready(wait_s)
        for _, outcome in got:
            self.kinds[outcome.kind] += 1
        return got

    def close(self) -> None:
        self.envs.close()


@contextlib.contextmanager
def _env_calls(mode: str, args: argparse.Namespace) -> Iterator[_CountedEnvs]:
    """The EnvCalls of one mode, built before the clock starts (the tier's workers started and answering);
    closed, and the tier's workers (and a Ray this bench started) stopped, on exit."""
    if mode != "tier":
        from dockrl.envs.host import EnvHost, LocalEnvs

        concurrency = 1 if mode == "one-by-one" else args.workers * args.concurrency
        host = EnvHost(lambda: SlowToolEnv(args.tool_seconds, args.turns), concurrency)
        try:
            yield _CountedEnvs(LocalEnvs(host))
        finally:
            host.close()
        return
    import ray

    from dockrl.recipes.common import init_ray
    from dockrl.workers.env import TierEnvs, start_env_workers

    started_ray = not ray.is_initialized()
    init_ray(args.ray_address)
    workers = start_env_workers(_env_spec(args), "qwen2", [])
    try:
        ray.get([w.ping.remote() for w in workers])  # started and answering before the clock starts
        yield _CountedEnvs(TierEnvs(workers, "bench-env"))
    finally:
        for worker in workers:
            ray.kill(worker, no_restart=True)
        if started_ray:
            ray.shutdown()


def _env_spec(args: argparse.Namespace) -> Any:
    """The tier's environment: SlowToolEnv, imported by name in the workers."""
    from dockrl.config.specs import EnvSpec

    return EnvSpec(
        name="dockrl.bench.env_tier:SlowToolEnv",
        kwargs={"tool_seconds": args.tool_seconds, "turns": args.turns},
        code=None,
        origin=None,
        max_turns=args.turns,
        max_tool_calls=args.turns,
        max_response_tokens=_response_budget(args),
        policy_budget=args.turns * args.new_tokens,
        call_timeout_s=_call_timeout_s(args),
        num_workers=args.workers,
        concurrency=args.concurrency,
        reward_weight=1.0,
        system_prompt=None,
    )


def _response_budget(args: argparse.Namespace) -> int:
    """Tokens after the prompt: each turn's sampled tokens and what follows them (the close of the turn, a tool
    message, the next generation prompt: 38 tokens of the tiny tokenizer)."""
    return args.turns * (args.new_tokens + 96)


def _call_timeout_s(args: argparse.Namespace) -> float:
    """A call's limit far past the tool's seconds: the bench counts timeouts, it does not provoke them."""
    return 10 * args.tool_seconds + 30.0


def _rollout(
    model: Any, tokenizer: Any, prompts: list[list[int]], envs: _CountedEnvs, args: argparse.Namespace
):
    """One pass of run_trajectories over `prompts`: its figures."""
    from dockrl.engines.rollout.multi_turn import ChatDelta, TurnLimits, run_trajectories
    from dockrl.engines.rollout.rollout_engine import RolloutEngine
    from dockrl.engines.rollout.sampling import SamplingParams

    max_response_tokens = _response_budget(args)
    engine = RolloutEngine(
        model,
        num_slots=args.slots,
        max_seq_len=max(len(p) for p in prompts) + max_response_tokens,
        pad_token_id=tokenizer.pad_token_id or 0,
        detokenize=tokenizer.decode,
    )
    params = SamplingParams(
        max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=tokenizer.encode("<|im_end|>")
    )
    limits = TurnLimits(
        max_turns=args.turns,
        max_tool_calls=args.turns,
        max_response_tokens=max_response_tokens,
        call_timeout_s=_call_timeout_s(args),
    )
    start = time.perf_counter()
    _, stats = run_trajectories(
        engine,
        prompts,
        [{"prompt": f"task {i}"} for i in range(len(prompts))],
        params=params,
        groups_per_pull=args.slots,
        row_seed=lambda row: args.seed + row,
        envs=envs,
        delta=ChatDelta(tokenizer, SlowToolEnv.tools),
        system_prompt=None,
        limits=limits,
    )
    wall = time.perf_counter() - start
    env = stats["env"]
    return {
        "trajectories": env["trajectories"],
        "wall_s": wall,
        "trajectories_per_s": env["trajectories"] / wall,
        "env_s": env["env_s"],
        "env_wait_s": env["env_wait_s"],
        "calls": sum(envs.kinds.values()),
        "tool_calls": env["tool_calls"],
        "turns": env["turns"],
        "timeouts": envs.kinds["timeout"],
        "errors": envs.kinds["error"],
        "truncated": env["truncated"],
    }


def _scaled(measured: dict[str, Any], trajectories: int) -> dict[str, Any]:
    """One-by-one for `trajectories`, scaled from its measured row (module docstring)."""
    factor = trajectories / measured["trajectories"]
    return {
        "mode": "one-by-one",
        "basis": f"{measured['trajectories']} x {factor:g}",
        "trajectories": trajectories,
        "wall_s": measured["wall_s"] * factor,
        "trajectories_per_s": measured["trajectories_per_s"],
        "env_s": measured["env_s"] * factor,
        "env_wait_s": measured["env_wait_s"] * factor,
    }


def _speedups(rows: list[dict[str, Any]], trajectories: int) -> None:
    """The one-by-one wall time for all trajectories (its last row: measured or scaled) over each mode's."""
    baseline = [r for r in rows if r["mode"] == "one-by-one" and r["trajectories"] == trajectories]
    if not baseline:
        return
    for row in rows:
        if row["mode"] != "one-by-one" and row["trajectories"] == trajectories:
            row["speedup"] = baseline[-1]["wall_s"] / row["wall_s"]


# ---- the python tool ------------------------------------------------------------------------------------------


def python_rows(calls: int, parallel: int) -> list[dict[str, Any]]:
    """`calls` runs of the python tool one after the other, then on `parallel` threads."""
    import shutil

    sandbox = "bwrap" if shutil.which("bwrap") else "none"
    rows = []
    for mode, threads in (("python one-by-one", 1), (f"python x{parallel}", parallel)):
        rows.append({"mode": mode, "sandbox": sandbox, **_python_pass(calls, threads)})
    return rows


def _python_pass(calls: int, threads: int) -> dict[str, Any]:
    import statistics
    from concurrent.futures import ThreadPoolExecutor

    from dockrl.envs.tools import Python

    tool = Python()

    def one(_: int) -> tuple[float, str]:
        start = time.perf_counter()
        try:
            out = tool.run({"code": PYTHON_CODE}, timeout_s=10)
        except Exception as exc:  # a refused or failed call is counted and named, not raised
            out = f"{type(exc).__name__}: {exc}"
        return time.perf_counter() - start, out

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = list(pool.map(one, range(calls)))
    wall = time.perf_counter() - start
    failed = [out for _, out in results if out.strip() != str(sum(range(1000)))]
    row: dict[str, Any] = {
        "calls": calls,
        "ok": calls - len(failed),
        "wall_s": wall,
        "calls_per_s": calls / wall,
        "median_ms": 1000 * statistics.median(seconds for seconds, _ in results),
    }
    if failed:
        row["error"] = failed[0][:200]
    return row


# ---- the machine ----------------------------------------------------------------------------------------------

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def cpu_row() -> dict[str, Any]:
    """The CPU's model name, cores this process may use and which of CPU_FLAGS it has (Linux's /proc/cpuinfo;
    blank elsewhere)."""
    import os

    model = ""
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value.split()
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "mode": "cpu",
        "cpu": model,
        "cores": cores,
        "flags": " ".join(f for f in CPU_FLAGS if f in flags),
    }
