"""Chat templates of the families beyond Llama: nanosft's Jinja rendering against transformers'
and its assistant-only loss masks against TRL's.

The templates are the official ones TRL ships in trl/chat_templates (Qwen3: `<think>` blocks,
reasoning dropped from turns before the last user query, `enable_thinking`; Gemma 3: no system
role, the system message folded into the first user turn, `raise_exception` on a bad role order)
and their `_training` variants with `{% generation %}` markers. Each is saved with a byte-level
BPE trained here into a tokenizer folder that both stacks load (nanosft Tokenizer.from_pretrained,
transformers AutoTokenizer). Compared exactly: the rendered text and its token ids with and without
add_generation_prompt (and enable_thinking=False), the refusal of a bad role order, the assistant
masks against transformers' return_assistant_tokens_mask, and the labels of
`prepare_dataset(..., assistant_only_loss=True)` against TRL SFTTrainer's train_dataset (also from
Gemma 3's official template, where nanosft renders prefixes and TRL swaps in its training variant;
and from Qwen3's, where nanosft's SFTTrainer swaps in the same variant, derived from the official
template, rendering and masking as TRL's qwen3_training.jinja, tool calls included).
Hermetic: nothing downloaded; skipped if the installed TRL lacks the templates.
Run: python -m pytest -q tests/parity/test_family_chat_templates.py
"""

import os

import datasets
import jinja2
import pytest
import transformers
import trl

from nanosft.data import prepare_dataset
from nanosft.tokenizer import Tokenizer

TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
CORPUS = ["What is two plus two? Four. And three plus three? Six.",
          "Add them. Again, add them. Be brief and think first."] * 4
FAMILIES = {  # name: (special tokens, (bos, eos, pad))
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
              (None, "<|im_end|>", "<|endoftext|>")),
    "gemma3": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
               ("<bos>", "<eos>", "<pad>")),
}
SYSTEM = {"role": "system", "content": "Be brief."}
CHATS = [
    [{"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nFour."}],
    # two turns: Qwen3 drops the first turn's reasoning (it precedes the last user query)
    [SYSTEM, {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nFour."},
     {"role": "user", "content": "And three plus three?"},
     {"role": "assistant", "content": "<think>\nAgain, add them.\n</think>\n\nSix."}],
    [SYSTEM, {"role": "user", "content": "  What is two plus two?  "},
     {"role": "assistant", "content": "Four."}],
]
PROMPTS = [[{"role": "user", "content": "What is two plus two?"}],
           [SYSTEM, {"role": "user", "content": "And three plus three?"}]]


def template_text(name):
    path = os.path.join(TEMPLATES, name)
    if not os.path.exists(path):
        pytest.skip(f"the installed trl has no {name}")
    with open(path) as f:
        return f.read()


def folder_with(family, template_file, tmp_path):
    """(nanosft, transformers) tokenizers read from one folder holding `template_file`."""
    specials, (bos, eos, pad) = FAMILIES[family]
    tok = Tokenizer.train(CORPUS, vocab_size=330, special_tokens=specials, bos_token=bos,
                          eos_token=eos, pad_token=pad)
    tok.chat_template = template_text(template_file)
    folder = tmp_path / template_file.removesuffix(".jinja")
    tok.save_pretrained(folder)
    return Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


def assert_renders_equal(ours, theirs, chat, **kwargs):
    text = ours.apply_chat_template(chat, tokenize=False, **kwargs)
    assert text == theirs.apply_chat_template(chat, tokenize=False, **kwargs)
    ids = ours.apply_chat_template(chat, **kwargs)
    assert ids == theirs.apply_chat_template(chat, return_dict=False, **kwargs)
    return text


@pytest.mark.parametrize("family", list(FAMILIES))
def test_official_template_renders_as_transformers(family, tmp_path):
    ours, theirs = folder_with(family, f"{family}.jinja", tmp_path)
    for chat in CHATS:
        assert_renders_equal(ours, theirs, chat)
    for chat in PROMPTS:
        text = assert_renders_equal(ours, theirs, chat, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n" if family == "qwen3" else
                             "<start_of_turn>model\n")
    two_turns = assert_renders_equal(ours, theirs, CHATS[1])
    if family == "qwen3":
        assert "Add them." not in two_turns and "<think>\nAgain, add them.\n</think>" in two_turns
        off = assert_renders_equal(ours, theirs, PROMPTS[0], add_generation_prompt=True,
                                   enable_thinking=False)
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:  # no system role: the system text opens the first user turn
        assert two_turns.startswith("<bos><start_of_turn>user\nBe brief.\n\nWhat is two")
        assert "system" not in two_turns


def test_gemma3_refuses_a_bad_role_order_as_transformers(tmp_path):
    ours, theirs = folder_with("gemma3", "gemma3.jinja", tmp_path)
    bad = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        ours.apply_chat_template(bad, tokenize=False)


def trl_labels(tokenizer, examples, tmp_path):
    """TRL's own preparation: SFTTrainer.__init__ -> _prepare_dataset (the model never runs)."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True,
                         bf16=False, max_steps=1, assistant_only_loss=True)
    trainer = trl.SFTTrainer(model=model, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(examples))
    return [{"input_ids": row["input_ids"], "labels": row["labels"]}
            for row in trainer.train_dataset]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_assistant_only_loss_masks_equal_transformers_and_trl(family, tmp_path):
    ours, theirs = folder_with(family, f"{family}_training.jinja", tmp_path)
    for chat in CHATS:
        got = ours.apply_chat_template(chat, return_assistant_tokens_mask=True)
        want = theirs.apply_chat_template(chat, return_assistant_tokens_mask=True,
                                          return_dict=True)
        assert got["input_ids"] == want["input_ids"]
        assert got["assistant_masks"] == want["assistant_masks"]
        assert 0 < sum(got["assistant_masks"]) < len(got["input_ids"])  # the mask did something
    examples = [{"messages": chat} for chat in CHATS]
    rows = prepare_dataset(examples, ours, assistant_only_loss=True)
    assert [{k: r[k] for k in ("input_ids", "labels")} for r in rows] == trl_labels(
        theirs, examples, tmp_path)


def test_gemma3_official_template_masks_by_prefixes_equal_trl(tmp_path):
    # No {% generation %} here: nanosft finds each assistant turn by rendering prefixes; TRL swaps
    # in its gemma3_training.jinja (get_training_chat_template). The labels must still agree.
    ours, theirs = folder_with("gemma3", "gemma3.jinja", tmp_path)
    examples = [{"messages": chat} for chat in CHATS]
    rows = prepare_dataset(examples, ours, assistant_only_loss=True)
    assert [{k: r[k] for k in ("input_ids", "labels")} for r in rows] == trl_labels(
        theirs, examples, tmp_path)


def nanosft_labels(tokenizer, examples, tmp_path):
    """nanosft's SFTTrainer preparation of the same examples (the model never runs)."""
    from nanosft.args import SFTConfig
    from nanosft.model import CausalLM, ModelConfig
    from nanosft.sft import SFTTrainer

    model = CausalLM(ModelConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2))
    args = SFTConfig(output_dir=str(tmp_path / "nanosft"), use_cpu=True, bf16=False, max_steps=1,
                     assistant_only_loss=True)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=examples)
    assert tokenizer.chat_template == template_text("qwen3.jinja")  # the tokenizer keeps its own
    return [{"input_ids": row["input_ids"], "labels": row["labels"]}
            for row in trainer.train_dataset]


TOOL_CHAT = [  # a tool call after reasoning, its response, the answer
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "<think>\nAsk the tool.\n</think>\n\n",
     "tool_calls": [{"type": "function", "function": {"name": "add",
                                                      "arguments": {"a": 2, "b": 2}}}]},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "Four."}]


def test_qwen3_training_variant_is_trls(tmp_path):
    # Qwen3's template drops earlier turns' reasoning, so its prefixes do not render inside the
    # whole chat: TRL swaps in qwen3_training.jinja; nanosft derives the same variant from the
    # tokenizer's own template. Rendered text and assistant masks equal TRL's file's.
    from nanosft.families.chat_templates import training_chat_template

    official, _ = folder_with("qwen3", "qwen3.jinja", tmp_path)
    training, theirs = folder_with("qwen3", "qwen3_training.jinja", tmp_path)
    variant = training_chat_template(official.chat_template)
    assert variant is not None and variant != official.chat_template
    assert training_chat_template(variant) is None  # it has {% generation %} markers
    for chat in [*CHATS, TOOL_CHAT]:
        want = training.apply_chat_template(chat, return_assistant_tokens_mask=True)
        got = official.apply_chat_template(chat, return_assistant_tokens_mask=True,
                                           chat_template=variant)
        assert got == want
        assert 0 < sum(got["assistant_masks"]) < len(got["input_ids"])
    with_prompt = official.apply_chat_template(PROMPTS[1], add_generation_prompt=True,
                                               chat_template=variant, enable_thinking=False)
    assert with_prompt == training.apply_chat_template(PROMPTS[1], add_generation_prompt=True,
                                                       enable_thinking=False)


def test_qwen3_official_template_under_assistant_only_loss_gives_trls_labels(tmp_path):
    # SFTTrainer swaps the variant in for tokenizing, as TRL's does: the labels equal TRL's from
    # the official template. prepare_dataset alone (no swap) still refuses, naming the fix.
    official, theirs = folder_with("qwen3", "qwen3.jinja", tmp_path)
    examples = [{"messages": chat} for chat in CHATS]
    want = trl_labels(theirs, examples, tmp_path)
    assert nanosft_labels(official, examples, tmp_path) == want
    with pytest.raises(ValueError, match="chat_template_path"):
        prepare_dataset(examples, official, assistant_only_loss=True)
