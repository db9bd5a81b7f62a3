"""Qwen2 and Qwen2.5 (transformers' Qwen2ForCausalLM): q/k/v always biased, o_proj never."""

from dockrl.models.families.record import Family, TinyPreset, register

FAMILY = register(
    Family(
        name="qwen2",
        hf_model_types=("qwen2",),
        causal_lm="Qwen2ForCausalLM",
        seq_cls="Qwen2ForSequenceClassification",
        qkv_bias=True,
        o_proj_bias=False,
        qk_norm=False,
        moe=False,
        sliding_window_key="use_sliding_window",
        hf_fixed={"use_sliding_window": False, "sliding_window": None},
        tool_call_format="qwen",
        tiny=TinyPreset(tie_word_embeddings=True, attention_bias=True),
    )
)
