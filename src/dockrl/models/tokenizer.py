"""Tokenizer: a Hugging Face tokenizer directory read without transformers.

A tokenizer directory holds ``tokenizer.json`` (the `tokenizers` pipeline: normalizer, pre-tokenizer, BPE
model, added tokens, decoder) and usually ``tokenizer_config.json`` (special token strings, the chat
template). Newer transformers versions write the chat template to ``chat_template.jinja`` instead; that file
wins over the config entry, as in transformers.

Chat templates are rendered the way transformers renders them (same jinja environment and variables), so
prompts built here tokenize to exactly the ids a Hugging Face pipeline would feed the model.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# Special-token roles handed to chat templates as ``<role>_token`` strings, as transformers does.
_SPECIAL_ROLES = ("bos", "eos", "unk", "pad")


def _token_content(value: Any) -> str | None:
    """Return a special token's string from the config's plain or ``{"content": ...}`` form."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token entry {value!r} is neither a string nor a dict with a 'content' string")


def _select_chat_template(value: Any) -> str | None:
    """Return the default template from a config entry that is a string or a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry["name"]: entry["template"] for entry in value}
        if "default" in named:
            return named["default"]
        raise ValueError(f"chat_template lists templates {sorted(named)} but none is named 'default'")
    raise ValueError(
        f"chat_template must be a string or a list of named templates, got {type(value).__name__}"
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; transformers overrides it with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers` pipeline plus the special tokens and chat template of its directory.

    Built with :meth:`from_dir`; immutable afterwards. ``*_token_id`` attributes are ``None`` when the
    directory does not name that token.
    """

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        config: dict[str, Any],
        chat_template: str | None,
        special_tokens: dict[str, str | None],
    ) -> None:
        """Wrap ``backend``; prefer :meth:`from_dir`. ``special_tokens`` maps role (bos/eos/unk/pad) to string."""
        self._backend = backend
        self._config = config
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.bos_token_id: int | None = self._token_id("bos")
        self.eos_token_id: int | None = self._token_id("eos")
        self.pad_token_id: int | None = self._token_id("pad")
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    def _token_id(self, role: str) -> int | None:
        token = self.special_tokens.get(role)
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{role}_token={token!r} from the tokenizer config is not in the vocabulary")
        return token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the special tokens / chat template next to it."""
        path = Path(path)
        tokenizer_file = path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {path}; a tokenizer directory must contain {TOKENIZER_FILE} "
                f"(and usually {TOKENIZER_CONFIG_FILE}); slow-tokenizer files alone are not supported"
            )
        backend = _BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / TOKENIZER_CONFIG_FILE)
        # Older directories keep special tokens only in special_tokens_map.json; the config wins when both do.
        legacy_map = _read_json(path / SPECIAL_TOKENS_MAP_FILE)
        special_tokens = {
            role: _token_content(config.get(f"{role}_token", legacy_map.get(f"{role}_token")))
            for role in _SPECIAL_ROLES
        }
        template_file = path / CHAT_TEMPLATE_FILE
        chat_template: str | None
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _select_chat_template(config.get("chat_template"))
        return cls(backend, config=config, chat_template=chat_template, special_tokens=special_tokens)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the pipeline's post-processor (e.g. BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (a list of ints or a 1-D integer tensor)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render ``messages`` with the chat template, as transformers' ``apply_chat_template(tokenize=False)``.

        ``template_kwargs`` become extra template variables (e.g. ``enable_thinking=False`` for Qwen3).
        """
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template: add 'chat_template' to tokenizer_config.json or a "
                f"{CHAT_TEMPLATE_FILE} file to its directory"
            )
        variables = {
            f"{role}_token": token for role, token in self.special_tokens.items() if token is not None
        }
        variables.update(template_kwargs)
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) to ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(path / TOKENIZER_FILE))
        config = dict(self._config)
        for role, token in self.special_tokens.items():
            if token is not None:
                config.setdefault(f"{role}_token", token)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        _write_json(path / TOKENIZER_CONFIG_FILE, config)
        # A stale chat_template.jinja would override the template just written into the config.
        (path / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files present in ``src`` to ``dst``; returns the names copied."""
    src, dst = Path(src), Path(dst)
    if not (src / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in tokenizer directory {src}")
    copied = []
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, CHAT_TEMPLATE_FILE):
        if (src / name).is_file() and (src / name).resolve() != (dst / name).resolve():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def first_token_id(*ids: Any) -> int:
    """The first id given (a list counts by its first entry); e.g. the pad id: pad, else eos, else 0."""
    for i in ids:
        if isinstance(i, list):
            i = i[0] if i else None
        if i is not None:
            return int(i)
    raise AssertionError("unreachable: the last default is an int")


def stop_token_ids(*ids: Any) -> list[int]:
    """Every distinct id given (ids or lists of ids), in order: the tokenizer's and the model's eos ids."""
    out: list[int] = []
    for i in ids:
        for j in i if isinstance(i, list) else [i]:
            if j is not None and int(j) not in out:
                out.append(int(j))
    return out


def same_vocabulary(first_dir: str | Path, second_dir: str | Path) -> bool:
    """Whether both tokenizer directories map every token (added tokens included) to the same id (a reward
    model or a distillation teacher then reads the policy's token ids unchanged)."""
    vocabularies = [
        _BackendTokenizer.from_file(str(Path(d) / TOKENIZER_FILE)).get_vocab(with_added_tokens=True)
        for d in (first_dir, second_dir)
    ]
    return vocabularies[0] == vocabularies[1]
