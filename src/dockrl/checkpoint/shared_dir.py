"""Is `run.output_dir` one directory for every node? Checkpoints of a multi-node run need it to be.

Staging, the commit rename and clean-up run on the driver's node, while every training rank writes its own
checkpoint shards into the same path: on a node that sees a different (local) directory under that path the
shards land on its own disk, and a checkpoint that looks complete cannot be resumed. So at start:

    driver:  probe = write_probe(run.output_dir)        a file with a random token
    every actor and critic rank:  check_probe(probe, node)   the same file with the same token, or an error
                                                             naming run.output_dir and the node
    driver:  remove_probe(probe)
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path


class OutputDirNotShared(ValueError):
    """A worker's node does not see the driver's run.output_dir."""


@dataclass(frozen=True)
class Probe:
    """The driver's probe file: `directory` (run.output_dir made absolute on the driver) / `name`, holding
    `token`."""

    directory: str
    name: str
    token: str

    @property
    def path(self) -> Path:
        """Where the file is."""
        return Path(self.directory) / self.name


def write_probe(output_dir: str | Path) -> Probe:
    """Write a probe file with a fresh token into `output_dir` (created if missing)."""
    directory = Path(output_dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    probe = Probe(str(directory), f".dockrl-probe-{token[:12]}", token)
    probe.path.write_text(token)
    return probe


def check_probe(probe: Probe, node: str) -> None:
    """Raise OutputDirNotShared, naming run.output_dir and `node` (where this runs), unless this process sees
    the probe file with its token."""
    try:
        found = probe.path.read_text()
    except OSError:
        found = None
    if found == probe.token:
        return
    what = "is missing" if found is None else "holds another run's token"
    raise OutputDirNotShared(
        f"run.output_dir={probe.directory!r} is not the driver's directory on node {node}: the probe file "
        f"{probe.name} the driver wrote there {what} on that node. Every node that holds training ranks writes "
        "checkpoint shards into run.output_dir, so a run on several nodes needs it on a filesystem they all "
        "mount (NFS or a cluster filesystem): set run.output_dir to such a path"
    )


def remove_probe(probe: Probe) -> None:
    """Delete the probe file (a missing one is fine)."""
    probe.path.unlink(missing_ok=True)
