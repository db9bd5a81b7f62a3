"""make_tiny: a tiny random model plus a locally trained tokenizer, as a Hugging Face directory.

For tests and demos; nothing is downloaded. The tokenizer is a byte-level BPE trained on a small built-in
corpus (arithmetic questions and answers plus generated English) with Qwen's pre-tokenizer, whose regex
isolates every digit, so numbers tokenize digit by digit. Its special tokens and ChatML template follow
Qwen2 (eos "<|im_end|>", pad "<|endoftext|>", no bos), and its tokenizer_config.json names Qwen2Tokenizer:
transformers rebuilds exactly this pipeline from the vocabulary, so dockrl and transformers tokenize alike.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from dockrl.models.classifier import RewardModel, save_reward_model
from dockrl.models.config import ModelArgs, VisionArgs
from dockrl.models.decoder import MLP, Transformer
from dockrl.models.families import FAMILIES
from dockrl.models.hf import load_state_dict, save_model
from dockrl.models.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer
from dockrl.models.vision_processing import PREPROCESSOR_FILE

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
# Qwen2.5's tool-call markers: added tokens that are not special (decoding keeps them, so a parser reads them),
# one id each as in Qwen's vocabulary. make_tiny(tools=True) adds them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen2.5-VL's vision markers, special added tokens as in its vocabulary; a vision family's make_tiny adds them.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VISION_SPECIAL_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
# The image processor beside a tiny vision model (transformers' Qwen2VLImageProcessor keys): few pixels, so a
# 56 x 56 .. 224 x 224 image is 16 .. 256 patches (4 .. 64 image-pad tokens).
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 56 * 56, 224 * 224

# Qwen2's pre-tokenizer regex (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX): \p{N} matches one digit.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# ChatML with Qwen2.5's tool conventions, compact: each tool as one line `name(arguments): description` in the
# system turn (a tiny vocabulary spends a token per JSON character; real Qwen templates list the JSON), calls as
# <tool_call>{json}</tool_call> in the assistant's text, and consecutive tool messages as one user turn of
# <tool_response> blocks. Without tools and tool messages it renders exactly plain ChatML. __CONTENT__ stands for
# how a message's content renders (below).
_CHATML_SKELETON = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools' }}"
    "{% for tool in tools %}{% set f = tool['function'] %}"
    "{{ '\\n' + f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + '): ' + f['description'] }}"
    "{% endfor %}"
    '{{ \'\\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% elif message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + __CONTENT__ + '<|im_end|>' + '\\n' }}"
    "{% else %}"
    "{{ raise_exception('chat roles must be system, user, assistant or tool, got ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2.5-VL's way with content: a string as it is, or a list of parts, {"type": "image"} (or a part holding an
# "image" key) as <|vision_start|><|image_pad|><|vision_end|> (the data side repeats the pad once per image
# token) and {"type": "text", "text": ...} as its text.
_CONTENT_MACRO = (
    "{% macro render_content(content) %}{% if content is string %}{{ content }}{% else %}"
    "{% for part in content %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endmacro %}"
)
CHATML_TEMPLATE = _CHATML_SKELETON.replace("__CONTENT__", "message['content']")
# The tool template for a consumer that renders the assistant's parsed calls from a `tool_calls` field (TRL's
# GRPOTrainer requires it: trl.chat_template_utils.supports_tool_calling): each call after the content as
# Qwen2.5 writes it, <tool_call>{"name": ..., "arguments": {...}}</tool_call>. Messages without `tool_calls`
# render exactly as CHATML_TEMPLATE renders them.
_CALLS_MACRO = (
    "{% macro render_calls(message) %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}{% set f = call['function'] %}"
    "{{ '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson) + '}</tool_call>' }}"
    "{% endfor %}{% endif %}{% endmacro %}"
)
TOOL_CALLS_CHAT_TEMPLATE = _CALLS_MACRO + _CHATML_SKELETON.replace(
    "__CONTENT__", "message['content'] + render_calls(message)"
)
VISION_CHAT_TEMPLATE = _CONTENT_MACRO + _CHATML_SKELETON.replace(
    "__CONTENT__", "render_content(message['content'])"
)

_SUBJECTS = (
    "the cat",
    "a small dog",
    "my friend",
    "the teacher",
    "our team",
    "the old man",
    "a student",
    "she",
    "he",
)
_VERBS = (
    "found",
    "wanted",
    "carried",
    "painted",
    "watched",
    "counted",
    "opened",
    "cleaned",
    "shared",
    "bought",
)
_OBJECTS = (
    "a red apple",
    "the green door",
    "three books",
    "the long road",
    "a quiet garden",
    "two boxes",
    "the answer",
)
_PLACES = (
    "near the river",
    "in the morning",
    "after school",
    "at the market",
    "before dinner",
    "in the park",
)
_CLOSERS = (
    "It was a good day.",
    "Then everyone went home.",
    "Nobody said a word.",
    "That is how it happened.",
)


def default_corpus() -> list[str]:
    """Built-in training text: arithmetic Q/A (also in ChatML form) and generated English sentences."""
    rng = random.Random(1234)  # fixed: the tokenizer does not depend on make_tiny's seed
    corpus = []
    for _ in range(600):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"What is {a}{op}{b}?"
        corpus += [
            question,
            str(answer),
            f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n",
        ]
    for _ in range(150):
        sentence = (
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
        )
        corpus.append(f"{sentence[0].upper()}{sentence[1:]} {rng.choice(_CLOSERS)}")
    corpus.append(f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n")
    return corpus


def tool_corpus() -> list[str]:
    """Extra training text for a tokenizer that reads tool calls: calculator calls in the Qwen2.5 JSON form and
    tool responses in ChatML, so BPE merges the call's fixed words ("name", "arguments", ...)."""
    rng = random.Random(4321)
    corpus = []
    for _ in range(300):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
        corpus += [
            f"{IM_START}assistant\n<tool_call>{call}</tool_call>{IM_END}\n",
            f"{IM_START}user\n<tool_response>\n{a * b}\n</tool_response>{IM_END}\n",
            "calculator(expression): Evaluate an arithmetic expression exactly, e.g. 123*456 or (7+8)/3.",
            'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
        ]
    return corpus


def train_tokenizer(
    corpus: list[str],
    vocab_size: int,
    added_tokens: tuple[str, ...] = (),
    added_special: tuple[str, ...] = (),
) -> BackendTokenizer:
    """Train a Qwen2-style byte-level BPE on ``corpus``; special tokens get ids 0, 1, 2, `added_special`
    (special: the vision markers) the ids after the trained vocabulary, then `added_tokens` (not special)."""
    backend = BackendTokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in added_special])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in added_tokens])
    return backend


def tokenizer_config(
    backend: BackendTokenizer,
    max_length: int,
    added: tuple[str, ...] = (),
    added_special: tuple[str, ...] = (),
) -> dict:
    """tokenizer_config.json for ``backend`` in the form Qwen2 checkpoints use (`added`: its non-special
    added tokens; `added_special`: its vision markers, whose presence picks the vision chat template)."""
    added_tokens = {
        str(backend.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS or token in added_special,
        }
        for token in (*SPECIAL_TOKENS, *added_special, *added)
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": VISION_CHAT_TEMPLATE if added_special else CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def make_tiny(
    out_dir: str | Path,
    *,
    family: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    corpus: list[str] | None = None,
    seed: int = 0,
    max_position_embeddings: int = 512,
    reward_model: bool = False,
    tools: bool = False,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    padded_vocab_size: int | None = None,
    eos_rate: float | None = None,
) -> Path:
    """Write a tiny random ``family`` model and its tokenizer to ``out_dir``; returns the directory.

    ``family`` is a name of models/families/; its record's tiny preset chooses the bias and the tied head (the
    choices of the family's small hub checkpoints), its q/k norm and experts come with it.
    ``vocab_size`` is the BPE target; the model gets the tokenizer's actual size (smaller when the corpus
    runs out of merges). ``intermediate_size`` defaults to 3 * hidden_size. Same arguments, same files.
    ``reward_model`` writes a ``<Family>ForSequenceClassification`` with a scalar score head instead of a
    causal LM (same decoder shape and tokenizer, so it reads the policy's token ids as they are).
    ``tools`` trains the tokenizer on tool calls too and adds Qwen2.5's ``<tool_call>`` markers as single
    tokens (TOOL_TOKENS), as a real Qwen vocabulary has them: a call then costs ~20 tokens instead of ~70.
    A family with experts (``family="qwen3_moe"``): every layer routes each token to ``num_experts_per_tok`` of
    ``num_experts`` experts of width ``moe_intermediate_size`` (default hidden_size); dense families ignore the
    three.
    ``padded_vocab_size``: the embedding and LM head get this many rows (>= the tokenizer's), as real checkpoints
    pad theirs (Qwen2.5: 151,936 rows for 151,665 tokens); the extra ids decode to nothing. Benchmarks use it for
    a real vocabulary-to-hidden ratio. ``eos_rate``: a dense model that ends each response with about this
    probability per token (geometric lengths: long-tailed, mean ~1 / eos_rate), see ``with_eos_rate``.
    """
    if family not in FAMILIES:
        raise ValueError(f"make_tiny family={family!r} is not supported; use one of {tuple(FAMILIES)}")
    record = FAMILIES[family]
    if hidden_size % num_heads != 0:
        raise ValueError(f"make_tiny hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"make_tiny vocab_size={vocab_size} must be >= 259 (256 bytes + 3 special tokens)")
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        text = default_corpus() if corpus is None else corpus
        added = TOOL_TOKENS if tools else ()
        special = VISION_SPECIAL_TOKENS if record.vision else ()
        backend = train_tokenizer(text + tool_corpus() if tools else text, vocab_size, added, special)
        backend.save(str(Path(tokenizer_dir) / TOKENIZER_FILE))
        with open(Path(tokenizer_dir) / TOKENIZER_CONFIG_FILE, "w", encoding="utf-8") as f:
            json.dump(tokenizer_config(backend, max_position_embeddings, added, special), f, indent=2)
            f.write("\n")
        tokenizer = Tokenizer.from_dir(tokenizer_dir)
        moe: dict[str, Any] = {}
        if record.moe:
            width = moe_intermediate_size or hidden_size
            moe = dict(
                num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=width
            )
        if padded_vocab_size is not None and padded_vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"make_tiny padded_vocab_size={padded_vocab_size} is below the tokenizer's {tokenizer.vocab_size}"
            )
        if eos_rate is not None and (record.moe or reward_model or not 0 < eos_rate < 1):
            raise ValueError(f"make_tiny eos_rate={eos_rate}: a rate in (0, 1) for a dense causal LM")
        args = ModelArgs(
            family=family,
            vocab_size=padded_vocab_size or tokenizer.vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size or 3 * hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=hidden_size // num_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=record.tiny.tie_word_embeddings and eos_rate is None,
            attention_bias=record.tiny.attention_bias,
            qk_norm=record.qk_norm,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **moe,
            **(_tiny_vision(backend, hidden_size, num_heads) if record.vision else {}),
        )
        if reward_model:
            scorer = RewardModel(args)
            scorer.init_weights(seed)
            save_reward_model(scorer, out_dir, tokenizer_dir=tokenizer_dir)
            return out_dir
        model = Transformer(args)
        model.init_weights(seed)
        if eos_rate is not None:
            with_eos_rate(model, eos_rate, seed)
        save_model(model, args, out_dir, tokenizer_dir=tokenizer_dir)
    if record.vision:
        _write_json(out_dir / PREPROCESSOR_FILE, tiny_preprocessor_config())
    return out_dir


def _tiny_vision(backend: BackendTokenizer, hidden_size: int, num_heads: int) -> dict[str, Any]:
    """The vision fields of a tiny ModelArgs: a 2-block tower of width 64 whose 56-pixel windows (2 x 2 merge
    units) cut a 224 x 224 image into 16, block 1 attending the whole image; mrope in Qwen2.5-VL's proportions
    (head_dim / 2 split 1/4 temporal, 3/8 height, 3/8 width)."""
    half = hidden_size // num_heads // 2
    temporal = half // 4
    height = (half - temporal) // 2
    vision = VisionArgs(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=hidden_size,
        window_size=56,
        fullatt_block_indexes=(1,),
    )
    ids = {
        "image": backend.token_to_id(IMAGE_PAD),
        "video": backend.token_to_id(VIDEO_PAD),
        "vision_start": backend.token_to_id(VISION_START),
        "vision_end": backend.token_to_id(VISION_END),
    }
    return {
        "vision": vision,
        "mrope_section": (temporal, height, half - temporal - height),
        "vision_token_ids": ids,
    }


def tiny_preprocessor_config() -> dict[str, Any]:
    """preprocessor_config.json of a tiny vision model: transformers' Qwen2VLImageProcessor with its defaults
    and few pixels (TINY_MIN_PIXELS .. TINY_MAX_PIXELS)."""
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "merge_size": 2,
        "min_pixels": TINY_MIN_PIXELS,
        "max_pixels": TINY_MAX_PIXELS,
        "patch_size": 14,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": TINY_MAX_PIXELS, "shortest_edge": TINY_MIN_PIXELS},
        "temporal_patch_size": 2,
    }


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


@torch.no_grad()
def with_eos_rate(model: Transformer, rate: float, seed: int = 0) -> float:
    """Make a fresh random `model` (untied LM head) emit its EOS token with probability ~`rate` per token.

    A fresh tiny model predicts an almost uniform distribution, so EOS comes once per ~vocab tokens and every
    response runs to the limit. Here hidden lane 0 carries a constant: every embedding row holds 1.0 there (the
    other entries are ~0.02), no layer writes to it (row 0 of each o_proj and down_proj is zeroed), so after the
    final norm it is ~sqrt(hidden) for every token; only the EOS row of the LM head reads it, with a weight
    solved from the measured lane and then corrected once on random sequences. The rest of the model is the
    random one. Returns the measured mean EOS probability."""
    args = model.args
    eos = args.eos_token_id
    assert eos is not None and not args.tie_word_embeddings, (
        "with_eos_rate needs an EOS id and an untied head"
    )
    decoder = model.model
    decoder.embed_tokens.weight[:, 0] = 1.0
    for layer in model.decoder_layers():
        layer.self_attn.o_proj.weight[0].zero_()
        mlp = layer.mlp
        assert isinstance(mlp, MLP), "with_eos_rate builds dense models"
        mlp.down_proj.weight[0].zero_()
    head = model.lm_head.weight
    head[:, 0] = 0.0
    generator = torch.Generator().manual_seed(seed)
    probe = torch.randint(0, args.vocab_size, (8, 64), generator=generator)

    def eos_probability() -> tuple[float, float]:
        hidden = model.hidden_states(probe)  # [B, T, H] after the final norm
        probs = torch.softmax(model.lm_logits(hidden).float(), dim=-1)[..., eos]
        return float(probs.mean()), float(hidden[..., 0].mean())

    _, lane = eos_probability()
    target = math.log(rate / (1 - rate) * (args.vocab_size - 1))  # EOS logit against ~uniform others
    head[eos, 0] = target / lane
    measured, _ = eos_probability()
    head[eos, 0] += (math.log(rate / (1 - rate)) - math.log(measured / (1 - measured))) / lane
    return eos_probability()[0]


def peaked_state_dict(model_dir: str | Path, seed: int) -> dict[str, torch.Tensor]:
    """Random weights for `model_dir`'s shapes whose next-token distributions are peaked: matrices N(0, 1/fan_in)
    (the embedding N(0, 1)), norms 1, biases 0. A fresh tiny model (std 0.02) predicts an almost uniform
    distribution, where greedy argmax sits on near ties and one token repeats; these logits have a standard
    deviation of ~sqrt(hidden), so the top tokens lie whole nats apart. Engine comparisons use them."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in load_state_dict(model_dir).items():
        if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):  # vision norms too
            out[name] = torch.ones_like(tensor)
        elif tensor.dim() == 1:
            out[name] = torch.zeros_like(tensor)
        else:
            fan_in = math.prod(tensor.shape[1:])  # a vision patch embedding's Conv3d reads C x t x p x p
            std = 1.0 if "embed_tokens" in name else fan_in**-0.5
            out[name] = (torch.randn(tensor.shape, generator=generator) * std).to(tensor.dtype)
    return out
