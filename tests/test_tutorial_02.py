"""Runs tutorials/02_sfttrainer_init.py as a user would and checks what SFTTrainer.__init__ is shown
to do.

Compared: exit code 0 (the script asserts the SFTConfig defaults, the QLoRA dtypes, the labels of
each dataset format, the collator choice, and TRL's prepared rows when trl is installed) and the
printed rows: text trains on every token, prompt/completion only on the completion plus EOS, packing
switches to a padding-free collator whose position_ids restart per document. Hermetic: a tokenizer
trained on a few sentences, tiny models, hand-written examples; no network.
Run: python -m pytest -q tests/test_tutorial_02.py
"""

import re

from run_tutorial import assert_reference_ran, run_tutorial


def test_tutorial_02_sfttrainer_init():
    out = run_tutorial("02_sfttrainer_init.py")
    assert "learning_rate            SFTConfig 2e-05  TrainingArguments 5e-05" in out
    assert "q_proj.lora_A.default.weight torch.bfloat16" in out
    assert "lora_magnitude_vector.default.weight torch.float32" in out
    assert "base layer of q_proj: Linear4bit" in out
    # prompt/completion row: the prompt is printed bare (masked), the completion and EOS in
    # [brackets]
    row = re.search(r"'What is two plus two\?((?:\[[^\]]*\])+)'", out)
    assert row and "".join(re.findall(r"\[([^\]]*)\]", row.group(1))) == " Four." + "<|im_end|>"
    assert "prompt_completion: completion_only_loss=True" in out
    assert "padding_free=False); rows 2" in out and "padding_free=True); rows 1" in out
    assert (
        "position_ids [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1," in out
    )  # restart at the second document
    assert out.count("TRL rows == nanosft rows: True") == 3  # one per dataset format
    assert_reference_ran(out, "trl SFTTrainer dataset preparation")
    assert "OK: walkthrough 2.1 checked" in out
