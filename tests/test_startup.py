"""Start-up stays cheap: what `import nanosft`, `import nanosft.sft` and `nanosft --help` load.

Compared, each in a fresh interpreter (a subprocess, so nothing this test process imported counts):
`import nanosft.sft` leaves bitsandbytes unimported (its import pulls in torch._dynamo: seconds),
while building one NF4 layer does import it (the negative control: the check can see it);
`nanosft --help`, `nanosft`, `nanosft --bogus demo` and `nanosft demo --bogus` never import
torch, and their exit status and message are argparse's / nanosft's; `import nanosft` imports
no torch, and each lazy top-level name is the object its module defines. Timings are not
asserted (a shared machine). Hermetic: CPU, no files written.
Run: python -m pytest -q tests/test_startup.py
"""

import subprocess
import sys

import pytest

import nanosft


def fresh(code):
    """Run `code` in a new interpreter; returns (exit status, stdout, stderr)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout, out.stderr


def test_import_sft_does_not_import_bitsandbytes():
    code = "import sys, nanosft.sft; print('bitsandbytes' in sys.modules)"
    assert fresh(code)[1].split() == ["False"]


def test_building_an_nf4_layer_does_import_bitsandbytes():
    # negative control: the check above would see bitsandbytes once a 4-bit layer exists
    code = ("import sys, torch; from nanosft.nf4 import Linear4bit\n"
            "Linear4bit.from_linear(torch.nn.Linear(64, 64))\n"
            "print('bitsandbytes' in sys.modules)")
    assert fresh(code)[1].split() == ["True"]


@pytest.mark.parametrize("argv, status, message", [
    (["--help"], 0, "demo"),
    (["--bogus", "demo"], 2, "unrecognized argument '--bogus'"),
    ([], 2, "the following arguments are required: COMMAND"),
    (["demo", "--bogus"], 2, "unrecognized argument '--bogus'"),
    (["demo", "--help"], 0, "--no-quant"),
])
def test_help_and_flag_errors_do_not_import_torch(argv, status, message):
    code = ("import sys; from nanosft.cli import main\n"
            f"try:\n    code = main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch' in sys.modules, code or 0, file=sys.stderr)")
    _, out, err = fresh(code)
    assert message in out + err
    assert err.split()[-2:] == ["False", str(status)]


def test_import_nanosft_is_lazy():
    code = "import sys, nanosft; print('torch' in sys.modules, 'nanosft.sft' in sys.modules)"
    assert fresh(code)[1].split() == ["False", "False"]


def test_top_level_names_are_the_modules_objects():
    from nanosft import args, nf4, peft, sft, trainer
    from nanosft.families import auto

    for name, module in [("AutoModelForCausalLM", auto), ("AutoTokenizer", auto),
                         ("PeftModel", peft), ("BitsAndBytesConfig", nf4), ("SFTConfig", args),
                         ("TrainingArguments", args), ("SFTTrainer", sft), ("Trainer", trainer),
                         ("LoraConfig", peft), ("get_peft_model", peft)]:
        assert getattr(nanosft, name) is getattr(module, name)
        assert name in dir(nanosft)
    with pytest.raises(AttributeError, match="no attribute 'AutoModel'"):
        nanosft.AutoModel  # noqa: B018
