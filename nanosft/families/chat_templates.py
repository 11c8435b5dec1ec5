"""Training variants of a family's official chat template, for assistant-only loss.

Some official templates render a chat so that an earlier prefix is not a prefix of the whole
(Qwen3 drops the reasoning of the assistant turns before the last user query, and writes a
`<think>` block only in the turns after it), so assistant turns cannot be located by rendering
prefixes. TRL then swaps in a prefix-preserving training variant with `{% generation %}` markers
(trl.chat_template_utils.get_training_chat_template), used to tokenize the dataset only: the
tokenizer keeps its template. nanosft recognizes the same official templates (by their SHA-256,
the text being the model's own) and derives the same variant from the template it is given.
"""

import hashlib
import re

# Qwen3's official template (Qwen/Qwen3-*): the assistant branch picks, by the turn's place
# against the last user query, whether a <think> block is written. The training variant writes one
# in every assistant turn and marks the turn, its end-of-turn token included, for the loss.
_QWEN3_CHOICE = "{%- if loop.index0 > ns.last_query_index %}"
_QWEN3_TURN = ("{{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}"
               "{{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
               "content.lstrip('\\n') }}")
_END_OF_TURN = "{{- '<|im_end|>\\n' }}"


def _block_end(template, start):
    """Index just past the `{% endif %}` closing the `{% if %}` tag at `start`."""
    depth = 0
    for tag in re.finditer(r"\{%-?\s*(if|endif)\b.*?%\}", template[start:]):
        depth += 1 if tag.group(1) == "if" else -1
        if depth == 0:
            return start + tag.end()
    raise ValueError("unbalanced {% if %} in the chat template")


def qwen3_training_template(template):
    """Qwen3's template with a <think> block in every assistant turn (prefix-preserving) and each
    assistant turn, through its `<|im_end|>`, inside {% generation %}.
    Mirrors: trl qwen3_training.jinja (what TRL swaps in for qwen3.jinja)"""
    start = template.index(_QWEN3_CHOICE)
    end = _block_end(template, start)
    close = template.index(_END_OF_TURN, end) + len(_END_OF_TURN)  # the assistant turn's end
    return (template[:start] + _QWEN3_TURN + template[end:close] + "{%- endgeneration %}"
            + template[close:])


# SHA-256 of an official template -> (its name, the function deriving its training variant)
TRAINING_VARIANTS = {
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8":
        ("Qwen3", qwen3_training_template),
}


def training_chat_template(template):
    """The training variant TRL swaps in for `template` under assistant_only_loss, or None when
    nanosft's rendering of prefixes locates the assistant turns as it is (a template with
    {% generation %} markers, or one nanosft knows no variant of).
    Mirrors: trl get_training_chat_template
    Differs: an unknown template is not refused here: data.assistant_char_spans refuses it if
    its prefixes do not render inside the whole chat."""
    if not isinstance(template, str) or re.search(r"\{%-?\s*generation\s*-?%\}", template):
        return None
    known = TRAINING_VARIANTS.get(hashlib.sha256(template.encode()).hexdigest())
    return None if known is None else known[1](template)
