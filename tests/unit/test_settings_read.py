"""No setting is accepted and ignored: every key of the schema is read by some code path (used, or checked
in config/validate.py, which errors or warns with its name when the setting cannot act).

`dockrl train` runs in many processes, so its check is static: it walks the schema and looks for a read of each
key in the source (`cfg.algo.clip_low`, `algo.clip_low` where `algo` holds the section, `self.optim_cfg.lr`
where `optim_cfg: OptimConfig`, `f.weight` for `f in cfg.functions`). Sections reach code through names, so
the walk follows assignments and annotations from the section to the name that reads it. A generic name can
make a key look read when it is not; a key with no read at all always fails. `dockrl sft` runs in one
process, so its check is exact: it records every read of a config attribute during a real run."""

import ast
import dataclasses
import sys
import typing
from pathlib import Path

from dockrl.config import SFTConfig, TrainConfig, load_config, run_schema, schema, training_schema
from dockrl.recipes.preflight import preflight_sft
from dockrl.recipes.sft import sft

SRC = Path(__file__).resolve().parents[2] / "src" / "dockrl"
# Where the schema itself lives (definitions, defaults, docs, YAML in/out): a name there is not a read.
NOT_READS = {
    ("config", "schema.py"),
    ("config", "training_schema.py"),
    ("config", "run_schema.py"),
    ("config", "loader.py"),
    ("config", "fields.py"),
}
# Settings that only config/validate.py reads, each because validation is all it needs (none today).
VALIDATION_ONLY: set[str] = set()

Path_ = tuple[str, ...]


def _sections(cls: type, prefix: Path_ = ()) -> dict[Path_, type]:
    """Section path -> dataclass, e.g. ("reward", "model") -> RewardModelConfig; list items get "[]"."""
    out: dict[Path_, type] = {prefix: cls}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out |= _sections(hint, prefix + (f.name,))
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            out[prefix + (f.name,)] = list
            out |= _sections(typing.get_args(hint)[0], prefix + (f.name, "[]"))
    return out


def _keys(sections: dict[Path_, type]) -> list[Path_]:
    """Every leaf setting (a field that is not itself a section)."""
    return [
        path + (f.name,)
        for path, cls in sections.items()
        if cls is not list
        for f in dataclasses.fields(cls)
        if path + (f.name,) not in sections
    ]


def _chain(node: ast.expr) -> list[str]:
    """`self.cfg.algo.clip_low` -> ["self", "cfg", "algo", "clip_low"] ("?" for a non-name root)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.append(node.id if isinstance(node, ast.Name) else "?")
    return parts[::-1]


class _SourceReads:
    """The setting keys read anywhere in src/dockrl, file names per key."""

    def __init__(self, sections: dict[Path_, type]):
        self.sections = sections
        self.trees = {
            f: ast.parse(f.read_text())
            for f in sorted(SRC.rglob("*.py"))
            if (f.parent.name, f.name) not in NOT_READS
        }
        self.aliases: dict[str, set[Path_]] = {}
        self._annotations()
        while self._propagate():
            pass

    def _suffix_section(self, chain: list[str]) -> Path_ | None:
        """The longest section path the chain ends with (`cfg.reward.model` -> ("reward", "model"))."""
        found = [p for p in self.sections if p and tuple(chain[-len(p) :]) == p]
        return max(found, key=len) if found else None

    def sections_of(self, expr: ast.expr) -> set[Path_]:
        """The sections an expression may hold."""
        if isinstance(expr, ast.Name):
            return set(self.aliases.get(expr.id, ()))
        if not isinstance(expr, ast.Attribute):
            return set()
        chain = _chain(expr)
        out = {s} if (s := self._suffix_section(chain)) else set()
        for i, name in enumerate(chain):
            out |= {a + tuple(chain[i + 1 :]) for a in self.aliases.get(name, ())} & self.sections.keys()
        return out

    def _annotations(self) -> None:
        """A parameter or a (spec's) field annotated with a section class (or a base of one, like OptimConfig)
        holds that section."""
        for tree in self.trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.arg) and node.annotation is not None:
                    name, annotation = node.arg, node.annotation
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    name, annotation = node.target.id, node.annotation
                else:
                    continue
                head = ast.unparse(annotation).replace('"', "").split("|")[0].strip()
                for path, cls in self.sections.items():
                    if cls is not list and head in {base.__name__ for base in cls.__mro__[:-1]}:
                        self.aliases.setdefault(name, set()).add(path)

    def _bind(self, target: ast.expr, sections: set[Path_]) -> bool:
        name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
        if not name or not sections or sections <= self.aliases.get(name, set()):
            return False
        self.aliases.setdefault(name, set()).update(sections)
        return True

    def _propagate(self) -> bool:
        """One pass of `x = <section>`, `a, b = s, t`, `for x in <list section>`; True if a name gained one."""
        changed = False
        for tree in self.trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                            for t, v in zip(target.elts, node.value.elts):
                                changed |= self._bind(t, self.sections_of(v))
                        else:
                            changed |= self._bind(target, self.sections_of(node.value))
                elif isinstance(node, ast.For | ast.comprehension):
                    items = {s + ("[]",) for s in self.sections_of(node.iter)} & self.sections.keys()
                    changed |= self._bind(node.target, items)
        return changed

    def reads(self) -> dict[Path_, set[str]]:
        """Setting key -> the files that read it."""
        found: dict[Path_, set[str]] = {}
        for file, tree in self.trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    for section in self.sections_of(node.value):
                        found.setdefault(section + (node.attr,), set()).add(file.name)
        return found


def test_every_train_setting_is_read():
    sections = _sections(TrainConfig)
    reads = _SourceReads(sections).reads()
    unread = [".".join(k) for k in _keys(sections) if not reads.get(k)]
    only_validated = [
        ".".join(k)
        for k in _keys(sections)
        if reads.get(k) == {"validate.py"} and ".".join(k) not in VALIDATION_ONLY
    ]
    assert unread == [], f"settings no code path reads: {unread}"
    assert only_validated == [], (
        f"settings only validation reads (use them, or warn/error on them): {only_validated}"
    )


def test_the_walk_sees_reads_through_names():
    """The walk itself: reads through a chain, an alias, an annotated base class and a list item are found."""
    reads = _SourceReads(_sections(TrainConfig)).reads()
    assert "step_plan.py" in reads[("algo", "clip_low")]  # algo.clip_low, algo: AlgoConfig
    assert "train_engine.py" in reads[("actor", "grad_clip")]  # self.optim_cfg.grad_clip, optim: OptimConfig
    assert "reward.py" in reads[("reward", "functions", "[]", "kwargs")]  # f.kwargs for f in cfg.functions
    assert ("algo", "no_such_setting") not in reads


def test_every_sft_setting_is_read(tiny_model, arithmetic_data, tmp_path, monkeypatch):
    """Record every attribute read of an SFTConfig section during preflight_sft + sft (dumps of the whole
    config to config.yaml do not count), then require each key to have been read."""
    sections = _sections(SFTConfig)
    classes = {cls for cls in sections.values() if cls is not list}
    read: set[tuple[str, str]] = set()
    skip = {dataclasses.__file__, sys.modules["copy"].__file__}
    skip |= {module.__file__ for module in (schema, training_schema, run_schema)}
    skip.add(sys.modules["dockrl.config.loader"].__file__)

    def recording(cls):
        plain = cls.__getattribute__

        def __getattribute__(self, name):
            if not name.startswith("_") and sys._getframe(1).f_code.co_filename not in skip:
                read.add((type(self).__name__, name))
            return plain(self, name)

        return __getattribute__

    for cls in classes:
        monkeypatch.setattr(cls, "__getattribute__", recording(cls))
    overrides = [
        f"model.path={tiny_model}",
        f"data.train_path={arithmetic_data['train']}",
        f"data.eval_path={arithmetic_data['test']}",
        "data.eval_limit=4",
        "data.label_field=answer",
        "run.epochs=0.125",
        "run.batch_size=16",
        "run.progress=false",
        f"run.output_dir={tmp_path}",
    ]
    summary = sft(preflight_sft(load_config(SFTConfig, None, overrides)))
    assert summary["eval_examples"] == 4
    unread = [".".join(p) for p in _keys(sections) if (sections[p[:-1]].__name__, p[-1]) not in read]
    assert unread == [], f"dockrl sft never reads: {unread}"
