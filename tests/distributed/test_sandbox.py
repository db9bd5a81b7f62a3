"""The python tool's sandbox (envs/sandbox.py) attacked as a hostile program would, through the built-in tool
environment and a Qwen-format call, as a policy's message reaches it: output floods, a setsid grandchild, a host
Unix socket, loopback TCP, files outside the work dir, a process flood, the caller's environment, 4 GiB. Each
attack's check is shown to see the attack where the sandbox is off (`allow_unsandboxed` without bubblewrap)."""

import json
import os
import resource
import secrets
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dockrl.envs import sandbox
from dockrl.envs.tool_env import ToolEnvironment

pytestmark = pytest.mark.skipif(sandbox.bwrap() is None, reason="bubblewrap is installed by `make test`")

REPO = Path(__file__).resolve().parents[2]


def _call(code: str, env: ToolEnvironment | None = None, timeout_s: float = 10.0) -> str:
    """The tool message answering one python call in a policy's message."""
    env = env or ToolEnvironment(tools=["python"], family="qwen2")
    env.call_timeout_s = timeout_s
    message = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"
    (answer,) = env.step(message).messages
    return answer["content"]


def _unsandboxed(monkeypatch) -> ToolEnvironment:
    """The same tool where bubblewrap is missing and env.allow_unsandboxed accepts a plain subprocess."""
    monkeypatch.setattr(sandbox, "bwrap", lambda: None)
    return ToolEnvironment(tools=["python"], family="qwen2", allow_unsandboxed=True)


def test_an_output_flood_is_cut_at_the_cap_and_costs_the_caller_nothing():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    answer = _call("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert answer.endswith("(output cut at 2000 characters)") and answer.count("x") == 2000
    assert grown_mb < 16  # the cap's 8 KB and one 64 KiB read, not the flood (5.9 GB before the sandbox)


SETSID_ATTACK = (
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
    "    os._exit(0)\n"
    "print('parent done')\n"
)


def _survivors(marker: str) -> list[int]:
    """Processes still running this attack's grandchild (`sleep <marker>`, a marker no other process has)."""
    return [int(p.name) for p in Path("/proc").glob("[0-9]*") if _cmdline(p).strip() == f"sleep {marker}"]


def test_a_setsid_grandchild_dies_with_the_call(monkeypatch):
    marker = f"{60 + secrets.randbelow(10**6) / 10**7:.7f}"  # sleep's seconds, unique to this run
    assert "parent done" in _call(SETSID_ATTACK.format(marker=marker))
    time.sleep(0.2)
    assert _survivors(marker) == []
    # the check sees the grandchild where the process group is all there is to kill: it holds the output pipe
    # open (the call runs to its limit) and outlives the kill
    attack = SETSID_ATTACK.format(marker=marker)
    assert "ran past its 2 s limit" in _call(attack, _unsandboxed(monkeypatch), timeout_s=2.0)
    time.sleep(0.2)
    left = _survivors(marker)
    for pid in left:
        os.kill(pid, 9)
    assert len(left) == 1


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _unix_listener(path: Path) -> tuple[socket.socket, list]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    server.settimeout(0.2)
    accepted: list = []

    def accept():
        for _ in range(50):
            try:
                accepted.append(server.accept())
                return
            except TimeoutError:
                continue
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, accepted


UNIX_ATTACK = (
    "import socket\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
    "try:\n"
    "    s.connect({path!r}); print('CONNECTED')\n"
    "except Exception as e:\n"
    "    print('refused', type(e).__name__)\n"
)


def test_a_host_unix_socket_is_out_of_reach(tmp_path, monkeypatch):
    path = tmp_path / "host.sock"
    server, accepted = _unix_listener(path)
    answer = _call(UNIX_ATTACK.format(path=str(path)))
    time.sleep(0.3)
    server.close()
    assert "CONNECTED" not in answer and accepted == []
    # the check sees the attack where there is no sandbox (the interpreter prelude refuses sockets: it is
    # bypassed by the real class kept in _socket)
    path2 = tmp_path / "host2.sock"
    server, accepted = _unix_listener(path2)
    bypass = UNIX_ATTACK.replace("socket.socket(", "__import__('_socket').socket(").format(path=str(path2))
    answer = _call(bypass, _unsandboxed(monkeypatch))
    time.sleep(0.3)
    server.close()
    assert "CONNECTED" in answer and len(accepted) == 1


def test_loopback_tcp_is_out_of_reach():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = (
        "import _socket\n"
        "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
        "s.settimeout(2)\n"
        "try:\n"
        f"    s.connect(('127.0.0.1', {port})); print('CONNECTED')\n"
        "except Exception as e:\n"
        "    print('refused', type(e).__name__)\n"
    )
    answer = _call(code)
    server.close()
    assert "CONNECTED" not in answer and "refused" in answer


FILE_ATTACK = (
    "import os\n"
    "for path in ({secret!r}, {repo!r}):\n"
    "    try:\n"
    "        print('READ', open(path).read()[:20])\n"
    "    except Exception as e:\n"
    "        print('no', type(e).__name__)\n"
    "try:\n"
    "    open({target!r}, 'w').write('pwned'); print('WROTE')\n"
    "except Exception as e:\n"
    "    print('no', type(e).__name__)\n"
)


def test_files_outside_the_work_dir_are_out_of_reach(tmp_path, monkeypatch):
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret")
    target = tmp_path / "written.txt"
    code = FILE_ATTACK.format(secret=str(secret), repo=str(REPO / "pyproject.toml"), target=str(target))
    answer = _call(code)
    assert "READ" not in answer and "WROTE" not in answer and not target.exists()
    answer = _call(code, _unsandboxed(monkeypatch))  # the check sees it without the sandbox
    assert answer.count("READ") == 2 and "WROTE" in answer and target.read_text() == "pwned"


def test_a_process_flood_is_capped():
    code = (
        "import os\n"
        "made = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            import time; time.sleep(5); os._exit(0)\n"
        "        made += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print('forked', made)\n"
    )
    answer = _call(code)
    made = int(answer.split("forked")[1].split()[0])
    assert made < 32  # the sandbox's pids limit (32, counting the interpreter and bwrap's init)


def test_the_callers_environment_is_not_passed(monkeypatch):
    monkeypatch.setenv("DOCKRL_TEST_SECRET", "hunter2")
    assert "hunter2" not in _call("import os\nprint(sorted(os.environ.items()))\n")
    # nor readable from /proc of a host process that holds it (the sandbox's /proc is its own); the check
    # sees it without the sandbox
    holder = subprocess.Popen(["sleep", "30"], env={"DOCKRL_TEST_SECRET": "hunter2"})
    try:
        read = (
            "try:\n"
            f"    print(open('/proc/{holder.pid}/environ', 'rb').read().count(b'hunter2'))\n"
            "except OSError as e:\n"
            "    print('no', type(e).__name__)\n"
        )
        assert _call(read).strip().splitlines()[-1] != "1"
        assert _call(read, _unsandboxed(monkeypatch)).strip().splitlines()[-1] == "1"
    finally:
        holder.kill()
        holder.wait()


def test_a_large_allocation_fails_inside():
    answer = _call("x = bytearray(4 * 2**30)\nprint('ALLOCATED', len(x))\n")
    assert "ALLOCATED" not in answer and ("MemoryError" in answer or "killed by signal" in answer)


def test_without_bubblewrap_the_python_tool_is_an_error_naming_the_fix(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap", lambda: None)
    with pytest.raises(ValueError, match="apt-get install bubblewrap.*env.allow_unsandboxed=true"):
        ToolEnvironment(tools=["python"], family="qwen2")
    ToolEnvironment(tools=["calculator"], family="qwen2")  # other tools do not need it
