"""EmulatedCluster (dockrl.bench.netem): Ray nodes in network namespaces behind shaped links, and cleanup.

Needs root and iproute2; skipped otherwise. Figures (throughput, start time) are printed, never asserted.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dockrl.bench import netem

_reason = netem.unavailable()
if _reason:
    pytest.skip(f"EmulatedCluster unavailable: {_reason}", allow_module_level=True)

pytestmark = pytest.mark.distributed

LINK_MBIT = 200
DELAY_MS = 1 if netem.netem_unavailable() is None else 0  # this kernel may lack netem: rate only
OBJECT_BYTES = 20_000_000

# Runs inside the head's namespace: nodes, a task pinned to node 1, a 20 MB object from node 1 to node 0.
_DRIVER = """
import json, sys, time
import numpy as np
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR", configure_logging=False)
alive = [n for n in ray.nodes() if n["Alive"]]

@ray.remote(num_cpus=0, resources={"node1": 1})
def where():
    return ray.util.get_node_ip_address()

@ray.remote(num_cpus=0, resources={"node1": 1})
def make(n):
    return np.ones(n, dtype=np.uint8)

@ray.remote(num_cpus=0, resources={"node0": 1})
def consume(a):
    return [ray.util.get_node_ip_address(), int(a.nbytes), int(a.sum())]

ip1 = ray.get(where.remote())
ref = make.remote(int(sys.argv[2]))
ray.wait([ref], fetch_local=False)
start = time.perf_counter()
consumed = ray.get(consume.remote(ref))
seconds = time.perf_counter() - start
print(json.dumps({
    "alive": len(alive),
    "resources": sorted(k for n in alive for k in n["Resources"] if k.startswith("node") and ":" not in k),
    "ips": sorted(n["NodeManagerAddress"] for n in alive),
    "pinned_ip": ip1,
    "consumed": consumed,
    "seconds": seconds,
}))
"""

_RECEIVER = """
import socket, sys, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], 5001))
srv.listen(1)
conn, _ = srv.accept()
total, start = 0, None
while chunk := conn.recv(1 << 20):
    start = start or time.perf_counter()
    total += len(chunk)
print(total, time.perf_counter() - start)
"""

_SENDER = """
import socket, sys, time
for _ in range(100):
    try:
        sock = socket.create_connection((sys.argv[1], 5001), timeout=1)
        break
    except OSError:
        time.sleep(0.05)
buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[2])):
    sock.sendall(buf)
sock.close()
"""


def _qdiscs(netns: str | None, dev: str) -> list[dict]:
    prefix = ["tc", "-j"] if netns is None else ["tc", "-j", "-n", netns]
    out = subprocess.run([*prefix, "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _leftovers(cluster: netem.EmulatedCluster) -> list[str]:
    """Whatever of cluster still exists: namespaces, links, the temp dir, processes naming either."""
    found = []
    ns_out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    found += [ns for ns in cluster.namespaces if ns in ns_out.split()]
    links = netem._root_links()
    found += [n for n in [cluster.bridge, *(end for pair in cluster.veths for end in pair)] if n in links]
    if os.path.exists(cluster.temp_dir):
        found.append(cluster.temp_dir)
    needles = [cluster.temp_dir.encode(), *(ns.encode() + b"\0" for ns in cluster.namespaces)]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if any(needle in cmdline for needle in needles):
                found.append(f"pid {entry.name}: {cmdline[:200]!r}")
    return found


def _dead_pid() -> int:
    """A pid above pid_max: never alive."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert pid_max < 9_999_999
    return pid_max + 1


def test_two_nodes_shaped_pinned_and_cleaned():
    with netem.EmulatedCluster(
        nodes=2, link_mbit=LINK_MBIT, delay_ms=DELAY_MS, object_store_mb=100
    ) as cluster:
        print(f"\n2-node cluster up in {cluster.start_seconds:.1f} s at {cluster.head_address}")
        assert cluster.head_address == f"{cluster.node_ips[0]}:6379"
        assert len(cluster.namespaces) == len(cluster.node_ips) == 2
        assert all(len(n) <= 15 for n in [cluster.bridge, *cluster.namespaces, *sum(cluster.veths, ())])
        own_ips = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
        assert f"{cluster.subnet}." not in own_ips  # the root namespace has no address in the subnet

        # both directions shaped: the node's own end and the bridge's end of every veth
        for ns, (inner, outer) in zip(cluster.namespaces, cluster.veths):
            for qdiscs in (_qdiscs(ns, inner), _qdiscs(None, outer)):
                kinds = {q["kind"]: q for q in qdiscs}
                assert kinds["tbf"]["options"]["rate"] == LINK_MBIT * 1e6 / 8
                assert ("netem" in kinds) == (DELAY_MS > 0)

        # the raw link, by socket: figure printed only
        receiver = cluster.popen_in(
            1, [sys.executable, "-c", _RECEIVER, cluster.node_ips[1]], stdout=subprocess.PIPE, text=True
        )
        sender = cluster.run_in(0, [sys.executable, "-c", _SENDER, cluster.node_ips[1], "20"], timeout=60)
        assert sender.returncode == 0, sender.stderr
        total, seconds = receiver.communicate(timeout=60)[0].split()
        assert int(total) == 20 << 20
        print(f"socket n0->n1: {int(total) / float(seconds) / 1e6:.1f} MB/s (link {LINK_MBIT / 8:.0f} MB/s)")

        driver = cluster.run_in(
            0, [sys.executable, "-c", _DRIVER, cluster.head_address, str(OBJECT_BYTES)], timeout=120
        )
        assert driver.returncode == 0, driver.stderr[-3000:]
        result = json.loads(driver.stdout.strip().splitlines()[-1])
        assert result["alive"] == 2
        assert result["resources"] == ["node0", "node1"]
        assert result["ips"] == sorted(cluster.node_ips)
        assert result["pinned_ip"] == cluster.node_ips[1]
        assert result["consumed"] == [cluster.node_ips[0], OBJECT_BYTES, OBJECT_BYTES]
        floor = OBJECT_BYTES / (LINK_MBIT * 1e6 / 8)
        print(
            f"ray object {OBJECT_BYTES / 1e6:.0f} MB n1->n0: {result['seconds']:.2f} s (link floor {floor:.2f} s)"
        )
        assert _leftovers(cluster) != []  # the check below sees a live cluster
    assert _leftovers(cluster) == []
    cluster.close()  # idempotent
    assert _leftovers(cluster) == []


@pytest.mark.parametrize("how", ["raise", "sigterm"])
def test_failure_inside_block_cleans_up(how):
    previous = signal.getsignal(signal.SIGTERM)
    cluster = netem.EmulatedCluster(nodes=1, link_mbit=LINK_MBIT)
    with pytest.raises(RuntimeError if how == "raise" else SystemExit) as info:
        with cluster:
            assert _leftovers(cluster) != []
            if how == "raise":
                raise RuntimeError("boom")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    if how == "raise":
        assert str(info.value) == "boom"
    else:
        assert info.value.code == 128 + signal.SIGTERM
    assert _leftovers(cluster) == []
    assert signal.getsignal(signal.SIGTERM) is previous


def test_leftovers_of_a_dead_run_are_removed():
    dead = _dead_pid()
    ns, bridge, temp_dir = f"dkrl{dead}n0", f"dkrl{dead}br", f"/tmp/dkrl{dead}ray"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
    os.makedirs(temp_dir, exist_ok=True)
    # a process left running inside the stale namespace
    stray = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "300"])
    unrelated = "dkrlkeep0"  # not <prefix><pid>...: must survive
    subprocess.run(["ip", "netns", "add", unrelated], check=True)
    try:
        with netem.EmulatedCluster(nodes=1, link_mbit=LINK_MBIT) as cluster:
            assert ns not in netem._netns_list()
            assert bridge not in netem._root_links()
            assert not os.path.exists(temp_dir)
            assert stray.wait(timeout=10) is not None
            assert unrelated in netem._netns_list()
        assert _leftovers(cluster) == []
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
        for name in (ns, unrelated):
            if name in netem._netns_list():
                subprocess.run(["ip", "netns", "del", name], check=False)
        if bridge in netem._root_links():
            subprocess.run(["ip", "link", "del", bridge], check=False)
        if os.path.exists(temp_dir):
            os.rmdir(temp_dir)


def test_delay_without_netem_is_refused():
    if netem.netem_unavailable() is None:
        pytest.skip("this kernel has netem")
    cluster = netem.EmulatedCluster(nodes=1, link_mbit=LINK_MBIT, delay_ms=5)
    with pytest.raises(RuntimeError, match="netem"):
        cluster.__enter__()
    assert _leftovers(cluster) == []
