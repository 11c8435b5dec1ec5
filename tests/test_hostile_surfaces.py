"""Hostile inputs on the Python API, family configs, the run lock, resume and the final save: each
ends in a one-paragraph error naming the file, field or argument and the fix, or in the right
result, never in lost data, a hang or a silent success on a wrong result (issue 30).

Compared, for each case: the exception type and the words its message must hold; where an input is
accepted, the effect (the lock's symlink target keeps its bytes, an endless iterable trains
max_steps steps, the final save's files all come from one run, a killed run's metrics.jsonl is set
aside rather than appended to).
Hermetic: tests/tiny.py's 2-layer model or the tiny default model (nanosft/cli/assets/default),
CPU, one thread, files under tmp_path, no network.
Run: python -m pytest -q tests/test_hostile_surfaces.py
"""

import itertools
import json
import os
import signal

import pytest
import torch
from tiny import one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

from nanosft.args import SFTConfig, TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.data import load_examples
from nanosft.families.auto import AutoConfig
from nanosft.cli import demo, main
from nanosft.io import hub
from nanosft.run import output_folder, preflight
from nanosft.run.checkpoint import save_model
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer
from nanosft.trainer import Trainer
from nanosft.trainer_callback import TrainerCallback

# ----------------------------------------------------------------------------- the run lock


def test_a_symlinked_lock_is_refused_and_its_target_keeps_its_bytes(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("do not truncate\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / output_folder.LOCK_NAME).symlink_to(outside)
    with pytest.raises(ValueError, match="symlink") as e:
        output_folder.lock_output_dir(str(out))
    assert "Remove" in str(e.value) and output_folder.LOCK_NAME in str(e.value)
    assert outside.read_text() == "do not truncate\n"
    assert (out / output_folder.LOCK_NAME).is_symlink()  # not removed either


def test_a_lock_that_is_a_folder_is_refused_by_name(tmp_path):
    out = tmp_path / "out"
    (out / output_folder.LOCK_NAME).mkdir(parents=True)
    with pytest.raises(ValueError, match="is a folder, not a plain file"):
        output_folder.lock_output_dir(str(out), command_line=True)


# ----------------------------------------------------------------------------- an endless stream

DEFAULT = demo.DEFAULT_DIR
SUMS = [{"prompt": f"{a} plus {a} is", "completion": f" {2 * a}."} for a in range(8)]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train([r["prompt"] + r["completion"] for r in SUMS] * 3, vocab_size=300)


def sft_config(tmp_path, **overrides):
    kwargs = {"output_dir": str(tmp_path / "out"), "max_steps": 2, "use_cpu": True, "bf16": False,
              "per_device_train_batch_size": 2, "gradient_checkpointing": False,
              "report_to": "none", "disable_tqdm": True, "save_strategy": "no",
              "learning_rate": 1e-2}
    return SFTConfig(**{**kwargs, **overrides})


def test_an_endless_generator_trains_max_steps_reading_only_what_they_use(tokenizer, tmp_path):
    drawn = []

    def endless():
        for i in itertools.count():
            drawn.append(i)
            assert i < 1000, "read on past the rows max_steps trains on"  # (endless otherwise)
            yield SUMS[i % len(SUMS)]

    config = sft_config(tmp_path, gradient_accumulation_steps=2)
    trainer = SFTTrainer(tiny_model(0, vocab_size=len(tokenizer)), args=config,
                         train_dataset=endless(), processing_class=tokenizer)
    assert trainer.train().global_step == 2
    assert len(drawn) == 2 * 2 * 2  # max_steps x batch x accumulation: the rows trained on


# ----------------------------------------------------------------------------- misused arguments

def _sft(tokenizer, tmp_path, **kwargs):
    model = kwargs.pop("model", None) or tiny_model(0, vocab_size=len(tokenizer))
    kwargs.setdefault("processing_class", tokenizer)
    kwargs.setdefault("args", sft_config(tmp_path))
    return SFTTrainer(model, train_dataset=SUMS, **kwargs)


def test_an_optimizer_built_before_the_lora_wrap_is_refused(tokenizer, tmp_path):
    model = tiny_model(0, vocab_size=len(tokenizer))
    early = torch.optim.AdamW(model.parameters())  # then SFTTrainer wraps LoRA: new parameters
    with pytest.raises(ValueError, match="holds none of the model's .* trainable parameters"):
        _sft(tokenizer, tmp_path, model=model, optimizers=(early, None),
             peft_config=LoraConfig(r=4, target_modules=["q_proj"]))
    other = torch.optim.AdamW(tiny_model(1).parameters())
    with pytest.raises(ValueError, match="get_peft_model"):
        _sft(tokenizer, tmp_path, optimizers=(other, None))


def test_an_optimizer_over_the_wrapped_model_trains(tokenizer, tmp_path):
    model = get_peft_model(tiny_model(0, vocab_size=len(tokenizer)),
                           LoraConfig(r=4, target_modules=["q_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    trainer = _sft(tokenizer, tmp_path, model=model, optimizers=(optimizer, None))
    trainer.train()
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"optimizers": (object(), None)}, TypeError, "optimizers[0] must be a torch.optim.Optimizer"),
    ({"optimizers": None}, TypeError, "optimizers must be a pair"),
    ({"callbacks": TrainerCallback()}, TypeError, "callbacks must be a list"),
    ({"callbacks": ["ProgressCallback"]}, TypeError, "callbacks holds a str"),
    ({"processing_class": "some/tokenizer"}, TypeError, "Tokenizer.from_pretrained(path)"),
    ({"peft_config": {"r": 8}}, TypeError, "LoraConfig(**your_dict)"),
    ({"formatting_func": "text"}, TypeError, "formatting_func must be a function"),
    ({"formatting_func": lambda row: None}, TypeError, "formatting_func returned NoneType"),
], ids=["optimizer_object", "optimizers_none", "callbacks_one", "callbacks_str",
        "processing_class_str", "peft_config_dict", "formatting_func_str",
        "formatting_func_none"])
def test_a_misused_trl_argument_is_named(kwargs, error, words, tokenizer, tmp_path):
    with pytest.raises(error) as caught:
        _sft(tokenizer, tmp_path, **kwargs)
    assert words in str(caught.value)


def test_compute_metrics_returning_none_is_named(tokenizer, tmp_path):
    trainer = _sft(tokenizer, tmp_path, eval_dataset=SUMS[:2], compute_metrics=lambda pred: None)
    with pytest.raises(TypeError, match="compute_metrics returned NoneType, not a dict"):
        trainer.evaluate()


# ----------------------------------------------------------------------------- family configs

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
TWO = ["sliding_attention", "full_attention"]
CONFIG_CASES = {
    # name: (config.json fields, words the error holds)
    "gemma3_window_0": ({"model_type": "gemma3_text", "sliding_window": 0},
                        ["sliding_window=0", "positive integer"]),
    "mistral_window_negative": ({"model_type": "mistral", "sliding_window": -4},
                                ["sliding_window=-4"]),
    "qwen2_window_0": ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 0,
                        "max_window_layers": 1}, ["sliding_window=0"]),
    "llama_theta_0": ({"rope_theta": 0.0}, ["rope_theta=0.0", "positive number"]),
    "qwen3_theta_negative": ({"model_type": "qwen3", "rope_parameters":
                              {"rope_type": "default", "rope_theta": -1.0}}, ["rope_theta=-1.0"]),
    "gemma3_local_theta_0": ({"model_type": "gemma3_text", "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
        ["rope_parameters['sliding_attention']", "rope_theta=0"]),
    "gemma3_layer_types_short": ({"model_type": "gemma3_text", "layer_types": TWO[:1]},
                                 ["layer_types has 1 entries", "num_hidden_layers=2"]),
    "gemma3_layer_type_unknown": ({"model_type": "gemma3_text",
                                   "layer_types": ["sliding_attention", "linear_attention"]},
                                  ["linear_attention", "full_attention"]),
    "qwen2_layer_types_short": ({"model_type": "qwen2", "layer_types": ["full_attention"]},
                                ["layer_types has 1 entries"]),
    "smollm3_no_rope_short": ({"model_type": "smollm3", "no_rope_layers": [1]},
                              ["no_rope_layers has 1 entries"]),
    "linear_rope_without_factor": ({"rope_scaling": {"rope_type": "linear"}},
                                   ["rope_type='linear'", "'factor'"]),
    "phi3_partial_rotary_2": ({"model_type": "phi3", "pad_token_id": 0, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 2}},
        ["partial_rotary_factor=2", "(0, 1]"]),
    "rms_norm_eps_string": ({"rms_norm_eps": "1e-6"}, ["rms_norm_eps='1e-6'", "positive number"]),
}


@pytest.mark.parametrize("name", sorted(CONFIG_CASES))
def test_a_family_config_value_no_model_can_use_is_named_at_load(name, tmp_path):
    fields, words = CONFIG_CASES[name]
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, **fields}))
    with pytest.raises(ValueError) as caught:
        AutoConfig.from_pretrained(str(tmp_path))
    for word in [str(tmp_path / "config.json"), *words]:
        assert word in str(caught.value), str(caught.value)


def test_the_family_configs_checked_still_load_with_sound_values(tmp_path):
    for fields in ({"model_type": "gemma3_text", "sliding_window": 4, "layer_types": TWO},
                   {"model_type": "smollm3", "no_rope_layers": [1, 0]},
                   {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}):
        (tmp_path / "config.json").write_text(json.dumps({**SMALL, **fields}))
        assert AutoConfig.from_pretrained(str(tmp_path)).num_hidden_layers == 2


# ----------------------------------------------------------------------------- the final save

class Terminated(Exception):
    pass


def _adapter_model(tokenizer, seed):
    model = get_peft_model(tiny_model(0, vocab_size=len(tokenizer)),
                           LoraConfig(r=4, target_modules=["q_proj"]))
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_()
    return model


def _signal_at_rename(monkeypatch, out, number, act):
    """os.replace calls `act()` just before its `number`-th rename of a finished file into `out`
    (another process's SIGTERM, or the machine going down)."""
    original, calls = os.replace, []

    def replace(src, dst, **kwargs):
        if os.path.dirname(os.fspath(dst)) == str(out):
            calls.append(src)
            if len(calls) == number:
                act()
        return original(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


def test_sigterm_between_the_final_renames_waits_until_all_files_are_in(
        tokenizer, tmp_path, monkeypatch):
    out, expected = tmp_path / "out", tmp_path / "expected"
    save_model(_adapter_model(tokenizer, 1), tokenizer, str(out))  # the save before
    new = _adapter_model(tokenizer, 2)
    save_model(new, tokenizer, str(expected))

    def raise_terminated(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        _signal_at_rename(monkeypatch, out, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
        with pytest.raises(Terminated):  # delivered, once the files are in
            save_model(new, tokenizer, str(out))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert {name: (out / name).read_bytes() for name in os.listdir(expected)} == \
        {name: (expected / name).read_bytes() for name in os.listdir(expected)}
    assert not (out / hub.FINAL_SAVE_MARKER).exists()


def test_a_final_save_killed_between_renames_is_not_loaded(tokenizer, tmp_path, monkeypatch,
                                                           capsys):
    out = tmp_path / "out"
    save_model(_adapter_model(tokenizer, 1), tokenizer, str(out))

    def machine_down():
        raise SystemExit("killed")  # nothing after this point of the save runs

    _signal_at_rename(monkeypatch, out, 2, machine_down)
    with pytest.raises(SystemExit):
        save_model(_adapter_model(tokenizer, 2), tokenizer, str(out))
    monkeypatch.undo()
    code = main(["generate", "--model", DEFAULT, "--adapter", str(out), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "final save was interrupted" in err and "--resume_from_checkpoint" in err


# ----------------------------------------------------------------------------- a killed run's log

def test_a_killed_runs_metrics_are_set_aside_not_appended_to(tokenizer, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    old_log = "".join(json.dumps({"loss": 9.0, "step": s}) + "\n" for s in (1, 2))
    (out / "metrics.jsonl").write_text(old_log)  # a run killed before its first checkpoint
    with pytest.warns(UserWarning, match="moved to .*metrics.1.jsonl"):
        _sft(tokenizer, tmp_path,
             args=sft_config(tmp_path, logging_steps=1, report_to="nanosft")).train()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == [1, 2]  # this run's, once each (before: 1, 2, 1, 2)
    assert (out / "metrics.1.jsonl").read_text() == old_log


# ----------------------------------------------------------------------------- resume

def _trainer(out, **overrides):
    kwargs = {"output_dir": str(out), "per_device_train_batch_size": 2, "max_steps": 1,
              "save_steps": 1, "use_cpu": True, "optim": "adamw_torch", "disable_tqdm": True,
              "report_to": "none"}
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(1, 64, (4, 6), generator=g).tolist()]
    return Trainer(tiny_model(), TrainingArguments(**{**kwargs, **overrides}),
                   train_dataset=rows, data_collator=DataCollatorForLanguageModeling(0))


def test_resuming_with_another_optimizer_names_both(tmp_path):
    _trainer(tmp_path / "out").train()
    resumed = _trainer(tmp_path / "out", max_steps=2, optim="sgd")
    with pytest.raises(ValueError, match="optimizer.pt was saved by another optimizer") as caught:
        resumed.train(resume_from_checkpoint=True)
    assert "optim='adamw_torch'" in str(caught.value)
    assert "--optim adamw_torch" in str(caught.value)


# ----------------------------------------------------------------------------- named eval sets

def test_best_model_metric_of_named_eval_sets_is_checked_against_their_keys(tokenizer, tmp_path):
    named = {"a": SUMS[:2], "b": SUMS[2:4]}

    def trainer(metric):
        args = sft_config(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                          save_steps=1, load_best_model_at_end=True, metric_for_best_model=metric)
        return _sft(tokenizer, tmp_path, args=args, eval_dataset=named)

    known = preflight.known_eval_metrics(trainer("eval_a_loss"))
    assert set(known) == set(trainer("eval_a_loss").evaluate()) - {"epoch"}  # as evaluate
    with pytest.raises(ValueError, match="will not produce 'eval_loss'.*eval_a_loss"):
        trainer("loss").train()  # before: accepted, then failed at the first evaluation
    out = trainer("a_loss")
    out.train()
    assert out.state.best_metric is not None


# ----------------------------------------------------------------------------- a second demo

def test_the_demo_replaces_its_own_earlier_result(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--output_dir", str(out), "--steps", "1", "--device", "cpu"]
    assert main(argv) == 0
    (out / "adapter" / "stale.txt").write_text("from the first demo")
    assert main([*argv, "--full"]) == 0  # before: refused, naming overwrite_output_dir
    assert "replacing the earlier demo run" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["model"]
    assert json.loads((out / demo.SUMMARY_FILE).read_text())["mode"] == "full"


def test_the_refusal_names_a_switch_scripts_under_both_stacks_can_use(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _trainer(out).train()
    with pytest.raises(ValueError) as caught:
        _trainer(out).train()
    assert f"{output_folder.OVERWRITE_ENV}=1" in str(caught.value)
    monkeypatch.setenv(output_folder.OVERWRITE_ENV, "1")  # TrainingArguments unchanged
    assert _trainer(out, max_steps=2).train().global_step == 2
    assert output_folder.get_last_checkpoint(str(out)).endswith("checkpoint-2")


def test_a_lone_surrogate_in_python_rows_is_named_by_example_and_field():
    chat = {"messages": [{"role": "user", "content": "hi \ud800"},
                         {"role": "assistant", "content": "yes"}]}
    with pytest.raises(ValueError, match=r"example 0: field 'messages'.*lone UTF-16 surrogate"):
        load_examples([chat])  # before: "TextInputSequence must be str" from the tokenizer
    with pytest.raises(ValueError, match=r"example 1: field 'text': .*\(\\udc80\)"):
        load_examples([{"text": "fine"}, {"text": "half \udc80"}])


def test_the_python_loaders_refuse_a_half_moved_final_save_too(tmp_path):
    from nanosft.families.auto import AutoModelForCausalLM, PeftModel

    (tmp_path / hub.FINAL_SAVE_MARKER).write_text("adapter_config.json\n")
    with pytest.raises(ValueError, match="final save was interrupted"):
        PeftModel.from_pretrained(tiny_model(), str(tmp_path))
    with pytest.raises(ValueError, match="final save was interrupted"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path))
