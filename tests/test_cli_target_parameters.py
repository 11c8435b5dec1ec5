"""LoRA on MoE expert parameters from the command line: TRL's `--lora_target_parameters` and
nanosft's own `--target_parameters` (peft 0.21's LoraConfig.target_parameters).

Compared: the same `trl sft` argv parsed by TRL (TrlParser + ModelConfig + trl's get_peft_config,
giving a peft LoraConfig) and by `nanosft train` (giving nanosft's LoraConfig), field for field
(target_modules, target_parameters, r, lora_alpha, lora_dropout, ...), for one name, several names,
and beside --lora_target_modules (a list, or "all-linear"); the same argv trained 2 steps on a tiny
Qwen3-MoE by trl.scripts.sft.main and by nanosft.cli.main: per-step losses and every saved adapter
tensor equal at fp32 tolerances. `nanosft train --target_parameters` on the tiny Qwen3-MoE writes
an adapter_config.json and adapter keys (and shapes) equal to those peft's get_peft_model gives the
transformers model with the same LoraConfig, and the expert adapters trained. An entry naming no
parameter stops the run with one paragraph naming the entry and the parameters there are (peft:
NoMatchingPeftModuleError when nothing matched, a warning otherwise). `nanosft memory
--target_parameters`: the ledger's adapter row grows by the expert pairs' bytes written out in the
test, and a wrong entry gets the same message from the config alone. Hermetic: a tiny random
Qwen3-MoE (hidden 64, 2 layers, 4 experts, top 2) saved by transformers to tmp_path with the demo
model's tokenizer; CPU, fp32, no network.
Run: python -m pytest -q -s tests/test_cli_target_parameters.py (-s prints the differences)
"""

import json
import os
import shutil

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.cli import build_parser, build_train_configs, demo, main
from nanosft.cli.trl_flags import apply_trl_flags

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ROWS = [{"text": f"{a} plus {a + 1} equals {2 * a + 1}."} for a in range(4)]


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """A random transformers Qwen3-MoE saved with the demo model's tokenizer (vocab 476)."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    config = transformers.Qwen3MoeConfig(
        vocab_size=476, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=2, bos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(demo.DEFAULT_DIR, name), folder / name)
    return folder


@pytest.fixture(scope="module")
def data_folder(tmp_path_factory):
    """A folder with train.jsonl (datasets.load_dataset, which `trl sft` calls, takes a folder)."""
    folder = tmp_path_factory.mktemp("data")
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return folder


def trl_argv(model, data, output_dir, *lora):
    return ["--model_name_or_path", str(model), "--dataset_name", str(data), "--use_peft",
            "--lora_r", "2", "--lora_alpha", "4", *lora, "--output_dir", str(output_dir),
            "--report_to", "none", "--bf16", "false"]  # TRL's bf16 default needs a GPU


def lora_fields(config):
    """The LoraConfig fields both libraries have, lists and sets made comparable."""
    def norm(value):
        return sorted(value) if isinstance(value, (list, set, tuple)) else value
    return {k: norm(getattr(config, k)) for k in (
        "target_modules", "target_parameters", "r", "lora_alpha", "lora_dropout", "use_rslora",
        "use_dora", "bias", "modules_to_save", "task_type")}


@pytest.mark.parametrize("lora", [
    ["--lora_target_parameters", "mlp.experts.down_proj"],  # one name: still a list
    ["--lora_target_parameters", *EXPERTS],
    ["--lora_target_modules", "q_proj", "v_proj", "--lora_target_parameters", *EXPERTS],
    ["--lora_target_modules", "all-linear", "--lora_target_parameters", "down_proj"],
    # one module name: TRL makes it a string (a regex), target_parameters stays a list
    ["--lora_target_modules", "q_proj", "--lora_target_parameters", "down_proj"],
    ["--lora_target_modules", "q_proj"],  # no target_parameters: None on both sides
], ids=["one", "several", "with-modules", "with-all-linear", "with-one-module", "absent"])
def test_trl_flag_gives_the_lora_config_trl_get_peft_config_gives(lora, tmp_path):
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser, get_peft_config
    from trl.scripts.utils import DatasetMixtureConfig

    argv = trl_argv("some/model", tmp_path / "d.jsonl", tmp_path / "o", *lora)
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig))
    model_args = parser.parse_args_and_config(argv)[2]
    want = get_peft_config(model_args)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    args = build_parser().parse_args(["train", *argv])
    apply_trl_flags(args)
    _, got = build_train_configs(args, args.sft_names, args.lora_names)
    assert isinstance(want, peft.LoraConfig)
    assert lora_fields(got) == lora_fields(want)
    assert type(got.target_parameters) is type(want.target_parameters)  # a list, or None


def test_nanosft_target_parameters_flag_takes_one_or_several_names(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n")
    base = ["train", "--model", "m", "--data", str(data), "--output_dir", str(tmp_path / "o")]
    for value, want in (("mlp.experts.down_proj", ["mlp.experts.down_proj"]),
                        (",".join(EXPERTS), EXPERTS), (json.dumps(EXPERTS), EXPERTS)):
        args = build_parser().parse_args([*base, "--target_parameters", value])
        _, lora = build_train_configs(args, args.sft_names, args.lora_names)
        assert lora.target_parameters == want  # in the order given, as peft keeps a list
    # TRL's flag and nanosft's name one setting: both given is refused, naming them
    args = build_parser().parse_args(["train", "--model_name_or_path", "m", *base[3:],
                                      "--target_parameters", "down_proj",
                                      "--lora_target_parameters", "down_proj"])
    with pytest.raises(ValueError, match="--target_parameters and --lora_target_parameters"):
        apply_trl_flags(args)


def test_train_writes_expert_adapters_with_peft_config_and_keys(moe_folder, data_folder, tmp_path,
                                                                capsys):
    out = tmp_path / "out"
    code = main(["train", "--model", str(moe_folder), "--data",
                 str(data_folder / "train.jsonl"), "--output_dir", str(out), "--lora_r", "2",
                 "--lora_alpha", "4", "--target_parameters", ",".join(EXPERTS),
                 "--learning_rate", "1e-2", "--max_steps", "2", "--per_device_train_batch_size",
                 "2", "--report_to", "none"])
    assert code == 0, capsys.readouterr().err[-2000:]
    # peft on the transformers model, same LoraConfig
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_folder)
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4,
                                                  target_parameters=list(EXPERTS)))
    ref.save_pretrained(tmp_path / "peft")
    want = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    got = json.loads((out / "adapter_config.json").read_text())
    for key in ("target_parameters", "target_modules", "rank_pattern", "alpha_pattern"):
        assert sorted(got[key]) == sorted(want[key]), key
    assert sorted(got["target_parameters"]) == sorted(EXPERTS)
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    ours = load_file(out / "adapter_model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in ours
    assert all(v.abs().max() > 0 for k, v in ours.items() if "lora_B" in k)  # both experts trained


def test_same_trl_command_line_on_moe_experts_gives_trl_losses_and_adapter(
        moe_folder, data_folder, tmp_path, capsys):
    """`trl sft ... --lora_target_parameters` run by TRL and by nanosft on the tiny Qwen3-MoE."""
    trl = pytest.importorskip("trl")
    from trl.scripts.sft import main as trl_main
    from trl.scripts.utils import DatasetMixtureConfig

    extra = ["--lora_target_modules", "q_proj", "v_proj", "--lora_target_parameters", *EXPERTS,
             "--lora_dropout", "0", "--learning_rate", "1e-2", "--max_steps", "2",
             "--per_device_train_batch_size", "2", "--logging_steps", "1",
             "--seed", "0"]
    parser = trl.TrlParser((trl.ScriptArguments, trl.SFTConfig, trl.ModelConfig,
                            DatasetMixtureConfig))
    trl_main(*parser.parse_args_and_config(trl_argv(moe_folder, data_folder, tmp_path / "trl",
                                                    *extra)))
    code = main(["train", *trl_argv(moe_folder, data_folder, tmp_path / "ours", *extra)])
    assert code == 0, capsys.readouterr().err[-2000:]
    losses = []
    for run in ("trl", "ours"):
        state = json.loads((tmp_path / run / "checkpoint-2" / "trainer_state.json").read_text())
        losses.append([row["loss"] for row in state["log_history"] if "loss" in row])
    assert len(losses[0]) == len(losses[1]) == 2
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]),
                               rtol=1e-4, atol=1e-4)  # logged rounded to 4 significant digits
    theirs = load_file(tmp_path / "trl" / "adapter_model.safetensors")
    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    assert any(".mlp.experts." in k for k in ours)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5, msg=key)
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    print(f"\n[trl sft --lora_target_parameters] losses {losses[1]} vs TRL {losses[0]}, "
          f"largest adapter difference {worst:.2e}")


def test_an_entry_naming_no_parameter_is_one_paragraph_naming_those_there_are(
        moe_folder, data_folder, tmp_path, capsys):
    code = main(["train", "--model", str(moe_folder), "--data",
                 str(data_folder / "train.jsonl"), "--output_dir", str(tmp_path / "o"),
                 "--target_parameters", "mlp.experts.down_proj,mlp.experts.up_proj",
                 "--max_steps", "1", "--report_to", "none"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "'mlp.experts.up_proj' matches no parameter of Qwen3MoeForCausalLM" in err
    assert "model.layers.N.mlp.experts.gate_up_proj" in err  # what the entry could have named
    assert not (tmp_path / "o" / "adapter_model.safetensors").exists()



def test_memory_command_counts_the_expert_adapters_it_is_given(moe_folder, monkeypatch, capsys):
    """`nanosft memory --target_parameters` puts the names in the ledger's plan; the adapter row
    grows by the ParamWrapper pairs written out here: A (r E, in) and B (out, r E) per layer."""
    from nanosft import memory

    ledgers = []
    estimate = memory.estimate_memory

    def spy(config, plan, **kwargs):
        ledgers.append(estimate(config, plan, **kwargs))
        return ledgers[-1]

    monkeypatch.setattr(memory, "estimate_memory", spy)
    base = ["memory", "--model", str(moe_folder), "--lora", "--target_modules", "q_proj,v_proj"]
    assert main([*base, "--target_parameters", "mlp.experts.gate_up_proj"]) == 0
    assert main(base) == 0
    assert "gate_up_proj" in capsys.readouterr().out
    assert ledgers[0].plan.target_parameters == ["mlp.experts.gate_up_proj"]
    config = transformers.AutoConfig.from_pretrained(moe_folder)
    E, C, I, r = config.num_experts, config.hidden_size, config.moe_intermediate_size, 8
    pair = 4 * (r * E * C + 2 * I * r * E)  # fp32 A and B of gate_up_proj (E, 2 I, C)
    grown = {k: ledgers[0].rows[k] - ledgers[1].rows[k] for k in ledgers[0].rows}
    assert grown["trainable parameters"] == config.num_hidden_layers * pair
    # an entry naming no parameter of the config: the training run's message, before any ledger
    assert main([*base, "--target_parameters", "mlp.experts.up_proj"]) == 2
    err = capsys.readouterr().err
    assert "'mlp.experts.up_proj' matches no parameter" in err
    assert "model.layers.N.mlp.experts.down_proj" in err and len(ledgers) == 2


def test_readme_memory_example_with_target_parameters_alone(moe_folder, monkeypatch, capsys):
    """The README's `nanosft memory --model ./my-qwen3-moe --qlora --target_parameters ...`: no
    target_modules and no peft default for qwen3_moe, so the experts alone train, as peft wraps
    them (it exited 2 before). The trainable row is exactly the expert pairs, A (r E, in) and
    B (out, r E), written out here."""
    from nanosft import memory

    ledgers = []
    estimate = memory.estimate_memory
    monkeypatch.setattr(memory, "estimate_memory",
                        lambda *a, **k: ledgers.append(estimate(*a, **k)) or ledgers[-1])
    names = "mlp.experts.gate_up_proj,mlp.experts.down_proj"
    assert main(["memory", "--model", str(moe_folder), "--qlora", "--target_parameters",
                 names]) == 0
    assert "gate_up_proj" in capsys.readouterr().out
    config = transformers.AutoConfig.from_pretrained(moe_folder)
    E, C, I, r = config.num_experts, config.hidden_size, config.moe_intermediate_size, 8
    gate_up, down = r * E * C + 2 * I * r * E, r * E * I + C * r * E
    bf16 = 2  # QLoRA's adapters under bf16 autocast, as the ledger prints
    want = config.num_hidden_layers * (gate_up + down) * bf16
    assert ledgers[0].rows["trainable parameters"] == want
