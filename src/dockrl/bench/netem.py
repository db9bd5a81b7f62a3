"""A multi-node Ray cluster on one machine, each node in its own network namespace behind a slow link.

```
 root namespace: no address in the cluster subnet
 +--------------------------------------------------------------------------+
 |                  bridge <prefix><pid>br (no IP)                          |
 |        +-------------------------+-------------------------+---- ...    |
 |   veth <prefix><pid>p0      veth <prefix><pid>p1      veth <..>p2        |
 |   tc: [netem] + tbf         tc: [netem] + tbf         tc: ...   egress -> node
 +--------|-------------------------|-------------------------|-------------+
          |                         |                         |
 +--------|----------------+ +------|------------------+ +----|------------+
 | netns <prefix><pid>n0   | | netns <prefix><pid>n1   | | netns ..n2      |
 | veth <prefix><pid>v0    | | veth <prefix><pid>v1    | | veth ..v2       |
 |   10.77.X.1/24          | |   10.77.X.2/24          | |   10.77.X.3/24  |
 |   tc: [netem] + tbf     | |   tc: [netem] + tbf     | |   tc: ...       |  egress <- node
 | Ray head :6379, node0   | | raylet, node1           | | raylet, node2   |
 | (+ the benchmark driver)| |                         | |                 |
 +-------------------------+ +-------------------------+ +-----------------+
```

Every byte between two nodes leaves one node through its own shaped egress and enters the other through
the shaped egress of the bridge-side veth, so each node has a `link_mbit` uplink and a `link_mbit`
downlink. Each of the two egresses adds `delay_ms` (netem, when the kernel has it): node to node is
2 x delay_ms one way, 4 x delay_ms round trip. Node i gets the Ray custom
resource `node<i>` so tasks and actors can be pinned to it. A benchmark runs its own driver inside the
head's namespace (`popen_in(0, [...])` with `ray.init(address=cluster.head_address)`), so the driver sits
behind the head's link like every other process of the node.

Everything created carries the creating process's pid in its name (namespaces `<prefix><pid>n<i>`, bridge
`<prefix><pid>br`, veths `<prefix><pid>v<i>` / `<prefix><pid>p<i>`, Ray temp dir `/tmp/<prefix><pid>ray`),
so a later cluster removes what a killed run left behind: names whose pid is no longer alive. Needs root,
iproute2 (`ip`, `tc`) and a kernel with network namespaces, bridges, veths and the tbf qdisc. Module-level
imports are stdlib only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

logger = logging.getLogger(__name__)

IFNAMSIZ = 15  # longest interface name Linux accepts
HEAD_PORT = 6379
_CMD_TIMEOUT_S = 20.0  # one `ip` / `tc` call
_TERM_GRACE_S = 1.0  # SIGTERM -> SIGKILL (raylet and gcs_server take > 5 s to heed SIGTERM; nothing to save)
_KILL_GRACE_S = 3.0  # SIGKILL -> give up (logged)
_KILL_ROUNDS = 3  # collect-and-kill passes (processes forked while the first pass ran)
_SUFFIX = r"(?:[nvpx]\d{1,3}|br)"

# Run inside the head's namespace: connect, wait until `expected` nodes are alive, print them as JSON.
_ALIVE_SCRIPT = """
import json, sys, time
import ray
address, expected, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
deadline = time.monotonic() + timeout_s
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= expected or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps([{"ip": n["NodeManagerAddress"], "resources": n["Resources"]} for n in alive]))
ray.shutdown()
"""


def _run(
    argv: Sequence[str], *, timeout: float = _CMD_TIMEOUT_S, check: bool = True
) -> subprocess.CompletedProcess:
    """Run argv, capture its output; with check, a non-zero exit raises RuntimeError naming its stderr."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return proc


def _quiet(argv: Sequence[str], timeout: float = _CMD_TIMEOUT_S) -> bool:
    """Run argv for cleanup: never raises, logs a failure, returns whether it succeeded."""
    try:
        proc = _run(argv, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("netem cleanup: %s failed: %s", " ".join(argv), exc)
        return False
    if proc.returncode != 0:
        logger.warning(
            "netem cleanup: %s exited %d: %s", " ".join(argv), proc.returncode, proc.stderr.strip()
        )
    return proc.returncode == 0


def _pid_alive(pid: int) -> bool:
    """Whether pid is a live (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _netns_list() -> list[str]:
    """Names of the named network namespaces (`ip netns list`), [] when it cannot be read."""
    try:
        out = _run(["ip", "netns", "list"], check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_links() -> list[str]:
    """Interface names in the root namespace (`ip -o link show`), [] when they cannot be read."""
    try:
        out = _run(["ip", "-o", "link", "show"], check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _netns_pids(ns: str) -> set[int]:
    """Pids of the processes in namespace ns (`ip netns pids`)."""
    try:
        out = _run(["ip", "netns", "pids", ns], check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {int(tok) for tok in out.split() if tok.isdigit()}


def _pids_with_cmdline(fragment: str) -> set[int]:
    """Pids of live processes whose command line contains fragment."""
    found: set[int] = set()
    needle = fragment.encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            found.add(int(entry.name))
    return found


def _kill_all(collect: Callable[[], set[int]], what: str) -> None:
    """SIGTERM what collect() returns, wait, SIGKILL the rest; bounded rounds and time, never raises."""
    me = os.getpid()
    for _ in range(_KILL_ROUNDS):
        try:
            pids = {p for p in collect() if p != me and _pid_alive(p)}
        except Exception as exc:  # never let cleanup raise
            logger.warning("netem cleanup: listing processes of %s failed: %s", what, exc)
            return
        if not pids:
            return
        for sig, grace in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, _KILL_GRACE_S)):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace
            while pids and time.monotonic() < deadline:
                time.sleep(0.05)
                pids = {p for p in pids if _pid_alive(p)}
            if not pids:
                break
        if pids:
            logger.warning("netem cleanup: processes %s of %s survived SIGKILL", sorted(pids), what)


@functools.cache
def _probe() -> tuple[str | None, str | None]:
    """(reason the cluster cannot be built or None, reason netem delay is unsupported or None)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux", "netem needs Linux"
    if os.geteuid() != 0:
        return "needs root (network namespaces, bridges, tc)", "needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found", f"`{tool}` not found"
    if not _ray_cli().exists():
        return f"ray CLI not found at {_ray_cli()}", None
    tag = f"dkrl{os.getpid()}x"
    ns, br, veth, peer = f"{tag}0", f"{tag}1", f"{tag}2", f"{tag}3"
    netem_reason: str | None = None
    try:
        steps = [
            (["ip", "netns", "add", ns], "`ip netns add` failed"),
            (["ip", "link", "add", br, "type", "bridge"], "bridge unsupported"),
            (["ip", "link", "add", veth, "type", "veth", "peer", "name", peer], "veth unsupported"),
            (["ip", "link", "set", peer, "netns", ns], "moving a veth into a namespace failed"),
            (["ip", "link", "set", veth, "master", br], "enslaving a veth to a bridge failed"),
            (_tc_tbf(veth, 100, parent=None), "tc tbf qdisc unsupported"),
        ]
        for argv, why in steps:
            proc = _run(argv, check=False)
            if proc.returncode != 0:
                return f"{why}: {proc.stderr.strip()[:200]}", None
        _run(["tc", "qdisc", "del", "dev", veth, "root"], check=False)
        proc = _run(
            ["tc", "qdisc", "add", "dev", veth, "root", "handle", "1:", "netem", "delay", "1ms"], check=False
        )
        if proc.returncode != 0:
            netem_reason = f"the kernel lacks the netem qdisc ({proc.stderr.strip()[:120]})"
        else:
            proc = _run(_tc_tbf(veth, 100, parent="1:"), check=False)
            if proc.returncode != 0:
                netem_reason = f"tbf under netem failed: {proc.stderr.strip()[:120]}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"probing namespaces failed: {exc}", None
    finally:
        links = _root_links()
        for name in (veth, br):
            if name in links:
                _quiet(["ip", "link", "del", name])
        if ns in _netns_list():
            _quiet(["ip", "netns", "del", ns])
    return None, netem_reason


def unavailable() -> str | None:
    """One line saying why an EmulatedCluster cannot be built here, or None (cached per process)."""
    return _probe()[0]


def netem_unavailable() -> str | None:
    """One line saying why delay_ms > 0 cannot be emulated (no netem qdisc), or None (cached)."""
    return _probe()[0] or _probe()[1]


def _ray_cli() -> Path:
    """The `ray` script of this interpreter's environment."""
    return Path(sys.executable).parent / "ray"


def _tc_tbf(dev: str, mbit: float, parent: str | None, netns: str | None = None) -> list[str]:
    """`tc qdisc add` of a token bucket at mbit on dev (root, or under parent)."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(int(rate_bytes / 250), 16 * 1514)  # 4 ms of traffic, at least 16 full frames
    where = ["root", "handle", "1:"] if parent is None else ["parent", parent, "handle", "2:"]
    prefix = ["tc"] if netns is None else ["tc", "-n", netns]
    shape = ["tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "50ms"]
    return [*prefix, "qdisc", "add", "dev", dev, *where, *shape]


def _shape(dev: str, mbit: float, delay_ms: float, netns: str | None) -> None:
    """Egress shaping on dev: netem delay at the root with tbf under it, or tbf alone when delay_ms == 0."""
    if delay_ms > 0:
        prefix = ["tc"] if netns is None else ["tc", "-n", netns]
        _run(
            [*prefix, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms"]
        )
        _run(_tc_tbf(dev, mbit, parent="1:", netns=netns))
    else:
        _run(_tc_tbf(dev, mbit, parent=None, netns=netns))


def _stale_pids(prefix: str) -> dict[int, dict[str, list[str]]]:
    """Leftovers named `<prefix><pid>...` whose pid is dead: pid -> {"netns": [...], "links": [...]}."""
    pattern = re.compile(rf"{re.escape(prefix)}(\d{{1,7}}){_SUFFIX}")
    found: dict[int, dict[str, list[str]]] = {}
    for kind, names in (("netns", _netns_list()), ("links", _root_links())):
        for name in names:
            match = pattern.fullmatch(name)
            if match and not _pid_alive(int(match.group(1))):
                found.setdefault(int(match.group(1)), {"netns": [], "links": []})[kind].append(name)
    temp = re.compile(rf"{re.escape(prefix)}(\d{{1,7}})ray")
    with contextlib.suppress(OSError):
        for entry in os.scandir("/tmp"):
            match = temp.fullmatch(entry.name)
            if match and not _pid_alive(int(match.group(1))):
                found.setdefault(int(match.group(1)), {"netns": [], "links": []})
    return found


def _remove(prefix: str, pid: int, netns: Sequence[str], links: Sequence[str], temp_dir: str) -> None:
    """Kill the processes of a cluster, delete its namespaces, links and temp dir; never raises."""
    existing_ns = set(_netns_list())
    mine = [ns for ns in netns if ns in existing_ns]

    def collect() -> set[int]:
        pids = _pids_with_cmdline(temp_dir + "/") if temp_dir else set()
        for ns in mine:
            pids |= _netns_pids(ns)
        return pids

    _kill_all(collect, f"{prefix}{pid}")
    for ns in mine:
        _quiet(["ip", "netns", "del", ns])
    existing_links = set(_root_links())
    # Bridge-side veth ends first (deleting one end deletes its peer), the bridge last.
    for name in sorted((n for n in links if n in existing_links), key=lambda n: n.endswith("br")):
        if name in set(_root_links()):
            _quiet(["ip", "link", "del", name])
    if temp_dir and os.path.isdir(temp_dir):
        shutil.rmtree(temp_dir, ignore_errors=True)
        if os.path.exists(temp_dir):
            logger.warning("netem cleanup: could not remove %s", temp_dir)


def clean_stale(prefix: str = "dkrl") -> list[int]:
    """Remove namespaces, links, processes and temp dirs of clusters whose creating process is dead.

    Only names `<prefix><pid>n<i>|v<i>|p<i>|x<i>|br` and `/tmp/<prefix><pid>ray` with a dead pid are touched.
    Returns the dead pids cleaned.
    """
    stale = _stale_pids(prefix)
    for pid, found in sorted(stale.items()):
        logger.info("netem: removing leftovers of dead pid %d: %s", pid, found)
        _remove(prefix, pid, found["netns"], found["links"], f"/tmp/{prefix}{pid}ray")
    return sorted(stale)


def _free_subnet() -> str:
    """A '10.77.X' /24 prefix that no address or route of the root namespace uses."""
    used = ""
    for argv in (["ip", "-o", "addr"], ["ip", "route"]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            used += _run(argv, check=False).stdout
    for third in range(256):
        if not re.search(rf"\b10\.77\.{third}\.", used):
            return f"10.77.{third}"
    raise RuntimeError("no free 10.77.X.0/24 subnet")


class EmulatedCluster:
    """N Ray nodes on this machine, each in its own network namespace behind a rate-limited link.

    `with EmulatedCluster(nodes=2, link_mbit=200) as cluster:` builds the namespaces, bridge, veths and tc
    shaping, starts a Ray head in namespace 0 and a raylet in each other one, and waits until all nodes are
    alive; leaving the block (normally, by an exception, or by SIGTERM/SIGINT, which raise SystemExit /
    KeyboardInterrupt inside it) kills every process in the namespaces and deletes everything it created.
    """

    def __init__(
        self,
        nodes: int = 2,
        link_mbit: float = 1000.0,
        delay_ms: float = 0.0,
        cpus_per_node: int = 1,
        name_prefix: str = "dkrl",
        object_store_mb: int | None = None,
        start_timeout_s: float | None = None,
    ) -> None:
        if not 1 <= nodes <= 254:
            raise ValueError(f"nodes must be in 1..254, got {nodes}")
        if link_mbit <= 0 or delay_ms < 0:
            raise ValueError(f"link_mbit must be > 0 and delay_ms >= 0, got {link_mbit}, {delay_ms}")
        if int(cpus_per_node) != cpus_per_node or cpus_per_node < 1:
            raise ValueError(f"cpus_per_node must be an integer >= 1, got {cpus_per_node}")
        if not re.fullmatch(r"[a-z]{1,8}", name_prefix):
            raise ValueError(f"name_prefix must be 1-8 lowercase letters, got {name_prefix!r}")
        self.nodes = nodes
        self.link_mbit = float(link_mbit)
        self.delay_ms = float(delay_ms)
        self.cpus_per_node = int(cpus_per_node)
        self.name_prefix = name_prefix
        self.object_store_mb = object_store_mb
        # nodes start one at a time, each within Ray's own 30 s registration bound
        self.start_timeout_s = float(30.0 + 20.0 * nodes if start_timeout_s is None else start_timeout_s)
        self.pid = os.getpid()
        tag = f"{name_prefix}{self.pid}"
        longest = len(tag) + max(len("br"), 1 + len(str(nodes - 1)))
        if longest > IFNAMSIZ:
            raise ValueError(f"interface names would reach {longest} > {IFNAMSIZ} chars; shorten name_prefix")
        self.namespaces: list[str] = [f"{tag}n{i}" for i in range(nodes)]
        self.bridge = f"{tag}br"
        # (namespace-side end, bridge-side end) of node i's veth pair
        self.veths: list[tuple[str, str]] = [(f"{tag}v{i}", f"{tag}p{i}") for i in range(nodes)]
        self.temp_dir = f"/tmp/{tag}ray"
        self.subnet = ""  # "10.77.X", chosen on enter
        self.node_ips: list[str] = []
        self.head_address = ""
        self.start_seconds = 0.0  # wall time of __enter__
        self._popens: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._entered = False
        self._tearing_down = False
        self._torn_down = False
        self._old_handlers: dict[int, Any] = {}

    # -- context manager ------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        if self._entered:
            raise RuntimeError("an EmulatedCluster can be entered once")
        reason = unavailable()
        if reason:
            raise RuntimeError(f"EmulatedCluster unavailable: {reason}")
        if self.delay_ms > 0 and netem_unavailable():
            raise RuntimeError(f"delay_ms={self.delay_ms} needs netem: {netem_unavailable()}")
        existing = set(_netns_list()) | set(_root_links())
        clash = [n for n in [*self.namespaces, self.bridge] if n in existing]
        if clash:
            raise RuntimeError(f"{clash} already exist (another EmulatedCluster of this process is running)")
        self._entered = True
        start = time.monotonic()
        self._install_signal_handlers()
        try:
            clean_stale(self.name_prefix)
            self._build_network()
            self._start_ray(deadline=start + self.start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - start
        logger.info(
            "netem: %d-node cluster at %s up in %.1f s (%g mbit, %g ms)",
            self.nodes,
            self.head_address,
            self.start_seconds,
            self.link_mbit,
            self.delay_ms,
        )
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._tearing_down = True  # from here on a signal no longer interrupts (close() is bounded)
        self.close()

    def close(self) -> None:
        """Kill every process of the cluster and delete what it created; idempotent, never raises."""
        with self._lock:
            if self._torn_down or not self._entered:
                return  # not entered: the names may belong to another instance of this process
            self._tearing_down = True
            try:
                for proc in self._popens:
                    with contextlib.suppress(Exception):
                        if proc.poll() is None:
                            proc.terminate()
                links = [*(end for pair in self.veths for end in pair), self.bridge]
                _remove(self.name_prefix, self.pid, self.namespaces, links, self.temp_dir)
                for proc in self._popens:
                    with contextlib.suppress(Exception):
                        proc.kill()
                        proc.wait(timeout=_KILL_GRACE_S)
            except BaseException as exc:  # never raise from teardown (a signal included)
                logger.warning("netem cleanup failed: %r", exc)
            finally:
                self._torn_down = True
                self._tearing_down = False
                self._restore_signal_handlers()

    # -- running commands in a node ------------------------------------------------------------------
    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of every process started in the cluster (os.environ, Ray settings, extra)."""
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
        env.update(extra or {})
        return env

    def _argv_in(self, node_index: int, argv: Sequence[str]) -> list[str]:
        if not 0 <= node_index < self.nodes:
            raise IndexError(f"node_index {node_index} not in 0..{self.nodes - 1}")
        return ["ip", "netns", "exec", self.namespaces[node_index], *argv]

    def run_in(
        self,
        node_index: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float | None = 120.0,
    ) -> subprocess.CompletedProcess:
        """Run argv inside node_index's namespace and wait; output captured as text, exit status unchecked.

        env entries are added to this process's environment (plus RAY_AUTH_MODE=disabled).
        """
        return subprocess.run(
            self._argv_in(node_index, argv),
            env=self.env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def popen_in(
        self, node_index: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start argv inside node_index's namespace (subprocess.Popen kwargs pass through); killed on close."""
        proc = subprocess.Popen(self._argv_in(node_index, argv), env=self.env(env), **kwargs)
        self._popens.append(proc)
        return proc

    # -- building -----------------------------------------------------------------------------------
    def _build_network(self) -> None:
        self.subnet = _free_subnet()
        self.node_ips = [f"{self.subnet}.{i + 1}" for i in range(self.nodes)]
        self.head_address = f"{self.node_ips[0]}:{HEAD_PORT}"
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "link", "set", self.bridge, "up"])
        for ns, (inner, outer), ip in zip(self.namespaces, self.veths, self.node_ips):
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "add", inner, "type", "veth", "peer", "name", outer])
            _run(["ip", "link", "set", inner, "netns", ns])
            _run(["ip", "link", "set", outer, "master", self.bridge])
            _run(["ip", "link", "set", outer, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", inner])
            _run(["ip", "-n", ns, "link", "set", inner, "up"])
            _shape(inner, self.link_mbit, self.delay_ms, netns=ns)  # node -> bridge
            _shape(outer, self.link_mbit, self.delay_ms, netns=None)  # bridge -> node

    def _ray_start_argv(self, i: int) -> list[str]:
        argv = [str(_ray_cli()), "start"]
        if i == 0:
            argv += ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.head_address}"]
        argv += [
            f"--node-ip-address={self.node_ips[i]}",
            f"--num-cpus={self.cpus_per_node}",
            "--num-gpus=0",
            f"--resources={json.dumps({f'node{i}': 1})}",
            "--disable-usage-stats",
            f"--temp-dir={self.temp_dir}",
        ]
        if self.object_store_mb is not None:
            argv.append(f"--object-store-memory={int(self.object_store_mb * 1024 * 1024)}")
        return argv

    def _start_ray(self, deadline: float) -> None:
        os.makedirs(self.temp_dir, exist_ok=True)

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"cluster not up within {self.start_timeout_s} s")
            return remaining

        head = self.run_in(0, self._ray_start_argv(0), timeout=left())
        if head.returncode != 0:
            raise RuntimeError(f"ray head failed to start: {(head.stdout + head.stderr).strip()[-1500:]}")
        # One node at a time: raylets registering at once on a small machine overload the GCS, and `ray start`
        # gives up on a raylet that has not registered within 30 s.
        for i in range(1, self.nodes):
            node = self.run_in(i, self._ray_start_argv(i), timeout=left())
            if node.returncode != 0:
                raise RuntimeError(
                    f"ray node {i} failed to start: {(node.stdout + node.stderr).strip()[-1500:]}"
                )
        budget = left()
        check = self.run_in(
            0,
            [sys.executable, "-c", _ALIVE_SCRIPT, self.head_address, str(self.nodes), str(budget)],
            timeout=budget + 30,
        )
        try:
            alive = json.loads(check.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError) as exc:
            raise RuntimeError(f"node check failed: {(check.stdout + check.stderr).strip()[-1500:]}") from exc
        if len(alive) < self.nodes:
            raise TimeoutError(f"{len(alive)} of {self.nodes} nodes alive after {self.start_timeout_s} s")

    # -- signals ------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._tearing_down:
            logger.warning("netem: signal %d during teardown, finishing teardown first", signum)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; close() still runs on exit
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._old_handlers.clear()
