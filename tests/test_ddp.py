"""Two DDP ranks (gloo, CPU) train to the same parameters and logged losses as one process with
the same global batch.

Rank r gets the global micro-batches r, r+2, ... of the seeded order (accelerate's
BatchSamplerShard), so with per-device batch 2 on 2 ranks each micro-step covers the 4 rows one
process sees with batch 4. num_items_in_batch is summed over ranks and the loss multiplied by
world_size, which cancels DDP's gradient average: the gradient is the token-weighted mean of the
whole global window. Negative control: without the all-reduce of the count (each rank divides by
its own tokens) the parameters differ.
Tolerance 1e-6 on losses and parameters after 4 AdamW steps (measured ~2.5e-7: fp32 sums in
another order; Adam's normalised update turns gradient rounding into parameter changes of about
lr * relative error, hence lr 1e-3).
Hermetic: torch.multiprocessing spawn on localhost, a tiny nanosft CausalLM, random rows, one
thread per process.
Run: python -m pytest -q tests/test_ddp.py
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.distributed import cleanup
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer
from tiny import join_as_rank

VOCAB = 64


def tiny_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=64))


def rows(n=12):
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 14, (1,), generator=g))  # ragged: every rank pads differently
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        labels = [t if j >= length // 2 else -100 for j, t in enumerate(ids)]
        out.append({"input_ids": ids, "labels": labels})
    return out


def train(output_dir, batch_size, average_tokens=True):
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", use_cpu=True, optim="adamw_torch",
                             disable_tqdm=True, seed=5,
                             average_tokens_across_devices=average_tokens)
    trainer = Trainer(tiny_model(), args, train_dataset=rows(),
                      data_collator=DataCollatorForLanguageModeling(0))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer.model.state_dict(), losses


def _worker(rank, port, output_dir):
    join_as_rank(rank, port)
    results = {}
    # one spawn for both runs: starting processes is the slow part
    for average_tokens in (True, False):
        state, losses = train(output_dir, batch_size=2, average_tokens=average_tokens)
        results[average_tokens] = {"state": state, "losses": losses}
    if rank == 0:
        torch.save(results, os.path.join(output_dir, "ddp_result.pt"))
    cleanup()


@pytest.mark.skipif(not torch.distributed.is_available(),
                    reason="torch.distributed is not built in")
def test_two_ranks_equal_one_process(tmp_path):
    torch.set_num_threads(1)
    single_state, single_losses = train(str(tmp_path / "single"), batch_size=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    results = torch.load(tmp_path / "ddp_result.pt", weights_only=True)
    ddp = results[True]
    assert len(ddp["losses"]) == len(single_losses) == 4
    torch.testing.assert_close(ddp["losses"], single_losses, rtol=0, atol=1e-6)
    for key, value in single_state.items():
        torch.testing.assert_close(ddp["state"][key], value, rtol=0, atol=1e-6, msg=key)
    # negative control: per-rank token counts (no all-reduce, no x world_size)
    # weight the ranks equally
    local = results[False]["state"]
    assert max((local[k] - v).abs().max().item() for k, v in single_state.items()) > 1e-5


@pytest.mark.skipif(not torch.distributed.is_available(),
                    reason="torch.distributed is not built in")
def test_cleanup_frees_a_ddp_wrapper_left_in_a_cycle():
    """A DDP wrapper kept only by a reference cycle must be gone once cleanup() returns: left to
    interpreter finalization, its reducer frees the gloo group there, which can abort the process
    (SIGABRT, "terminate called without an active exception") after the work succeeded."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    was_enabled = gc.isenabled()
    gc.disable()  # the cycle must survive until cleanup(), as it may between two automatic passes
    try:
        holder = {"ddp": DistributedDataParallel(torch.nn.Linear(2, 2))}
        holder["self"] = holder  # the cycle: nothing outside it refers to the wrapper
        alive = weakref.ref(holder["ddp"])
        del holder
        assert alive() is not None
        cleanup()
        assert alive() is None
        assert not dist.is_initialized()
    finally:
        if was_enabled:
            gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
