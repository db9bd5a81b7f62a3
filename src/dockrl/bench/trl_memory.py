"""What TRL's GRPOTrainer holds in memory for one GRPO step on a CPU: `bench e2e`'s choice of micro-batches.

Counted for a Qwen2-shaped decoder under transformers' sdpa attention and TRL's fused LM head
(`trl.trainer.utils.add_fused_lm_head`, which never materializes the [N, V] logits), in TRL's compute dtype
(bf16 under autocast where dockrl's precision rule says bf16, else fp32), weights in fp32, with gradient
checkpointing (GRPOConfig's default) or without. Letters: h hidden, m MLP width, a query heads, n layers, V
vocabulary, P parameters, L the padded sequence length (prompt + response), b bytes of the compute dtype.

    process      the child's interpreter and libraries (torch, transformers, trl, datasets): PROCESS_BYTES
    weights      the policy 4P, its gradients 4P, Adam's two moments 8P, the reference model 4P (KL > 0), bf16
                 autocast's copy of every matmul weight 2P (bf16 only), the fused head's fp32 gradient
                 accumulator 4Vh
    saved        per token, what the backward finds saved: each layer's fp32 input (4h per layer) with
                 checkpointing, every layer's saved tensors (`layer_bytes_per_token`) without; and the final
                 norm's and the head's input (12h)
    head         the head's backward: tiles of min(tokens, 4096) x V (`head_bytes_per_element`) and its fp32
                 gradient of the hidden states (4h per token)
    layers       the backward through the layers: one layer's saved tensors recomputed (checkpointing) and
                 their gradients, each at most the layer's saved bytes, and two fp32 residual gradients (8h)
    generation   the generation phase: the KV cache of the step's prompts x samples (TRL generates them in one
                 batch whatever the micro-batches; fp32, twice as transformers' cache grows by concatenation)
                 and the reference model's forward through the head (`head_forward_bytes_per_element`)

The bound is the sum of every term, not the largest phase: the phases (generation, the head's backward, the
layers' backward) do not overlap in time, but CPU torch allocates from glibc's malloc, whose heap serves
tensors up to 32 MiB once its dynamic mmap threshold has risen and keeps what a phase freed resident, so a later
phase's peak can sit on an earlier one's. MARGIN covers what is
not counted (biases, RoPE tables, the padding mask, per-token vectors). docs/benchmarks.md ("Where TRL fell
back") has TRL's measured peaks against the bound.
"""

from __future__ import annotations

from typing import Any

GIB = 2**30
PROCESS_BYTES = 0.5 * GIB
"""Python with torch, transformers, trl and datasets imported: 0.49 GiB resident (VmRSS) on the bench host; the
TRL child held 0.51 GiB before its first step with the 1m and 6m models loaded."""
HEAD_TOKENS = 4096
"""Token rows of one fused-head tile (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE)."""
HEAD_FP32_TILES = 7
"""fp32 [tile, V] temporaries of the head's torch fallback alive at once in its backward (`_backward_tile`):
the recomputed logits before and after the temperature, the log-probs, the probabilities, the gradient, and two
products that form it (one-hot minus probabilities, times the incoming gradient)."""


def head_bytes_per_element(compute_bytes: int) -> int:
    """Bytes per [tile, V] element of the head's backward: HEAD_FP32_TILES fp32 temporaries, the bool one-hot
    and the matmul's output in the compute dtype. Measured: 31.5-31.7 bytes over the resident memory before
    (N = 2,048 and 4,096 tokens, V = 8,000, bf16: 4 x 7 + 1 + 2 = 31)."""
    return 4 * HEAD_FP32_TILES + 1 + compute_bytes


def head_forward_bytes_per_element(compute_bytes: int) -> int:
    """Bytes per [tile, V] element of the head's forward (`_forward_tile`): the logits in fp32, their
    exponentials and one product at once, and the matmul's output. Measured 14.1-14.2 (bf16: 4 x 3 + 2 = 14)."""
    return 4 * 3 + compute_bytes


MARGIN = 1.10
"""The bound's factor over the terms it counts, for the tensors it leaves out (module docstring)."""


def layer_bytes_per_token(margs: Any, length: int, compute_bytes: int) -> int:
    """Bytes autograd saves per token in one decoder layer for its backward.

    Both RMSNorms save their fp32 input and normalized output (4h each) and a rsqrt (4); the residual stream
    stays fp32 because the norms upcast. Under bf16 autocast each projection casts its input anew (q, k, v:
    3 x 2h; gate, up: 2 x 2h); in fp32 the two norm outputs are saved once (2 x 4h). sdpa's CPU flash kernel
    saves q, k and v (repeated to every query head: transformers repeats them when a padding mask is passed),
    its output (4 x b a d; o_proj's input is a view of that output), a fp32 logsumexp per head (4a) and the
    padding mask converted to the compute dtype (b L); the SwiGLU MLP saves gate, silu(gate), up and their
    product (4 b m). Counted with torch.autograd.graph.saved_tensors_hooks on the 6m shape (docs/benchmarks.md,
    "Where TRL fell back")."""
    h, b = margs.hidden_size, compute_bytes
    heads_width = margs.num_heads * margs.head_dim
    norms = 2 * (4 * h + 4 * h + 4)
    projection_inputs = 5 * b * h if b == 2 else 2 * 4 * h
    attention = 4 * b * heads_width + 4 * margs.num_heads + b * length
    return norms + projection_inputs + attention + 4 * b * _mlp_width(margs)


def trl_step_bytes(
    margs: Any,
    rows: int,
    length: int,
    precision: str,
    step_rows: int,
    kl: bool = True,
    checkpointing: bool = True,
) -> dict[str, float]:
    """The terms of TRL's peak memory (module docstring) for micro-batches of `rows` sequences of `length`
    tokens, the step generating `step_rows`; "total" is their sum times MARGIN."""
    b = 2 if precision == "bf16" else 4
    h, vocab, layers = margs.hidden_size, margs.vocab_size, margs.num_layers
    weights = (4 + 4 + 8 + (4 if kl else 0) + (2 if b == 2 else 0)) * margs.num_params() + 4 * vocab * h
    layer = layer_bytes_per_token(margs, length, b)
    tokens = rows * length
    kept = 4 * h if checkpointing else layer
    tile = min(tokens, HEAD_TOKENS) * vocab
    kv_cache = 2 * step_rows * length * layers * 2 * margs.num_kv_heads * margs.head_dim * 4
    terms = {
        "process": PROCESS_BYTES,
        "weights": float(weights),
        "saved": float(tokens * (layers * kept + 12 * h)),
        "head": float(tile * head_bytes_per_element(b) + tokens * 4 * h),
        "layers": float(tokens * ((2 if checkpointing else 1) * layer + 8 * h)),
        "generation": float(kv_cache + tile * head_forward_bytes_per_element(b)),
    }
    return terms | {"total": MARGIN * sum(terms.values())}


def _mlp_width(margs: Any) -> int:
    """The MLP width a token passes through: the dense MLP's, or its experts' together (top-k of them)."""
    if getattr(margs, "num_experts", 0):
        return margs.num_experts_per_tok * margs.moe_intermediate_size
    return margs.intermediate_size
