"""Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration): a Qwen2 language model with multimodal RoPE,
fed image embeddings from a vision tower at its <|image_pad|> tokens (models/vision.py, docs/vision.md).

LoRA adapts the language model's linear layers only (the vision tower's have other names); no reward models.
"""

from dockrl.models.families.record import Family, TinyPreset, register

FAMILY = register(
    Family(
        name="qwen2_5_vl",
        hf_model_types=("qwen2_5_vl",),
        causal_lm="Qwen2_5_VLForConditionalGeneration",
        seq_cls=None,
        qkv_bias=True,
        o_proj_bias=False,
        qk_norm=False,
        moe=False,
        sliding_window_key="use_sliding_window",
        hf_fixed={"use_sliding_window": False, "sliding_window": None},
        tool_call_format="qwen",
        tiny=TinyPreset(tie_word_embeddings=False, attention_bias=True),
        vision=True,
    )
)
