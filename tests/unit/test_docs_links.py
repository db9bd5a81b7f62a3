"""The README, docs/ and the package's docstrings and comments name only files that exist in the repository.

Two checks:
- a Markdown link `[text](target)` in README.md or docs/*.md resolves to a file in the repository;
- a repository path named in README.md, docs/*.md (prose, code spans and code blocks) or in a docstring or a
  comment under src/ exists. A token counts as a repository path when it has a slash, ends in a source-file
  extension (`.py`, `.md`, `.yaml`, ...) or a slash, and its first folder is one of the repository's folders
  (not a git-ignored one) under one of the bases it is resolved against: the naming file's folder, the
  repository root, src/, src/dockrl/ and docs/. So `checkpoint/layout.py`, `src/dockrl/dock/columns.py`,
  `examples/grpo_tiny.yaml` and `engines/rollout/` are checked; a bare file name (`config.yaml`, a run's
  output; `my_reward.py`, a user's file), a metric name (`dock/rows`), an absolute path (`/data/train.jsonl`),
  a placeholder (`path/to/file.py`, `runs/<name>/`) or a run directory (`step_000040/`, `runs/demo/`) is not:
  which file such a name means cannot be told from the text.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASES = [ROOT, ROOT / "src", ROOT / "src" / "dockrl", ROOT / "docs"]
EXTENSIONS = (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg", ".ini", ".txt")
# A path-like token: folders separated by slashes, not glued to a longer path, a template or a URL.
PATH_TOKEN = re.compile(r"(?<![\w./<>*{}$:~-])((?:[\w-][\w.-]*/)+(?:[\w-][\w.-]*)?)(?![\w/<>*{}$-])")


def _ignored_folders() -> set[str]:
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return {line.strip().strip("/") for line in lines if line.strip().endswith("/")}


IGNORED = _ignored_folders()


def _repo_paths(text: str) -> list[str]:
    """The tokens of `text` that claim to be repository paths (see the module docstring)."""
    found = []
    for token in PATH_TOKEN.findall(text):
        token = token.rstrip(".")
        if token.endswith("/") or token.endswith(EXTENSIONS):
            found.append(token)
    return found


def _missing(path: str, here: Path) -> bool:
    """True when `path` claims a repository folder under some base but names nothing that exists."""
    first = path.split("/")[0]
    if first in IGNORED:
        return False
    claimed = False
    for base in [here, *BASES]:
        if (base / first).is_dir():
            claimed = True
            if (base / path).exists():
                return False
    return claimed


def _source_text_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of a Python file."""
    text = path.read_text()
    lines = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            lines.append((token.start[0], token.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                start = node.body[0].lineno
                lines.extend((start + i, line) for i, line in enumerate(docstring.splitlines()))
    return lines


def test_relative_links_point_at_files_in_the_repository():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.exists() or ROOT.resolve() not in resolved.parents:
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_paths_named_in_readme_docs_and_docstrings_exist():
    named = []
    for page in PAGES:
        named += [(page, n, line) for n, line in enumerate(page.read_text().splitlines(), 1)]
    for module in sorted((ROOT / "src").rglob("*.py")):
        named += [(module, n, line) for n, line in _source_text_lines(module)]
    missing = [
        f"{where.relative_to(ROOT)}:{n}: {path}"
        for where, n, line in named
        for path in _repo_paths(line)
        if _missing(path, where.parent)
    ]
    assert not missing, "paths that name no file or folder of the repository:\n" + "\n".join(missing)


def test_the_path_check_finds_what_it_should():
    """The check cannot pass vacuously: it sees stale paths and lets non-paths through."""
    here = ROOT / "src" / "dockrl" / "recipes"
    line = (
        "(checkpoint/layout.py), `src/dockrl/dock/columns.py`, `workers/train/`; `dock/rows` path/to/file.py"
    )
    assert _repo_paths(line) == [
        "checkpoint/layout.py",
        "src/dockrl/dock/columns.py",
        "workers/train/",
        "path/to/file.py",
    ]
    assert [p for p in _repo_paths(line) if _missing(p, here)] == ["checkpoint/layout.py", "workers/train/"]
    assert _repo_paths(
        "`config.yaml` /data/x.yaml runs/<name>/config.yaml https://a.b/c.md docs/design.md."
    ) == ["docs/design.md"]
    assert not _missing("runs/demo/", ROOT)
