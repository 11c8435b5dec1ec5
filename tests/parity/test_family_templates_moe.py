"""The chat templates TRL ships for gpt-oss (harmony), GLM-4-MoE and Cohere 2: nanosft's Jinja
rendering equals transformers', and assistant_only_loss with the gpt-oss, GLM-4-MoE and Cohere 2
templates gives TRL's labels; for Cohere 2 also TRL SFTTrainer's per-step loss (a tiny random
Cohere 2, fp32, 3 full fine-tuning steps, atol 1e-5). Cohere 2's chats carry a ~2,300-character
system preamble: its tokenizer (a BPE of 1,024 trained with that text) keeps them ~450 tokens, so
TRL's max_length 1024 cuts no reply.

Each official template from trl/chat_templates is saved with a byte-level BPE trained in
test_family_chat_templates (its helpers, with these families' special tokens) into a tokenizer
folder both stacks load; compared exactly: the rendered text and token ids of its chats, and of
its prompts with add_generation_prompt; assistant masks against transformers'
return_assistant_tokens_mask and labels against TRL SFTTrainer's train_dataset.
Hermetic: nothing downloaded; skipped if the installed TRL lacks a template.
Run: python -m pytest -q tests/parity/test_family_templates_moe.py
"""

import re

import datasets
import pytest
import test_family_chat_templates as templates
import torch
import transformers
import trl
from test_families import save_random
from test_family_sft import ARGS as SFT_ARGS
from test_family_sft import KEYS, train_logs
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.args import SFTConfig
from nanosft.data import prepare_dataset
from nanosft.families.auto import AutoModelForCausalLM
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer

SPECIALS = {  # name: (special tokens, (bos, eos, pad))
    "gptoss": (["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
                "<|channel|>", "<|return|>", "<|constrain|>", "<|call|>"],
               ("<|startoftext|>", "<|return|>", "<|endoftext|>")),
    "glm4moe": (["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                 "<|observation|>", "<think>", "</think>"],
                (None, "<|endoftext|>", "<|endoftext|>")),
    "cohere2": (["<PAD>", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>",
                 "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>",
                 "<|END_RESPONSE|>"], ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<PAD>")),
}
OPENS = {"gptoss": "<|start|>assistant", "glm4moe": "<|assistant|>",
         "cohere2": "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"}


@pytest.mark.parametrize("family", list(SPECIALS))
def test_official_template_renders_as_transformers(family, tmp_path, monkeypatch):
    monkeypatch.setitem(templates.FAMILIES, family, SPECIALS[family])
    ours, theirs = templates.folder_with(family, f"{family}.jinja", tmp_path)
    for chat in templates.CHATS:
        templates.assert_renders_equal(ours, theirs, chat)
    for chat in templates.PROMPTS:
        text = templates.assert_renders_equal(ours, theirs, chat, add_generation_prompt=True)
        assert OPENS[family] in text[-60:]  # the prompt ends by opening the assistant's turn


@pytest.mark.parametrize("family", ["gptoss", "glm4moe"])
def test_training_template_assistant_masks_and_labels_equal_trl(family, tmp_path, monkeypatch):
    """TRL's *_training.jinja with {% generation %} markers: harmony renders the last assistant
    turn differently from earlier ones (no prefix renders inside the whole chat), so nanosft takes
    the marked spans, as transformers does: masks equal transformers', labels equal TRL's."""
    monkeypatch.setitem(templates.FAMILIES, family, SPECIALS[family])
    templates.test_assistant_only_loss_masks_equal_transformers_and_trl(family, tmp_path)


def cohere2_folder(template_file, tmp_path):
    """(nanosft, transformers) tokenizers for Cohere 2. Its template renders a ~2,300-character
    system preamble into every chat: a byte-level BPE of 330 over CORPUS alone spells a chat in
    ~1,800 ids, so TRL's max_length 1024 cuts every assistant token; one of 1,024 trained with
    the preamble's text too spells it in ~450."""
    template = templates.template_text(template_file)
    preamble = re.sub(r"\{[{%#].*?[}%#]\}", " ", template, flags=re.S)  # the text outside tags
    specials, (bos, eos, pad) = SPECIALS["cohere2"]
    tok = Tokenizer.train(templates.CORPUS + [preamble], vocab_size=1024, special_tokens=specials,
                          bos_token=bos, eos_token=eos, pad_token=pad)
    tok.chat_template = template
    folder = tmp_path / template_file.removesuffix(".jinja")
    tok.save_pretrained(folder)
    return Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


def assistant_tokens(rows):
    return [[t for t in row["labels"] if t != -100] for row in rows]


@pytest.mark.parametrize("template_file", ["cohere2_training.jinja", "cohere2.jinja"])
def test_cohere2_assistant_only_labels_equal_trl(template_file, tmp_path):
    """With the training template (its {% generation %} spans) and with the official one (nanosft
    renders prefixes, TRL swaps in cohere2_training.jinja): TRL's labels, each chat's replies
    (with <|END_RESPONSE|><|END_OF_TURN_TOKEN|>) trained on, nothing truncated."""
    ours, theirs = cohere2_folder(template_file, tmp_path)
    examples = [{"messages": chat} for chat in templates.CHATS]
    rows = [{k: r[k] for k in ("input_ids", "labels")}
            for r in prepare_dataset(examples, ours, assistant_only_loss=True)]
    assert rows == templates.trl_labels(theirs, examples, tmp_path)
    assert all(len(r["input_ids"]) < 1024 for r in rows)  # under TRL's max_length: no cut
    ends = ours.convert_tokens_to_ids(["<|END_RESPONSE|>", "<|END_OF_TURN_TOKEN|>"])
    for chat, labels in zip(templates.CHATS, assistant_tokens(rows)):
        replies = [m["content"] for m in chat if m["role"] == "assistant"]
        assert labels == [t for text in replies
                          for t in ours.encode(text, add_special_tokens=False) + ends]


def test_cohere2_assistant_only_sft_losses_equal_trl(tmp_path):
    """A tiny random Cohere 2 (vocabulary the tokenizer's, a sliding and a full layer, logit_scale
    0.5) trained 3 full fine-tuning steps (fp32) by TRL's SFTTrainer and nanosft's on the same
    chats from the official template, assistant_only_loss=True: the same train rows, and per step
    the loss, grad_norm and learning_rate within 1e-5 (test_family_sft's tolerance)."""
    ours_tok, theirs_tok = cohere2_folder("cohere2.jinja", tmp_path)
    config = transformers.Cohere2Config(
        vocab_size=len(theirs_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        sliding_window=5, layer_types=["sliding_attention", "full_attention"], logit_scale=0.5,
        pad_token_id=theirs_tok.pad_token_id, bos_token_id=theirs_tok.bos_token_id,
        eos_token_id=theirs_tok.eos_token_id)
    _, folder = save_random(config, tmp_path)
    chats = [{"messages": chat} for chat in templates.CHATS * 2]
    args = {**SFT_ARGS, "gradient_accumulation_steps": 1, "assistant_only_loss": True}
    ref = trl.SFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        args=trl.SFTConfig(str(tmp_path / "ref"), **args), processing_class=theirs_tok,
        train_dataset=datasets.Dataset.from_list(chats))
    ours = SFTTrainer(AutoModelForCausalLM.from_pretrained(folder),
                      SFTConfig(str(tmp_path / "ours"), **args),
                      train_dataset=chats, processing_class=ours_tok)
    want = [{k: r[k] for k in ("input_ids", "labels")} for r in ref.train_dataset]
    assert [{k: r[k] for k in ("input_ids", "labels")} for r in ours.train_dataset] == want
    # the replies only: the preamble and user turns (most of each row) carry no loss
    assert all(0 < sum(t != -100 for t in r["labels"]) < len(r["labels"]) / 4 for r in want)
    ref_logs, our_logs = train_logs(ref), train_logs(ours)
    assert [h["step"] for h in our_logs] == [h["step"] for h in ref_logs] == [1, 2, 3]
    for a, b in zip(our_logs, ref_logs):
        for key in KEYS:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5,
                                       msg=f"step {a['step']} {key}")
    assert our_logs[-1]["loss"] != our_logs[0]["loss"]
    worst = {key: max(abs(a[key] - b[key]) for a, b in zip(our_logs, ref_logs)) for key in KEYS}
    print("\n[cohere2] assistant-only SFT, 3 steps: max |diff| " +
          ", ".join(f"{key} {value:.2e}" for key, value in worst.items()))
