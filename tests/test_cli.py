"""The `nanosft` command line: `demo` runs end to end; bad sub-commands fail with a usage line.

Compared: exit codes and printed lines against what the command promises (a ChatML prompt, at
most --max_new_tokens generated ids, their decoded text). Hermetic: the demo trains its tokenizer
and builds its random model in-process; no files, no network.
Run: python -m pytest -q tests/test_cli.py
"""

import ast
import re
import subprocess
import sys

import pytest

from nanosft.cli import main


def test_python_m_nanosft_demo_prints_generated_text():
    result = subprocess.run([sys.executable, "-m", "nanosft", "demo"], check=False, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "prompt: '<|im_start|>user\\nWhat is two plus two?<|im_end|>\\n<|im_start|>assistant\\n'" in out
    count, ids = re.search(r"generated (\d+) tokens: (\[[\d, ]*\])", out).groups()
    assert 1 <= int(count) == len(ast.literal_eval(ids)) <= 8  # default --max_new_tokens 8
    assert re.search(r"^generated text: '.*'$", out, re.MULTILINE)


def test_max_new_tokens_bounds_the_generation(capsys):
    assert main(["demo", "--max_new_tokens", "1"]) == 0
    assert re.search(r"generated 1 tokens: \[\d+\]", capsys.readouterr().out)


@pytest.mark.parametrize("argv, message", [(["bogus"], "invalid choice: 'bogus'"),
                                            ([], "the following arguments are required: COMMAND")])
def test_bad_command_exits_nonzero_with_usage(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("usage: nanosft") and message in err


def test_unknown_subcommand_via_python_m():
    result = subprocess.run([sys.executable, "-m", "nanosft", "bogus"], check=False, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and "usage: nanosft" in result.stderr
