"""Conversations beyond role/content text, prepared by nanosft and by TRL 1.16 on the same rows.

Compared exactly (input_ids, labels): tool calling (an assistant message with `tool_calls` and no
content, `tool` messages, a `tools` column as a list and as a JSON string, rendered by a template
that prints both), ShareGPT rows (`conversations` of from/value, converted to messages), per-row
`chat_template_kwargs`, and assistant_only_loss over tool calls. TRL runs its own
SFTTrainer._prepare_dataset on a datasets.Dataset of the rows, with transformers' tokenizer read
from the same folder; nanosft prepares both that Dataset (its Arrow rows carry None for absent
keys) and the plain lists. Hermetic: a BPE trained here, a 1-layer Llama TRL needs to construct.
Run: python -m pytest -q tests/parity/test_conversation_parity.py
"""

import json
import types

import datasets
import pytest
from test_tokenizer_protocol_parity import CORPUS, TOOL_CHAT, TOOL_TEMPLATE, TOOLS

from nanosft.data import prepare_dataset
from nanosft.tokenizer import Tokenizer

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "rome"}}}
TOOL_ROWS = [
    {"messages": TOOL_CHAT, "tools": TOOLS},
    {"messages": [{"role": "user", "content": "rome?"},
                  {"role": "assistant", "content": "let me look.", "tool_calls": [CALL]},
                  {"role": "tool", "content": "rain"},
                  {"role": "assistant", "content": "rain in rome."}], "tools": TOOLS},
]
SHAREGPT = [
    {"conversations": [{"from": "system", "value": "be brief"},
                       {"from": "user", "value": "hello world"},
                       {"from": "assistant", "value": "the cat sat."}], "source": "a"},
    {"conversations": [{"from": "user", "value": "two plus two?"},
                       {"from": "assistant", "value": "four."}], "source": "b"},
]
KWARGS_ROWS = [
    {"messages": TOOL_CHAT[:1] + [TOOL_CHAT[3]], "chat_template_kwargs": {"greeting": "hi"}},
    {"messages": TOOL_CHAT[:1] + [TOOL_CHAT[3]], "chat_template_kwargs": {"greeting": "yo"}},
]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    folder = str(tmp_path_factory.mktemp("tok"))
    tok = Tokenizer.train(CORPUS, vocab_size=330)
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(folder)
    return types.SimpleNamespace(dir=folder, hf=AutoTokenizer.from_pretrained(folder),
                                 tok=Tokenizer.from_pretrained(folder))


def trl_rows(ref, rows, **config):
    """TRL's own preparation: SFTTrainer.__init__ -> _prepare_dataset; its input_ids / labels."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(ref.hf), hidden_size=16,
                                         intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    args = SFTConfig(output_dir=ref.dir, report_to="none", use_cpu=True, bf16=False,
                     max_steps=1, **config)
    trainer = SFTTrainer(model=model, args=args, processing_class=ref.hf,
                         train_dataset=datasets.Dataset.from_list(rows))
    return [{k: row[k] for k in ("input_ids", "labels")} for row in trainer.train_dataset]


def assert_prepared_like_trl(ref, rows, **config):
    theirs = trl_rows(ref, rows, **config)
    for given in (rows, datasets.Dataset.from_list(rows)):  # plain lists, and Arrow's rows
        ours = prepare_dataset(given, ref.tok, **config)
        assert [{k: r[k] for k in ("input_ids", "labels")} for r in ours] == theirs
    return theirs


def test_tool_calls_and_tools_column(ref):
    theirs = assert_prepared_like_trl(ref, TOOL_ROWS)
    text = ref.tok.decode(theirs[0]["input_ids"])
    assert '"name": "get_weather"' in text and "<tool_call>" in text  # tools and calls rendered


def test_tools_as_a_json_string(ref):
    rows = [{**row, "tools": json.dumps(row["tools"])} for row in TOOL_ROWS]
    assert assert_prepared_like_trl(ref, rows) == trl_rows(ref, TOOL_ROWS)


def test_assistant_only_loss_over_tool_calls(ref):
    theirs = assert_prepared_like_trl(ref, TOOL_ROWS, assistant_only_loss=True)
    trained = ref.tok.decode([t for t in theirs[0]["labels"] if t != -100])
    assert "<tool_call>" in trained and "weather in paris" not in trained


def test_sharegpt_rows_become_messages(ref):
    theirs = assert_prepared_like_trl(ref, SHAREGPT, max_length=None)
    assert ref.tok.decode(theirs[0]["input_ids"]).startswith("<|im_start|>system\nbe brief")


def test_per_row_chat_template_kwargs(ref):
    theirs = assert_prepared_like_trl(ref, KWARGS_ROWS)
    assert ref.tok.decode(theirs[0]["input_ids"]).startswith("hi\n")
    assert ref.tok.decode(theirs[1]["input_ids"]).startswith("yo\n")
