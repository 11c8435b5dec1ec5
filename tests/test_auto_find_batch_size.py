"""auto_find_batch_size: the Trainer retries on out-of-memory with a smaller batch, as transformers.

Compared: with a simulated out-of-memory (a forward pre-hook raising CUDA's message above a row
limit), the batch sizes nanosft's Trainer tries equal those of accelerate's
find_executable_batch_size (which transformers' auto_find_batch_size calls) on the same limit; the
run that follows equals a run started at the found size (log_history and weights, exact: the
failed attempts never reach an optimizer step, and the schedule is rebuilt for the new length);
errors that are not out-of-memory are not retried; should_reduce_batch_size agrees with
accelerate's on the same exceptions; a batch of one that still fails ends with accelerate's message.
Hermetic: a tiny CausalLM on CPU, 30 random rows; no GPU needed (the OOM is raised, not provoked).
Run: python -m pytest -q tests/test_auto_find_batch_size.py
"""

import contextlib
import io

import pytest
import torch
from accelerate.utils import find_executable_batch_size as accelerate_find_executable_batch_size
from accelerate.utils.memory import should_reduce_batch_size as accelerate_should_reduce

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer
from nanosft.trainer_utils import should_reduce_batch_size

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)"


def rows(n=30):  # 30 = 6 x 5: no short last batch at the size the search finds
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, TINY["vocab_size"], (n, 12), generator=g).tolist()
    return [{"input_ids": r, "labels": r} for r in ids]


def make_trainer(tmp_path, limit=None, error=CUDA_OOM, **overrides):
    """A Trainer whose model raises `error` on any forward of more than `limit` rows."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**TINY))
    tried = []

    def hook(module, args, kwargs):
        tried.append(len(kwargs["input_ids"]))
        if limit is not None and len(kwargs["input_ids"]) > limit:
            raise (torch.OutOfMemoryError(error) if "memory" in error else RuntimeError(error))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    settings = {"per_device_train_batch_size": 16, "num_train_epochs": 1, "learning_rate": 1e-3,
                "logging_steps": 1, "save_strategy": "no", "use_cpu": True, "report_to": "none",
                "disable_tqdm": True, "optim": "adamw_torch", **overrides}
    args = TrainingArguments(output_dir=str(tmp_path), **settings)
    trainer = Trainer(model, args, train_dataset=rows(),
                      data_collator=DataCollatorForLanguageModeling(pad_token_id=0))
    return trainer, tried


def attempts(tried):
    """The first forward of each attempt: consecutive forwards of one size are one attempt."""
    return [size for i, size in enumerate(tried) if i == 0 or size != tried[i - 1]]


def accelerate_attempts(limit, start=16):
    seen = []

    def train(batch_size):
        seen.append(batch_size)
        if batch_size > limit:
            raise torch.OutOfMemoryError(CUDA_OOM)

    with contextlib.suppress(RuntimeError):  # limit 0: accelerate's "reached zero"
        accelerate_find_executable_batch_size(train, starting_batch_size=start)()
    return seen


def quiet_train(trainer):
    with contextlib.redirect_stdout(io.StringIO()):
        return trainer.train()


def test_batch_sizes_tried_equal_accelerate(tmp_path):
    trainer, tried = make_trainer(tmp_path, limit=5, auto_find_batch_size=True)
    quiet_train(trainer)
    expected = accelerate_attempts(limit=5)
    assert expected == [16, 14, 12, 10, 9, 8, 7, 6, 5]  # int(0.9 * b): accelerate 1.x, not halving
    assert attempts(tried) == expected
    assert trainer.state.train_batch_size == 5
    assert trainer.state.global_step == 6  # 30 / 5 micro-batches, GA 1


def test_found_run_equals_a_run_started_at_that_size(tmp_path):
    auto, _ = make_trainer(tmp_path / "auto", limit=5, auto_find_batch_size=True)
    quiet_train(auto)
    direct, _ = make_trainer(tmp_path / "direct", per_device_train_batch_size=5)
    quiet_train(direct)
    steps = [h for h in auto.state.log_history if "loss" in h and "grad_norm" in h]
    reference = [h for h in direct.state.log_history if "loss" in h and "grad_norm" in h]
    assert len(steps) == len(reference) == 6
    for ours, theirs in zip(steps, reference):
        # learning_rate too: the linear schedule was rebuilt for 6 steps, not kept from the 2-step
        # attempt at batch 16 (which would reach 0 after 2 steps)
        assert (ours["loss"], ours["grad_norm"], ours["learning_rate"]) == (
            theirs["loss"], theirs["grad_norm"], theirs["learning_rate"])
    for a, b in zip(auto.model.parameters(), direct.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_without_auto_find_the_out_of_memory_error_propagates(tmp_path):
    trainer, tried = make_trainer(tmp_path, limit=5)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        quiet_train(trainer)
    assert tried == [16]


def test_other_errors_are_not_retried(tmp_path):
    trainer, tried = make_trainer(tmp_path, limit=5, error="mat1 and mat2 shapes cannot be "
                                  "multiplied", auto_find_batch_size=True)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        quiet_train(trainer)
    assert tried == [16]


def test_batch_of_one_still_failing_ends_the_search(tmp_path):
    trainer, tried = make_trainer(tmp_path, limit=0, auto_find_batch_size=True,
                                  per_device_train_batch_size=4)
    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero") as info:
        quiet_train(trainer)
    assert "gradient_checkpointing" in str(info.value)  # the message names a fix
    assert attempts(tried) == accelerate_attempts(limit=0, start=4) == [4, 3, 2, 1]


@pytest.mark.parametrize("exception", [
    torch.OutOfMemoryError(CUDA_OOM),
    RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("out of memory"),  # no leading space and no period: not accelerate's pattern
    RuntimeError(CUDA_OOM, "a second argument"),
    ValueError(CUDA_OOM),
    MemoryError(),
])
def test_should_reduce_batch_size_agrees_with_accelerate(exception):
    assert should_reduce_batch_size(exception) == accelerate_should_reduce(exception)
