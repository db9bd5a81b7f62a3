"""Prompt datasets: load prompt/label rows from JSON lines or Parquet, render them to model input text.

A prompt is either text ("What is 2+3?") or a chat message list ([{"role": "user", "content": ...}]).
Errors name the file, the line or row, the field, and the fields that do exist.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dockrl.data.images import ImageError, ImageSource, place_images

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


class DatasetError(ValueError):
    """A prompt file that cannot be read as configured (bad JSON, missing field, empty, unknown format)."""


@dataclass
class PromptRecord:
    """One prompt of a dataset.

    Attributes:
        prompt: text, or a chat message list of ``{"role": ..., "content": ...}`` dicts.
        label: ground truth handed to the reward functions (None when the dataset has no label field).
        index: 0-based position of the row in its file.
        source: the file it came from.
        where: where in that file ("line 7" of JSON lines, "item 3" of a JSON array, "row 5" of Parquet).
        images: the row's images in prompt order, not yet read (data/images.py); the prompt then holds one
            IMAGE_PLACEHOLDER per image, its message content lists flattened to text.
    """

    prompt: str | list[dict]
    label: Any
    index: int
    source: str
    where: str = ""
    images: list[ImageSource] = field(default_factory=list)


def load_prompts(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    label_field: str | None = "answer",
    limit: int | None = None,
    images_field: str = "images",
) -> list[PromptRecord]:
    """Read prompt records from a ``.jsonl``/``.json`` (JSON lines) or ``.parquet`` file.

    A ``.json`` file holding one JSON array of objects is accepted as well as JSON lines. Blank lines are
    skipped. Parquet is read in place with pyarrow (no cache copy, no hub access).

    Args:
        path: the file.
        prompt_field: column holding the prompt (text or message list).
        label_field: column holding the label; None for unlabelled data (labels are then None).
        limit: read at most this many rows.
        images_field: the optional column listing a row's images for <image> markers or value-less image
            parts (data/images.py); image parts of message content lists need no field.

    Raises:
        DatasetError: unknown suffix, missing file, invalid JSON (names file and line), a row without
            ``prompt_field`` / ``label_field`` (names file, line or row, the field and the fields present),
            a prompt that is neither text nor a message list, images that do not match their places (names
            the image), or no rows at all. Images are not read here: `data.images.open_images` does.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"prompt file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        rows = iter_json_rows(path)
    elif suffix in PARQUET_SUFFIXES:
        fields = [f for f in (prompt_field, label_field) if f is not None]
        rows = _iter_parquet_rows(path, fields, optional=(images_field,))
    else:
        raise DatasetError(
            f"prompt file {str(path)!r} has suffix {suffix!r}; supported: {JSON_SUFFIXES + PARQUET_SUFFIXES}"
        )
    records = []
    for index, (where, row) in enumerate(rows):
        if limit is not None and index >= limit:
            break
        records.append(_to_record(row, where, index, path, prompt_field, label_field, images_field))
    if not records:
        raise DatasetError(f"prompt file {str(path)!r} has no rows")
    return records


def iter_json_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield ("line N", row) from JSON lines, or ("item N", row) from a .json file holding one array."""
    with path.open(encoding="utf-8") as handle:
        head = handle.read(1)
        while head and head.isspace():
            head = handle.read(1)
        handle.seek(0)
        if head == "[" and path.suffix.lower() == ".json":
            try:
                items = json.load(handle)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
            for number, item in enumerate(items):
                yield f"item {number}", _expect_object(item, path, f"item {number}")
            return
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{path}: line {number} is not valid JSON ({exc.msg}): {line[:80]!r}"
                ) from exc
            yield f"line {number}", _expect_object(row, path, f"line {number}")


def _expect_object(row: Any, path: Path, where: str) -> dict:
    if not isinstance(row, dict):
        raise DatasetError(f"{path}: {where} is a JSON {type(row).__name__}, expected an object")
    return row


def _iter_parquet_rows(
    path: Path, columns: list[str], optional: tuple[str, ...] = ()
) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    present = parquet.schema_arrow.names
    columns = columns + [c for c in optional if c in present and c not in columns]
    for column in columns:
        if column not in present:
            raise DatasetError(
                f"{path}: every row lacks field {column!r} (no such column); fields present: {present}"
            )
    number = 0
    for batch in parquet.iter_batches(columns=columns, batch_size=1024):
        for row in batch.to_pylist():
            yield f"row {number}", row
            number += 1


def _to_record(
    row: dict,
    where: str,
    index: int,
    path: Path,
    prompt_field: str,
    label_field: str | None,
    images_field: str,
) -> PromptRecord:
    for name in (prompt_field, label_field):
        if name is not None and row.get(name) is None:
            state = "is null" if name in row else "is missing"
            raise DatasetError(f"{path}: {where}: field {name!r} {state}; fields present: {sorted(row)}")
    prompt = row[prompt_field]
    if not (isinstance(prompt, str) or _is_messages(prompt)):
        raise DatasetError(
            f"{path}: {where}: field {prompt_field!r} must be text or a list of "
            f"{{'role', 'content'}} messages; got {type(prompt).__name__}"
        )
    label = row[label_field] if label_field is not None else None
    try:
        prompt, images = place_images(prompt, row.get(images_field), path.parent)
    except ImageError as exc:
        raise DatasetError(f"{path}: {where}: {exc}") from exc
    return PromptRecord(prompt=prompt, label=label, index=index, source=str(path), where=where, images=images)


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def render_prompt(
    record: PromptRecord,
    tokenizer: Any,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> str:
    """Turn a record into the text the model is prompted with.

    With ``use_chat_template`` the messages (a text prompt becomes one user message, after an optional
    system message) go through ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``,
    which must return text (for a Hugging Face tokenizer, wrap it to pass ``tokenize=False``). Without
    it, the system prompt and the message contents are joined by blank lines.

    A message-list prompt that already starts with a system message keeps it; ``system_prompt`` is then
    ignored, with a warning.
    """
    messages = _messages(record, system_prompt)
    if not use_chat_template:
        return "\n\n".join(str(m["content"]) for m in messages)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(text, str):
        raise TypeError(
            f"tokenizer.apply_chat_template returned {type(text).__name__}, expected str; "
            "render_prompt needs the text form (Hugging Face: tokenize=False)"
        )
    return text


def _messages(record: PromptRecord, system_prompt: str | None) -> list[dict]:
    if isinstance(record.prompt, str):
        messages = [{"role": "user", "content": record.prompt}]
    else:
        messages = [dict(m) for m in record.prompt]
    if system_prompt is None:
        return messages
    if messages and messages[0].get("role") == "system":
        warnings.warn(
            f"prompt {record.index} of {record.source} has its own system message; system_prompt is ignored",
            stacklevel=3,
        )
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


@dataclass
class RowImages:
    """A row's images as the model reads them (models/vision_processing.py), and how to name them.

    Attributes:
        patches: uint8 [n_patches, 3 * temporal_patch * patch * patch], every image's patches in prompt order,
            before rescale and normalize.
        grid_thw: int64 [n_images, 3], each image's (frames, patch rows, patch columns).
        token_counts: the <|image_pad|> tokens each image takes in the prompt (patches / merge_size**2).
        refs: each image for logs, never its pixels: {"ref": ImageSource.ref (data/images.py), "width",
            "height"} (the image's own size, before the processor resizes it).
    """

    patches: Any
    grid_thw: Any
    token_counts: list[int]
    refs: list[dict[str, Any]]


def read_row_images(record: PromptRecord, processor: Any) -> RowImages:
    """Decode a record's images and run the image processor on them (`processor`: a ProcessorConfig, from
    data/images.vision_processor); a record without images gets zero patches and an empty grid.

    Raises:
        DatasetError: an image is missing or cannot be decoded (names the file, the line or row, the image
            by number and reference).
    """
    from dockrl.data.images import open_images
    from dockrl.models.vision_processing import image_token_count, process_images

    try:
        images = open_images(record.images)
    except ImageError as exc:
        raise DatasetError(f"{record.source}: {record.where}: {exc}") from exc
    patches, grid_thw = process_images(processor, images)
    counts = image_token_count(grid_thw, processor.merge_size)
    refs = [
        {"ref": s.ref, "width": image.width, "height": image.height}
        for s, image in zip(record.images, images)
    ]
    return RowImages(patches, grid_thw, counts, refs)
