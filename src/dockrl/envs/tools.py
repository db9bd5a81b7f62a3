"""Built-in tools: `calculator` (exact arithmetic) and `python` (code in a sandboxed subprocess).

A tool has a name, a JSON schema (OpenAI function format, what the chat template renders into the prompt) and
`run(arguments, timeout_s) -> str`. A bad call raises ToolError, whose message the model sees as the tool's
answer; running past its time raises ToolTimeout (counted apart, in `env/timeouts`).

`python` runs the code with the base interpreter (`-I`) in a fresh work dir inside the sandbox of
envs/sandbox.py (bubblewrap namespaces, cgroup limits, output read up to its cap, every process killed at the
end; its module docstring says what it promises). A prelude before the code also sets RLIMIT_CPU, RLIMIT_AS
and RLIMIT_NPROC and refuses socket creation inside the interpreter (what remains of isolation where
env.allow_unsandboxed runs it as a plain subprocess).
"""

from __future__ import annotations

import ast
import operator
import shutil
import sys
import tempfile
from decimal import Decimal, localcontext
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

from dockrl.envs import sandbox


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


def _bits(value: Fraction) -> int:
    """An upper bound of the bits of a fraction's numerator or denominator, whichever is larger (and 1 for 0)."""
    return max(1, value.numerator.bit_length(), value.denominator.bit_length())


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
        if abs(value) >= 10**12:  # 12 significant digits, past float's range too
            with localcontext() as context:
                context.prec = 12
                return str(Decimal(value.numerator) / Decimal(value.denominator))
        return f"{float(value):.12f}".rstrip("0").rstrip(".")

    def _bound(self, bits: int) -> None:
        """Refuse a result of more than `max_digits` digits before computing it (bits x log10 2)."""
        if bits * 0.30103 > self.max_digits:
            raise ToolError(f"the result would have more than {self.max_digits} digits")

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
                self._bound(_bits(left) * abs(int(right)))
            elif isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise ToolError("division by zero")
            else:  # + - * / // %: a result of at most the operands' bits together
                self._bound(_bits(left) + _bits(right))
            value = _BINARY[type(node.op)](left, right)
            if isinstance(node.op, ast.FloorDiv | ast.Mod):
                value = Fraction(value)
            return value
        raise ToolError(f"unsupported in an arithmetic expression: {ast.dump(node)[:60]}")


_SANDBOX_PRELUDE = """\
import resource as _resource
_resource.setrlimit(_resource.RLIMIT_CPU, ({cpu}, {cpu} + 1))
_resource.setrlimit(_resource.RLIMIT_AS, ({memory}, {memory}))
_resource.setrlimit(_resource.RLIMIT_NPROC, ({processes}, {processes}))
import socket as _socket
def _refused(*args, **kwargs):
    raise OSError("network access is disabled in this sandbox")
_socket.socket = type("socket", (_socket.socket,), {{"__init__": _refused}})
_socket.create_connection = _refused
_socket.getaddrinfo = _refused
del _socket, _refused, _resource
"""


class Python:
    """Run Python code in the sandbox (envs/sandbox.py); answers with its stdout and stderr, cut at
    `max_output_chars`. Without bubblewrap it refuses to be built unless `allow_unsandboxed` accepts a plain
    subprocess (env.allow_unsandboxed)."""

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

    def __init__(
        self,
        cpu_s: float = 5.0,
        memory_mb: int = 512,
        max_output_chars: int = 2000,
        max_processes: int = 32,
        allow_unsandboxed: bool = False,
    ):
        self.sandboxed = sandbox.bwrap() is not None
        if not self.sandboxed and not allow_unsandboxed:
            raise ValueError(
                f"the python tool runs model-written code in a sandbox, and bubblewrap is missing: "
                f"{sandbox.INSTALL_HINT}, or set env.allow_unsandboxed=true to run it as a plain subprocess"
            )
        self.cpu_s, self.memory_mb, self.max_output_chars = cpu_s, memory_mb, max_output_chars
        self.max_processes = max_processes

    def run(self, arguments: dict[str, Any], timeout_s: float) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError('python needs {"code": "<program>"}')
        cpu = max(1, int(self.cpu_s))
        prelude = _SANDBOX_PRELUDE.format(
            cpu=cpu, memory=self.memory_mb * 2**20, processes=self.max_processes
        )
        limits = sandbox.Limits(
            wall_s=timeout_s,
            cpu_s=cpu,
            memory_mb=self.memory_mb,
            max_processes=self.max_processes,
            max_output_bytes=4 * self.max_output_chars,  # UTF-8: at most 4 bytes a character
        )
        workdir = tempfile.mkdtemp(prefix="dockrl-python-")
        try:
            Path(workdir, "main.py").write_text(prelude + code, encoding="utf-8")
            if self.sandboxed:
                result = sandbox.sandboxed([sandbox.interpreter()[0], "-I", "main.py"], workdir, limits)
            else:
                result = sandbox.unsandboxed([sys.executable, "-I", "main.py"], workdir, limits)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if result.timed_out:
            raise ToolTimeout(f"python ran past its {timeout_s:g} s limit and was stopped")
        text = result.output.decode("utf-8", errors="replace")
        if result.output_cut or len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + f"\n... (output cut at {self.max_output_chars} characters)"
        elif result.returncode is not None and result.returncode < 0:
            text += f"\n(killed by signal {-result.returncode}: a CPU or memory limit)"
        return text


BUILTIN_TOOLS: dict[str, type[Calculator] | type[Python]] = {"calculator": Calculator, "python": Python}


def tool_schemas(names: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """The JSON schemas of built-in tools by name, without building them (nothing runs: SFT only renders them,
    so a machine without bubblewrap can still train on python-tool conversations)."""
    _check_names(names)
    return [BUILTIN_TOOLS[n].schema for n in names]


def build_tools(names: list[str] | tuple[str, ...], allow_unsandboxed: bool = False) -> list[Tool]:
    """Built-in tools by name; ValueError listing the built-ins for an unknown one (or naming what the python
    tool's sandbox needs)."""
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; built-in tools are {sorted(BUILTIN_TOOLS)}")
    return [
        Python(allow_unsandboxed=allow_unsandboxed) if n == "python" else BUILTIN_TOOLS[n]() for n in names
    ]


def _check_names(names: list[str] | tuple[str, ...]) -> None:
    """ValueError listing the built-ins when `names` holds one that is not."""
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; built-in tools are {sorted(BUILTIN_TOOLS)}")
