"""Qwen3, dense (transformers' Qwen3ForCausalLM): per-head RMSNorm on q and k; biases only with
attention_bias."""

from dockrl.models.families.record import Family, TinyPreset, register

FAMILY = register(
    Family(
        name="qwen3",
        hf_model_types=("qwen3",),
        causal_lm="Qwen3ForCausalLM",
        seq_cls="Qwen3ForSequenceClassification",
        qkv_bias=False,
        o_proj_bias=True,
        qk_norm=True,
        moe=False,
        sliding_window_key="use_sliding_window",
        hf_fixed={"use_sliding_window": False, "sliding_window": None},
        tool_call_format="qwen",
        tiny=TinyPreset(tie_word_embeddings=True, attention_bias=False),
    )
)
