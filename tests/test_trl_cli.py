"""`nanosft train` with the `trl sft` flags (TRL's ScriptArguments / ModelConfig names).

Compared: a `trl sft` command line run through nanosft.cli.main against the adapter it must write
(r, lora_alpha, target modules, TRL's lora_dropout default); each TRL flag against the nanosft
config it maps to (TRL ModelConfig's LoRA defaults, full fine-tuning without --use_peft, as TRL's
get_peft_config); --load_in_4bit against a base of Linear4bit layers with the asked quant type and
nesting; refused and conflicting flags against a one-paragraph message naming them; and the same
argv run by trl.scripts.sft.main in-process (skipped without trl): per-step losses and the saved
adapter tensors equal at fp32 tolerances. Hermetic: the tiny model in nanosft/cli/assets/default,
JSONL written to tmp_path, CPU only, no network.
Run: python -m pytest -q tests/test_trl_cli.py
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from nanosft import nf4
from nanosft.cli import build_parser, build_train_configs, demo, load_model, main
from nanosft.cli.trl_flags import TRL_LORA_DEFAULTS, apply_trl_flags, trl_eval_data

DEFAULT = demo.DEFAULT_DIR
ROWS = [{"text": f"{a} plus {a + 1} equals {2 * a + 1}."} for a in range(4)]


def write_jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def trl_argv(data, output_dir, *extra):
    """A typical `trl sft` command line (without the program name)."""
    return ["--model_name_or_path", DEFAULT, "--dataset_name", data, "--use_peft",
            "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj",
            "--learning_rate", "1e-3", "--max_steps", "2", "--per_device_train_batch_size", "2",
            "--output_dir", str(output_dir), "--report_to", "none", *extra]


def parsed(*argv):
    """`nanosft train ARGV` parsed and its TRL flags applied: (args, SFTConfig, peft config)."""
    args = build_parser().parse_args(["train", *map(str, argv)])
    apply_trl_flags(args)
    sft_config, peft_config = build_train_configs(args, args.sft_names, args.lora_names)
    trl_eval_data(args, sft_config)
    return args, sft_config, peft_config


def test_trl_command_line_trains_and_saves_the_adapter_it_names(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl")
    code = main(["train", *trl_argv(data, tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert config["lora_dropout"] == TRL_LORA_DEFAULTS["lora_dropout"]  # TRL's, not peft's 0.0
    adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # it trained


def test_each_trl_flag_maps_to_the_nanosft_config(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl")
    args, sft_config, lora = parsed(*trl_argv(data, tmp_path / "o"), "--lora_dropout", "0.1",
                                    "--use_rslora", "--dtype", "bfloat16")
    assert (args.model, args.data, args.model_dtype) == (DEFAULT, data, "bfloat16")
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.use_rslora) == (4, 8, 0.1, True)
    assert sorted(lora.target_modules) == ["q_proj", "v_proj"]
    assert (sft_config.learning_rate, sft_config.max_steps) == (1e-3, 2)
    assert not args.qlora and args.quantization_config is None
    # --use_peft alone: trl ModelConfig's defaults; one target module is a string, as in TRL
    base = ["--model_name_or_path", DEFAULT, "--dataset_name", data, "--output_dir", tmp_path]
    _, _, lora = parsed(*base, "--use_peft", "--lora_target_modules", "all-linear")
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (16, 32, 0.05)
    assert lora.target_modules == "all-linear"
    # without --use_peft TRL's get_peft_config returns None: the full model trains
    args, _, peft_config = parsed(*base)
    assert args.full and peft_config is None
    # nanosft's own --model keeps peft's defaults (r=8, lora_alpha=8)
    _, _, lora = parsed("--model", DEFAULT, "--data", data, "--output_dir", tmp_path)
    assert (lora.r, lora.lora_alpha) == (8, 8)


def test_dataset_name_folder_splits_and_eval_only_with_an_eval_strategy(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl")
    write_jsonl(folder / "test.jsonl", ROWS[:2])
    base = ["--model_name_or_path", DEFAULT, "--dataset_name", folder, "--output_dir", tmp_path]
    args, _, _ = parsed(*base)
    assert len(args.data) == 4 and args.eval_data is None  # eval_strategy "no": no test split
    args, _, _ = parsed(*base, "--eval_strategy", "steps", "--eval_steps", "1")
    assert len(args.eval_data) == 2 and args.eval_data[0] == ROWS[0]
    with pytest.raises(ValueError, match="no split 'validation'"):
        parsed(*base, "--eval_strategy", "steps", "--dataset_test_split", "validation")
    data = write_jsonl(tmp_path / "d.jsonl")  # one file: its only split is "train"
    with pytest.raises(ValueError, match="only split is 'train'"):
        parsed("--model_name_or_path", DEFAULT, "--dataset_name", data, "--output_dir", tmp_path,
               "--eval_strategy", "steps")


@pytest.mark.parametrize("quant_type,nested", [("nf4", False), ("fp4", True)])
def test_load_in_4bit_gives_a_quantized_base(quant_type, nested, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl")
    args, _, lora = parsed(*trl_argv(data, tmp_path / "o"), "--load_in_4bit",
                           "--bnb_4bit_quant_type", quant_type, "--use_bnb_nested_quant",
                           str(nested))
    assert args.qlora and lora.r == 4
    model = load_model(args.model, load_in_4bit=args.qlora,
                       quantization_config=args.quantization_config)
    layers = [m for m in model.modules() if isinstance(m, nf4.Linear4bit)]
    assert layers and all(m.quant_type == quant_type for m in layers)
    assert all(m.compress_statistics == nested for m in layers)  # double quant: TRL default off


def test_load_in_4bit_trains(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl")
    code = main(["train", *trl_argv(data, tmp_path / "out"), "--load_in_4bit"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("extra,words", [
    (["--attn_implementation", "flash_attention_2"], ["--attn_implementation", "SDPA"]),
    (["--load_in_8bit"], ["--load_in_8bit", "4 bits"]),
    (["--trust_remote_code"], ["--trust_remote_code"]),
    (["--model", DEFAULT], ["--model and --model_name_or_path"]),
    (["--target_modules", "k_proj"], ["--target_modules and --lora_target_modules"]),
])
def test_refused_and_conflicting_flags_are_named(extra, words, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl")
    code = main(["train", *trl_argv(data, tmp_path / "o"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert all(word in err for word in words), err


def test_load_in_4bit_without_use_peft_is_refused(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl")
    code = main(["train", "--model_name_or_path", DEFAULT, "--dataset_name", data,
                 "--output_dir", str(tmp_path / "o"), "--load_in_4bit"])
    assert code == 2 and "add --use_peft" in capsys.readouterr().err


def test_same_command_line_as_trl_sft_gives_the_same_losses_and_adapter(tmp_path, capsys):
    """One argv run by `trl sft` (trl.scripts.sft.main) and by `nanosft train`."""
    pytest.importorskip("trl")
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser
    from trl.scripts.sft import main as trl_main
    from trl.scripts.utils import DatasetMixtureConfig

    folder = tmp_path / "ds"  # datasets.load_dataset takes a folder of data files, not one file
    folder.mkdir()
    write_jsonl(folder / "train.jsonl")
    # fp32 and no dropout, so the two runs draw the same numbers
    extra = ["--lora_dropout", "0", "--bf16", "false", "--logging_steps", "1", "--seed", "0"]
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig))
    trl_main(*parser.parse_args_and_config(trl_argv(str(folder), tmp_path / "trl", *extra)))
    state = json.loads((tmp_path / "trl" / "checkpoint-2" / "trainer_state.json").read_text())
    trl_losses = [row["loss"] for row in state["log_history"] if "loss" in row]

    code = main(["train", *trl_argv(str(folder), tmp_path / "ours", *extra)])
    assert code == 0, capsys.readouterr().err[-2000:]
    state = json.loads((tmp_path / "ours" / "checkpoint-2" / "trainer_state.json").read_text())
    losses = [row["loss"] for row in state["log_history"] if "loss" in row]
    assert len(trl_losses) == len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(trl_losses),
                               rtol=1e-4, atol=1e-4)
    theirs = load_file(tmp_path / "trl" / "adapter_model.safetensors")
    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5)
