"""The chat templates TRL ships for gpt-oss (harmony), GLM-4-MoE and Cohere 2: nanosft's Jinja
rendering equals transformers', and assistant_only_loss with the gpt-oss and GLM-4-MoE training
templates gives TRL's labels.

Each official template from trl/chat_templates is saved with a byte-level BPE trained in
test_family_chat_templates (its helpers, with these families' special tokens) into a tokenizer
folder both stacks load; compared exactly: the rendered text and token ids of its chats, and of
its prompts with add_generation_prompt; assistant masks against transformers'
return_assistant_tokens_mask and labels against TRL SFTTrainer's train_dataset.
Hermetic: nothing downloaded; skipped if the installed TRL lacks a template.
Run: python -m pytest -q tests/parity/test_family_templates_moe.py
"""

import pytest
import test_family_chat_templates as templates

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
