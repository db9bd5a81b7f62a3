"""Supervised fine-tuning on prompt/answer pairs, loss on the answer tokens only (the demo's warm start).

    file rows ─▶ chat-template(prompt) + answer + eos ─▶ shuffled batches ─▶ micro-batches ─▶ AdamW step
                 (prompt tokens masked out of the loss)                      ─▶ Hugging Face checkpoint

Runs in one process (no Ray); the same TrainEngine as the RL actor does the forward/backward.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any, NamedTuple

import torch

from dockrl.algos.logprobs import token_logprobs
from dockrl.config.loader import to_dict
from dockrl.config.schema import ActorConfig, SFTConfig
from dockrl.data.datasets import load_prompts, render_prompt
from dockrl.data.images import vision_processor
from dockrl.engines.rollout.multi_turn import ChatDelta
from dockrl.engines.train.batch import MicroBatch, make_micro_batch, micro_batch_rows
from dockrl.engines.train.train_engine import TrainEngine
from dockrl.envs.tools import tool_schemas
from dockrl.models.hf import save_model
from dockrl.models.tokenizer import Tokenizer
from dockrl.observe.run_dir import RunDir
from dockrl.recipes.common import check_images_supported, encode_with_images, image_tensors

log = logging.getLogger(__name__)


class Example(NamedTuple):
    """One SFT example: prompt ids, answer ids (+ eos), the answer's loss mask (None: every token trains), and a
    vision-language model's images, (patches uint8 [N, 3*t*p*p], grid_thw int64 [n_images, 3]), else None."""

    prompt: list[int]
    answer: list[int]
    mask: list[float] | None
    images: tuple[torch.Tensor, torch.Tensor] | None = None


def build_examples(
    cfg: SFTConfig, tokenizer: Tokenizer, path: str, *, limit: int | None = None
) -> tuple[list[Example], dict[str, int]]:
    """An Example per row of `path` (at most `limit` rows); rows whose prompt is longer than
    data.max_prompt_len or whose prompt + answer is longer than run.max_len are skipped and counted. A row
    whose prompt is a conversation with assistant turns (tool use) is a multi-turn example: every assistant turn
    is trained on, tool and user turns are not (`conversation_example`). For a vision-language model
    (model.path) each single-turn row's images are read and processed as in the RL data pass
    (recipes/common.py encode_with_images); rows with images and a text model are a DatasetError."""
    d = cfg.data
    records = load_prompts(path, prompt_field=d.prompt_field, label_field=d.label_field, limit=limit)
    conversation = [
        isinstance(rec.prompt, list) and any(m.get("role") == "assistant" for m in rec.prompt)
        for rec in records
    ]
    processor = vision_processor(cfg.model.path)  # a vision-language model's rows carry their images
    check_images_supported(path, records, processor, cfg.model.path, multi_turn=False)
    check_images_supported(
        path, [r for r, c in zip(records, conversation) if c], processor, cfg.model.path, multi_turn=True
    )
    eos = tokenizer.eos_token_id
    tools = tool_schemas(d.tools) if d.tools else None
    examples: list[Example] = []
    skipped = {"prompt_len": 0, "max_len": 0}
    for rec, is_conversation in zip(records, conversation):
        mask: list[float] | None = None
        images = None
        if is_conversation:
            prompt, answer, mask = conversation_example(tokenizer, rec.prompt, tools, d.system_prompt)  # type: ignore[arg-type]
        else:
            text = render_prompt(
                rec, tokenizer, system_prompt=d.system_prompt, use_chat_template=d.use_chat_template
            )
            _, prompt, row_images = encode_with_images(rec, text, tokenizer, processor)
            images = None if row_images is None else image_tensors(row_images)
            answer = tokenizer.encode(str(rec.label)) + ([eos] if eos is not None else [])
        if len(prompt) > d.max_prompt_len:
            skipped["prompt_len"] += 1
        elif len(prompt) + len(answer) > cfg.run.max_len:
            skipped["max_len"] += 1
        else:
            examples.append(Example(prompt, answer, mask, images))
    if not examples:
        raise ValueError(
            f"{path}: no example fits data.max_prompt_len={d.max_prompt_len} and run.max_len={cfg.run.max_len}"
            f" ({skipped['prompt_len']} prompts too long, {skipped['max_len']} examples too long); raise them"
        )
    for key, what in (
        ("prompt_len", "prompts longer than data.max_prompt_len"),
        ("max_len", "examples longer than run.max_len"),
    ):
        if skipped[key]:
            log.warning("%s: skipped %d %s", path, skipped[key], what)
    return examples, skipped


def conversation_example(
    tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None, system_prompt: str | None
) -> tuple[list[int], list[int], list[float]]:
    """A conversation as the multi-turn rollout lays it out (engines.rollout.multi_turn): the prompt up to the
    first assistant turn; then each assistant turn's tokens with the stop token (mask 1) and each observation
    as the chat template's delta (mask 0). SFT and RL train on the same token layout."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    history = [dict(m) for m in messages[:first]]
    if system_prompt and history[0]["role"] != "system":
        history.insert(0, {"role": "system", "content": system_prompt})
    delta = ChatDelta(tokenizer, tools or [])
    prompt = tokenizer.encode(delta.render(history, True))
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    mask: list[float] = []
    rest = messages[first:]
    i = 0
    while i < len(rest):
        content = str(rest[i]["content"])
        turn = tokenizer.encode(content) + stop
        ids += turn
        mask += [1.0] * len(turn)
        new = []
        i += 1
        while i < len(rest) and rest[i]["role"] != "assistant":
            new.append(dict(rest[i]))
            i += 1
        if new:
            sampled = tokenizer.decode(turn, skip_special_tokens=False)
            observation, _ = delta.observation(history, content, sampled, new)
            ids += observation
            mask += [0.0] * len(observation)
        history += [{"role": "assistant", "content": content}, *new]
    return prompt, ids, mask


def sft(cfg: SFTConfig) -> dict[str, Any]:
    """Run a checked SFT config (recipes/preflight.py: preflight_sft); returns the summary with the checkpoint path (and held-out loss and token
    accuracy when data.eval_path is set)."""
    torch.manual_seed(cfg.run.seed)
    run = RunDir(cfg.run.output_dir, cfg.run.name)
    run.refuse_if_taken("run.name", resume_hint=False)
    run.write_config(to_dict(cfg))
    tokenizer = Tokenizer.from_dir(cfg.model.path)
    examples, skipped = build_examples(cfg, tokenizer, cfg.data.train_path)
    held_out: list = []
    if cfg.data.eval_path is not None:
        held_out, _ = build_examples(cfg, tokenizer, cfg.data.eval_path, limit=cfg.data.eval_limit)
    steps_per_epoch = math.ceil(len(examples) / cfg.run.batch_size)
    total_steps = max(1, round(cfg.run.epochs * steps_per_epoch))
    engine = TrainEngine(
        cfg.model.path,
        device=cfg.run.device,
        precision=cfg.run.precision,
        optim=cfg.actor,
        total_optimizer_steps=total_steps,
        packing=cfg.actor.packing,
        freeze_vision=cfg.actor.vision.freeze,  # a vision model's tower (docs/vision.md)
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rng = random.Random(cfg.run.seed)
    order: list[int] = []
    progress = _progress(cfg, total_steps)
    with run.loggers(cfg.run.loggers, to_dict(cfg)):
        for step in range(1, total_steps + 1):
            if (
                len(order) < cfg.run.batch_size
            ):  # the next pass over the file (data.shuffle: in a seeded order)
                fresh = list(range(len(examples)))
                if cfg.data.shuffle:
                    rng.shuffle(fresh)
                order += fresh
            batch = [examples[i] for i in order[: cfg.run.batch_size]]
            del order[: cfg.run.batch_size]
            metrics = _train_batch(engine, batch, pad, cfg.actor)
            if step == total_steps and held_out:
                metrics |= _evaluate(engine, held_out, pad, cfg.actor)
            run.log_metrics(step, metrics)
            progress.update(1)
            progress.set_postfix(loss=f"{metrics['sft/loss']:.3f}")
    progress.close()
    out = run.checkpoints / "final"
    save_model(engine.full_state_dict(), engine.args, out, tokenizer_dir=cfg.model.path)
    summary = {
        "checkpoint": str(out),
        "steps": total_steps,
        "examples": len(examples),
        "skipped": sum(skipped.values()),
        "final_loss": metrics["sft/loss"],
        "run_dir": str(run.path),
    }
    if held_out:
        summary |= {
            "eval_examples": len(held_out),
            **{k: metrics[k] for k in ("eval/loss", "eval/token_accuracy")},
        }
    run.write_summary(summary)
    return summary


def _micro_batches(engine: TrainEngine, batch, pad: int, actor: ActorConfig) -> list[MicroBatch]:
    """Micro-batches by actor.max_tokens_per_micro_batch (or actor.micro_batch_size rows with a budget of 0)."""
    lengths = [len(example.prompt) + len(example.answer) for example in batch]
    if engine.vision is None and any(e.images is not None and len(e.images[1]) for e in batch):
        raise ValueError("SFT rows carry images but model.path is not a vision-language model")
    no_images = (torch.zeros((0, 0), dtype=torch.uint8), torch.zeros((0, 3), dtype=torch.long))
    return [
        make_micro_batch(
            [torch.tensor(batch[i][0]) for i in idx],
            [torch.tensor(batch[i][1]) for i in idx],
            pad_token_id=pad,
            device=engine.device,
            response_masks=[
                torch.ones(len(batch[i][1])) if batch[i][2] is None else torch.tensor(batch[i][2])
                for i in idx
            ],
            packed=engine.packing,
            images=None
            if engine.vision is None
            else [no_images if batch[i].images is None else batch[i].images for i in idx],
            vision=engine.vision,
        )
        for idx in micro_batch_rows(
            lengths, actor.micro_batch_size, actor.max_tokens_per_micro_batch, engine.packing
        )
    ]


def _answer_nll_and_hits(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed answer-token NLL and count of answer tokens predicted exactly (argmax) in one micro-batch."""
    targets = mb.input_ids[:, 1:]
    nll = (-token_logprobs(logits, targets) * mb.response_mask).sum()
    hits = ((logits.argmax(-1) == targets).float() * mb.response_mask).sum()
    return nll, hits


def _train_batch(engine: TrainEngine, batch, pad: int, actor: ActorConfig) -> dict[str, float]:
    num_tokens = float(sum(_trained(e.answer, e.mask) for e in batch))

    def loss_fn(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        nll, hits = _answer_nll_and_hits(logits, mb)
        loss = nll / num_tokens
        return loss, {"sft/loss": loss.item(), "sft/token_accuracy": (hits / num_tokens).item()}

    micro_batches = _micro_batches(engine, batch, pad, actor)
    return engine.train_step(micro_batches, loss_fn, aux_loss_coef=actor.moe_aux_loss_coef)


@torch.no_grad()
def _evaluate(engine: TrainEngine, examples, pad: int, actor: ActorConfig) -> dict[str, float]:
    """Mean answer-token NLL and token accuracy (teacher forcing) over the held-out examples."""
    engine.model.eval()
    num_tokens = float(sum(_trained(e.answer, e.mask) for e in examples))
    nll = hits = 0.0
    for mb in _micro_batches(engine, examples, pad, actor):
        mb_nll, mb_hits = _answer_nll_and_hits(engine.logits(mb).float(), mb)
        nll, hits = nll + mb_nll.item(), hits + mb_hits.item()
    engine.model.train()
    return {"eval/loss": nll / num_tokens, "eval/token_accuracy": hits / num_tokens}


def _trained(answer: list[int], mask: list[float] | None) -> float:
    """Tokens of an example the loss counts."""
    return float(len(answer)) if mask is None else float(sum(mask))


def _progress(cfg: SFTConfig, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="sft", unit="step", disable=not cfg.run.progress, dynamic_ncols=True)
