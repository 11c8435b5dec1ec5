"""nanosft.data: loading errors, the TRL dataset formats, loss masks, truncation and packing.

Compared: every bad input against the error it must raise (naming file, line, example, field);
supervised tokens against the text they must decode to (completion + EOS, each assistant turn with
its `<|im_end|>`); packed rows against the unpacked examples and against the BFD examples in TRL's
`pack_dataset` docstring. Hermetic: a tiny byte-level BPE is trained in-process, no network.
Run: python -m pytest -q tests/test_data.py
"""

import json
import logging

import pytest

from nanosft.data import (
    MAP_BATCH_SIZE,
    dataset_format,
    load_examples,
    pack_dataset,
    prepare_dataset,
)
from nanosft.tokenizer import CHATML_TEMPLATE, Tokenizer

CORPUS = ["the cat sat on the mat.", "hello world, what is two plus two? four.",
          "be nice and brief."]
CHAT = [
    {"role": "system", "content": "be nice"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "two plus two?"},
    {"role": "assistant", "content": "four."},
]
# ChatML with no {% generation %} tags: assistant turns must still be found (by rendering prefixes).
PLAIN_CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(CORPUS * 10, vocab_size=320)


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def supervised_runs(tok, row):
    """Decode each maximal run of labels != -100 (the text the loss is taken on)."""
    runs, current = [], []
    for label in row["labels"] + [-100]:
        if label != -100:
            current.append(label)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs


# ---------------------------------------------------------------- bad inputs, each with its message

def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl",
                       ['{"text": "ok"}', '{"text": "broken"', '{"text": "ok"}'])
    with pytest.raises(ValueError, match=r"d\.jsonl, line 2: not valid JSON"):
        load_examples(path)


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"text": "ok"}', '["text", "x"]'])
    with pytest.raises(TypeError, match=r"d\.jsonl, line 2: expected a JSON object.*got a list"):
        load_examples(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_dataset_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"empty\.jsonl: the dataset is empty"):
        load_examples(path)


def test_empty_list():
    with pytest.raises(ValueError, match="the dataset is empty"):
        load_examples([])


def test_missing_field_names_line_and_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"text": "ok"}', "", '{"txt": "typo"}'])
    with pytest.raises(ValueError, match=r"line 3 \(example 1\): no 'text'.*keys: \['txt'\]"):
        load_examples(path)


def test_prompt_without_completion():
    with pytest.raises(ValueError, match=r"example 0: field 'completion' is missing"):
        load_examples([{"prompt": "2+2="}])


def test_unknown_role_names_example_field_and_message():
    bad = [{"messages": CHAT},
           {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}]
    with pytest.raises(ValueError,
                       match=r"example 1: field 'messages': messages\[1\]\['role'\] is 'bot'"):
        load_examples(bad)


def test_non_string_content_names_example_and_message(tmp_path):
    line = json.dumps({"messages": [{"role": "user", "content": 42}]})
    path = write_jsonl(tmp_path / "d.jsonl", [line])
    with pytest.raises(TypeError,
                       match=r"line 1 \(example 0\): field 'messages': messages\[0\]\['content'\] "
                                        r"must be a str, got int"):
        load_examples(path)


def test_non_string_text_and_completion():
    with pytest.raises(TypeError, match=r"example 0: field 'text' must be a string, got int"):
        load_examples([{"text": 3}])
    with pytest.raises(TypeError,
                       match=r"example 0: field 'completion' must be a string, got list"):
        load_examples([{"prompt": "a", "completion": ["b"]}])


def test_mixed_formats_are_an_error():
    with pytest.raises(ValueError,
                       match=r"example 1: format conversational differs from example 0's"):
        load_examples([{"text": "a"}, {"messages": CHAT}])


def test_assistant_only_loss_needs_conversations(tok):
    with pytest.raises(ValueError, match="assistant_only_loss=True needs a conversational dataset"):
        prepare_dataset([{"text": "the cat"}], tok, assistant_only_loss=True)


def test_assistant_only_loss_chat_without_assistant_turn(tok):
    chats = [{"messages": CHAT}, {"messages": CHAT[:2]}]
    with pytest.raises(ValueError, match="example 1 has no assistant turn"):
        prepare_dataset(chats, tok, assistant_only_loss=True)


def test_jsonl_round_trip(tmp_path):
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d", "extra": 1}]
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    assert load_examples(path) == rows


def test_dataset_format_names():
    assert dataset_format({"text": "x"}) == "language_modeling"
    assert dataset_format({"body": "x"}, dataset_text_field="body") == "language_modeling"
    assert dataset_format({"prompt": "a", "completion": "b"}) == "prompt_completion"
    assert dataset_format({"messages": CHAT}) == "conversational"
    conv_pc = {"prompt": CHAT[:2], "completion": CHAT[2:3]}
    assert dataset_format(conv_pc) == "conversational_prompt_completion"


# ---------------------------------------------------------------- tokenization and masks

def test_language_modeling_appends_eos_once(tok):
    rows = prepare_dataset([{"text": "the cat"}, {"text": "the cat<|im_end|>"}], tok)
    expected = tok.encode("the cat") + [tok.eos_token_id]
    assert rows[0]["input_ids"] == expected == rows[1]["input_ids"]
    assert rows[0]["labels"] == rows[0]["input_ids"]  # no mask: every token is a target


def test_custom_eos_token_and_text_field(tok):
    rows = prepare_dataset([{"body": "the cat"}], tok, dataset_text_field="body",
                           eos_token="<|endoftext|>")
    assert rows[0]["input_ids"][-1] == tok.pad_token_id


def test_completion_only_masks_exactly_the_completion(tok):
    rows = prepare_dataset([{"prompt": "what is two plus two?", "completion": " four."}], tok)
    n_prompt = len(tok.encode("what is two plus two?"))
    assert rows[0]["labels"][:n_prompt] == [-100] * n_prompt
    assert -100 not in rows[0]["labels"][n_prompt:]
    assert supervised_runs(tok, rows[0]) == [" four.<|im_end|>"]


def test_prompt_merging_into_completion_warns_and_masks_from_the_divergence(tok):
    # "the cat " + "sat": the trailing space merges into " sat", so the prompt's last token is not
    # in prompt+completion; the completion mask starts where the two tokenizations diverge.
    with pytest.warns(UserWarning, match="not a prefix of the tokenized prompt"):
        rows = prepare_dataset([{"prompt": "the cat ", "completion": "sat"}], tok)
    assert tok.encode("the cat ")[-1] not in rows[0]["input_ids"]
    assert supervised_runs(tok, rows[0]) == [" sat<|im_end|>"]


def test_completion_only_loss_false_trains_on_prompt_too(tok):
    rows = prepare_dataset([{"prompt": "the cat", "completion": " sat"}], tok,
                           completion_only_loss=False)
    assert rows[0]["labels"] == rows[0]["input_ids"]


def test_conversational_prompt_completion_masks_the_reply(tok):
    example = {"prompt": CHAT[:2], "completion": CHAT[2:3]}
    rows = prepare_dataset([example], tok)
    assert rows[0]["input_ids"] == tok.apply_chat_template(CHAT[:3])
    assert supervised_runs(tok, rows[0]) == ["hello world<|im_end|>\n"]


def test_conversational_without_masks_trains_on_everything(tok):
    rows = prepare_dataset([{"messages": CHAT}], tok)
    assert rows[0]["labels"] == rows[0]["input_ids"] == tok.apply_chat_template(CHAT)


def test_assistant_only_masks_exactly_the_assistant_turns(tok):
    rows = prepare_dataset([{"messages": CHAT}], tok, assistant_only_loss=True)
    # Each assistant turn, with its end-of-turn token, and nothing of the system or user turns.
    assert supervised_runs(tok, rows[0]) == ["hello world<|im_end|>\n", "four.<|im_end|>\n"]
    # Independent check: the template's own {% generation %} spans give the same mask.
    tagged = tok.apply_chat_template(CHAT, return_assistant_tokens_mask=True)["assistant_masks"]
    assert [int(label != -100) for label in rows[0]["labels"]] == tagged


def test_assistant_only_works_without_generation_tags(tok):
    tagged = prepare_dataset([{"messages": CHAT}], tok, assistant_only_loss=True)
    tok.chat_template = PLAIN_CHATML  # same text, rendered through Jinja, no tags
    try:
        assert tok.render_chat(CHAT) == Tokenizer.train(CORPUS, 300).render_chat(CHAT)
        plain = prepare_dataset([{"messages": CHAT}], tok, assistant_only_loss=True)
    finally:
        tok.chat_template = CHATML_TEMPLATE
    assert plain == tagged


# ---------------------------------------------------------------- truncation, dropping

def test_truncation_keeps_the_start(tok):
    rows = prepare_dataset([{"text": "the cat sat on the mat."}], tok, max_length=3)
    assert rows[0]["input_ids"] == tok.encode("the cat sat on the mat.<|im_end|>")[:3]


def test_fully_masked_examples_are_dropped_with_a_warning(tok, caplog):
    long_prompt = {"prompt": "the cat sat on the mat. " * 4, "completion": " four."}
    short = {"prompt": "the cat", "completion": " sat"}
    with caplog.at_level(logging.WARNING, logger="nanosft.data"):
        rows = prepare_dataset([short, long_prompt, short], tok, max_length=8)
    assert len(rows) == 2 and all(r["input_ids"] == rows[0]["input_ids"] for r in rows)
    assert "dropped 1 of 3 examples" in caplog.text


def test_nothing_left_is_an_error(tok):
    long_prompt = {"prompt": "the cat sat on the mat. " * 4, "completion": " four."}
    with pytest.raises(ValueError, match=r"all 1 examples have labels that are all -100"):
        prepare_dataset([long_prompt], tok, max_length=8)


def test_pretokenized_rows_skip_tokenization(tok):
    rows = prepare_dataset([{"input_ids": [5, 6, 7, 8]}], tok, max_length=3)
    assert rows == [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}]


# ---------------------------------------------------------------- packing

def split_documents(row, key):
    out, start = [], 0
    for n in row["seq_lengths"]:
        out.append(tuple(row[key][start : start + n]))
        start += n
    return out


def test_packing_loses_no_token_and_no_example(tok):
    texts = [{"text": " ".join(["the cat sat"] * k)} for k in (1, 5, 2, 7, 3, 3, 1, 4)]
    unpacked = prepare_dataset(texts, tok, max_length=None)
    packed = prepare_dataset(texts, tok, packing=True, max_length=32)
    assert max(len(r["input_ids"]) for r in unpacked) <= 32  # so bfd truncates nothing here
    assert all(len(r["input_ids"]) <= 32 for r in packed)
    assert len(packed) < len(unpacked)
    for key in ("input_ids", "labels"):
        docs = sorted(d for r in packed for d in split_documents(r, key))
        assert docs == sorted(tuple(r[key]) for r in unpacked)


def test_bfd_matches_trl_docstring_examples():
    # trl.pack_dataset's own docstring: seq_length=4 on [[1..5], [6, 7], [8, 9, 10], [11]].
    rows = [{"input_ids": ids} for ids in ([1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11])]
    bfd = pack_dataset(rows, 4, "bfd")
    assert [r["input_ids"] for r in bfd] == [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]]
    assert [r["seq_lengths"] for r in bfd] == [[4], [3, 1], [2]]
    split = pack_dataset(rows, 4, "bfd_split")
    assert [r["input_ids"] for r in split] == [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]]
    assert [r["seq_lengths"] for r in split] == [[4], [3, 1], [2, 1]]


def test_bfd_picks_the_tightest_bin_not_the_first():
    # Into 8: [6] (room 2), [4] (room 4), 3 -> [4, 3] (room 1); the 1 goes to the room-1 bin
    # (best fit), where first-fit would put it beside the 6.
    rows = [{"input_ids": [i] * n} for i, n in enumerate([6, 4, 3, 1])]
    assert [r["seq_lengths"] for r in pack_dataset(rows, 8)] == [[6], [4, 3, 1]]


def test_bfd_ties_go_to_the_oldest_bin():
    # Into 8: [6] and [6] both have room 2; the first 2 joins the older bin, the second the other.
    rows = [{"input_ids": [i] * n} for i, n in enumerate([6, 6, 2, 2])]
    packed = pack_dataset(rows, 8)
    assert [r["input_ids"] for r in packed] == [[0] * 6 + [2] * 2, [1] * 6 + [3] * 2]


def test_bins_form_within_each_map_batch():
    rows = [{"input_ids": [7]} for _ in range(MAP_BATCH_SIZE + 1)]
    packed = pack_dataset(rows, 4 * MAP_BATCH_SIZE)  # one bin would hold all of them
    assert [len(r["seq_lengths"]) for r in packed] == [MAP_BATCH_SIZE, 1]


def test_wrapped_cuts_the_concatenation():
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7, 8, 9]}]
    assert [r["input_ids"] for r in pack_dataset(rows, 4, "wrapped")] == [[1, 2, 3, 4],
                                                                          [5, 6, 7, 8], [9]]


def test_packing_errors():
    with pytest.raises(ValueError, match="unknown packing strategy 'best'"):
        pack_dataset([{"input_ids": [1]}], 4, "best")
    with pytest.raises(ValueError, match="packing=True needs max_length"):
        prepare_dataset([{"input_ids": [1]}], None, packing=True, max_length=None)
