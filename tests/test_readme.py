"""README statements a new user tries, checked against the code they describe.

Compared: the demo output block's first line and trainable-parameter count against the values the
demo computes now (its parameter count as transformers counts a 4-bit model: packed weights
twice); the prose parameter count against the same number; the shipped model folder the README
names against the package's; the README's `train` / `generate` / `merge` commands on that folder,
run as written (fewer steps, folders under tmp_path); scripts/readme_demo_output.py's trimming on
a captured run, and that the README's block is what it writes.
Hermetic: the tiny default model (nanosft/cli/assets/default), CPU, files under tmp_path.
Run: python -m pytest -q tests/test_readme.py
"""

import importlib.util
import os
import re
import shlex

import pytest
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.cli import demo, main
from nanosft.peft import get_peft_model
from nanosft.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as _f:
    README = _f.read()


def _script():
    spec = importlib.util.spec_from_file_location(
        "readme_demo_output", os.path.join(ROOT, "scripts", "readme_demo_output.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _demo_block():
    return README.split("<!-- demo output -->")[1].split("<!-- /demo output -->")[0]


def test_the_demo_block_states_todays_counts():
    model = demo.load_demo_model(demo.DEFAULT_DIR, "qlora", "cpu")
    tokenizer = Tokenizer.from_pretrained(demo.DEFAULT_DIR)
    pairs = demo.held_out_prompts(os.path.join(demo.DEFAULT_DIR, demo.EVAL_FILE))
    first = (f"nanosft demo: qlora SFT of the embedded default ({model.num_parameters():,} "
             f"parameters, {len(tokenizer)} tokens) on cpu; {len(pairs)} held-out prompts")
    block = _demo_block()
    assert first in block
    assert f"({round(model.num_parameters() / 1000)}k\nparameters" in README
    # the float base counts the same: a packed NF4 weight holds two values a byte
    assert demo.load_demo_model(demo.DEFAULT_DIR, "lora", "cpu").num_parameters() == \
        model.num_parameters()
    wrapped = get_peft_model(model, demo.demo_peft_config("qlora"))
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert f"Number of trainable parameters = {trainable:,}" in block


def test_the_script_trims_a_captured_run_to_the_readme_block():
    script = _script()
    stdout = ("nanosft demo: qlora SFT\n{'loss': 1.0}\n  Memory predicted = 1\n"
              "{'train_runtime': 1.0}\n\nheld-out prompt   expected\n-----\n"
              + "".join(f"What is {i} plus 1?   {i + 1}\n" for i in range(4))
              + "\nheld-out exact match: 1\nloss curve: x\n")
    stderr = "  0%|  | 0/2\r100%|##| 2/2 [00:01<00:00]\r100%|##| 2/2 [00:02<00:00]\n"
    assert script.trim(stdout, stderr).splitlines() == [
        "nanosft demo: qlora SFT", "100%|##| 2/2 [00:02<00:00]", "{'train_runtime': 1.0}", "",
        "held-out prompt   expected", "-----", "What is 0 plus 1?   1", "What is 1 plus 1?   2",
        "...", "", "held-out exact match: 1"]
    block = _demo_block().strip().removeprefix("```").removesuffix("```").strip("\n")
    assert script.replace_block(README, block) == README  # the block is the script's format


def test_the_readme_commands_on_the_shipped_folder_run(tmp_path, capsys, monkeypatch):
    assert os.path.join("nanosft", "cli", "assets", "default") in demo.DEFAULT_DIR
    assert "nanosft/cli/assets/default" in README
    commands = re.search(r'DEFAULT=\$\(python -c "from nanosft.cli import demo; '
                         r'print\(demo.DEFAULT_DIR\)"\)\n(.+?)```', README, re.S)[1]
    monkeypatch.chdir(tmp_path)
    for command in commands.replace("\\\n", " ").splitlines():
        words = shlex.split(command.replace("$DEFAULT", demo.DEFAULT_DIR))
        assert words[0] == "nanosft"
        if "--max_steps" in words:
            words[words.index("--max_steps") + 1] = "2"  # the README's run, shorter
        assert main(words[1:]) == 0, capsys.readouterr().err
    assert (tmp_path / "runs" / "sums-merged" / "model.safetensors").is_file()


def test_fp4_is_refused_by_auto_model_and_quantized_by_causal_lm():
    from nanosft.families.auto import AutoModelForCausalLM
    from nanosft.model import CausalLM
    from nanosft.nf4 import BitsAndBytesConfig

    assert "refused there by name, since a QLoRA script means NF4" in " ".join(README.split())
    with pytest.raises(ValueError, match="fp4"):  # transformers' default quant type
        AutoModelForCausalLM.from_pretrained(
            demo.DEFAULT_DIR, quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    model = CausalLM.from_pretrained(demo.DEFAULT_DIR, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="fp4"))
    assert {m.quant_type for m in model.modules() if hasattr(m, "quant_type")} == {"fp4"}


def test_the_cpu_torch_install_is_a_command():
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in README
