"""A run on several nodes needs run.output_dir shared by them all: the driver's probe file, checked by a worker
that sees the same directory and by one that sees another (as a node with a local disk under that path would)."""

import pytest

from dockrl.checkpoint.shared_dir import OutputDirNotShared, Probe, check_probe, remove_probe, write_probe


def test_a_worker_that_sees_the_driver_directory_passes(tmp_path):
    probe = write_probe(tmp_path / "runs")
    assert probe.path.parent == (tmp_path / "runs").resolve()
    check_probe(probe, node="node-a (10.0.0.1)")
    remove_probe(probe)
    assert not probe.path.exists()


def test_a_worker_that_sees_another_directory_fails_naming_the_setting_and_its_node(tmp_path):
    """The worker's node has its own directory under the same path: the probe is not there, or a stale probe
    of another run with another token is."""
    probe = write_probe(tmp_path / "driver" / "runs")
    elsewhere = tmp_path / "node-b" / "runs"
    elsewhere.mkdir(parents=True)
    seen_from_b = Probe(str(elsewhere), probe.name, probe.token)  # the same path, resolved on node b
    with pytest.raises(
        OutputDirNotShared, match=r"run.output_dir=.* on node node-b \(10.0.0.2\).* is missing"
    ):
        check_probe(seen_from_b, node="node-b (10.0.0.2)")
    (elsewhere / probe.name).write_text("another run's token")
    with pytest.raises(OutputDirNotShared, match="holds another run's token"):
        check_probe(seen_from_b, node="node-b (10.0.0.2)")
