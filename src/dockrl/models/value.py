"""ValueModel: dockrl's decoder body with a scalar value head (PPO's critic).

Shape letters: B batch, T tokens, H hidden size.

Parameter names: the body is Hugging Face's `model.` tree (as in `Transformer`), the head is `score.weight`
[1, H] and `score.bias` [1] (the names of Hugging Face's `*ForTokenClassification` head). The critic starts
from a causal-LM checkpoint (its `lm_head` is dropped and a fresh head is drawn) or from a saved critic
directory (config.json of the body + the head), which `save_model` writes and `load_value_model` reads back.

The value at position t is V(prompt + response[: t - P + 1]): on the trainer's shifted grid [B, T-1] (see
`engines.train.batch`) the value of the state before response token j sits where that token's log-prob does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dockrl.models.config import ModelArgs
from dockrl.models.decoder import DecoderModel, segment_positions
from dockrl.models.hf import ModelKind, load_state_dict, materialize, read_config

SCORE_WEIGHT, SCORE_BIAS = "score.weight", "score.bias"


class ValueModel(nn.Module):
    """Decoder body + linear value head; `forward(input_ids [B, T])` returns values [B, T] in fp32."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        self.score = nn.Linear(args.hidden_size, 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        segments: tuple[int, ...] | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values [B, T] (fp32) of every prefix; right padding is harmless (causal attention). `segments`: rows
        packed end to end in input_ids [1, T] (as `Transformer.hidden_states` takes them). `position_ids` [B, T]:
        the tokens' positions when they are not 0..T-1 (a context-parallel rank's zig-zag share)."""
        batch, seq = input_ids.shape
        if position_ids is None and segments is not None:
            position_ids = segment_positions(segments, input_ids.device)[None]
        elif position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        hidden = self.model(input_ids, position_ids, None, None, segments)  # [B, T, H]
        # A copy, not a view of the head's [B, T, 1] output: FSDP2 hooks the root module's output for backward.
        return self.score(hidden).squeeze(-1).float().clone()  # [B, T]


def fresh_value_head(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """A new head: weight ~ N(0, 1 / (H + 1)) (OpenRLHF's init: initial values near 0), bias 0."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.empty(1, args.hidden_size).normal_(0.0, 1.0 / (args.hidden_size + 1), generator=generator)
    return {SCORE_WEIGHT: weight, SCORE_BIAS: torch.zeros(1)}


def value_model_kind(seed: int) -> ModelKind:
    """Shard-sized loading of a ValueModel: a causal LM's lm_head is dropped, a missing head drawn with `seed`."""
    return ModelKind(
        build=ValueModel,
        ignore=lambda name, args: name.startswith("lm_head."),
        fallback=lambda args: fresh_value_head(args, seed),
    )


def load_value_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> ValueModel:
    """Build a `ValueModel` from a model directory: a causal LM (fresh head drawn with `seed`) or a saved critic."""
    args = read_config(path)
    state = {k: v for k, v in load_state_dict(path).items() if not k.startswith("lm_head.")}
    if SCORE_WEIGHT not in state:
        state.update(fresh_value_head(args, seed))
    return materialize(lambda: ValueModel(args), state, path, device=device, dtype=dtype)
