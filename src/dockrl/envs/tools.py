"""Built-in tools: `calculator` (exact arithmetic) and `python` (code in a sandboxed subprocess).

A tool has a name, a JSON schema (OpenAI function format, what the chat template renders into the prompt) and
`run(arguments, timeout_s) -> str`. A bad call raises ToolError, whose message the model sees as the tool's
answer; running past its time raises ToolTimeout (counted apart, in `env/timeouts`).

`python` runs the code with `sys.executable -I` in a fresh temporary working directory, in a session of its own
(killed with its whole process group at the wall-clock limit), with RLIMIT_CPU and RLIMIT_AS set by a prelude
before the code (no preexec_fn: the caller is threaded, where forking runs no Python safely), its output
cut at `max_output_chars`, and no network: in a network namespace of its own (`unshare -n`: only a loopback
that is down) when the process may create one (root), and in any case with socket creation refused inside
the interpreter before the code runs.
"""

from __future__ import annotations

import ast
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from fractions import Fraction
from typing import Any, Protocol


class ToolError(Exception):
    """A call the tool could not answer: its message is the answer the model sees."""


class ToolTimeout(ToolError):
    """The call ran past its time limit."""


class Tool(Protocol):
    """A tool the model may call."""

    name: str
    schema: dict[str, Any]

    def run(self, arguments: dict[str, Any], timeout_s: float) -> str:
        """The tool's answer to one call; raises ToolError (ToolTimeout past `timeout_s`)."""
        ...


def function_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool's JSON schema in the OpenAI function format chat templates render."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


_BINARY: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Any] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    """Exact arithmetic on integers and decimals: + - * / // % ** and parentheses (no names, no calls).
    Division is exact (fractions); the answer is an integer when it is one, else a decimal to 12 places."""

    name = "calculator"
    schema = function_schema(
        "calculator",
        "Evaluate an arithmetic expression exactly, e.g. 123*456 or (7+8)/3.",
        {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression"}},
            "required": ["expression"],
        },
    )
    max_exponent = 1000
    max_digits = 4000

    def run(self, arguments: dict[str, Any], timeout_s: float = 0.0) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str) or not expression.strip():
            raise ToolError('calculator needs {"expression": "<arithmetic>"}')
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as exc:
            raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from None
        value = self._eval(tree.body)
        if value.denominator == 1:
            return str(value.numerator)
        return (
            f"{float(value):.12g}" if abs(value) >= 1e12 else f"{float(value):.12f}".rstrip("0").rstrip(".")
        )

    def _eval(self, node: ast.AST) -> Fraction:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            return Fraction(node.value) if isinstance(node.value, int) else Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                if right.denominator != 1 or abs(right) > self.max_exponent:
                    raise ToolError(f"exponents must be integers of at most {self.max_exponent}")
                if left == 0 and right < 0:
                    raise ToolError("division by zero")
            elif isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise ToolError("division by zero")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(node.op, ast.FloorDiv | ast.Mod):
                value = Fraction(value)
            if len(str(value.numerator)) > self.max_digits:
                raise ToolError(f"the result has more than {self.max_digits} digits")
            return value
        raise ToolError(f"unsupported in an arithmetic expression: {ast.dump(node)[:60]}")


_SANDBOX_PRELUDE = """\
import resource as _resource
_resource.setrlimit(_resource.RLIMIT_CPU, ({cpu}, {cpu} + 1))
_resource.setrlimit(_resource.RLIMIT_AS, ({memory}, {memory}))
import socket as _socket
def _refused(*args, **kwargs):
    raise OSError("network access is disabled in this sandbox")
_socket.socket = type("socket", (_socket.socket,), {{"__init__": _refused}})
_socket.create_connection = _refused
_socket.getaddrinfo = _refused
del _socket, _refused, _resource
"""


class Python:
    """Run Python code in a sandboxed subprocess (module docstring); answers with its stdout and stderr."""

    name = "python"
    schema = function_schema(
        "python",
        "Run Python code and return what it prints.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
        },
    )

    def __init__(self, cpu_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000):
        self.cpu_s, self.memory_mb, self.max_output_chars = cpu_s, memory_mb, max_output_chars

    def run(self, arguments: dict[str, Any], timeout_s: float) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError('python needs {"code": "<program>"}')
        workdir = tempfile.mkdtemp(prefix="dockrl-python-")
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                prelude = _SANDBOX_PRELUDE.format(cpu=max(1, int(self.cpu_s)), memory=self.memory_mb * 2**20)
                f.write(prelude + code)
            command = [sys.executable, "-I", "main.py"]
            if network_namespace_available():
                command = ["unshare", "--net", "--", *command]
            process = subprocess.Popen(
                command,
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the whole tree dies at the limit
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "PYTHONHASHSEED": "0"},
            )
            try:
                out, _ = process.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                raise ToolTimeout(f"python ran past its {timeout_s:g} s limit and was stopped") from None
            text = out.decode("utf-8", errors="replace")
            if len(text) > self.max_output_chars:
                text = (
                    text[: self.max_output_chars]
                    + f"\n... (output cut at {self.max_output_chars} characters)"
                )
            if process.returncode < 0:
                text += f"\n(killed by signal {-process.returncode}: a CPU or memory limit)"
            return text
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()


_NETNS: bool | None = None


def network_namespace_available() -> bool:
    """True when `unshare --net` works here (root, or unprivileged namespaces allowed); checked once."""
    global _NETNS
    if _NETNS is None:
        try:
            _NETNS = (
                shutil.which("unshare") is not None
                and subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=10).returncode
                == 0
            )
        except (OSError, subprocess.TimeoutExpired):
            _NETNS = False
    return _NETNS


BUILTIN_TOOLS = {"calculator": Calculator, "python": Python}


def build_tools(names: list[str] | tuple[str, ...]) -> list[Tool]:
    """Built-in tools by name; ValueError listing the built-ins for an unknown one."""
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; built-in tools are {sorted(BUILTIN_TOOLS)}")
    return [BUILTIN_TOOLS[n]() for n in names]
