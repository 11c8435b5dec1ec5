"""The tokenizer protocol scripts and TRL use, against transformers' fast tokenizer on one file.

Compared exactly (ids, masks, strings): `tokenizer(...)` single and batched, with padding
(longest, max_length, left / right, pad_to_multiple_of), truncation (special tokens counted),
max_length alone, add_special_tokens, return_tensors="pt"; `pad_token = eos_token`;
batch_decode; convert_tokens_to_ids; apply_chat_template with tools, tool calls, template
variables, return_dict and a padded batch. Both read the same tokenizer.json, trained here with a
BOS token so add_special_tokens changes the ids. Hermetic, CPU, no network.
Run: python -m pytest -q tests/parity/test_tokenizer_protocol_parity.py
"""

import pytest
import torch
import transformers

from nanosft.tokenizer import CHATML_TEMPLATE, BatchEncoding, Tokenizer

CORPUS = ["the cat sat on the mat.", "hello world, what is two plus two? four.",
          "tools: get_weather(city) returns the weather."] * 8
TEXTS = ["the cat sat", "hello world, what is two plus two?", "four."]

# ChatML that also renders a `tools` list and assistant `tool_calls` (a Qwen 2.5-style layout),
# with {% generation %} around the assistant turn, and one template variable (`greeting`).
TOOL_TEMPLATE = (
    "{%- if greeting is defined %}{{- greeting + '\\n' }}{%- endif %}"
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' + (call.function | tojson) + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "weather in paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}]},
    {"role": "tool", "name": "get_weather", "content": "sunny"},
    {"role": "assistant", "content": "it is sunny."},
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer.train(CORPUS, vocab_size=330, bos_token="<s>")
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(folder)
    return Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


def assert_encodings_equal(ours, theirs):
    assert isinstance(ours, BatchEncoding)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        if isinstance(theirs[key], torch.Tensor):
            assert torch.equal(ours[key], theirs[key]), key
        else:
            assert ours[key] == theirs[key], key


CALLS = [
    ({}, "single"),
    ({"add_special_tokens": False}, "single"),
    ({"return_tensors": "pt"}, "single"),
    ({}, "batch"),
    ({"padding": True}, "batch"),
    ({"padding": "longest", "return_tensors": "pt"}, "batch"),
    ({"padding": "max_length", "max_length": 12}, "batch"),
    ({"padding": True, "pad_to_multiple_of": 8, "return_tensors": "pt"}, "batch"),
    ({"padding": True, "padding_side": "left"}, "batch"),
    ({"truncation": True, "max_length": 4}, "batch"),  # BOS counts towards max_length
    ({"truncation": True, "max_length": 4, "add_special_tokens": False}, "single"),
    ({"max_length": 3}, "batch"),  # max_length alone turns truncation on
    ({"padding": True, "truncation": True, "max_length": 5, "return_tensors": "pt"}, "batch"),
    ({"padding": True, "return_attention_mask": False}, "batch"),
]


@pytest.mark.parametrize("kwargs,shape", CALLS)
def test_call_equals_transformers(pair, kwargs, shape):
    ours, theirs = pair
    ours.pad_token = theirs.pad_token = "<|endoftext|>"
    text = TEXTS[1] if shape == "single" else TEXTS
    assert_encodings_equal(ours(text, **kwargs), theirs(text, **kwargs))


def test_padding_side_attribute_and_pad_token_setter(pair):
    ours, theirs = pair
    for tok in (ours, theirs):
        tok.pad_token = tok.eos_token  # the line most QLoRA scripts carry
        tok.padding_side = "left"
    try:
        assert ours.pad_token_id == theirs.pad_token_id == ours.token_to_id("<|im_end|>")
        assert_encodings_equal(ours(TEXTS, padding=True, return_tensors="pt"),
                               theirs(TEXTS, padding=True, return_tensors="pt"))
    finally:
        ours.padding_side = theirs.padding_side = "right"
    ours.bos_token_id = theirs.bos_token_id = ours.token_to_id("<|endoftext|>")
    assert (ours.bos_token, ours.bos_token_id) == (theirs.bos_token, theirs.bos_token_id)
    ours.bos_token = theirs.bos_token = "<s>"


def test_batch_decode_and_token_conversions(pair):
    ours, theirs = pair
    batch = theirs(TEXTS, padding=True, return_tensors="pt")["input_ids"]
    for skip in (False, True):
        assert ours.batch_decode(batch, skip_special_tokens=skip) == theirs.batch_decode(
            batch, skip_special_tokens=skip)
        assert ours.decode(batch[0], skip_special_tokens=skip) == theirs.decode(
            batch[0], skip_special_tokens=skip)
    tokens = ["<s>", "<|im_end|>", "not-a-token"]
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("<|im_start|>") == theirs.convert_tokens_to_ids(
        "<|im_start|>")
    ids = batch[1].tolist()
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.get_vocab() == theirs.get_vocab()


@pytest.mark.parametrize("kwargs", [
    {"tokenize": False},
    {"tools": TOOLS, "tokenize": False},
    {"tools": TOOLS, "add_generation_prompt": True, "greeting": "hi there"},
    {"tools": TOOLS, "return_dict": True},
    {"tools": TOOLS, "return_dict": True, "return_tensors": "pt"},
])
def test_apply_chat_template_with_tools_equals_transformers(pair, kwargs):
    ours, theirs = pair
    chat = TOOL_CHAT[:1] if kwargs.get("add_generation_prompt") else TOOL_CHAT
    got = ours.apply_chat_template(chat, **kwargs)
    want = theirs.apply_chat_template(chat, **{"return_dict": False, **kwargs})
    if kwargs.get("return_dict"):
        assert_encodings_equal(got, want)
    else:
        assert got == want
    if kwargs.get("tools") and kwargs.get("tokenize") is False:
        assert '"name": "get_weather"' in got  # the template saw the tools


def test_tool_call_assistant_masks_equal_transformers(pair):
    ours, theirs = pair
    got = ours.apply_chat_template(TOOL_CHAT, tools=TOOLS, return_assistant_tokens_mask=True)
    want = theirs.apply_chat_template(TOOL_CHAT, tools=TOOLS, return_assistant_tokens_mask=True,
                                      return_dict=True)
    assert_encodings_equal(got, want)
    assert 0 < sum(got["assistant_masks"]) < len(got["input_ids"])


def test_batched_chats_padded_equal_transformers(pair):
    ours, theirs = pair
    ours.pad_token = theirs.pad_token = "<|endoftext|>"
    chats = [[{"role": "user", "content": "hello"}], [TOOL_CHAT[0], TOOL_CHAT[3]]]
    kwargs = {"padding": True, "return_tensors": "pt", "return_dict": True,
              "chat_template": CHATML_TEMPLATE}  # a per-call template: ours renders it in Python
    assert_encodings_equal(ours.apply_chat_template(chats, **kwargs),
                           theirs.apply_chat_template(chats, **kwargs))
    texts = ours.apply_chat_template(conversation=chats, tokenize=False,
                                     chat_template=CHATML_TEMPLATE)  # transformers' keyword
    assert texts == theirs.apply_chat_template(chats, tokenize=False,
                                               chat_template=CHATML_TEMPLATE)
