"""models/tokenizer.py: the dockrl Tokenizer tokenizes and renders chat exactly as transformers does."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from dockrl.models.tiny import make_tiny
from dockrl.models.tokenizer import Tokenizer

TEXTS = [
    "What is 12+34?",
    "46",
    "The cat found a red apple near the river.  Then everyone went home.\n\nNext line\t tab",
    "Unicode: caf\u00e9 \u00fcber na\u00efve \u4f60\u597d \U0001f600 -- and 3.14159!",
    "<|im_start|>user\nWhat is 7*8?<|im_end|>\n<|im_start|>assistant\n56<|im_end|>",
    "   leading spaces, trailing spaces   ",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12+34?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 5-9?"},
    ],
    [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2*3?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "And 6*7?"},
    ],
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny(
        tmp_path_factory.mktemp("tiny"), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1
    )


@pytest.fixture(scope="module")
def tokenizers(tiny_dir):
    return Tokenizer.from_dir(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)


def test_encode_and_decode_match_transformers(tokenizers):
    ours, hf = tokenizers
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (
                text
            )
    chat_ids = ours.encode(TEXTS[4])
    assert chat_ids.count(ours.eos_token_id) == 2  # special tokens in text map to their single ids


def test_custom_corpus_tokenizes_like_transformers(tmp_path):
    # Text where Qwen2's pre-tokenizer (which transformers rebuilds for Qwen2Tokenizer) splits differently
    # from GPT-2's: punctuation before words, upper-case contractions, punctuation before newlines.
    corpus = ["(hello) (world) DON'T WON'T it's.\nEnd.\n\n(next) 2024 12.5%"] * 50
    out = make_tiny(tmp_path, corpus=corpus, vocab_size=320, hidden_size=16, num_layers=1, num_heads=2)
    ours, hf = Tokenizer.from_dir(out), AutoTokenizer.from_pretrained(out)
    decomposed = "cafe\u0301 (hello)"  # NFC-normalized by both pipelines
    for text in [*corpus[:1], "(hello) DON'T.\n(world) 99.5%", decomposed, *TEXTS]:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text


def test_tool_tokens_are_single_and_kept_in_decoding(tmp_path):
    # make_tiny(tools=True): Qwen2.5's tool markers are one non-special token each, as in a real Qwen
    # vocabulary: decoding without special tokens keeps them (a tool-call parser reads the decoded text).
    out = make_tiny(tmp_path, tools=True, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    ours, hf = Tokenizer.from_dir(out), AutoTokenizer.from_pretrained(out)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*829"}}</tool_call>'
    response = "<|im_start|>user\n<tool_response>\n287663\n</tool_response>"
    text = f"<|im_start|>assistant\n{call}<|im_end|>\n{response}"
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    for marker in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(ours.encode(marker)) == 1 and ours.encode(marker)[0] in ids
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert call in ours.decode(ids, skip_special_tokens=True)
    assert len(ours.encode(call)) < 30  # the call's fixed words are merged (~70 tokens without)


def test_chat_template_matches_transformers(tokenizers):
    ours, hf = tokenizers
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    rendered = ours.apply_chat_template(CONVERSATIONS[1])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 5-9?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_special_tokens_and_vocab_size(tokenizers):
    ours, hf = tokenizers
    assert ours.vocab_size == len(hf)
    assert ours.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>") == hf.eos_token_id
    assert ours.pad_token_id == hf.convert_tokens_to_ids("<|endoftext|>") == hf.pad_token_id
    assert ours.bos_token_id is None and hf.bos_token_id is None


def test_digits_are_one_token_each(tokenizers):
    ours, _ = tokenizers
    ids = ours.encode("9876543210")
    assert [ours.decode([i]) for i in ids] == list("9876543210")
    question = ours.encode("What is 123+45?")
    pieces = [ours.decode([i]) for i in question]
    assert pieces[-7:] == ["1", "2", "3", "+", "4", "5", "?"]


def test_decode_inverts_encode(tokenizers):
    ours, _ = tokenizers
    for text in TEXTS:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.decode(ours.encode(TEXTS[3])) == TEXTS[3]


def test_config_forms_and_template_file(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    # The dict form older transformers versions wrote.
    config["bos_token"] = {
        "__type": "AddedToken",
        "content": "<|im_start|>",
        "lstrip": False,
        "rstrip": False,
    }
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "rstrip": False}
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(tmp_path)
    assert (ours.eos_token_id, ours.bos_token_id) == (2, 1)
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template(CONVERSATIONS[0])
    # chat_template.jinja, as newer transformers writes it, is used and sees bos_token / eos_token.
    # Multi-line with indented blocks: the output depends on trim_blocks / lstrip_blocks being on.
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}\n{% for m in messages %}\n    {% if m['role'] == 'system' %}\n"
        "[{{ m['content'] }}]\n    {% else %}\n{{ m['content'] + eos_token }}\n    {% endif %}\n{% endfor %}\n"
    )
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.apply_chat_template(CONVERSATIONS[1]) == (
        "<|im_start|>\n[You are a helpful assistant.]\nWhat is 5-9?<|im_end|>\n"
    )
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.apply_chat_template(CONVERSATIONS[1], tokenize=False) == ours.apply_chat_template(
        CONVERSATIONS[1]
    )


def test_save_round_trip_and_missing_dir(tokenizers, tmp_path):
    ours, hf = tokenizers
    ours.save(tmp_path / "saved")
    reloaded = Tokenizer.from_dir(tmp_path / "saved")
    assert reloaded.encode(TEXTS[2]) == ours.encode(TEXTS[2])
    assert reloaded.apply_chat_template(CONVERSATIONS[2]) == ours.apply_chat_template(CONVERSATIONS[2])
    assert (reloaded.eos_token_id, reloaded.pad_token_id, reloaded.vocab_size) == (
        ours.eos_token_id,
        ours.pad_token_id,
        ours.vocab_size,
    )
    hf_reloaded = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert hf_reloaded.encode(TEXTS[3], add_special_tokens=False) == hf.encode(
        TEXTS[3], add_special_tokens=False
    )
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        Tokenizer.from_dir(missing)
