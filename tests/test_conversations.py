"""Conversation rows beyond role/content: ShareGPT conversion, tools and template variables.

Checked: a ShareGPT row becomes a messages row with its other fields kept (and the from/value
keys of prompt/completion lists renamed too); a row's `tools` JSON string and
`chat_template_kwargs` reach the template; bad values are refused naming the field and the fix.
Parity with TRL on the same rows: tests/parity/test_conversation_parity.py. Hermetic, CPU.
Run: python -m pytest -q tests/test_conversations.py
"""

import pytest

from nanosft.data import (chat_template_kwargs, is_conversational_from_value, load_examples,
                          maybe_convert_to_chatml, prepare_dataset)
from nanosft.tokenizer import Tokenizer

TEMPLATE = ("{%- if tools %}{{ 'TOOLS ' + (tools | tojson) + '\\n' }}{%- endif %}"
            "{%- if greeting is defined %}{{ greeting + '\\n' }}{%- endif %}"
            "{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>\\n' }}"
            "{%- endfor %}")


def test_sharegpt_row_converted_as_trl_does():
    row = {"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "yo"}],
           "id": 7}
    assert is_conversational_from_value(row)
    assert not is_conversational_from_value({"conversations": [{"role": "user", "content": "x"}]})
    converted = maybe_convert_to_chatml(row)
    assert list(converted) == ["id", "messages"]  # "conversations" dropped, "messages" added last
    assert converted["messages"] == [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "yo"}]
    assert row["conversations"][0] == {"from": "user", "value": "hi"}  # the caller's row untouched
    prompt = {"prompt": [{"from": "user", "value": "q"}], "completion": [{"from": "assistant",
                                                                          "value": "a"}]}
    assert maybe_convert_to_chatml(prompt)["prompt"] == [{"role": "user", "content": "q"}]
    assert load_examples([row])[0]["messages"][1] == {"role": "assistant", "content": "yo"}


def test_tools_string_and_template_variables_reach_the_template():
    tok = Tokenizer.train(["hello world tools"] * 4, vocab_size=300)
    tok.chat_template = TEMPLATE
    row = {"messages": [{"role": "user", "content": "hi"}], "tools": '[{"name": "f"}]',
           "chat_template_kwargs": {"greeting": "hey"}}
    assert chat_template_kwargs(row) == {"tools": [{"name": "f"}], "greeting": "hey"}
    ids = prepare_dataset([row], tok, max_length=None)[0]["input_ids"]
    assert tok.decode(ids) == 'TOOLS [{"name": "f"}]\nhey\nuser: hi<|im_end|>\n'
    plain = prepare_dataset([{"messages": row["messages"]}], tok, max_length=None)[0]
    assert tok.decode(plain["input_ids"]) == "user: hi<|im_end|>\n"  # negative control


@pytest.mark.parametrize("row,error,match", [
    ({"tools": "[{'name': 1}]"}, ValueError, "field 'tools' is a string but not JSON"),
    ({"chat_template_kwargs": "greeting=hi"}, TypeError,
     "'chat_template_kwargs' must be a dict"),
])
def test_bad_tools_and_template_variables_are_refused(row, error, match):
    with pytest.raises(error, match=match):
        chat_template_kwargs(row)


def test_sharegpt_human_gpt_roles_get_the_mapping_hint():
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    with pytest.raises(ValueError, match="map them to 'user' / 'assistant'"):
        load_examples([row])
