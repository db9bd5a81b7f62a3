"""Llama (2, 3, 3.1 and later: transformers' LlamaForCausalLM), and Mistral with its sliding window off, which
is a Llama without biases."""

from dockrl.models.families.record import Family, TinyPreset, register

FAMILY = register(
    Family(
        name="llama",
        hf_model_types=("llama", "mistral"),
        causal_lm="LlamaForCausalLM",
        seq_cls="LlamaForSequenceClassification",
        qkv_bias=False,
        o_proj_bias=True,
        qk_norm=False,
        moe=False,
        sliding_window_key="sliding_window",  # Mistral's window width; null is full attention
        hf_fixed={"mlp_bias": False},
        tool_call_format="llama",
        tiny=TinyPreset(tie_word_embeddings=False, attention_bias=False),
    )
)
