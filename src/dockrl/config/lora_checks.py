"""The rules of `actor.lora` and `model.lora_path` (pure: the adapter directory itself is read by the preflight).

rank 0                      full fine-tuning; any other actor.lora key set is an error (it would do nothing)
rank > 0                    alpha (None: 2 x rank) > 0, dropout (None: 0) in [0, 1), target_modules (None:
                            all-linear) a non-empty list of the decoder's linear layers
with a critic (ppo)         refused: the critic trains every weight and has no adapter path yet
"""

from __future__ import annotations

from dataclasses import dataclass

from dockrl.config.fields import config_error
from dockrl.config.schema import LoraConfig
from dockrl.models.families import ALL_LINEAR, linear_targets


@dataclass(frozen=True)
class LoraSettings:
    """actor.lora resolved: rank r, alpha, dropout and the adapted layers' short names."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]


def check_lora(lora: LoraConfig, *, has_critic: bool) -> LoraSettings | None:
    """The resolved settings of `actor.lora`, or None for full fine-tuning; raises a ConfigError naming the
    setting otherwise (module docstring)."""
    others = {"alpha": lora.alpha, "dropout": lora.dropout, "target_modules": lora.target_modules}
    if lora.rank < 0:
        raise config_error("actor.lora.rank", lora.rank, "must be >= 0", "use 0 (full fine-tuning) or a rank")
    if lora.rank == 0:
        set_keys = [f"actor.lora.{k}" for k, v in others.items() if v is not None]
        if set_keys:
            raise config_error(
                "actor.lora.rank",
                0,
                f"is full fine-tuning, so {', '.join(set_keys)} would do nothing",
                "set actor.lora.rank > 0 to train adapters, or remove those keys",
            )
        return None
    alpha = 2.0 * lora.rank if lora.alpha is None else lora.alpha
    if alpha <= 0:
        raise config_error("actor.lora.alpha", lora.alpha, "must be > 0", "use e.g. 2 x actor.lora.rank")
    dropout = 0.0 if lora.dropout is None else lora.dropout
    if not 0 <= dropout < 1:
        raise config_error("actor.lora.dropout", lora.dropout, "must be in [0, 1)", "use 0 or e.g. 0.05")
    targets = linear_targets(
        ALL_LINEAR if lora.target_modules is None else lora.target_modules, "actor.lora.target_modules"
    )
    if has_critic:
        raise config_error(
            "actor.lora.rank",
            lora.rank,
            "LoRA with a critic (algo.name=ppo) is not built: the critic trains every weight",
            "use actor.lora.rank=0 with ppo, or a critic-free algorithm (grpo, rloo, ...)",
        )
    return LoraSettings(lora.rank, alpha, dropout, targets)
