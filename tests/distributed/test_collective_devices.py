"""Collectives stay legal on GPUs: every tensor a collective is handed lies on a device its group serves.

On CUDA the process groups are `cpu:gloo,cuda:nccl`; an NCCL-only group refuses CPU tensors, and the policy
update, the step whitening and the critic's statistics all-reduce small CPU tensors (token counts, metric sums,
moments). The test runs those paths on 2 gloo ranks with every torch.distributed collective spied on, and
checks each tensor's device against the devices the CUDA backend serves: it fails if the CUDA backend ever
loses its CPU part, or if a collective is handed a tensor on some other device.
"""

import torch

from dockrl.parallel.dist import backend_for, free_port
from dockrl.parallel.spawn import spawn_ranks

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")


def served_devices(backend: str) -> set[str]:
    """Device types whose tensors the backend string `backend` takes ("nccl" -> {"cuda"})."""
    defaults = {"gloo": "cpu", "nccl": "cuda", "mpi": "cpu"}
    served = set()
    for part in backend.split(","):
        device, _, name = part.strip().rpartition(":")
        served.add(device or defaults.get(name, name))
    return served


def test_backends_serve_the_devices_of_their_tensors():
    assert backend_for("cuda") == "cpu:gloo,cuda:nccl" and backend_for("cpu") == "gloo"
    assert served_devices("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert served_devices("nccl") == {"cuda"} and served_devices("gloo") == {"cpu"}


def _spy(calls: list) -> None:
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name)

        def spied(*args, _original=original, _name=name, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            calls.append((_name, sorted({t.device.type for t in tensors})))
            return _original(*args, **kwargs)

        setattr(dist, name, spied)


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, leave) -> None:
    from dockrl.config import ActorConfig, AlgoConfig, loss_plan
    from dockrl.engines.train.policy_update import all_reduce_sum, policy_update, whiten_rows
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.parallel.dist import data_parallel_mesh, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    engine = TrainEngine(
        model_dir, device="cpu", precision="fp32", mesh=data_parallel_mesh("cpu", world), optim=ActorConfig()
    )
    calls: list = []
    _spy(calls)
    g = torch.Generator().manual_seed(rank)
    batch = {
        "prompt_ids": [torch.randint(0, 100, (4,), generator=g) for _ in range(2)],
        "response_ids": [torch.randint(0, 100, (3,), generator=g) for _ in range(2)],
        "advantages": [torch.randn(3, generator=g) for _ in range(2)],
    }
    batch["advantages"] = whiten_rows(batch["advantages"], engine.dp_group)  # REINFORCE++ / PPO moments
    policy_update(
        engine,
        batch,
        [0, 1],
        ["advantages"],
        loss_plan(AlgoConfig(kl_coef=0.0)),
        temperature=1.0,
        micro_batch_size=1,
        pad_token_id=0,
        world_size=world,
    )
    all_reduce_sum(torch.zeros(6, dtype=torch.float64), engine.dp_group)  # the critic's step statistics
    if rank == 0:
        torch.save(calls, out)
    leave(rank)


def test_update_collectives_use_devices_the_cuda_backend_serves(tmp_path, tiny_model):
    out = tmp_path / "calls.pt"
    spawn_ranks(_worker, 2, free_port(), str(tiny_model), str(out))
    calls = torch.load(out)
    assert len([c for c in calls if c[0] == "all_reduce"]) >= 4, calls  # tokens, moments, metrics, critic
    served = served_devices(backend_for("cuda"))
    for name, devices in calls:
        assert set(devices) <= served, f"{name} handed tensors on {devices}; a CUDA group serves {served}"


def test_gloo_interface_is_the_one_holding_the_node_address():
    """Ranks on several nodes: gloo must bind to the interface of the node's cluster address, not to what the
    host name resolves to (often loopback, always so in a network namespace)."""
    from dockrl.parallel.dist import interface_with_address

    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_with_address("198.51.100.77") is None  # TEST-NET-2: no interface of this host holds it
