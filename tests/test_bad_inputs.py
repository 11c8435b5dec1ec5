"""Bad inputs fail early with an error that names the culprit and the fix, and leave no partial
output behind.

Compared, for each of the cases below (the command line, TrainingArguments/SFTConfig, datasets,
Hub ids, tokenizers, model folders, adapters, checkpoints): the exception type (or, for the command
line, exit status 2 and a one-paragraph stderr without a traceback), that the message contains the
culprit (file and line, field, tensor with both shapes, folder) and the fix, and that the failing
call created or changed no file under tmp_path (a snapshot of every path, size and mtime before and
after: no half-written output folder, no temp file, no metrics.jsonl).
Hermetic: tiny models (hidden 32, 2 layers) and a tokenizer trained in-process, every file in
tmp_path, CPU; Hub ids resolve from a cache in tmp_path with HF_HUB_OFFLINE=1.
Run: python -m pytest -q tests/test_bad_inputs.py
"""

import contextlib
import io
import json
import os
import shutil
import unittest.mock
from dataclasses import dataclass, field

import pytest
import torch

from nanosft import AutoModelForCausalLM, AutoTokenizer
from nanosft.run import checkpoint
from nanosft import cli
from nanosft.args import SFTConfig, TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.data import load_examples, prepare_dataset
from nanosft.model import CausalLM, ModelConfig
from nanosft.peft import LoraConfig, PeftModelForCausalLM, get_peft_model
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer
from nanosft.trainer import Trainer

CORPUS = ["What is two plus two? Four.", "Capital of France? Paris.", "Opposite of hot? Cold."] * 4


@dataclass
class Bad:
    """A call that must fail with `error`, and the pieces its message must contain."""

    call: object
    error: type
    culprit: list
    fix: list = field(default_factory=list)


class CliExit(Exception):
    """`nanosft ...` ended with a non-zero status; the message is what it wrote to stderr."""

    def __init__(self, status, stderr):
        super().__init__(stderr)
        self.status = status


def nanosft(*argv):
    """Run the command line in-process; a non-zero exit becomes CliExit(status, stderr)."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            status = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse's own errors
            status = e.code
    if status:
        raise CliExit(status, err.getvalue())


def tiny_model(vocab_size=300, hidden=32, seed=0):
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(vocab_size=vocab_size, hidden_size=hidden,
                                intermediate_size=2 * hidden,
                                num_hidden_layers=2, num_attention_heads=4,
                                max_position_embeddings=64))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A model folder with its tokenizer, and a finished 2-step run (checkpoint-1, checkpoint-2)."""
    root = tmp_path_factory.mktemp("shared")
    tokenizer = Tokenizer.train(CORPUS, vocab_size=300)
    tokenizer.save_pretrained(root / "model")
    tiny_model(len(tokenizer)).save_pretrained(root / "model")
    trainer = _trainer(root / "run", max_steps=2, save_steps=1)
    trainer.train()
    return {"model": root / "model", "run": root / "run", "tokenizer": tokenizer}


def _rows(n=8):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, 64, (6,), generator=g).tolist(),
             "labels": [-100, 5, 6, 7, 8, 9]}
            for _ in range(n)]


def _trainer(output_dir, model=None, **overrides):
    kwargs = {"output_dir": str(output_dir), "per_device_train_batch_size": 2, "max_steps": 4,
              "save_strategy": "steps", "save_steps": 2, "logging_steps": 1, "use_cpu": True,
              "optim": "adamw_torch", "disable_tqdm": True}
    kwargs.update(overrides)
    return Trainer(model or tiny_model(64), TrainingArguments(**kwargs), train_dataset=_rows(),
                   data_collator=DataCollatorForLanguageModeling(pad_token_id=0))


def _sft_config(output_dir, **overrides):
    kwargs = {"output_dir": str(output_dir), "bf16": False, "gradient_checkpointing": False,
              "use_cpu": True,
              "max_steps": 1, "save_strategy": "no", "disable_tqdm": True}
    return SFTConfig(**{**kwargs, **overrides})


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_json(path, **changes):
    values = json.loads(path.read_text())
    values.update(changes)
    path.write_text(json.dumps(values))


PC = [{"prompt": "What is two plus two?", "completion": " Four."},
      {"prompt": "Hot?", "completion": " Cold."}]


# ----------------------------------------------------------------------------- the command line
def case_cli_unknown_command(tmp, shared):
    return Bad(lambda: nanosft("trian"), CliExit, ["'trian'"], ["choose from", "'train'"])


def case_cli_misspelled_flag(tmp, shared):
    data = _write(tmp / "d.jsonl", json.dumps(PC[0]) + "\n")
    call = lambda: nanosft("train", "--model", shared["model"], "--data", data, "--output_dir",
                           tmp / "out",
                           "--learnig_rate", "1e-4")
    return Bad(call, CliExit, ["'--learnig_rate'"], ["did you mean --learning_rate"])


def case_cli_data_file_missing(tmp, shared):
    call = lambda: nanosft("train", "--model", shared["model"], "--data", tmp / "nope.jsonl",
                           "--output_dir",
                           tmp / "out")
    return Bad(call, CliExit, [f"--data {tmp / 'nope.jsonl'}: no such file"], ["give a JSONL file"])


def case_cli_model_folder_missing(tmp, shared):
    data = _write(tmp / "d.jsonl", json.dumps(PC[0]) + "\n")
    call = lambda: nanosft("train", "--model", tmp / "nomodel", "--data", data, "--output_dir",
                           tmp / "out")
    return Bad(call, CliExit, [f"--model {tmp / 'nomodel'}: no such folder"],
               ["a local folder or a Hub id"])


def case_cli_malformed_jsonl_line(tmp, shared):
    data = _write(tmp / "d.jsonl",
                  json.dumps(PC[0]) + "\n" + '{"prompt": "Hot?", "completion": " Cold."\n')
    call = lambda: nanosft("train", "--model", shared["model"], "--data", data, "--output_dir",
                           tmp / "out",
                           "--max_steps", "1")
    return Bad(call, CliExit, [f"{data}, line 2: not valid JSON"], ["one JSON object per line"])


def case_cli_config_unknown_key(tmp, shared):
    data = _write(tmp / "d.jsonl", json.dumps(PC[0]) + "\n")
    config = _write(tmp / "c.json", json.dumps({"learning_rat": 1e-4}))
    call = lambda: nanosft("train", "--model", shared["model"], "--data", data, "--output_dir",
                           tmp / "out",
                           "--config", config)
    return Bad(call, CliExit, [str(config), "'learning_rat'"], ["did you mean 'learning_rate'"])


def case_cli_qlora_and_full(tmp, shared):
    data = _write(tmp / "d.jsonl", json.dumps(PC[0]) + "\n")
    call = lambda: nanosft("train", "--model", shared["model"], "--data", data, "--output_dir",
                           tmp / "out",
                           "--qlora", "--full")
    return Bad(call, CliExit, ["--qlora and --full"], ["pick one"])


def case_cli_merge_into_non_empty_folder(tmp, shared):
    adapter = tmp / "adapter"
    get_peft_model(tiny_model(300), LoraConfig(target_modules=["q_proj"])).save_pretrained(adapter)
    _write(tmp / "merged" / "keep.txt", "precious")
    call = lambda: nanosft("merge", "--model", shared["model"], "--adapter", adapter, "--out",
                           tmp / "merged")
    return Bad(call, CliExit, [f"--out {tmp / 'merged'} exists and is not empty"],
               ["give a new folder"])


def case_cli_tokenizer_larger_than_model(tmp, shared):
    model = _copy(shared["model"], tmp / "model")
    tiny_model(64).save_pretrained(model)  # same tokenizer (300 tokens), an embedding of 64 rows
    data = _write(tmp / "d.jsonl", "".join(json.dumps(x) + "\n" for x in PC))
    call = lambda: nanosft("train", "--model", model, "--data", data, "--output_dir", tmp / "out",
                           "--max_steps", "1", "--bf16", "false", "--gradient_checkpointing",
                           "false",
                           "--use_cpu", "true", "--save_strategy", "no")
    return Bad(call, CliExit, ["64", "tokenizer"], ["embedding"])


# ----------------------------------------------------------------------------- arguments
def case_args_gradient_accumulation_steps_zero(tmp, shared):
    call = lambda: TrainingArguments(output_dir=str(tmp / "out"), gradient_accumulation_steps=0)
    return Bad(call, ValueError, ["gradient_accumulation_steps=0"], ["whole number >= 1"])


def case_args_fp16_and_bf16(tmp, shared):
    call = lambda: TrainingArguments(output_dir=str(tmp / "out"), fp16=True, bf16=True)
    return Bad(call, ValueError, ["fp16 and bf16 are both True"], ["keep at most one"])


def case_args_fp16_on_cpu(tmp, shared):
    call = lambda: TrainingArguments(output_dir=str(tmp / "out"), fp16=True, use_cpu=True)
    return Bad(call, ValueError, ["fp16=True"], ["needs a CUDA device", "use bf16=True"])


def case_args_output_dir_is_a_file(tmp, shared):
    target = _write(tmp / "out", "not a folder")
    return Bad(lambda: TrainingArguments(output_dir=str(target)), ValueError,
               [f"output_dir={str(target)!r}"],
               ["existing file", "pass a directory"])


def case_args_unknown_optimizer(tmp, shared):
    call = lambda: TrainingArguments(output_dir=str(tmp / "out"), optim="adamw_torh")
    return Bad(call, ValueError, ["optim='adamw_torh'"], ["did you mean 'adamw_torch'"])


def case_args_json_config_unknown_key(tmp, shared):
    path = _write(tmp / "args.json",
                  json.dumps({"output_dir": str(tmp / "out"), "num_train_epoch": 2}))
    return Bad(lambda: TrainingArguments.from_json_file(str(path)), ValueError,
               [str(path), "'num_train_epoch'"],
               ["did you mean 'num_train_epochs'"])


def case_args_json_config_bad_json(tmp, shared):
    path = _write(tmp / "args.json", '{"output_dir": "x",\n "seed": 1,,\n}')
    return Bad(lambda: TrainingArguments.from_json_file(str(path)), ValueError,
               [str(path), "line 2"])


def case_args_best_model_with_mismatched_strategies(tmp, shared):
    call = lambda: TrainingArguments(output_dir=str(tmp / "out"), load_best_model_at_end=True,
                                     eval_strategy="epoch", save_strategy="steps")
    return Bad(call, ValueError, ["load_best_model_at_end", "'steps'", "'epoch'"],
               ['save_strategy="best"'])


# ----------------------------------------------------------------------------- datasets
def case_data_malformed_jsonl_line(tmp, shared):
    path = _write(tmp / "d.jsonl", '{"text": "fine"}\n\n{"text": "broken}\n')
    return Bad(lambda: load_examples(str(path)), ValueError, [f"{path}, line 3"],
               ["one JSON object per line"])


def case_data_line_not_an_object(tmp, shared):
    path = _write(tmp / "d.jsonl", '["text", "in a list"]\n')
    return Bad(lambda: load_examples(str(path)), TypeError, [f"{path}, line 1", "got a list"],
               ['{"text": "..."}'])


def case_data_empty_dataset(tmp, shared):
    path = _write(tmp / "d.jsonl", "\n\n")
    return Bad(lambda: load_examples(str(path)), ValueError, [str(path), "empty (0 examples)"],
               ["at least one example"])


def case_data_unknown_role(tmp, shared):
    chat = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hello"}]
    path = _write(tmp / "d.jsonl",
                  json.dumps({"messages": chat[:1]}) + "\n" + json.dumps({"messages": chat}) + "\n")
    return Bad(lambda: load_examples(str(path)), ValueError,
               [f"{path}, line 2", "messages[1]['role'] is 'wizard'"],
               ["expected one of"])


def case_data_content_not_a_string(tmp, shared):
    chat = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    return Bad(lambda: load_examples([{"messages": chat}]), TypeError,
               ["example 0", "messages[0]['content']"],
               ["join multi-part content into one string"])


def case_data_prompt_without_completion(tmp, shared):
    return Bad(lambda: load_examples([PC[0], {"prompt": "Hot?"}]), ValueError,
               ["example 1", "'completion'"],
               ["need both 'prompt' and 'completion'"])


def case_data_no_known_field(tmp, shared):
    return Bad(lambda: load_examples([{"txt": "typo in the field name"}]), ValueError,
               ["example 0", "['txt']"],
               ["use one of TRL's three dataset formats"])


def case_data_mixed_formats(tmp, shared):
    return Bad(lambda: load_examples([PC[0], {"text": "plain"}]), ValueError,
               ["example 1", "language_modeling", "prompt_completion"],
               ["one dataset holds one format"])


def case_data_every_example_fully_masked(tmp, shared):
    # max_length 3 keeps only prompt tokens: no example has a completion token left to train on
    call = lambda: prepare_dataset(PC, shared["tokenizer"], max_length=3)
    return Bad(call, ValueError, ["all 2 examples", "all -100"], ["raise max_length"])


def case_data_packing_without_max_length(tmp, shared):
    # nearest honest case of "longer than max_length with truncation off": packing needs a row
    # length
    call = lambda: SFTTrainer(tiny_model(300),
                              _sft_config(tmp / "out", packing=True, max_length=None),
                              train_dataset=PC, processing_class=shared["tokenizer"])
    return Bad(call, ValueError, ["packing=True", "max_length"], ["needs max_length"])


# ----------------------------------------------------------------------------- tokenizers
def case_tokenizer_pad_token_missing(tmp, shared):
    call = lambda: SFTTrainer(tiny_model(300), _sft_config(tmp / "out", pad_token="<pad>"),
                              train_dataset=PC,
                              processing_class=shared["tokenizer"])
    return Bad(call, ValueError, ["pad token '<pad>'"], ["SFTConfig(pad_token=...)"])


def case_tokenizer_json_missing(tmp, shared):
    folder = _copy(shared["model"], tmp / "model")
    os.remove(folder / "tokenizer.json")
    return Bad(lambda: Tokenizer.from_pretrained(str(folder)), FileNotFoundError,
               [str(folder / "tokenizer.json")],
               ["Hugging Face tokenizer folder"])


def case_tokenizer_json_corrupt(tmp, shared):
    folder = _copy(shared["model"], tmp / "model")
    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text[: len(text) // 2])  # a truncated download
    return Bad(lambda: Tokenizer.from_pretrained(str(folder)), ValueError,
               [str(folder / "tokenizer.json"), "line"])


def case_tokenizer_special_token_not_in_vocab(tmp, shared):
    folder = _copy(shared["model"], tmp / "model")
    _edit_json(folder / "tokenizer_config.json", eos_token="<|eot|>")
    return Bad(lambda: Tokenizer.from_pretrained(str(folder)), ValueError,
               [str(folder / "tokenizer_config.json"), "eos_token '<|eot|>'"],
               ["set eos_token to an existing token"])


# ----------------------------------------------------------------------------- model folders
def case_model_unknown_model_type(tmp, shared):
    folder = _copy(shared["model"], tmp / "model")
    _edit_json(folder / "config.json", model_type="gpt2")
    from nanosft.families.auto import AutoModelForCausalLM, supported_model_types

    # the message names every family
    return Bad(lambda: AutoModelForCausalLM.from_pretrained(str(folder)), ValueError,
               ["model_type='gpt2'"],
               [f"use one of {supported_model_types()}"])


def case_model_missing_shard(tmp, shared):
    folder = tmp / "model"
    tiny_model(300).save_pretrained(str(folder), max_shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    os.remove(shard)
    return Bad(lambda: CausalLM.from_pretrained(str(folder)), FileNotFoundError, [str(shard)],
               ["re-download"])


def case_model_corrupt_safetensors_header(tmp, shared):
    folder = _copy(shared["model"], tmp / "model")
    with open(folder / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 8)  # the 8-byte header length becomes absurd
    return Bad(lambda: CausalLM.from_pretrained(str(folder)), ValueError,
               [str(folder / "model.safetensors"), "header"], ["re-save or re-download"])


def case_model_weights_do_not_fit_config(tmp, shared):
    folder = _copy(shared["model"], tmp / "model")
    _edit_json(folder / "config.json", intermediate_size=96)
    return Bad(lambda: CausalLM.from_pretrained(str(folder)), ValueError,
               ["model.layers.0.mlp.down_proj.weight", "(32, 64)", "(32, 96)"],
               ["fix the sizes in config.json"])


def case_model_config_missing(tmp, shared):
    folder = _copy(shared["model"], tmp / "model")
    os.remove(folder / "config.json")
    return Bad(lambda: CausalLM.from_pretrained(str(folder)), FileNotFoundError,
               [str(folder / "config.json")],
               ["save_pretrained writes it"])


def case_model_config_bad_json(tmp, shared):
    folder = _copy(shared["model"], tmp / "model")
    (folder / "config.json").write_text('{"model_type": "llama",\n "hidden_size": 32,,\n}')
    return Bad(lambda: CausalLM.from_pretrained(str(folder)), ValueError,
               [str(folder / "config.json"), "line 2"])


# ----------------------------------------------------------------------------- adapters
def case_adapter_for_another_base(tmp, shared):
    get_peft_model(tiny_model(300, hidden=32),
                   LoraConfig(target_modules=["q_proj"])).save_pretrained(tmp / "a")
    call = lambda: PeftModelForCausalLM.from_pretrained(tiny_model(300, hidden=64), str(tmp / "a"))
    return Bad(call, ValueError,
               [str(tmp / "a" / "adapter_model.safetensors"), "q_proj.lora_A", "(8, 32)",
                                  "(8, 64)"], ["another base model"])


def case_adapter_weights_missing(tmp, shared):
    get_peft_model(tiny_model(300),
                   LoraConfig(target_modules=["q_proj"])).save_pretrained(tmp / "a")
    os.remove(tmp / "a" / "adapter_model.safetensors")
    call = lambda: PeftModelForCausalLM.from_pretrained(tiny_model(300), str(tmp / "a"))
    return Bad(call, FileNotFoundError, [str(tmp / "a" / "adapter_model.safetensors")],
               ["as written by save_pretrained"])


def case_adapter_unsupported_peft_feature(tmp, shared):
    get_peft_model(tiny_model(300),
                   LoraConfig(target_modules=["q_proj"])).save_pretrained(tmp / "a")
    _edit_json(tmp / "a" / "adapter_config.json", use_qalora=True)
    call = lambda: PeftModelForCausalLM.from_pretrained(tiny_model(300), str(tmp / "a"))
    return Bad(call, ValueError, ["use_qalora=True"], ["remove it or use peft itself"])


def case_adapter_unknown_target_module(tmp, shared):
    call = lambda: get_peft_model(tiny_model(300), LoraConfig(target_modules=["q_proj", "qv_proj"]))
    return Bad(call, ValueError, ["'qv_proj' matches no module"], ["'q_proj', 'up_proj', 'v_proj'"])


def case_adapter_rank_zero(tmp, shared):
    return Bad(lambda: LoraConfig(r=0), ValueError, ["LoraConfig.r", "r=0"], ["positive integer"])


# ----------------------------------------------------------------------------- checkpoints
def case_resume_from_folder_that_is_not_a_checkpoint(tmp, shared):
    (tmp / "empty").mkdir()
    trainer = _trainer(tmp / "out")
    return Bad(lambda: trainer.train(resume_from_checkpoint=str(tmp / "empty")), FileNotFoundError,
               [f"{tmp / 'empty'} is not a checkpoint", "trainer_state.json", "model.safetensors"],
               ["output_dir/checkpoint-N"])


def case_resume_from_output_dir_instead_of_checkpoint(tmp, shared):
    run = _copy(shared["run"], tmp / "run")
    trainer = _trainer(tmp / "out")
    return Bad(lambda: trainer.train(resume_from_checkpoint=str(run)), FileNotFoundError,
               [f"{run} is not a checkpoint"], [f"did you mean {run / 'checkpoint-2'}"])


def case_resume_true_without_checkpoints(tmp, shared):
    (tmp / "out").mkdir()
    trainer = _trainer(tmp / "out")
    return Bad(lambda: trainer.train(resume_from_checkpoint=True), ValueError,
               ["resume_from_checkpoint=True", str(tmp / "out")],
               ["resume_from_checkpoint=None to start a fresh run"])


def case_resume_from_missing_path(tmp, shared):
    trainer = _trainer(tmp / "out")
    return Bad(lambda: trainer.train(resume_from_checkpoint=str(tmp / "checkpoint-9")), ValueError,
               [repr(str(tmp / "checkpoint-9")), "is not a folder"], ["checkpoint-<step> folder"])


def case_resume_corrupt_optimizer_state(tmp, shared):
    ckpt = _copy(shared["run"] / "checkpoint-2", tmp / "out" / "checkpoint-2")
    (ckpt / checkpoint.OPTIMIZER_NAME).write_bytes(b"not a torch file")
    trainer = _trainer(tmp / "out")
    return Bad(lambda: trainer.train(resume_from_checkpoint=True), ValueError,
               [f"{ckpt / checkpoint.OPTIMIZER_NAME} could not be read"],
               [f"delete {ckpt}", "earlier checkpoint"])


def case_resume_checkpoint_of_another_model(tmp, shared):
    ckpt = _copy(shared["run"] / "checkpoint-2", tmp / "out" / "checkpoint-2")
    trainer = _trainer(tmp / "out", model=tiny_model(64, hidden=64))
    return Bad(lambda: trainer.train(resume_from_checkpoint=True), ValueError,
               [f"{ckpt / 'model.safetensors'} does not fit this model",
                "model.embed_tokens.weight",
                "[64, 32]", "[64, 64]"])


# ----------------------------------------------------------------------------- the test
# ----------------------------------------------------------------------------- Hub ids, datasets
def _with_env(env, call):
    with unittest.mock.patch.dict(os.environ, env):
        return call()


def case_hub_id_not_cached_offline(tmp, shared):
    env = {"HF_HUB_CACHE": str(tmp / "hub"), "HF_HUB_OFFLINE": "1"}
    call = lambda: _with_env(env, lambda: AutoModelForCausalLM.from_pretrained("org/absent"))
    return Bad(call, FileNotFoundError,
               ["org/absent was not found", str(tmp / "hub" / "models--org--absent")],
               ["HF_HUB_OFFLINE is set", "or give a local model folder"])


def case_hub_unknown_revision(tmp, shared):
    repo = tmp / "hub" / "models--org--tiny"
    shutil.copytree(shared["model"], repo / "snapshots" / ("a" * 40))
    _write(repo / "refs" / "main", "a" * 40)
    env = {"HF_HUB_CACHE": str(tmp / "hub"), "HF_HUB_OFFLINE": "1"}
    call = lambda: _with_env(env, lambda: AutoTokenizer.from_pretrained("org/tiny", revision="v9"))
    return Bad(call, FileNotFoundError, ["revision 'v9' is not cached", "'main'", "a" * 40],
               ["pass one of those as revision="])


def case_dataset_rows_not_dicts(tmp, shared):
    call = lambda: SFTTrainer(tiny_model(300), _sft_config(tmp / "out"),
                              train_dataset=[PC[0], "Cold."],
                              processing_class=shared["tokenizer"])
    return Bad(call, TypeError, ["example 1", "got a str"],
               ["each row is one example with named fields"])


def _columnar_without_format_columns(tmp, shared, kind):
    import datasets

    path = tmp / f"train.{kind}"
    rows = [{"question": ex["prompt"], "answer": ex["completion"]} for ex in PC]
    getattr(datasets.Dataset.from_list(rows), f"to_{kind}")(str(path))
    call = lambda: SFTTrainer(tiny_model(300), _sft_config(tmp / "out"), train_dataset=str(path),
                              processing_class=shared["tokenizer"])
    return Bad(call, ValueError, [f"{path}, row 0", "keys: ['answer', 'question']"],
               ["use one of TRL's three dataset formats"])


def case_parquet_without_format_columns(tmp, shared):
    return _columnar_without_format_columns(tmp, shared, "parquet")


def case_csv_without_format_columns(tmp, shared):
    return _columnar_without_format_columns(tmp, shared, "csv")


def case_iterable_dataset_without_max_steps(tmp, shared):
    call = lambda: SFTTrainer(tiny_model(300), _sft_config(tmp / "out", max_steps=-1),
                              train_dataset=(ex for ex in PC), processing_class=shared["tokenizer"])
    return Bad(call, ValueError, ["train_dataset is an iterable without a length"],
               ["set max_steps"])


CASES = [(name[len("case_"):], fn) for name, fn in globals().items() if name.startswith("case_")]
PARAMS = [pytest.param(fn, id=name) for name, fn in CASES]


def _snapshot(root):
    """Every path under root with its size and mtime: any file written, removed or changed shows."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            info = os.stat(path)
            found[os.path.relpath(path, root)] = (info.st_size,
                                                  info.st_mtime_ns) if name in files else "dir"
    return found


def test_there_are_at_least_25_distinct_bad_inputs():
    assert len(CASES) >= 25


@pytest.mark.parametrize("make", PARAMS)
def test_bad_input_is_named_with_its_fix_and_leaves_nothing_behind(make, tmp_path, shared):
    bad = make(tmp_path, shared)
    before = _snapshot(tmp_path)
    with pytest.raises(bad.error) as info:
        bad.call()
    message = str(info.value)
    for part in bad.culprit + bad.fix:
        assert part in message, f"{part!r} missing from: {message}"
    if isinstance(info.value, CliExit):
        assert info.value.status == 2
        assert "Traceback" not in message
        assert len(message.strip().splitlines()) <= 3  # a short paragraph
    assert _snapshot(tmp_path) == before
