"""Parity of nanosft.tokenizer with transformers 5 (AutoTokenizer / PreTrainedTokenizerFast).

Compared, on the same texts and chats: token ids, special-token ids, decode, the rendered chat
string, its tokenization and its assistant masks, for a folder saved by nanosft and read by
transformers, and for a folder saved by transformers and read by nanosft. Hermetic: tokenizers are
trained in-process on a few sentences and saved under tmp_path; nothing is downloaded.
Run: python -m pytest -q tests/parity/test_tokenizer_parity.py
"""

import json

import jinja2  # noqa: F401 (transformers renders every chat template with jinja2)
import pytest
import transformers

from nanosft.tokenizer import CHATML_TEMPLATE, Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Supervised fine-tuning trains on prompt and completion pairs.",
    "Grüße aus Köln! 你好，世界。 🙂",
] * 4

TEXTS = [
    "The quick brown fox",
    "  two leading spaces, trailing too  ",
    "unseen: Zyxwv ĳ ﬁ 🚀🚀 \t\n\n tabs",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "glued<|im_end|>special<|im_start|>",
    "",
]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": " spaced answer \n"},
        {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "No."},
    ],
]


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.train(CORPUS, vocab_size=330)


def assert_same_encoding(ours, theirs):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], repr(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    assert (ours.pad_token_id, ours.eos_token_id, ours.bos_token_id) == (
        theirs.pad_token_id,
        theirs.eos_token_id,
        theirs.bos_token_id,
    )
    assert (len(ours), ours.vocab_size) == (len(theirs), theirs.vocab_size)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_nanosft_folder_read_by_autotokenizer(ours, tmp_path, add_generation_prompt):
    ours.save_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert_same_encoding(ours, theirs)
    for chat in CHATS:
        text = ours.apply_chat_template(chat, add_generation_prompt, tokenize=False)
        assert text == theirs.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours.apply_chat_template(chat, add_generation_prompt) == theirs.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, return_dict=False
        )


def test_assistant_masks_match_transformers(ours, tmp_path):
    # Our saved template carries {% generation %}, so transformers can build the masks from it.
    ours.save_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for chat in CHATS:
        expected = theirs.apply_chat_template(
            chat, return_dict=True, return_assistant_tokens_mask=True
        )
        got = ours.apply_chat_template(chat, return_assistant_tokens_mask=True)
        assert got["input_ids"] == expected["input_ids"]
        assert got["assistant_masks"] == expected["assistant_masks"]
        assert sum(got["assistant_masks"]) > 0


def test_bos_tokenizer_read_by_autotokenizer(tmp_path):
    ours = Tokenizer.train(CORPUS, vocab_size=330, bos_token="<s>")
    ours.save_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.encode("fox")[0] == ours.bos_token_id  # the case under test really adds a BOS
    assert_same_encoding(ours, theirs)
    assert ours.apply_chat_template(CHATS[0]) == theirs.apply_chat_template(
        CHATS[0], return_dict=False
    )


def test_transformers_folder_read_by_nanosft(ours, tmp_path):
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours.backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    theirs.chat_template = CHATML_TEMPLATE
    theirs.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert_same_encoding(loaded, theirs)
    assert loaded.chat_template == theirs.chat_template
    for chat in CHATS:
        for gen in (False, True):
            assert loaded.render_chat(chat, gen) == theirs.apply_chat_template(
                chat, add_generation_prompt=gen, tokenize=False
            )


def test_transformers_folder_with_its_own_template(ours, tmp_path):
    # A non-ChatML template goes through our Jinja path; bos/eos variables come from the config.
    template = (
        "{% for m in messages %}{{ bos_token }}{{ m['role'] | upper }}: {{ m['content'] | trim }}"
        "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}{{ bos_token }}"
        "ASSISTANT:{% endif %}"
    )
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours.backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    theirs.chat_template = template
    theirs.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == template != CHATML_TEMPLATE
    for chat in CHATS:
        for gen in (False, True):
            assert loaded.render_chat(chat, gen) == theirs.apply_chat_template(
                chat, add_generation_prompt=gen, tokenize=False
            )
            assert loaded.apply_chat_template(chat, gen) == theirs.apply_chat_template(
                chat, add_generation_prompt=gen, return_dict=False
            )


@pytest.mark.parametrize("add_bos, add_eos", [(False, False), (True, True)])
def test_config_add_bos_add_eos_do_not_override_tokenizer_json(tmp_path, add_bos, add_eos):
    # transformers 5 drops add_bos_token / add_eos_token from the config when tokenizer.json exists.
    ours = Tokenizer.train(CORPUS, vocab_size=330, bos_token="<s>")  # tokenizer.json adds BOS
    ours.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert_same_encoding(loaded, theirs)
    ids = loaded.encode("fox")
    assert ids[0] == loaded.bos_token_id and ids[-1] != loaded.eos_token_id
