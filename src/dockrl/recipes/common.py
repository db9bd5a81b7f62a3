"""Pieces shared by the recipes: Ray start-up, prompt encoding, the epoch sampler."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dockrl.data.datasets import (
    DatasetError,
    PromptRecord,
    RowImages,
    load_prompts,
    read_row_images,
    render_prompt,
)
from dockrl.data.images import IMAGE_PAD, ImageError, expand_image_tokens
from dockrl.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


_reaped = False  # this process started a local Ray with a reaper (init_ray)


def owns_reaped_ray() -> bool:
    """Whether this process started its own local Ray under a reaper: its processes die with this process,
    so the process may exit without Ray's shutdown (dockrl.cli.console_main)."""
    return _reaped


def init_ray(address: str | None, beside: tuple[str, ...] = ()) -> None:
    """Join the cluster at `address`, or start a local Ray bound to localhost without a dashboard; a local
    Ray gets a reaper (workers/reaper.py), so even a driver killed with SIGKILL leaves no process behind.

    beside: modules to import in a thread while Ray starts (ray.init must run on the main thread, and spends
    most of its seconds waiting for Ray's daemons; the run's imports of torch and the workers fill that time).
    An import that fails raises here, after Ray is up.
    """
    failures: list[BaseException] = []
    importer = threading.Thread(target=_import_all, args=(beside, failures), name="dockrl-import")
    importer.start()
    try:
        _start_ray(address)
    finally:
        importer.join()
    if failures:
        raise failures[0]


def _import_all(modules: tuple[str, ...], failures: list[BaseException]) -> None:
    try:
        for module in modules:
            importlib.import_module(module)
    except BaseException as error:  # noqa: BLE001 - re-raised by init_ray on the main thread
        failures.append(error)


def _start_ray(address: str | None) -> None:
    import ray

    global _reaped
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address:
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        return
    from dockrl.workers.reaper import reaped_ray_start

    # Ray's daemons inherit the reaper's run id; the driver's later children do not (the id leaves
    # os.environ once Ray runs).
    with reaped_ray_start() if os.path.isdir("/proc/self") else contextlib.nullcontext():
        ray.init(
            address="local",  # a new local Ray, never a cluster left behind on this machine by `ray start`
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            configure_logging=False,
            log_to_driver=True,
        )
    _reaped = os.path.isdir("/proc/self")


@dataclass
class EncodedPrompt:
    """A prompt rendered with the chat template and tokenized, with its label."""

    ids: list[int]
    text: str
    label: Any
    index: int
    env_row: dict[str, Any] | None = None  # multi-turn: what the rollout resets its environment with
    where: str = ""  # in its file: "line 7" (data/datasets.py PromptRecord.where)
    # A vision-language model's rows (every row of its run, zero images for a text row; None: a text model's):
    image_patches: Any = (
        None  # torch uint8 [n_patches, 3*t*p*p], before rescale/normalize (dock image_patches)
    )
    image_grid_thw: Any = None  # torch int64 [n_images, 3] (dock image_grid_thw)
    images: list[dict[str, Any]] | None = (
        None  # each image's {ref, width, height} for samples.jsonl (image_refs)
    )


def add_prompts(client: Any, prompts: list[EncodedPrompt], group_size: int) -> list[int]:
    """Add one group of `group_size` rows per prompt to the dock (client: a DockAPI): prompt_ids, label, for
    multi-turn runs env_row, and for a vision-language model's runs image_patches, image_grid_thw and
    image_refs; returns the row ids."""
    import torch

    from dockrl.dock.columns import ENV_ROW, IMAGE_GRID_THW, IMAGE_PATCHES, IMAGE_REFS

    ids, labels = [torch.tensor(p.ids) for p in prompts], [p.label for p in prompts]
    extra: dict[str, list] = {}
    if prompts and prompts[0].env_row is not None:
        extra[ENV_ROW] = [p.env_row for p in prompts]
    if prompts and prompts[0].image_patches is not None:
        extra[IMAGE_PATCHES] = [p.image_patches for p in prompts]
        extra[IMAGE_GRID_THW] = [p.image_grid_thw for p in prompts]
        extra[IMAGE_REFS] = [list(p.images or []) for p in prompts]
    return (
        client.add_groups(ids, labels, group_size, extra=extra)
        if extra
        else client.add_groups(ids, labels, group_size)
    )


def encode_prompts(
    path: str,
    tokenizer: Tokenizer,
    *,
    prompt_field: str,
    label_field: str | None,
    system_prompt: str | None,
    use_chat_template: bool,
    max_prompt_len: int,
    limit: int | None = None,
    make_env: Callable[[], Any] | None = None,
    agent: bool = False,
    processor: Any = None,
    model_path: str = "",
) -> tuple[list[EncodedPrompt], int]:
    """Load, render and tokenize a prompt file; returns the prompts and the number skipped as too long.
    With `make_env` (multi-turn) the first turn is the environment's reset of the row, rendered with its
    tools (what the rollout's environment starts from too). With `agent` (an agent function's run) the prompt
    renders as a single-turn one and every prompt carries its row for the agent (whose first request the
    rollout puts as the row's prompt).

    `processor`: a vision-language model's image processor settings (data/images.vision_processor of
    `model_path`; None for a text model). Each row's images are read and processed here, once, and its prompt
    holds each image's expanded <|image_pad|> tokens; a text model given rows with images, or a multi-turn or
    agent run given them, is a DatasetError naming the row and the fix."""
    records: list[PromptRecord] = load_prompts(
        path, prompt_field=prompt_field, label_field=label_field, limit=limit
    )
    check_images_supported(path, records, processor, model_path, make_env is not None or agent)
    out, skipped = [], 0
    for rec in records:
        env_row = {"prompt": rec.prompt, "label": rec.label} if agent else None
        if make_env is None:
            text = render_prompt(
                rec, tokenizer, system_prompt=system_prompt, use_chat_template=use_chat_template
            )
        else:
            env_row = {"prompt": rec.prompt, "label": rec.label}
            text = _render_env_prompt(make_env(), env_row, tokenizer, system_prompt)
        text, ids, images = encode_with_images(rec, text, tokenizer, processor)
        if len(ids) > max_prompt_len:
            skipped += 1
            continue
        prompt = EncodedPrompt(ids, text, rec.label, rec.index, env_row=env_row, where=rec.where)
        if images is not None:
            prompt.image_patches, prompt.image_grid_thw = image_tensors(images)
            prompt.images = images.refs
        out.append(prompt)
    if not out:
        raise ValueError(
            f"{path}: every prompt is longer than data.max_prompt_len={max_prompt_len}; raise it"
        )
    if skipped:
        log.warning(
            "%s: skipped %d prompts longer than data.max_prompt_len=%d", path, skipped, max_prompt_len
        )
    return out, skipped


def check_images_supported(
    path: str, records: list[PromptRecord], processor: Any, model_path: str, multi_turn: bool
) -> None:
    """Rows with images need a vision-language model (`processor` not None) and a single-turn run: else a
    DatasetError naming the file, the first such row and the fix."""
    first = next((r for r in records if r.images), None)
    if first is None:
        return
    many = sum(1 for r in records if r.images)
    if processor is None:
        raise DatasetError(
            f"{path}: {many} rows have images (first at {first.where}) but model.path={model_path or '?'} is a "
            "text model (its config.json has no vision_config); set model.path to a vision-language model "
            "(a Qwen2.5-VL checkpoint, or one from `dockrl make-tiny --family qwen2_5_vl`) or drop the images"
        )
    if multi_turn:
        raise DatasetError(
            f"{path}: {many} rows have images (first at {first.where}); multi-turn and agent runs (env.name) "
            "and tool conversations take text prompts only: use single-turn rows or drop the images"
        )


def encode_with_images(
    rec: PromptRecord, text: str, tokenizer: Tokenizer, processor: Any
) -> tuple[str, list[int], RowImages | None]:
    """Tokenize a record's rendered prompt `text`: (text, ids, None) for a text model (`processor` None); for a
    vision-language model its images are read and processed once, each image's <|image_pad|> repeated to its
    token count, and the ids checked to hold one <|image_pad|> token per merged patch (a tokenizer without the
    vision tokens splits them into pieces). Raises DatasetError naming the file and the row."""
    if processor is None:
        return text, tokenizer.encode(text), None
    images = read_row_images(rec, processor)
    try:
        text = expand_image_tokens(text, images.token_counts)
    except ImageError as exc:
        raise DatasetError(f"{rec.source}: {rec.where}: {exc}") from exc
    ids = tokenizer.encode(text)
    pad = tokenizer.encode(IMAGE_PAD)
    wanted = sum(images.token_counts)
    found = sum(1 for i in ids if len(pad) == 1 and i == pad[0])
    if found != wanted:
        raise DatasetError(
            f"{rec.source}: {rec.where}: the prompt holds {found} {IMAGE_PAD} tokens for its images' {wanted}: "
            f"the tokenizer encodes {IMAGE_PAD} as {pad}, not one special token; use the vision-language "
            "model's own tokenizer"
        )
    return text, ids, images


def image_tensors(images: RowImages) -> tuple[Any, Any]:
    """A row's (patches uint8 [N, 3*t*p*p], grid_thw int64 [n_images, 3]) as torch tensors, as the dock and
    the train engine hold them."""
    import torch

    return torch.from_numpy(images.patches), torch.from_numpy(images.grid_thw)


def check_prompt_room(
    path: str,
    prompts: list[EncodedPrompt],
    *,
    max_positions: int,
    max_new_tokens: int,
    trajectory: int | None,
) -> None:
    """Prompts that leave no room for their response within the model's positions, found in the data pass
    (before any process starts) rather than by the rollout worker mid-run: a prompt needs room for one turn of
    rollout.max_new_tokens (else a ConfigError naming the file, the first such prompt, how many and the fix);
    multi-turn (`trajectory`: the trajectory budget, config/budgets.py) warns of prompts whose trajectories
    the model's positions cut short (the rollout ends them there, truncated)."""
    from dockrl.errors import ConfigError

    room = max_positions - max_new_tokens
    long = [p for p in prompts if len(p.ids) > room]
    if long:
        first = long[0]
        many = f"{len(long)} prompts leave" if len(long) > 1 else "1 prompt leaves"
        raise ConfigError(
            f"{path}: {many} no room for the response: first at {first.where} ({len(first.ids)} tokens); "
            f"a prompt may hold max_position_embeddings={max_positions} - rollout.max_new_tokens="
            f"{max_new_tokens} = {room} tokens. Set data.max_prompt_len={max(room, 1)} to skip them, lower "
            "rollout.max_new_tokens, or use a model with more positions"
        )
    if trajectory is None or trajectory <= max_new_tokens:
        return
    room = max_positions - trajectory
    cut = [p for p in prompts if len(p.ids) > room]
    if cut:
        log.warning(
            "%s: %d prompts (first at %s, %d tokens) leave less than the trajectory budget of %d tokens within "
            "max_position_embeddings=%d: their trajectories end truncated at the model's positions (lower "
            "env.max_response_tokens or data.max_prompt_len to %d to avoid it)",
            path,
            len(cut),
            cut[0].where,
            len(cut[0].ids),
            trajectory,
            max_positions,
            max(room, 1),
        )


def _render_env_prompt(env: Any, row: dict[str, Any], tokenizer: Tokenizer, system_prompt: str | None) -> str:
    """The prompt of a multi-turn trajectory: the system prompt, the environment's first turn, its tools."""
    from dockrl.envs.base import check_messages
    from dockrl.envs.loader import env_tools

    first = check_messages(env.reset(dict(row)).as_messages(), "environment reset")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + first
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=env_tools(env) or None)


class EpochSampler:
    """Yields batches of prompts, reshuffled each epoch with a seed; resumable from (epoch, position)."""

    def __init__(self, items: list, batch_size: int, *, shuffle: bool, seed: int):
        self.items, self.batch_size, self.shuffle, self.seed = items, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def seek(self, epoch: int, position: int) -> None:
        """Continue from `position` in epoch `epoch` (a resumed run's sampler)."""
        self.epoch, self.position = epoch, position
        self._order = self._make_order()

    def next_batch(self, size: int | None = None) -> list:
        """The next `size` (default batch_size) items, crossing epoch boundaries as needed."""
        size = self.batch_size if size is None else size
        batch: list = []
        while len(batch) < size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._make_order()
            take = min(size - len(batch), len(self._order) - self.position)
            batch += [self.items[i] for i in self._order[self.position : self.position + take]]
            self.position += take
        return batch


class RunFailed(RuntimeError):
    """A run stopped on a worker or dock failure; the message says which, where, and how to resume."""
