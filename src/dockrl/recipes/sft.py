"""Supervised fine-tuning on prompt/answer pairs, loss on the answer tokens only (the demo's warm start).

    file rows ─▶ chat-template(prompt) + answer + eos ─▶ shuffled batches ─▶ micro-batches ─▶ AdamW step
                 (prompt tokens masked out of the loss)                      ─▶ Hugging Face checkpoint

Runs in one process (no Ray); the same TrainEngine as the RL actor does the forward/backward.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any

import torch

from dockrl.algos.logprobs import token_logprobs
from dockrl.config.loader import to_dict
from dockrl.config.schema import SFTConfig
from dockrl.data.datasets import load_prompts, render_prompt
from dockrl.models.hf import save_model
from dockrl.models.tokenizer import Tokenizer
from dockrl.observe.run_dir import RunDir
from dockrl.workers.train.batch import MicroBatch, make_micro_batch, split_indices
from dockrl.workers.train.train_engine import TrainEngine

log = logging.getLogger(__name__)


def build_examples(cfg: SFTConfig, tokenizer: Tokenizer) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(prompt ids, answer ids + eos) per row; rows longer than run.max_len are skipped and counted."""
    d = cfg.data
    records = load_prompts(d.train_path, prompt_field=d.prompt_field, label_field=d.label_field)
    eos = tokenizer.eos_token_id
    examples, skipped = [], 0
    for rec in records:
        prompt = tokenizer.encode(
            render_prompt(
                rec, tokenizer, system_prompt=d.system_prompt, use_chat_template=d.use_chat_template
            )
        )
        answer = tokenizer.encode(str(rec.label)) + ([eos] if eos is not None else [])
        if len(prompt) + len(answer) > cfg.run.max_len:
            skipped += 1
            continue
        examples.append((prompt, answer))
    if not examples:
        raise ValueError(f"{d.train_path}: no example fits run.max_len={cfg.run.max_len}; raise it")
    return examples, skipped


def sft(cfg: SFTConfig) -> dict[str, Any]:
    """Run a validated SFT config; returns the summary with the checkpoint path."""
    torch.manual_seed(cfg.run.seed)
    run = RunDir(cfg.run.output_dir, cfg.run.name)
    run.write_config(to_dict(cfg))
    tokenizer = Tokenizer.from_dir(cfg.model.path)
    examples, skipped = build_examples(cfg, tokenizer)
    steps_per_epoch = math.ceil(len(examples) / cfg.run.batch_size)
    total_steps = max(1, round(cfg.run.epochs * steps_per_epoch))
    engine = TrainEngine(
        cfg.model.path,
        device=cfg.run.device,
        precision=cfg.run.precision,
        optim=cfg.actor,
        total_optimizer_steps=total_steps,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rng = random.Random(cfg.run.seed)
    order: list[int] = []
    progress = _progress(cfg, total_steps)
    for step in range(1, total_steps + 1):
        if len(order) < cfg.run.batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        batch = [examples[i] for i in order[: cfg.run.batch_size]]
        del order[: cfg.run.batch_size]
        metrics = _train_batch(engine, batch, pad, cfg.actor.micro_batch_size)
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
        "skipped": skipped,
        "final_loss": metrics["sft/loss"],
        "run_dir": str(run.path),
    }
    run.write_summary(summary)
    return summary


def _train_batch(engine: TrainEngine, batch, pad: int, micro_batch_size: int) -> dict[str, float]:
    num_tokens = float(sum(len(a) for _, a in batch))
    micro = [
        make_micro_batch(
            [torch.tensor(batch[i][0]) for i in idx],
            [torch.tensor(batch[i][1]) for i in idx],
            pad_token_id=pad,
            device=engine.device,
        )
        for idx in split_indices(len(batch), micro_batch_size)
    ]

    def loss_fn(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        nll = -token_logprobs(logits, mb.input_ids[:, 1:])  # [B, T-1]
        loss = (nll * mb.response_mask).sum() / num_tokens
        correct = ((logits.argmax(-1) == mb.input_ids[:, 1:]).float() * mb.response_mask).sum() / num_tokens
        return loss, {"sft/loss": loss.item(), "sft/token_accuracy": correct.item()}

    return engine.train_step(micro, loss_fn)


def _progress(cfg: SFTConfig, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="sft", unit="step", disable=not cfg.run.progress, dynamic_ncols=True)
