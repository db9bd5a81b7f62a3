"""Running untrusted code (the `python` tool's programs): bubblewrap namespaces, cgroup limits, capped output.

```
 sandboxed(command, workdir, limits)
   sh: join a fresh cgroup (pids.max, memory.limit_in_bytes)  ─▶ exec bwrap ─▶ the command, as PID 1's child
       bwrap: new user, pid, net, ipc, uts and cgroup namespaces; --die-with-parent; --new-session
       sees:  /usr (and the interpreter's prefix) read-only, the work dir read-write at /work, its own /proc,
              a minimal /dev, an empty /tmp; nothing else of the host
   the caller reads its stdout+stderr as it comes, keeps the first `max_output_bytes`, and at that cap, at the
   wall-clock limit or when the command ends kills every process of the cgroup (and the pid namespace dies
   with its first process), then removes the cgroup
```

The promise, per call:
- files: only the work dir is writable; the interpreter and its standard library are readable; the repository,
  the host's /tmp, /home, /root, /run and /etc are not there at all;
- processes: its own PID namespace (no view of other processes, /proc included); at most `max_processes`
  (cgroup pids controller); a descendant that calls setsid dies with the rest when the call ends;
- network: a namespace with only a loopback that is down: no TCP or UDP anywhere, no host Unix socket (their
  paths are not mounted, abstract ones live in the host's network namespace);
- memory: `memory_mb` (cgroup memory controller, and RLIMIT_AS inside); CPU: RLIMIT_CPU seconds, and the wall
  clock; output: read incrementally, never more than the cap held by the caller;
- the caller's environment variables are not passed (--clearenv).

Not promised: the kernel is shared (a kernel exploit escapes any namespace sandbox); CPU time is shared with the
host, limited only by RLIMIT_CPU and the wall clock; without root (no writable cgroups) the process limit is
RLIMIT_NPROC and memory RLIMIT_AS only. Where bubblewrap is missing the `python` tool refuses to run unless
`env.allow_unsandboxed` accepts plain subprocesses (`unsandboxed`), which keep only the output cap, the limits
set inside the interpreter and the killing of the process group.
"""

from __future__ import annotations

import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"


@dataclass(frozen=True)
class Limits:
    """One call's limits."""

    wall_s: float
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 32
    max_output_bytes: int = 2000


@dataclass(frozen=True)
class Result:
    """What a call left: its output (at most the cap), how it ended, and whether the output was cut."""

    output: bytes
    returncode: int | None  # None: killed at a limit
    timed_out: bool
    output_cut: bool


def bwrap() -> str | None:
    """The bubblewrap executable, or None where it is not installed."""
    return shutil.which("bwrap")


def interpreter() -> tuple[str, str]:
    """(the base Python executable, its prefix): the standard library without the run's site-packages."""
    prefix = sys.base_prefix
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (Path(prefix) / "bin" / version, Path(prefix) / "bin" / "python3"):
        if candidate.exists():
            return str(candidate), prefix
    return sys.executable, prefix


def sandboxed(argv: list[str], workdir: str, limits: Limits) -> Result:
    """Run `argv` (its paths as seen inside: the work dir is /work) in the sandbox (module docstring)."""
    tool = bwrap()
    if tool is None:
        raise FileNotFoundError(f"no bubblewrap (bwrap) on PATH: {INSTALL_HINT}")
    _, prefix = interpreter()
    command = [tool, *_mounts(prefix, workdir), "--unshare-all", "--die-with-parent", "--new-session"]
    command += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work"]
    command += ["--setenv", "PYTHONHASHSEED", "0", "--chdir", "/work", "--", *argv]
    groups = _Cgroups.make(limits)
    if groups is not None:  # join the cgroups first, so bwrap and everything it starts is counted
        command = ["/bin/sh", "-c", f'{groups.join_script()} && exec "$@"', "sh", *command]
    try:
        return _run(command, limits, groups, new_session=False)
    finally:
        if groups is not None:
            groups.remove()


def unsandboxed(argv: list[str], workdir: str, limits: Limits) -> Result:
    """Run `argv` as a plain subprocess in `workdir` (env.allow_unsandboxed): its own session, killed with its
    process group, the output capped; no isolation of files, network or processes."""
    return _run(argv, limits, None, new_session=True, cwd=workdir)


def _mounts(prefix: str, workdir: str) -> list[str]:
    """What the sandbox sees: /usr, the merged-usr links, the interpreter's prefix, /work, /proc, /dev, /tmp."""
    mounts = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        path = Path(top)
        if path.is_symlink():
            mounts += ["--symlink", os.readlink(path), top]
        elif path.exists():
            mounts += ["--ro-bind", top, top]
    if not prefix.startswith("/usr/"):
        mounts += ["--ro-bind", prefix, prefix]
    return [*mounts, "--bind", workdir, "/work", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]


def _run(
    command: list[str], limits: Limits, groups: _Cgroups | None, *, new_session: bool, cwd: str | None = None
) -> Result:
    """Start `command`, read its output as it comes up to the cap, and kill everything at the cap, at the
    wall-clock limit or at its end."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=new_session,
        env=_plain_env(cwd) if cwd is not None else {"PATH": "/usr/bin:/bin"},
    )
    assert process.stdout is not None
    out, cut, timed_out = bytearray(), False, False
    deadline = time.monotonic() + limits.wall_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not selector.select(timeout=left):
                continue
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:  # every writer closed its end: the command (and its children) are done
                break
            out += chunk[: limits.max_output_bytes + 1 - len(out)]
            if len(out) > limits.max_output_bytes:
                cut = True
                break
    _kill(process, groups, new_session)
    returncode = process.wait()
    process.stdout.close()
    ended = not (timed_out or cut)
    return Result(bytes(out[: limits.max_output_bytes]), returncode if ended else None, timed_out, cut)


def _kill(process: subprocess.Popen, groups: _Cgroups | None, new_session: bool) -> None:
    """Kill the command and everything it started: the cgroup's processes, the process group, the process."""
    if groups is not None:
        groups.kill_all()
    if new_session:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if process.poll() is None:
        process.kill()


def _plain_env(home: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "PYTHONHASHSEED": "0"}


class _Cgroups:
    """A fresh pids and memory cgroup (v1 hierarchies, or v2's unified one) for one call; None where not
    writable (no root)."""

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs

    @classmethod
    def make(cls, limits: Limits) -> _Cgroups | None:
        name = f"dockrl-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        files = {"pids": {"pids.max": limits.max_processes}}
        files["memory"] = {"memory.limit_in_bytes": limits.memory_mb * 2**20}
        unified = CGROUP_ROOT / "cgroup.controllers"
        if unified.exists():  # cgroup v2: one directory holds both limits
            files = {"": {"pids.max": limits.max_processes, "memory.max": limits.memory_mb * 2**20}}
        dirs = []
        try:
            for controller, settings in files.items():
                path = CGROUP_ROOT / controller / name
                path.mkdir()
                dirs.append(path)
                for key, value in settings.items():
                    (path / key).write_text(str(value))
        except OSError:
            cls(dirs).remove()
            return None
        return cls(dirs)

    def join_script(self) -> str:
        return " && ".join(f"echo $$ > {d / 'cgroup.procs'}" for d in self.dirs)

    def kill_all(self) -> None:
        for _ in range(100):  # bounded: a fork racing the kill is caught on a later pass
            pids = set()
            for path in self.dirs:
                try:
                    pids |= {int(p) for p in (path / "cgroup.procs").read_text().split()}
                except OSError:
                    pass
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        for path in self.dirs:
            for _ in range(100):  # rmdir succeeds once the killed processes are reaped
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
