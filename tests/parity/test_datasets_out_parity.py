"""Datasets in, datasets out: what SFTTrainer holds and evaluates when given `datasets` objects.

Compared with TRL 1.16 on the same rows and model folder: trainer.train_dataset / eval_dataset are
datasets.Dataset with TRL's column names, in TRL's order, and equal rows in every column (the
example's own fields with EOS appended, input_ids, labels, an unused completion_mask, packed
seq_lengths, a ShareGPT row's messages); trainer.evaluate(eval_dataset=<raw Dataset or a dict of
them>) prepares them first and gives TRL's eval losses (fp32, 1e-5); a with_transform dataset
is refused unless dataset_kwargs={"skip_prepare_dataset": True}, which hands the rows through
unprepared (refused there when mask columns come without labels); padding_free=True without
packing but with max_length, and a missing train_dataset, are refused by both; the collator
keeps caller-given labels and computes packed position_ids as TRL's.
Hermetic: a tiny Llama folder and a BPE tokenizer built here; CPU, HF_HUB_OFFLINE=1.
Run: python -m pytest -q tests/parity/test_datasets_out_parity.py
"""

import datasets
import pytest
import torch
from tiny import TINY_LLAMA, one_thread  # noqa: F401 (one_thread: an autouse fixture)

from nanosft.model import CausalLM, ModelConfig
from nanosft.tokenizer import Tokenizer

QA = [("what is two plus two?", "four."), ("the cat sat on?", "the mat."),
      ("hello?", "hello world."), ("be nice?", "yes, be nice.")]
TEXT = [{"text": f"{q} {a}", "source": "quiz"} for q, a in QA]
PAIRS = [{"prompt": q, "completion": " " + a, "id": i} for i, (q, a) in enumerate(QA)]
CHATS = [{"conversations": [{"from": "user", "value": q}, {"from": "assistant", "value": a}],
          "id": i} for i, (q, a) in enumerate(QA)]
COMMON = {"report_to": "none", "use_cpu": True, "bf16": False, "max_steps": 1,
          "per_device_eval_batch_size": 2, "seed": 0, "disable_tqdm": True,
          "save_strategy": "no"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    tokenizer = Tokenizer.train([q + " " + a for q, a in QA] * 4, vocab_size=300)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = ModelConfig(**{**TINY_LLAMA, "vocab_size": len(tokenizer)},
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    CausalLM(config).save_pretrained(folder)
    return str(folder)


def both(model_dir, tmp_path, train, eval_dataset=None, **config):
    """(TRL's trainer, nanosft's trainer) built from the same model folder and Dataset rows."""
    import trl

    import nanosft

    trainers = []
    for stack in (trl, nanosft):
        args = stack.SFTConfig(output_dir=str(tmp_path / stack.__name__), **COMMON, **config)
        trainers.append(stack.SFTTrainer(model=model_dir, args=args,
                                         train_dataset=datasets.Dataset.from_list(train),
                                         eval_dataset=eval_dataset))
    return trainers


def assert_same_dataset(ours, theirs):
    assert isinstance(ours, datasets.Dataset)
    assert ours.column_names == theirs.column_names
    assert ours.to_list() == theirs.to_list()


@pytest.mark.parametrize("rows,config", [
    (TEXT, {}),
    (PAIRS, {}),  # completion_mask turned into labels, then dropped
    (PAIRS, {"completion_only_loss": False}),  # completion_mask kept, unused
    (CHATS, {}),  # ShareGPT: conversations -> messages
    (TEXT, {"packing": True, "max_length": 32}),  # input_ids, labels, seq_lengths
    (TEXT, {"packing": True, "packing_strategy": "wrapped", "max_length": 8}),
], ids=["text", "prompt_completion", "completion_mask_kept", "sharegpt",
        "packed_bfd", "packed_wrapped"])
def test_prepared_train_dataset_equals_trl(model_dir, tmp_path, rows, config):
    theirs, ours = both(model_dir, tmp_path, rows, **config)
    assert_same_dataset(ours.train_dataset, theirs.train_dataset)


def test_evaluate_prepares_raw_datasets_as_trl(model_dir, tmp_path):
    named = {"pairs": datasets.Dataset.from_list(PAIRS), "text": datasets.Dataset.from_list(TEXT)}
    theirs, ours = both(model_dir, tmp_path, PAIRS, eval_dataset=named)
    for name in named:
        assert_same_dataset(ours.eval_dataset[name], theirs.eval_dataset[name])
    results = [trainer.evaluate(eval_dataset=datasets.Dataset.from_list(TEXT))
               for trainer in (theirs, ours)]
    torch.testing.assert_close(results[1]["eval_loss"], results[0]["eval_loss"], rtol=0,
                               atol=1e-5)
    results = [trainer.evaluate(eval_dataset=datasets.DatasetDict(named))
               for trainer in (theirs, ours)]
    for name in named:
        key = f"eval_{name}_loss"
        torch.testing.assert_close(results[1][key], results[0][key], rtol=0, atol=1e-5)
    assert results[1]["eval_pairs_loss"] != results[1]["eval_text_loss"]


def test_with_transform_refused_unless_preparation_is_skipped(model_dir, tmp_path):
    import trl

    import nanosft

    tokenizer = Tokenizer.from_pretrained(model_dir)

    def tokenize(batch):
        ids = [tokenizer.encode(t) for t in batch["text"]]
        return {"input_ids": ids, "labels": ids}

    for stack in (trl, nanosft):
        dataset = datasets.Dataset.from_list(TEXT).with_transform(tokenize)
        args = stack.SFTConfig(output_dir=str(tmp_path / stack.__name__), **COMMON)
        with pytest.raises(ValueError, match="with_transform"):
            stack.SFTTrainer(model=model_dir, args=args, train_dataset=dataset)
        args = stack.SFTConfig(output_dir=str(tmp_path / stack.__name__), **COMMON,
                               dataset_kwargs={"skip_prepare_dataset": True},
                               remove_unused_columns=False)  # the transform's input columns
        trainer = stack.SFTTrainer(model=model_dir, args=args, train_dataset=dataset)
        assert trainer.train_dataset is dataset  # handed through, the transform still live
        assert trainer.train_dataset[0]["input_ids"] == tokenizer.encode(TEXT[0]["text"])
        trainer.train()
        assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))


def test_padding_free_without_packing_refused_as_trl(model_dir, tmp_path):
    import trl

    import nanosft

    for stack in (trl, nanosft):
        args = stack.SFTConfig(output_dir=str(tmp_path / stack.__name__), **COMMON,
                               padding_free=True, max_length=64)
        with pytest.raises(ValueError, match="`max_length` is not enforced"):
            stack.SFTTrainer(model=model_dir, args=args,
                             train_dataset=datasets.Dataset.from_list(TEXT))


def test_collator_keeps_caller_labels_as_trl():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling as TrlCollator

    from nanosft.collator import DataCollatorForLanguageModeling

    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "completion_mask": [0, 0, 1, 1],
             "assistant_masks": [1, 1, 0, 1]},
            {"input_ids": [9, 10], "labels": [9, -100], "completion_mask": [0, 1]}]
    for padding_free in (False, True):
        theirs = TrlCollator(pad_token_id=0, padding_free=padding_free)(rows)
        ours = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=padding_free)(rows)
        torch.testing.assert_close(ours["labels"], theirs["labels"], rtol=0, atol=0)
        torch.testing.assert_close(ours["input_ids"], theirs["input_ids"], rtol=0, atol=0)
    lengths = [[3, 2], [4]]
    for got, want in zip(DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths(
            lengths), TrlCollator.get_position_ids_from_packed_seq_lengths(lengths)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_skip_prepare_with_masks_but_no_labels_and_no_train_dataset_refused_as_trl(model_dir,
                                                                                   tmp_path):
    import trl

    import nanosft

    rows = [{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}] * 4
    for stack in (trl, nanosft):
        args = stack.SFTConfig(output_dir=str(tmp_path / stack.__name__), **COMMON,
                               dataset_kwargs={"skip_prepare_dataset": True})
        with pytest.raises(ValueError, match="mask columns but no 'labels'.*Add a 'labels' column"):
            stack.SFTTrainer(model=model_dir, args=args,
                             train_dataset=datasets.Dataset.from_list(rows))
        with pytest.raises(ValueError, match="`train_dataset` is required"):
            stack.SFTTrainer(model=model_dir, args=args, train_dataset=None)
