"""Benchmarks behind `dockrl bench NAME`: each module here defines

    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> dict | list   # printed as a table, or as JSON with --json

and is listed in BENCHMARKS. Keep module-level imports light (the CLI imports every benchmark module to
build its parser); import torch, ray and the like inside `run`. Benchmarks print figures; tests never
assert on wall time.
"""

BENCHMARKS: dict[str, str] = {
    # name -> module under dockrl.bench, e.g. "dock": "dockrl.bench.dock"
    "dock": "dockrl.bench.dock",
    "rollout": "dockrl.bench.rollout",
    "multiturn": "dockrl.bench.rollout_turns",
    "reshard": "dockrl.bench.reshard",
    "load": "dockrl.bench.load_memory",
    "faults": "dockrl.bench.fault_timing",
    "train": "dockrl.bench.cluster_train",
    "async": "dockrl.bench.async_train",
    "activations": "dockrl.bench.activations",
    "e2e": "dockrl.bench.e2e",
    "logprobs": "dockrl.bench.logprob_memory",
    "kernels": "dockrl.bench.kernels",
    "lora": "dockrl.bench.lora",
    "distill": "dockrl.bench.distill",
    "scaling": "dockrl.bench.scaling",
    "startup": "dockrl.bench.startup",
    "env": "dockrl.bench.env_tier",
    "agent": "dockrl.bench.agent",
    "packing": "dockrl.bench.packing",
    "longctx": "dockrl.bench.longctx",
}
