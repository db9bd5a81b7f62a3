"""Process groups and device meshes for the workers of one group.

Each worker of a WorkerGroup calls `init_distributed` with its rank, the world size and the rendezvous
address chosen by rank 0; the backend follows the device, so one code path serves a laptop and a cluster:
gloo on CPU, and on CUDA `cpu:gloo,cuda:nccl` (NCCL for device tensors, gloo for the small CPU tensors of
token counts, metric sums and whitening moments: an NCCL-only group refuses CPU tensors). Sub-groups (device
meshes) inherit the default group's backends.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def free_port() -> int:
    """A TCP port free on this host right now (for the rendezvous of a new group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_ip() -> str:
    """An address of this host that other nodes of the cluster can reach: Ray's node address in a Ray worker,
    else loopback (one machine). Never imports Ray itself (single-process tools run where Ray is absent)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def backend_for(device: str) -> str:
    """The process-group backend of a run on `device` (see the module docstring)."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


def init_distributed(
    rank: int, world_size: int, master_addr: str, master_port: int, device: str, timeout_s: float = 600.0
) -> torch.device:
    """Join the group's process group; returns this rank's device. Idempotent within a process."""
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        _pin_gloo_interface()
        dist.init_process_group(
            backend=backend_for(device),
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return dev


def side_group(
    addr: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0
) -> dist.ProcessGroup:
    """A gloo group of its own between processes of different worker groups (the trainer's rank 0 and the
    rollout replicas of separate placement), beside each process's default group. Rank 0 hosts the store at
    addr:port; the others connect to it."""
    _pin_gloo_interface()
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout)
    # ProcessGroupGloo is a ProcessGroup at run time; torch's stubs do not say so.
    return cast(dist.ProcessGroup, dist.ProcessGroupGloo(store, rank, world_size, timeout))


def _pin_gloo_interface() -> None:
    """Make gloo use the interface of this node's cluster address. Left alone, gloo binds to whatever the host
    name resolves to, which on many machines (and in a network namespace) is loopback: ranks on other nodes
    then cannot connect. GLOO_SOCKET_IFNAME set by the user wins; on one machine (loopback) nothing changes."""
    ip = host_ip()
    if "GLOO_SOCKET_IFNAME" in os.environ or ip.startswith("127."):
        return
    name = interface_with_address(ip)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def interface_with_address(ip: str) -> str | None:
    """The network interface holding IPv4 address `ip` on this host (Linux), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(answer[20:24]) == ip:
                return name
    return None


def data_parallel_mesh(device: str, dp: int) -> DeviceMesh:
    """A 1-D mesh over the data-parallel ranks (FSDP2 shards over it)."""
    return init_device_mesh(device, (dp,), mesh_dim_names=("dp",))


def training_mesh(device: str, dp: int, tp: int, cp: int = 1) -> DeviceMesh:
    """The actor's training mesh (dp, tp), or (dp, cp, tp) with context parallelism: FSDP2 over dp (x cp),
    tensor parallel over tp (tp ranks contiguous, then the cp ranks of one dp rank)."""
    if cp == 1:
        return init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))


def inference_mesh(device: str, world_size: int, tp: int) -> DeviceMesh:
    """The rollout mesh (replica, tp): world_size / tp replicas of tp contiguous ranks each."""
    return init_device_mesh(device, (world_size // tp, tp), mesh_dim_names=("replica", "tp"))
