"""`nanosft train` flags pass through torchrun's parser, and the README's torchrun line runs.

Compared: every option string of `nanosft train` placed after `torchrun --nproc_per_node=2 -m
nanosft train` in torchrun's own argparse parser (torch.distributed.run.get_args_parser) must
come out unchanged in the script's arguments; `--r` is the negative control (an ambiguous prefix of
--rdzv-*, --role, --run-path: torchrun's parser rejects it, which is why `--lora_r` exists), and
`--lora_r` must set LoraConfig.r. Then the README's torchrun command line, taken verbatim from
README.md, runs in a subprocess (2 CPU processes) against a Hugging Face cache built in tmp_path
that holds a tiny model under the README's Hub id; the saved adapter_config.json must carry the
line's r and lora_alpha.
Hermetic: HF_HUB_OFFLINE=1, tiny model (hidden 32, 2 layers), gloo on CPU, files in tmp_path.
Run: python -m pytest -q tests/test_cli_torchrun.py
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import tiny_model
from torch.distributed.run import get_args_parser

from nanosft import cli
from nanosft.tokenizer import Tokenizer

README = Path(__file__).resolve().parent.parent / "README.md"
PREFIX = ["--nproc_per_node=2", "-m", "nanosft", "train"]


def train_flags():
    train = cli.build_parser()._subparsers._group_actions[0].choices["train"]
    return [o for action in train._actions for o in action.option_strings if o.startswith("--")]


def torchrun_script_args(argv):
    """What torchrun hands to the module after parsing `torchrun <argv>`; its errors raise."""
    parser = get_args_parser()

    def error(message):
        raise ValueError(message)

    parser.error = error
    return parser.parse_args(argv).training_script_args


def test_every_train_flag_passes_through_torchrun():
    flags = train_flags()
    assert "--lora_r" in flags and "--learning_rate" in flags and len(flags) > 50
    for flag in flags:
        if flag == "--r":
            continue
        assert torchrun_script_args(PREFIX + [flag, "1"]) == ["train", flag, "1"], flag


def test_r_is_rejected_by_torchrun_and_lora_r_is_r():
    with pytest.raises(ValueError, match="ambiguous option: --r could match"):
        torchrun_script_args(PREFIX + ["--r", "16"])  # negative control
    parser = cli.build_parser()
    args = parser.parse_args(["train", "--model", "m", "--data", "d", "--lora_r", "16"])
    assert cli.collect(args, "LoraConfig.") == {"r": 16}


def readme_torchrun_line():
    # the quick-start line (a Hub id, --lora_r); the distributed section's lines use ./my-llama
    lines = [line for line in README.read_text().splitlines()
             if line.startswith("torchrun ") and " -m nanosft train " in line
             and " --lora_r " in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_readme_torchrun_line_runs(tmp_path):
    line = readme_torchrun_line()
    argv = shlex.split(line)
    model_id = argv[argv.index("--model") + 1]
    data = argv[argv.index("--data") + 1]
    output_dir = argv[argv.index("--output_dir") + 1]
    # a Hugging Face cache holding a tiny model under the README's id
    repo = tmp_path / "hub" / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    texts = [f"{a} plus {a} is {2 * a}." for a in range(20)]
    tokenizer = Tokenizer.train(texts, vocab_size=300)
    tokenizer.save_pretrained(snapshot)
    tiny_model(0, vocab_size=len(tokenizer)).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    work = tmp_path / "work"
    work.mkdir()
    (work / data).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ.get("PATH", "")}
    done = subprocess.run(line, shell=True, cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((work / output_dir / "adapter_config.json").read_text())
    assert config["r"] == int(argv[argv.index("--lora_r") + 1])
    assert config["lora_alpha"] == int(argv[argv.index("--lora_alpha") + 1])
