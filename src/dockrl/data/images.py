"""Images in prompt rows: where a row names them, reading them, and the prompt text that holds their tokens.

    row ──image_sources──▶ prompt with placeholders + [ImageSource]      (load_prompts: no pixels read yet)
        ──encode_images (per row, in the data pass)──▶ PIL images ──vision_processing──▶ uint8 patches, grid
        ──expand_image_tokens──▶ <|vision_start|><|image_pad|> x k <|vision_end|> per image in the prompt text

A row gives its images in one of two ways (docs/vision.md, "Data"):

1. Chat messages whose `content` is a list of parts, the transformers/Qwen convention:
   ``{"type": "image", "image": <image>}`` and ``{"type": "text", "text": "..."}``.
2. An ``images`` field (a list) beside a text prompt holding one ``<image>`` marker per image, or beside
   messages whose image parts carry no value (``{"type": "image"}``, TRL's convention): the images fill the
   markers or parts in order.

An <image> is a path (relative to the data file, or absolute), a base64 string (optionally a
``data:image/...;base64,`` URI), raw bytes (a Parquet binary column), or a ``{"bytes": ..., "path": ...}``
struct (a Hugging Face datasets Image column written to Parquet). Every image becomes the text
``<|vision_start|><|image_pad|><|vision_end|>`` at its place (what Qwen2.5-VL's chat template writes for an
image part), so the prompt renders through any chat template as plain text; `expand_image_tokens` then
repeats each image's ``<|image_pad|>`` to the number of tokens its patches merge into.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END  # one image in the prompt text, before expansion
IMAGE_MARKER = "<image>"  # an image's place in a text prompt of the `images` field convention
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")


class ImageError(ValueError):
    """An image of a row that cannot be found, decoded or placed; the message names file, line and image."""


@dataclass(frozen=True)
class ImageSource:
    """One image of a row, not yet read.

    Attributes:
        kind: "path", "base64" or "bytes".
        value: the path as written, the base64 text, or the bytes.
        ref: what logs record instead of the pixels: the file's absolute path, or "base64:<sha256 prefix>" /
            "bytes:<sha256 prefix>" of the encoded image.
        base: the data file's folder, which a relative path is read from.
    """

    kind: str
    value: str | bytes
    ref: str
    base: Path

    def read_bytes(self) -> bytes:
        """The encoded image (png, jpeg, ...). Raises ImageError (missing file, bad base64) without location."""
        if self.kind == "bytes":
            assert isinstance(self.value, bytes)
            return self.value
        if self.kind == "base64":
            assert isinstance(self.value, str)
            text = self.value.split(",", 1)[1] if self.value.startswith("data:") else self.value
            try:
                return base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ImageError(f"is not valid base64 ({exc})") from exc
        path = self.path
        if not path.is_file():
            raise ImageError(f"file {str(path)!r} does not exist")
        return path.read_bytes()

    @property
    def path(self) -> Path:
        """A path source's file (relative paths resolved against the data file's folder)."""
        assert isinstance(self.value, str)
        path = Path(self.value)
        return path if path.is_absolute() else self.base / path


def _digest(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()[:16]


def image_source(value: Any, base: Path) -> ImageSource:
    """Classify one image value of a row (module docstring). A string is base64 when it is a ``data:`` URI, or
    when it does not end with an image suffix (IMAGE_SUFFIXES) and decodes as strict base64; else a path.
    Raises ImageError for other types."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image struct
        if value.get("bytes") is not None:
            return image_source(bytes(value["bytes"]), base)
        if value.get("path") is not None:
            return image_source(str(value["path"]), base)
        raise ImageError("is a {'bytes', 'path'} struct with neither set")
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return ImageSource("bytes", data, f"bytes:{_digest(data)}", base)
    if isinstance(value, str):
        if value.startswith("data:"):
            return ImageSource("base64", value, f"base64:{_digest(value.split(',', 1)[-1])}", base)
        if not value.lower().endswith(IMAGE_SUFFIXES) and _is_base64(value):
            return ImageSource("base64", value, f"base64:{_digest(value)}", base)
        path = Path(value)
        return ImageSource("path", value, str((path if path.is_absolute() else base / path).absolute()), base)
    raise ImageError(f"is a {type(value).__name__}; give a path, a base64 string or bytes")


def _is_base64(text: str) -> bool:
    """Whether `text` decodes as strict base64 of some length (a short relative path such as "a/b" may too,
    so a string that names an existing file is a path: the caller tries the suffix first)."""
    if len(text) < 64:  # no image file encodes to fewer bytes than this
        return False
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def place_images(
    prompt: str | list[dict], images: list | None, base: Path
) -> tuple[str | list[dict], list[ImageSource]]:
    """The prompt with every image replaced by IMAGE_PLACEHOLDER (message content lists flattened to text)
    and its images in prompt order; (prompt, []) for a prompt without images. `images`: the row's
    ``images`` field (None when absent). Raises ImageError when markers and images disagree in number, or a
    part holds an image while the ``images`` field is given too."""
    if images is None and not (isinstance(prompt, list) and has_image_parts(prompt)):
        return prompt, []  # a text row (a literal "<image>" in a row without the images field stays text)
    if images is not None and not isinstance(images, list):
        raise ImageError(f"the images field is a {type(images).__name__}; give a list of images")
    queue = list(images or [])
    given = len(queue)
    sources: list[ImageSource] = []
    if isinstance(prompt, str):
        markers = prompt.count(IMAGE_MARKER)
        if markers != given:
            raise ImageError(
                f"the prompt has {markers} {IMAGE_MARKER} markers and the images field {given} images; give "
                f"one {IMAGE_MARKER} marker per image"
            )
        sources = [_numbered(image_source, value, base, i) for i, value in enumerate(queue)]
        return prompt.replace(IMAGE_MARKER, IMAGE_PLACEHOLDER), sources
    messages = []
    for message in prompt:
        content = message["content"]
        if isinstance(content, list):
            content = _flatten(content, queue, sources, base, bool(given))
        messages.append({**message, "content": content})
    if queue:
        raise ImageError(
            f"the images field has {given} images and the messages {given - len(queue)} image parts "
            "({'type': 'image'}); give one part per image"
        )
    return (messages, sources) if sources else (prompt, [])


def _flatten(parts: list, queue: list, sources: list[ImageSource], base: Path, from_field: bool) -> str:
    """One message's content parts as text: text parts as they are, image parts as IMAGE_PLACEHOLDER."""
    text = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
            raise ImageError(
                f"content part {part!r:.80} is not {{'type': 'text', 'text': ...}} or {{'type': 'image', ...}}"
            )
        if part["type"] == "text":
            text.append(str(part.get("text", "")))
            continue
        value = part.get("image")
        if value is not None and from_field:
            raise ImageError(
                "an image part holds an image and the images field is given too; use one of them"
            )
        if value is None:
            if not queue:
                raise ImageError(
                    f"image part {len(sources) + 1} has no 'image' value and no images field entry fills it"
                )
            value = queue.pop(0)
        sources.append(_numbered(image_source, value, base, len(sources)))
        text.append(IMAGE_PLACEHOLDER)
    return "".join(text)


def _numbered(read: Any, value: Any, base: Path, index: int) -> ImageSource:
    try:
        return read(value, base)
    except ImageError as exc:
        raise ImageError(f"image {index + 1} {exc}") from exc


def has_image_parts(prompt: Any) -> bool:
    """Whether a prompt places images (an image content part, or an <image> marker in text)."""
    if isinstance(prompt, str):
        return IMAGE_MARKER in prompt
    return any(
        isinstance(part, dict) and part.get("type") == "image"
        for message in prompt
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


def open_images(sources: Sequence[ImageSource]) -> list:
    """Decode each source to an RGB-convertible PIL image, fully read. Raises ImageError "image N (ref): ..."."""
    from PIL import Image, UnidentifiedImageError

    opened = []
    for number, source in enumerate(sources, start=1):
        name = f"image {number} ({source.ref if len(source.ref) <= 120 else source.ref[:117] + '...'})"
        try:
            data = source.read_bytes()
            image = Image.open(io.BytesIO(data))
            image.load()  # decodes every pixel here: a truncated file fails now, not in the processor
        except ImageError as exc:
            raise ImageError(f"{name} {exc}") from exc
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            raise ImageError(f"{name} cannot be decoded as an image: {exc}") from exc
        opened.append(image)
    return opened


def expand_image_tokens(text: str, counts: Sequence[int]) -> str:
    """`text` with the i-th IMAGE_PLACEHOLDER's pad repeated counts[i] times. Raises ImageError when the text
    (after the chat template) holds a different number of placeholders than there are images."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(counts):
        raise ImageError(
            f"the rendered prompt holds {len(pieces) - 1} image placeholders for {len(counts)} images (does "
            "the system prompt or the chat template write <|vision_start|><|image_pad|><|vision_end|>?)"
        )
    out = [pieces[0]]
    for count, piece in zip(counts, pieces[1:]):
        out.append(VISION_START + IMAGE_PAD * count + VISION_END + piece)
    return "".join(out)


def is_vision_model(model_dir: str | Path) -> bool:
    """Whether a model directory holds a vision-language model (its config.json has a vision_config)."""
    import json

    config_file = Path(model_dir) / "config.json"
    return config_file.is_file() and "vision_config" in json.loads(config_file.read_text())


def vision_processor(model_dir: str | Path) -> Any:
    """The image processor settings (models/vision_processing.ProcessorConfig) of a vision-language model
    directory, or None for a text model (is_vision_model). Raises ImageError when a vision-language model
    lacks its preprocessor_config.json."""
    from dockrl.models.vision_processing import PREPROCESSOR_FILE, processor_config

    model_dir = Path(model_dir)
    if not is_vision_model(model_dir):
        return None
    if not (model_dir / PREPROCESSOR_FILE).is_file():
        raise ImageError(
            f"{model_dir} is a vision-language model (its config.json has vision_config) without "
            f"{PREPROCESSOR_FILE}; copy it from the checkpoint the model came from"
        )
    return processor_config(model_dir)
