"""Reward models: dockrl's decoder with a scalar `score` head (Hugging Face `*ForSequenceClassification`).

    input_ids [B, T] ─▶ model (decoder, final norm) ─▶ hidden [B, T, H] ─▶ pick the pooled token ─▶ score ─▶ [B, L]

A checkpoint is a Hugging Face directory of the family's sequence-classification class (`Family.seq_cls` in
models/families/: `LlamaForSequenceClassification`, `Qwen2ForSequenceClassification`,
`Qwen3ForSequenceClassification`): the decoder under `model.` (no `lm_head`) and `score.weight` [L, H] without
bias, L = num_labels (1 for a reward model). The pooled token follows transformers: the rightmost token whose id
is not `pad_token_id` (so left and right padding both work, and a sequence that itself ends in pad-token ids
is scored at its last other token); with no pad_token_id, the last real token. Only that token's hidden state
goes through the head, which gives the same numbers as transformers' head over every position.

Shape letters: B batch, T tokens, H hidden size, L labels (num_labels).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dockrl.models.config import ModelArgs
from dockrl.models.decoder import DecoderModel, Transformer
from dockrl.models.families import FAMILIES
from dockrl.models.hf import CONFIG_FILE, load_state_dict, materialize, read_config, save_model

# transformers' default when a config.json names neither id2label nor num_labels.
_HF_DEFAULT_NUM_LABELS = 2


class RewardModel(nn.Module):
    """Decoder (`model.`) plus a bias-free linear `score` head read at one pooled token per sequence."""

    def __init__(self, args: ModelArgs, num_labels: int = 1) -> None:
        super().__init__()
        self.args, self.num_labels = args, num_labels
        self.model = DecoderModel(args)
        self.score = nn.Linear(args.hidden_size, num_labels, bias=False)

    def forward(self, input_ids: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled scores [B, L] of input_ids [B, T]; key_mask bool [B, T] (True = real token) or None.

        Positions count from 0 at the first slot (transformers' default), so right padding, which
        `score_sequences` builds, gives each row exactly the numbers it gets alone.
        """
        batch, seq = input_ids.shape
        position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        hidden = self.model(input_ids, position_ids, key_mask)  # [B, T, H]
        pooled = hidden[
            torch.arange(batch, device=hidden.device), pooled_index(input_ids, key_mask, self.args)
        ]
        return self.score(pooled)  # [B, L]

    @torch.no_grad()
    def score_sequences(self, sequences: list[list[int]], micro_batch_size: int) -> list[float]:
        """Scalar score of each token sequence, run in right-padded micro-batches of similar lengths."""
        if self.num_labels != 1:
            raise ValueError(
                f"score_sequences needs a scalar head; this model has num_labels={self.num_labels}"
            )
        device = self.score.weight.device
        pad = self.args.pad_token_id if self.args.pad_token_id is not None else 0
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # less padding per batch
        scores = [0.0] * len(sequences)
        for start in range(0, len(order), micro_batch_size):
            chunk = order[start : start + micro_batch_size]
            longest = max(len(sequences[i]) for i in chunk)
            input_ids = torch.full((len(chunk), longest), pad, dtype=torch.long)
            key_mask = torch.zeros((len(chunk), longest), dtype=torch.bool)
            for row, i in enumerate(chunk):
                input_ids[row, : len(sequences[i])] = torch.tensor(sequences[i], dtype=torch.long)
                key_mask[row, : len(sequences[i])] = True
            values = self(input_ids.to(device), key_mask.to(device))[:, 0].float().tolist()  # [B]
            for i, value in zip(chunk, values):
                scores[i] = value
        return scores

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float = 0.02) -> None:
        """Random init with the scheme of `Transformer.init_weights` (the head too draws from N(0, std))."""
        # Transformer.init_weights only walks named_parameters, so it applies to this module unchanged.
        Transformer.init_weights(self, seed, std)  # type: ignore[arg-type]


def pooled_index(input_ids: torch.Tensor, key_mask: torch.Tensor | None, args: ModelArgs) -> torch.Tensor:
    """Index [B] of the token each row is scored at: the rightmost real token whose id is not the pad id.

    As in transformers, a row of nothing but pad-token ids pools position 0 (argmax of an all-zero row).
    """
    batch, seq = input_ids.shape
    real = torch.ones_like(input_ids, dtype=torch.bool) if key_mask is None else key_mask.to(torch.bool)
    if args.pad_token_id is not None:
        real = real & (input_ids != args.pad_token_id)
    positions = torch.arange(seq, device=input_ids.device, dtype=torch.int32)
    return (positions * real.to(torch.int32)).argmax(-1)  # [B]


def read_num_labels(hf_config: dict) -> int:
    """num_labels as transformers derives it: len(id2label), else `num_labels`, else its default of 2."""
    if hf_config.get("id2label"):
        return len(hf_config["id2label"])
    return hf_config.get("num_labels") or _HF_DEFAULT_NUM_LABELS


def _seq_cls_names() -> list[str]:
    return [family.seq_cls for family in FAMILIES.values() if family.seq_cls is not None]


def seq_cls_architecture(args: ModelArgs) -> str:
    """The `*ForSequenceClassification` class of `args`' family; raises ValueError for a family without
    one."""
    wanted = args.family_record.seq_cls
    if wanted is None:
        raise ValueError(
            f"model family={args.family!r} has no sequence-classification model in dockrl; a reward model is "
            f"one of {sorted(_seq_cls_names())}"
        )
    return wanted


def check_reward_model_dir(path: str | Path) -> ModelArgs:
    """Check that `path` holds a supported `*ForSequenceClassification` checkpoint with num_labels=1.

    Returns its ModelArgs; raises FileNotFoundError or ValueError with a message that says the fix.
    """
    args = read_config(path)
    with open(Path(path) / CONFIG_FILE, encoding="utf-8") as f:
        hf_config = json.load(f)
    architectures = hf_config.get("architectures") or []
    wanted = seq_cls_architecture(args)
    if wanted not in architectures:
        raise ValueError(
            f"config.json architectures={architectures} is not a sequence-classification model; a reward "
            f"model is a Hugging Face *ForSequenceClassification checkpoint (here {wanted}, one of "
            f"{sorted(_seq_cls_names())}); build a tiny one with `dockrl make-tiny DIR --reward-model`"
        )
    num_labels = read_num_labels(hf_config)
    if num_labels != 1:
        raise ValueError(
            f"config.json has num_labels={num_labels} (id2label={hf_config.get('id2label')}); a reward model "
            "has one scalar output: use a checkpoint saved with num_labels=1"
        )
    return args


def load_reward_model(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> RewardModel:
    """Build a `RewardModel` from a `*ForSequenceClassification` directory, weights loaded strictly."""
    args = check_reward_model_dir(path)
    return materialize(
        lambda: RewardModel(args, num_labels=1), load_state_dict(path), path, device=device, dtype=dtype
    )


def save_reward_model(
    model: RewardModel,
    path: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write `model` as a Hugging Face `<Family>ForSequenceClassification` directory (transformers loads it)."""
    architecture = seq_cls_architecture(model.args)
    save_model(model, model.args, path, tokenizer_dir=tokenizer_dir, dtype=dtype)
    config_file = Path(path) / CONFIG_FILE
    config = json.loads(config_file.read_text(encoding="utf-8"))
    labels = [f"LABEL_{i}" for i in range(model.num_labels)]
    config["architectures"] = [architecture]
    config["id2label"] = {str(i): label for i, label in enumerate(labels)}
    config["label2id"] = {label: i for i, label in enumerate(labels)}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
