"""Behaviour of nanosft.tokenizer: training, round trips, special tokens, chat rendering, errors.

Compared: decode(encode(text)) with the text itself; ids before and after save/load; the ChatML
string with one written out by hand in the test; the Jinja rendering of CHATML_TEMPLATE with the
plain-Python renderer; assistant masks with the tokens of the assistant text. Hermetic: tiny
tokenizers trained in-process on a few sentences, files only under pytest's tmp_path.
Run: python -m pytest -q tests/test_tokenizer.py
"""

import itertools
import json
import random
import sys

import pytest

from nanosft import tokenizer as tokmod
from nanosft.tokenizer import CHATML_TEMPLATE, Tokenizer, render_chatml, render_jinja_template

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer turns text into ids; a model turns ids into text.",
    "Grüße aus Köln! 你好，世界。 Emoji: 🙂🚀",
    "def add(a, b):\n    return a + b\n",
] * 4

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "six 🙂"},
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(CORPUS, vocab_size=320)


def test_train_is_deterministic_and_depends_on_the_corpus():
    a = Tokenizer.train(CORPUS, vocab_size=320).backend.to_str()
    b = Tokenizer.train(CORPUS, vocab_size=320).backend.to_str()
    assert a == b
    # Negative control: the comparison is not vacuous, another corpus gives other merges.
    c = Tokenizer.train(["zzz yyy xxx " * 5], vocab_size=320).backend.to_str()
    assert c != a


def test_train_layout_special_ids_first_and_no_bos(tok):
    assert [tok.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.bos_token is None and tok.bos_token_id is None
    assert 3 + 256 < len(tok) <= 320 and tok.vocab_size == len(tok)
    assert tok.encode("fox") == tok.encode("fox", add_special_tokens=False)  # nothing prepended


def test_bos_token_is_prepended_only_with_special_tokens():
    tok = Tokenizer.train(CORPUS, vocab_size=320, bos_token="<s>")
    bos = tok.token_to_id("<s>")
    assert tok.bos_token_id == bos
    assert tok.encode("fox") == [bos] + tok.encode("fox", add_special_tokens=False)
    # chat templates tokenize without special tokens
    assert bos not in tok.apply_chat_template(CHAT)


def test_round_trip_of_arbitrary_unicode(tok):
    rng = random.Random(0)
    planes = [(0x20, 0x7F), (0xA0, 0x2FF), (0x400, 0x4FF), (0x4E00, 0x4FFF), (0x1F600, 0x1F64F),
              (0, 0x20)]
    texts = ["", " ", "  leading and trailing  ", "tab\tnewline\n\r\nnul\x00", "e\u0301 combining"]
    for _ in range(40):
        length = rng.randint(1, 30)
        texts.append("".join(chr(rng.randint(*rng.choice(planes))) for _ in range(length)))
    for text in texts:
        assert tok.decode(tok.encode(text)) == text, repr(text)


def test_special_tokens_are_single_ids_and_never_split(tok):
    text = "x<|im_start|>user\nhi<|im_end|><|endoftext|>y"
    ids = tok.encode(text)
    assert [i for i in ids if i < 3] == [1, 2, 0]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "xuser\nhiy"
    # A near-miss is plain text: many byte-level pieces, no special id.
    assert all(i >= 3 for i in tok.encode("<|im_end|")) and len(tok.encode("<|im_end|")) > 1


def test_encode_with_offsets_covers_the_text(tok):
    text = "Grüße, fox! 🙂 <|im_end|>\n"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text, add_special_tokens=False)
    # Contiguous spans covering the text; a char split over two tokens lies in both spans.
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    for (_, prev_end), (start, end) in itertools.pairwise(offsets):
        assert prev_end - 1 <= start <= prev_end < end + 1
    assert text[offsets[ids.index(2)][0]:offsets[ids.index(2)][1]] == "<|im_end|>"


def test_save_load_round_trip(tok, tmp_path):
    written = tok.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]  # no temp files left
    assert len(written) == 3
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["backend"] == "tokenizers" and config["tokenizer_class"] == "TokenizersBackend"
    assert (config["pad_token"], config["eos_token"]) == ("<|endoftext|>", "<|im_end|>")
    assert "bos_token" not in config
    loaded = Tokenizer.from_pretrained(tmp_path)
    for text in CORPUS[:4] + ["<|im_start|>unseen wörds<|im_end|>"]:
        assert loaded.encode(text) == tok.encode(text)
    assert (loaded.pad_token_id, loaded.eos_token_id, len(loaded)) == (0, 2, len(tok))
    assert loaded.chat_template == CHATML_TEMPLATE
    assert loaded.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)


def test_chatml_exact_string(tok):
    expected = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                "<|im_start|>assistant\n4<|im_end|>\n"
                "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                "<|im_start|>assistant\nsix 🙂<|im_end|>\n")
    assert tok.render_chat(CHAT) == expected
    assert tok.apply_chat_template(CHAT, tokenize=False) == expected
    assert tok.render_chat(CHAT, add_generation_prompt=True) == expected + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(CHAT) == tok.encode(expected, add_special_tokens=False)


def test_generation_prompt_render_is_a_prefix_of_the_full_chat(tok):
    # What completion masks rely on: prompt + generation prompt is a prefix of prompt + answer.
    for k in (2, 4):
        prompt = tok.render_chat(CHAT[:k], add_generation_prompt=True)
        full = tok.render_chat(CHAT[:k + 1])
        assert full.startswith(prompt) and full[len(prompt):] == CHAT[k]["content"] + "<|im_end|>\n"


def test_assistant_spans_and_masks(tok):
    text, spans = tok.render_chat_with_spans(CHAT)
    assert [text[s:e] for s, e in spans] == ["4<|im_end|>\n", "six 🙂<|im_end|>\n"]
    out = tok.apply_chat_template(CHAT, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "4<|im_end|>\nsix 🙂<|im_end|>\n"
    assert out["input_ids"] == tok.apply_chat_template(CHAT)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_jinja_chatml_template_renders_like_the_builtin(add_generation_prompt):
    pytest.importorskip("jinja2")
    for chat in (CHAT, CHAT[:2], [{"role": "tool", "content": "{\"x\": 1}\n  indented"}]):
        ours = render_chatml(chat, add_generation_prompt)
        jinja = render_jinja_template(CHATML_TEMPLATE, chat, add_generation_prompt,
                                      eos_token="<|im_end|>")
        assert jinja == ours


def test_folder_with_its_own_jinja_template(tok, tmp_path):
    jinja2 = pytest.importorskip("jinja2")
    template = ("{{ bos_token }}{% for m in messages %}\n"
                "    {% if m.role == 'system' %}"
                "{{ raise_exception('no system role') }}{% endif %}\n"
                "[{{ m.role }}] {{ m.content }}{{ eos_token }}\n"
                "{% endfor %}\n"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(template)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<|endoftext|>", "special": True}  # dict spelling
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_pretrained(tmp_path)
    # trim_blocks / lstrip_blocks: the block tags leave neither their indent nor their newline.
    assert loaded.render_chat(CHAT[1:3], add_generation_prompt=True) == (
        "<|endoftext|>[user] What is 2+2?<|im_end|>\n[assistant] 4<|im_end|>\n[assistant]")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        loaded.render_chat(CHAT)


def test_legacy_chat_template_key_in_tokenizer_config(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": CHATML_TEMPLATE},
                               {"name": "rag", "template": "x"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(tmp_path).chat_template == CHATML_TEMPLATE
    config["chat_template"] = "{{ messages[0].content }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(tmp_path).chat_template == "{{ messages[0].content }}"


def test_added_tokens_decoder_adds_missing_tokens_and_config_add_bos_is_ignored(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    new_id = len(tok)
    config["added_tokens_decoder"] = {"0": {"content": "<|endoftext|>", "special": True},
                                      str(new_id): {"content": "<tool>", "special": True}}
    # tokenizer.json's post-processor decides BOS (transformers 5 drops add_bos_token here).
    config.update(bos_token="<tool>", add_bos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert loaded.token_to_id("<tool>") == new_id == loaded.bos_token_id
    assert len(loaded) == len(tok) + 1
    assert loaded.encode("a<tool>b") == tok.encode("a") + [new_id] + tok.encode("b")


# ---- errors: each names the culprit and the fix ------------------------------------------------
def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found.*AutoTokenizer"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_corrupt_json_names_file_and_line(tok, tmp_path, name):
    tok.save_pretrained(tmp_path)
    (tmp_path / name).write_text('{\n  "model": {,\n}')
    with pytest.raises(ValueError, match=rf"{name}: not valid JSON \(line 2, column"):
        Tokenizer.from_pretrained(tmp_path)


def test_tokenizer_json_the_library_rejects(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(ValueError, match="tokenizer.json: the tokenizers library cannot read it"):
        Tokenizer.from_pretrained(tmp_path)


def test_special_token_not_in_vocabulary(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError,
                       match=r"tokenizer_config\.json: eos_token '</s>' is not in the vocabulary"):
        Tokenizer.from_pretrained(tmp_path)


def test_added_tokens_decoder_id_mismatch(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {"5": {"content": "<|im_end|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"added_tokens_decoder\['5'\] is '<\|im_end\|>'.*id 2"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("messages, error, pattern", [
    ([], ValueError, "non-empty list"),
    (["hi"], TypeError, r"messages\[0\] must be a dict"),
    ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], ValueError,
     r"messages\[1\]\['role'\] is 'bot'"),
    ([{"role": "user", "content": ["a", "b"]}], TypeError,
     r"messages\[0\]\['content'\] must be a str"),
    ([{"role": "user"}], TypeError, r"messages\[0\]\['content'\] must be a str, got NoneType"),
])
def test_bad_messages_name_index_and_field(tok, messages, error, pattern):
    with pytest.raises(error, match=pattern):
        tok.apply_chat_template(messages)


def test_training_errors():
    with pytest.raises(ValueError, match="vocab_size=100 is below 256 byte symbols"):
        Tokenizer.train(CORPUS, vocab_size=100)
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, got int"):
        Tokenizer.train(["a", 3], vocab_size=300)


def test_no_chat_template_and_chatml_without_its_tokens(tok):
    bare = Tokenizer(tok.backend, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="no chat template; fix: set tokenizer.chat_template"):
        bare.render_chat(CHAT)
    other = Tokenizer.train(CORPUS, 300, special_tokens=["<s>", "</s>"], pad_token=None,
                            eos_token="</s>")
    with pytest.raises(ValueError, match=r"ChatML template needs '<\|im_start\|>'"):
        other.render_chat(CHAT)


def test_missing_jinja2_is_a_clear_import_error(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)  # makes `import jinja2` fail
    tokmod._compile_jinja_template.cache_clear()
    try:
        with pytest.raises(ImportError, match="pip install jinja2"):
            render_jinja_template("{{ messages }}", CHAT)
        # the built-in needs no jinja2
        assert tok.render_chat(CHAT).startswith("<|im_start|>system\n")
    finally:
        tokmod._compile_jinja_template.cache_clear()
