"""Behaviour of the tokenizer protocol beyond parity: what is refused and what stays untouched.

Checked: a special token outside the vocabulary is refused by the setters; a padded or
truncated `tokenizer(...)` call leaves `encode` as it was (the backend's settings are restored);
ragged rows with return_tensors="pt", padding without a pad token and unknown arguments give
one-line fixes; tool-call messages pass validation only with `tool_calls`, and the built-in
ChatML renderer refuses them with the fix. Parity with transformers lives in
tests/parity/test_tokenizer_protocol_parity.py. Hermetic, CPU.
Run: python -m pytest -q tests/test_tokenizer_protocol.py
"""

import pytest

from nanosft.tokenizer import Tokenizer, validate_messages

CORPUS = ["the cat sat on the mat.", "hello world, what is two plus two? four."] * 8


@pytest.fixture
def tok():
    return Tokenizer.train(CORPUS, vocab_size=300)


def test_setters_refuse_tokens_outside_the_vocabulary(tok):
    with pytest.raises(ValueError, match=r"pad_token = '\[PAD\]': not in the vocabulary"):
        tok.pad_token = "[PAD]"
    with pytest.raises(ValueError, match="pad_token_id = 100000: no token has that id"):
        tok.pad_token_id = 100000
    assert tok.pad_token == "<|endoftext|>"  # unchanged by the refused assignments
    tok.pad_token = None
    assert tok.pad_token_id is None
    with pytest.raises(ValueError, match="tokenizer.pad_token = tokenizer.eos_token"):
        tok(["a", "bb"], padding=True)


def test_call_leaves_encode_as_the_file_set_it(tok):
    tok.backend.enable_truncation(3)  # a tokenizer.json may carry its own truncation
    before = tok.encode(CORPUS[1])
    assert len(before) == 3
    tok(CORPUS[:2], padding="max_length", max_length=40, truncation=True)
    assert tok.encode(CORPUS[1]) == before
    assert tok.backend.padding is None and tok.backend.truncation["max_length"] == 3
    tok.backend.no_truncation()
    # transformers ignores the file's truncation in __call__ unless asked
    assert len(tok(CORPUS[1])["input_ids"]) > 3


def test_ragged_tensors_and_unknown_arguments_are_refused(tok):
    with pytest.raises(ValueError, match="fix: padding=True"):
        tok(["a", "a longer text"], return_tensors="pt")
    with pytest.raises(ValueError, match="return_tensors='pt'"):
        tok("a", return_tensors="np")
    with pytest.raises(TypeError, match="unsupported arguments"):
        tok("a", is_split_into_words=True)
    out = tok("hello")
    assert out.input_ids == out["input_ids"] and out.attention_mask == [1] * len(out.input_ids)


def test_tool_call_messages_validate_only_with_tool_calls():
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    validate_messages([{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "content": "ok"}])
    with pytest.raises(TypeError, match=r"messages\[1\]\['content'\] must be a str, got NoneType "
                                        r"\(fix: give it a string content, or tool_calls"):
        validate_messages([{"role": "user", "content": "hi"}, {"role": "assistant"}])


def test_builtin_chatml_refuses_tool_calls_with_the_fix(tok):
    chat = [{"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    with pytest.raises(ValueError, match="set a chat template that renders tool calls"):
        tok.apply_chat_template(chat)
