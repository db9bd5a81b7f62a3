"""Benchmark command lines that cannot work fail at once with the conflicting flags named."""

import pytest

from dockrl.cli import build_parser


@pytest.mark.parametrize("flag", ["--emulate-nodes=4", "--ray-address=auto"])
def test_bench_dock_nodes_conflicts_with_a_multi_node_cluster(flag):
    from dockrl.bench.dock import run

    args = build_parser().parse_args(["bench", "dock", "--nodes=1,2", flag])
    with pytest.raises(SystemExit, match=f"--nodes=1,2 conflicts with {flag.split('=')[0]}; drop --nodes"):
        run(args)


def test_bench_train_needs_three_nodes():
    from dockrl.bench.cluster_train import placement

    assert placement(3) == {"actor": ["node1", "node2"], "reward": ["node0"]}
    assert placement(4) == {"actor": ["node1", "node2"], "reward": ["node3"]}
    with pytest.raises(SystemExit, match="--emulate-nodes=2; the layout needs at least 3 nodes"):
        placement(2)


def test_bench_e2e_names_an_unknown_system():
    from dockrl.bench.e2e import run

    args = build_parser().parse_args(["bench", "e2e", "--systems=dockrl,verl"])
    with pytest.raises(SystemExit, match=r"--systems=dockrl,verl: unknown \['verl'\]"):
        run(args)
