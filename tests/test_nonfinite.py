"""Non-finite numbers never reach disk as a success (issue 25, finding 3).

Compared: (1) nan/inf hyperparameters of TrainingArguments / SFTConfig / LoraConfig against a
ValueError naming the field and the value, with the legitimate edge values (max_grad_norm=0,
warmup_steps=0) as the negative control; `--learning_rate inf` on the command line against exit
status 2 and no traceback; (2) a model folder with 3 nan values in one weight, loaded in fp32 and
quantized to NF4 while loading (--qlora), against an error naming the file, the tensor and the
count, the untouched folder loading as the control; (3) a run whose weights turn nan against
NonFiniteTrainingError naming the step and the fixes, checkpoints written while finite kept and
none written after, train() never returning; on the command line exit status 2, no adapter and no
"saved the adapter"; (4) the weights decide, not the logged numbers: a GradScaler step skipped for
an inf gradient, or a nan loss over finite weights, lets the run go on (the second with a printed
line), the same inf gradient without the scaler being the negative control.
Hermetic: tiny models (tests/tiny.py, the default model in nanosft/cli/assets/default), CPU, files
in tmp_path. fp16 autocast needs CUDA in nanosft, so the skip runs a CPU GradScaler set on the
Trainer by hand, as tests/test_trainer.py does.
Run: python -m pytest -q tests/test_nonfinite.py
"""

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanosft import nf4
from nanosft.args import SFTConfig, TrainingArguments
from nanosft.cli import demo, main
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM
from nanosft.monitoring.callbacks import NonFiniteTrainingError, StopOnNonFiniteCallback
from nanosft.peft import LoraConfig
from nanosft.trainer import Trainer
from nanosft.trainer_callback import TrainerControl, TrainerState
from tiny import TINY_LLAMA, tiny_model

POISONED = "model.layers.0.mlp.up_proj.weight"  # a linear weight: NF4-quantized under --qlora
CLI_FAST = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--gradient_checkpointing",
            "false", "--bf16", "false", "--logging_steps", "1", "--disable_tqdm", "true"]


def cli(argv, capsys):
    """nanosft's main(argv) in-process: (exit status, stdout, stderr)."""
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"text": f"{a} plus {a + 1} equals {2 * a + 1}."} for a in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, TINY_LLAMA["vocab_size"], (8,), generator=g).tolist(),
             "labels": torch.randint(1, TINY_LLAMA["vocab_size"], (8,), generator=g).tolist()}
            for _ in range(n)]


def make_trainer(tmp_path, **overrides):
    kwargs = {"output_dir": str(tmp_path / "run"), "per_device_train_batch_size": 2,
              "max_steps": 4, "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no",
              "use_cpu": True, "optim": "adamw_torch", "disable_tqdm": True, "seed": 3,
              **overrides}
    return Trainer(tiny_model(), TrainingArguments(**kwargs), train_dataset=rows(),
                   data_collator=DataCollatorForLanguageModeling(pad_token_id=0))


def nan_grads_from_step(trainer, first_bad_step):
    """From optimizer step `first_bad_step` (1-based) on, lm_head's gradient is nan: the optimizer
    writes nan into the weights, as a diverging run does."""
    def hook(grad):
        return grad * float("nan") if trainer.state.global_step + 1 >= first_bad_step else grad

    trainer.model.lm_head.weight.register_hook(hook)


# ----------------------------------------------------------------------------- hyperparameters
@pytest.mark.parametrize("name, value", [
    ("learning_rate", math.inf), ("learning_rate", -math.inf), ("learning_rate", math.nan),
    ("weight_decay", math.nan), ("adam_beta1", math.nan), ("adam_beta2", math.inf),
    ("adam_epsilon", math.inf), ("max_grad_norm", math.nan), ("warmup_steps", math.nan),
    ("label_smoothing_factor", math.nan), ("num_train_epochs", math.inf),
])
def test_nonfinite_training_argument_is_refused(tmp_path, name, value):
    for cls in (TrainingArguments, SFTConfig):
        with pytest.raises(ValueError, match=rf"{name}={value!r} is invalid: give a finite number"):
            cls(output_dir=str(tmp_path), **{name: value})


def test_zero_clipping_and_warmup_stay_valid(tmp_path):
    # negative control: 0 switches clipping and warmup off; only nan/inf are refused
    args = TrainingArguments(output_dir=str(tmp_path), max_grad_norm=0.0, warmup_steps=0.0)
    assert args.max_grad_norm == 0.0 and args.warmup_steps == 0.0


@pytest.mark.parametrize("name", ["lora_alpha", "lora_dropout"])
def test_nonfinite_lora_config_is_refused(name):
    with pytest.raises(ValueError, match=rf"LoraConfig.{name}=inf is invalid: give a finite"):
        LoraConfig(**{name: math.inf})
    LoraConfig(**{name: 0.5})  # a finite value is fine


def test_cli_learning_rate_inf_is_refused(tmp_path, data_file, capsys):
    out_dir = tmp_path / "out"
    status, out, err = cli(["train", "--model", demo.DEFAULT_DIR, "--data", data_file,
                            "--output_dir", out_dir, *CLI_FAST, "--learning_rate", "inf"], capsys)
    assert status == 2 and "Traceback" not in err
    assert "learning_rate=inf is invalid: give a finite number" in err
    assert not (out_dir / "adapter_model.safetensors").exists()


# ----------------------------------------------------------------------------- base weights
@pytest.fixture
def nan_model_dir(tmp_path):
    """The default model's folder with 3 nan values in one weight."""
    folder = tmp_path / "nan-model"
    shutil.copytree(demo.DEFAULT_DIR, folder)
    state_dict = load_file(folder / "model.safetensors")
    state_dict[POISONED][0, :3] = math.nan
    save_file(state_dict, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("qlora", [False, True], ids=["fp32", "nf4"])
def test_base_model_with_nan_weight_is_refused_at_load(nan_model_dir, qlora):
    config = nf4.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4") if qlora else None
    with pytest.raises(ValueError) as error:
        CausalLM.from_pretrained(str(nan_model_dir), quantization_config=config)
    message = str(error.value)
    assert str(nan_model_dir / "model.safetensors") in message
    assert f"tensor {POISONED!r} holds 3 nan/inf values" in message
    assert "the checkpoint is damaged" in message
    # negative control: the folder it was copied from loads
    CausalLM.from_pretrained(demo.DEFAULT_DIR, quantization_config=config)


@pytest.mark.parametrize("flags", [[], ["--qlora"]], ids=["fp32", "qlora"])
def test_cli_refuses_nan_base_model(tmp_path, nan_model_dir, data_file, capsys, flags):
    out_dir = tmp_path / "out"
    status, out, err = cli(["train", "--model", nan_model_dir, "--data", data_file,
                            "--output_dir", out_dir, *CLI_FAST, *flags], capsys)
    assert status == 2 and "Traceback" not in err
    assert f"tensor {POISONED!r} holds 3 nan/inf values" in err
    assert "saved the" not in out and not (out_dir / "adapter_model.safetensors").exists()


# ----------------------------------------------------------------------------- a diverging run
@pytest.mark.parametrize("logging_steps", [1, 100], ids=["checked-at-log", "checked-before-save"])
def test_run_that_goes_nan_stops_before_its_next_checkpoint(tmp_path, logging_steps):
    trainer = make_trainer(tmp_path, save_strategy="steps", save_steps=1,
                           logging_steps=logging_steps, max_grad_norm=0.0)
    nan_grads_from_step(trainer, 2)
    with pytest.raises(NonFiniteTrainingError) as error:
        trainer.train()
    message = str(error.value)
    assert message.startswith("Training diverged at step 2:")
    # the clipping's nan total norm spreads the nan into every gradient, so into every weight
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    assert f"{len(trainable)} trainable tensors hold nan/inf values: 'model.embed_tokens" in message
    assert "nothing was saved as a result" in message
    assert "lower learning_rate (now 0.001)" in message
    assert "max_grad_norm=1.0 to clip gradients (now 0.0)" in message
    assert "look at the data" in message
    run = tmp_path / "run"
    assert "checkpoint-1 was saved before, with finite weights" in message
    # the checkpoint of step 1 (finite) is kept; none of step 2 was written
    assert sorted(p for p in os.listdir(run) if p.startswith("checkpoint")) == ["checkpoint-1"]
    assert torch.isfinite(load_file(run / "checkpoint-1" / "model.safetensors")["lm_head.weight"]
                          ).all()


def test_nan_weights_in_the_last_window_are_caught_at_train_end(tmp_path):
    # the case: fewer logging windows than the old "3 in a row"; nothing logs or saves
    # before the end, so on_train_end is what stops the nan model from being returned
    trainer = make_trainer(tmp_path, max_steps=2, logging_steps=100, max_grad_norm=0.0)
    nan_grads_from_step(trainer, 2)
    with pytest.raises(NonFiniteTrainingError, match="Training diverged at step 2:"):
        trainer.train()


def test_nan_loss_over_finite_weights_warns_and_goes_on(tmp_path, capsys):
    # with logging_nan_inf_filter off a nan step loss reaches the log; the gradients were real, so
    # the weights are finite and the run ends normally, with one line saying so
    trainer = make_trainer(tmp_path, logging_nan_inf_filter=False)
    step = trainer.training_step

    def nan_loss_on_step_2(model, inputs, num_items_in_batch=None):
        loss = step(model, inputs, num_items_in_batch)
        return torch.tensor(math.nan) if trainer.state.global_step == 1 else loss

    trainer.training_step = nan_loss_on_step_2
    assert trainer.train().global_step == 4
    assert "Step 2: the logged loss is nan but the weights are finite" in capsys.readouterr().out


def test_weights_decide_not_the_logged_numbers():
    # the callback alone: a nan loss and an inf grad_norm over finite weights (an fp16 step the
    # GradScaler skipped) stop nothing; one inf weight does
    args = TrainingArguments(output_dir="unused", use_cpu=True)
    callback, model = StopOnNonFiniteCallback(), tiny_model()
    state, control = TrainerState(global_step=7), TrainerControl()
    logs = {"loss": math.nan, "grad_norm": math.inf}
    callback.on_log(args, state, control, logs=logs, model=model)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = math.inf
    with pytest.raises(NonFiniteTrainingError) as error:
        callback.on_log(args, state, control, logs=logs, model=model)
    assert str(error.value).startswith("Training diverged at step 7: the logged loss nan, "
                                       "grad_norm inf; 1 trainable tensor holds nan/inf values: "
                                       "'lm_head.weight' (1).")


@pytest.mark.parametrize("scaler", [True, False], ids=["gradscaler-skips", "no-scaler"])
def test_inf_gradient_skipped_by_gradscaler_does_not_stop(tmp_path, scaler):
    trainer = make_trainer(tmp_path, max_steps=3)
    if scaler:
        trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    weight = trainer.model.lm_head.weight
    weight.register_hook(lambda g: g * math.inf if trainer.state.global_step == 1 else g)
    if not scaler:  # negative control: the optimizer writes the inf/nan into the weights
        with pytest.raises(NonFiniteTrainingError, match="at step 2"):
            trainer.train()
        return
    assert trainer.train().global_step == 3
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert not math.isfinite(logged[1]) and trainer.scaler.get_scale() == 2.0**7  # step 2 skipped
    assert torch.isfinite(weight).all()


def test_cli_run_that_goes_nan_exits_non_zero_and_saves_no_adapter(tmp_path, data_file, capsys):
    # Adam's first update is learning_rate x sign(grad): 3e38 leaves lora_B near float32's max, so
    # the next forward overflows and the weights turn nan
    out_dir = tmp_path / "out"
    status, out, err = cli(["train", "--model", demo.DEFAULT_DIR, "--data", data_file,
                            "--output_dir", out_dir, *CLI_FAST, "--save_strategy", "no",
                            "--learning_rate", "3e38"], capsys)
    assert status == 2 and "Traceback" not in err
    assert "Training diverged at step" in err and "lower learning_rate (now 3e+38)" in err
    assert "saved the" not in out
    assert not (out_dir / "adapter_model.safetensors").exists()
