"""`dockrl bench packing`: the padding a trainer's micro-batches compute, and the time of its passes, with
padding-free packing (actor.packing=true) and without (rows padded to their micro-batch's longest).

The long-tail workload of `dockrl bench rollout --lengths longtail`: num_sequences rows of a prompt_len-token
prompt and a response drawn from a lognormal (sigma 1) with mean new_tokens / 4, clipped to [1, new_tokens].
Micro-batches as the actor forms them (batch.micro_batch_rows with actor.max_tokens_per_micro_batch =
--max-tokens: longest first; padded: rows x the longest within the budget, packed: the rows' tokens; 0:
--micro-batch-size rows in order). Figures:

  tokens            the rows' real tokens (prompt + response)
  computed_padded   positions the padded micro-batches push through every layer (rows x longest, summed)
  padding_share     1 - tokens / computed, padded and packed (packed computes the rows' tokens only: 0)
  attention_ratio   attention score elements padded / packed (sum over micro-batches of B T^2 / sum of L_i^2)
  logprob_s         one no-grad log-prob pass over the rows (the reference / old log-prob pass), best of repeats
  update_s          one optimizer step over the rows (forward, backward, AdamW), best of repeats

on a tiny random Qwen2-family model (make_tiny) on one process, the torch thread count --threads.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dockrl bench packing`."""
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-sequences", type=int, default=64, help="rows of one step")
    parser.add_argument("--new-tokens", type=int, default=2048, help="longest response (mean a quarter)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=4096, help="actor.max_tokens_per_micro_batch")
    parser.add_argument(
        "--micro-batch-size", type=int, default=8, help="actor.micro_batch_size (used with --max-tokens 0)"
    )
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per mode; the best counts")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model and rows, count the padding, time both modes."""
    import tempfile

    import torch

    from dockrl.bench.rollout import sequence_lengths
    from dockrl.engines.train.batch import micro_batch_rows
    from dockrl.models.tiny import make_tiny

    torch.set_num_threads(args.threads)
    args.lengths = "longtail"
    responses_len = sequence_lengths(args)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(1, 400, (args.prompt_len,), generator=generator) for _ in responses_len]
    responses = [torch.randint(1, 400, (n,), generator=generator) for n in responses_len]
    lengths = [args.prompt_len + n for n in responses_len]
    out: dict[str, Any] = {"rows": len(lengths), "mean_response": sum(responses_len) / len(lengths)}
    out["tokens"] = sum(lengths)
    for packed in (False, True):
        chunks = micro_batch_rows(lengths, args.micro_batch_size, args.max_tokens, packed)
        mode = "packed" if packed else "padded"
        computed = sum(len(c) * max(lengths[i] for i in c) for c in chunks) if not packed else sum(lengths)
        scores = sum(len(c) * max(lengths[i] for i in c) ** 2 for c in chunks) if not packed else None
        out[f"micro_batches_{mode}"] = len(chunks)
        out[f"computed_{mode}"] = computed
        out[f"padding_share_{mode}"] = 1 - sum(lengths) / computed
        if scores is not None:
            out["attention_ratio"] = scores / sum(n * n for n in lengths)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(
            f"{tmp}/model",
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            max_position_embeddings=max(512, max(lengths)),
            seed=args.seed,
        )
        for packed in (False, True):
            out.update(_time(str(model_dir), prompts, responses, packed, args))
    return out


def _time(model_dir: str, prompts, responses, packed: bool, args: argparse.Namespace) -> dict[str, float]:
    import time

    from dockrl.config.schema import ActorConfig
    from dockrl.engines.train.batch import make_micro_batch, micro_batch_rows
    from dockrl.engines.train.train_engine import TrainEngine

    optim = ActorConfig(max_tokens_per_micro_batch=args.max_tokens, packing=packed)
    engine = TrainEngine(model_dir, device="cpu", precision=args.precision, optim=optim, packing=packed)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    logprob_s = update_s = float("inf")

    def loss_fn(stats, mb):
        return (stats[0] * mb.response_mask).sum() / max(1, sum(mb.lengths)), {}

    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.logprobs(prompts, responses, temperature=1.0, micro_batch_size=args.micro_batch_size, pad_token_id=0,
                        max_tokens_per_micro_batch=args.max_tokens)  # fmt: skip
        logprob_s = min(logprob_s, time.perf_counter() - start)
        start = time.perf_counter()
        micro_batches = [
            make_micro_batch(
                [prompts[i] for i in c], [responses[i] for i in c], pad_token_id=0, packed=packed
            )
            for c in micro_batch_rows(lengths, args.micro_batch_size, args.max_tokens, packed)
        ]
        engine.train_step(micro_batches, loss_fn, forward=lambda mb: engine.token_stats(mb, 1.0))
        update_s = min(update_s, time.perf_counter() - start)
    mode = "packed" if packed else "padded"
    return {f"logprob_s_{mode}": logprob_s, f"update_s_{mode}": update_s}
