"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM): Qwen3's attention, experts in the MLPs (docs/moe.md).

No reward models and no tool-call format are wired for it yet.
"""

from dockrl.models.families.record import Family, TinyPreset, register

FAMILY = register(
    Family(
        name="qwen3_moe",
        hf_model_types=("qwen3_moe",),
        causal_lm="Qwen3MoeForCausalLM",
        seq_cls=None,
        qkv_bias=False,
        o_proj_bias=True,
        qk_norm=True,
        moe=True,
        sliding_window_key="use_sliding_window",
        hf_fixed={"use_sliding_window": False, "sliding_window": None},
        tool_call_format=None,
        tiny=TinyPreset(tie_word_embeddings=True, attention_bias=False),
    )
)
