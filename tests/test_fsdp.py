"""FSDP2 (torch fully_shard, gloo, 2 CPU processes) trains to the parameters of one process.

Compared: full fine-tuning, LoRA, DoRA over an NF4 base and QLoRA, each 4 AdamW steps with gradient
accumulation 2; 2 ranks x per-device batch 2 against 1 process x batch 4 (rank r gets global
micro-batches r, r+2, ..., so each micro-step covers the same 4 rows). Every trainable parameter
within 1e-5 (measured ~3e-7: fp32 sums in another order, turned into parameter changes of about lr x
relative error by Adam), the logged losses and grad_norm too.
Also asserted, in the same launch (starting processes is the slow part):
- no reduce-scatter before the sync step: with accumulation 2 a run makes as many reduce-scatters as
  one without accumulation and the same optimizer steps; negative control: without
  set_requires_gradient_sync(False) every micro-batch reduce-scatters (twice as many);
- clipping over sharded gradients: the logged norm equals the one-process norm; negative control:
  the norm of the rank's own shards differs;
- the token count all-reduce: negative control without it (average_tokens_across_devices=False)
  differs;
- bytes per rank: each rank holds about half of the parameter bytes (4-bit bytes and absmax
  included);
- resume (full, QLoRA): a fresh 2-rank Trainer resumed from checkpoint-1 (mid-epoch: what a run
  killed after checkpoint-1 leaves) ends bitwise equal to the uninterrupted 2-rank run; negative
  control: resuming with ignore_data_skip (replaying the epoch) is caught. Checkpoint files equal
  what one process writes: same files, keys, dtypes, shapes, optimizer layout, values within 1e-5;
  so do the folders Trainer.save_model writes (config or adapter_config identical).
Hermetic: torch.multiprocessing spawn on localhost, tiny models (hidden 64), random token rows, one
thread each.
Run: python -m pytest -q tests/test_fsdp.py
"""

import contextlib
import os
import socket
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from tiny import join_as_rank, leave_group, tiny_model
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from nanosft import distributed
from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.parallel.fsdp import held_bytes
from nanosft.nf4 import quantize_model
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.trainer import Trainer

VOCAB = 64
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
}  # NF4 needs in_features divisible by its 64-value blocks
MODES = ("full", "lora", "qdora", "qlora")
TOL = 1e-5


def build(mode):
    """The same seeded tiny model in every process: float or NF4 base, with or without an
    adapter."""
    model = tiny_model(seed=0, **SIZES)
    if mode in ("qdora", "qlora"):
        quantize_model(model)
    if mode == "full":
        return model
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets,
        use_dora=mode == "qdora",
        init_lora_weights="gaussian",
    )
    return get_peft_model(model, config)


def rows(n=16):
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 14, (1,), generator=g))  # ragged: each rank pads differently
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        out.append(
            {
                "input_ids": ids,
                "labels": [t if j >= length // 2 else -100 for j, t in enumerate(ids)],
            }
        )
    return out


def make_trainer(mode, output_dir, batch_size, ga=2, fsdp=False, **overrides):
    kwargs = {
        "output_dir": output_dir,
        "per_device_train_batch_size": batch_size,
        "gradient_accumulation_steps": ga,
        "num_train_epochs": 2,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "optim": "adamw_torch",
        "disable_tqdm": True,
        "seed": 5,
        "max_grad_norm": 0.5,
        **overrides,
    }
    if fsdp:
        kwargs.update(
            fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True}
        )
    args = TrainingArguments(**kwargs)
    return Trainer(
        build(mode), args, train_dataset=rows(), data_collator=DataCollatorForLanguageModeling(0)
    )


def trainable_state(trainer):
    """Name -> whole tensor of every trainable parameter (a collective under FSDP: every rank calls
    it)."""
    return {
        n: distributed.to_full(p.detach()).clone()
        for n, p in trainer.model.named_parameters()
        if p.requires_grad
    }


def logged(trainer):
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def count_reduce_scatters(run):
    """Calls of the collective FSDP2 reduce-scatters gradients with (torch 2.13:
    dist.reduce_scatter_single)."""
    name = (
        "reduce_scatter_single"
        if hasattr(torch.distributed, "reduce_scatter_single")
        else "reduce_scatter_tensor"
    )
    calls, original = [], getattr(torch.distributed, name)
    setattr(torch.distributed, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    try:
        run()
    finally:
        setattr(torch.distributed, name, original)
    return len(calls)


def resume_runs(out):
    """Per mode: the uninterrupted run, a fresh Trainer resumed from its checkpoint-1 (mid-epoch:
    what a run killed after checkpoint-1 leaves), and the negative control with ignore_data_skip."""
    runs = {}
    for mode in ("full", "qlora"):
        saving = {"save_strategy": "steps", "save_steps": 1}
        first = make_trainer(mode, os.path.join(out, f"ckpt-{mode}"), 2, fsdp=True, **saving)
        first.train()
        resumed = {}
        for label, extra in (("resumed", {}), ("replayed", {"ignore_data_skip": True})):
            trainer = make_trainer(mode, os.path.join(out, f"{label}-{mode}"), 2, fsdp=True,
                                   **saving, **extra)
            trainer.train(resume_from_checkpoint=os.path.join(out, f"ckpt-{mode}", "checkpoint-1"))
            resumed[label] = trainable_state(trainer)
        runs[mode] = {"uninterrupted": trainable_state(first), **resumed}
    return runs


def _worker(rank, port, out):
    join_as_rank(rank, port)
    result = {}
    for mode in MODES:
        trainer = make_trainer(mode, os.path.join(out, mode), batch_size=2, fsdp=True)
        trainer.train()
        trainer.save_model(os.path.join(out, f"saved-{mode}"))  # every rank: shards are gathered
        result[mode] = {
            "state": trainable_state(trainer),
            "logged": logged(trainer),
            "held_bytes": held_bytes(trainer.model),
        }
        result[mode]["held_bytes_all"] = distributed.all_reduce_sum(
            torch.tensor(result[mode]["held_bytes"])
        ).item()
    result["no_sync"] = {}
    for label, ga, sync_every in (
        ("ga2", 2, False),
        ("ga1", 1, False),
        ("ga2_reduce_every", 2, True),
    ):
        trainer = make_trainer(
            "full", os.path.join(out, label), batch_size=2, ga=ga, fsdp=True, max_steps=2
        )
        # the classic mistake: set_requires_gradient_sync(False) never reaches FSDP on the first
        # micro-batches
        skip = mock.patch.object(FSDPModule, "set_requires_gradient_sync", lambda *a, **k: None)
        with skip if sync_every else contextlib.nullcontext():
            result["no_sync"][label] = count_reduce_scatters(trainer.train)
    trainer = make_trainer(
        "full",
        os.path.join(out, "local"),
        batch_size=2,
        fsdp=True,
        average_tokens_across_devices=False,
    )
    trainer.train()
    result["per_rank_tokens"] = trainable_state(trainer)
    # negative control for clipping: the norm of this rank's own gradient shards, taken at the first
    # sync step
    trainer = make_trainer("full", os.path.join(out, "norm"), batch_size=2, fsdp=True, max_steps=1)
    clip, local_norms = trainer._clip_grad_norm, []

    def clip_and_record(model):
        shards = [
            torch.linalg.vector_norm(p.grad.to_local())
            for p in model.parameters()
            if p.grad is not None
        ]
        local_norms.append(torch.linalg.vector_norm(torch.stack(shards)).item())
        return clip(model)

    trainer._clip_grad_norm = clip_and_record
    trainer.train()
    result["norm"], result["norm_local"] = logged(trainer)[0][1], local_norms[0]
    result["resume"] = resume_runs(out)
    if rank == 0:
        torch.save(result, os.path.join(out, "fsdp_result.pt"))
    leave_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    torch.set_num_threads(1)
    single = {}
    for mode in MODES:
        trainer = make_trainer(mode, str(out / f"single-{mode}"), batch_size=4)
        trainer.train()
        trainer.save_model(str(out / f"single-saved-{mode}"))
        single[mode] = {
            "state": trainable_state(trainer),
            "logged": logged(trainer),
            "held_bytes": held_bytes(trainer.model),
        }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for mode in ("full", "qlora"):  # the files one process writes, to compare with FSDP's
        saving = {"save_strategy": "steps", "save_steps": 2}
        make_trainer(mode, str(out / f"single-ckpt-{mode}"), batch_size=4, **saving).train()
    mp.spawn(_worker, args=(port, str(out)), nprocs=2, join=True)
    return single, torch.load(out / "fsdp_result.pt", weights_only=False), out


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_equal_one_process(runs, mode):
    single, sharded = runs[0][mode], runs[1][mode]
    assert len(single["logged"]) == len(sharded["logged"]) == 4  # 4 optimizer steps, GA 2
    torch.testing.assert_close(sharded["logged"], single["logged"], rtol=0, atol=TOL)
    assert set(sharded["state"]) == set(single["state"]) and single["state"]
    for name, value in single["state"].items():
        torch.testing.assert_close(sharded["state"][name], value, rtol=0, atol=TOL, msg=name)
    moved = max(
        (value - build_state(mode)[name]).abs().max().item()
        for name, value in single["state"].items()
    )
    assert (
        moved > 100 * TOL
    )  # the parameters did move: the comparison is not between two untouched models


def build_state(mode):
    return {n: p.detach() for n, p in build(mode).named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", MODES)
def test_each_rank_holds_half_the_parameter_bytes(runs, mode):
    one, rank0, both = (
        runs[0][mode]["held_bytes"],
        runs[1][mode]["held_bytes"],
        runs[1][mode]["held_bytes_all"],
    )
    print(f"{mode}: one process {one:,} bytes, rank 0 of 2 holds {rank0:,} ({rank0 / one:.3f})")
    # whole on every rank: each 4-bit layer's code tables (16 + 256 fp32) and offset (1 fp32); the
    # rest is split
    linears4bit = 14 if mode.startswith("q") else 0  # 2 layers x 7 projections
    assert both - one == linears4bit * (16 + 256 + 1) * 4
    assert abs(rank0 - both / 2) <= 0.02 * one  # uneven shards differ by at most a row per tensor


def test_no_reduce_scatter_before_the_sync_step(runs):
    counts = runs[1]["no_sync"]
    # same optimizer steps, twice the micro-batches: reduce-scatters only on the sync micro-batch
    assert counts["ga2"] == counts["ga1"] > 0
    assert (
        counts["ga2_reduce_every"] == 2 * counts["ga2"]
    )  # negative control: every micro-batch reduces


def test_clip_norm_over_sharded_grads_is_the_one_process_norm(runs):
    single, sharded = runs[0]["full"]["logged"][0][1], runs[1]["norm"]
    assert abs(sharded - single) < TOL * max(1.0, single)
    assert (
        abs(runs[1]["norm_local"] - single) > 1e-3
    )  # negative control: the norm of one rank's shards


def test_token_count_all_reduce_is_needed(runs):
    single, local = runs[0]["full"]["state"], runs[1]["per_rank_tokens"]
    assert max((local[k] - v).abs().max().item() for k, v in single.items()) > 10 * TOL


# ----- bad input: each error names the problem and the fix, before anything is written
@pytest.mark.parametrize(
    "fsdp, config, words",
    [
        (
            True,
            {"fsdp_cpu_offload": True},
            ["cpu_offload", "supported keys", "reshard_after_forward"],
        ),
        (True, {"version": 1}, ["'version'", "use 2"]),
        (True, {"state_dict_type": "SHARDED_STATE_DICT"}, ["state_dict_type", "FULL_STATE_DICT"]),
        (True, {"reshard_after_forward": "maybe"}, ["reshard_after_forward", "true or false"]),
        ("full_shard offload", None, ["'offload'", "fsdp=True"]),
    ],
)
def test_bad_fsdp_config_is_refused(tmp_path, fsdp, config, words):
    with pytest.raises(ValueError) as e:
        TrainingArguments(output_dir=str(tmp_path), fsdp=fsdp, fsdp_config=config)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_fsdp_config_from_a_json_file_with_prefixed_keys(tmp_path):
    path = tmp_path / "fsdp_config.json"
    path.write_text(
        '{"fsdp_version": 2, "fsdp_reshard_after_forward": false, '
        '"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}'
    )
    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, fsdp_config=str(path))
    assert args.fsdp is True and args.fsdp_config["reshard_after_forward"] is False
    assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*could not be read"):
        TrainingArguments(
            output_dir=str(tmp_path), fsdp=True, fsdp_config=str(tmp_path / "bad.json")
        )


@pytest.mark.parametrize("option", [{"optim": "adamw_bnb_8bit"}, {"torch_compile": True}])
def test_fsdp_with_options_it_cannot_honour_is_refused(tmp_path, option):
    with pytest.raises(ValueError, match=f"fsdp with {next(iter(option))}=.*not supported"):
        TrainingArguments(output_dir=str(tmp_path), fsdp=True, **option)


def test_fsdp_in_one_process_is_refused_before_training(tmp_path, monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    trainer = make_trainer(
        "full", str(tmp_path / "out"), batch_size=2, fsdp=True, save_strategy="steps", save_steps=1
    )
    with pytest.raises(
        RuntimeError, match="fsdp needs several processes.*torchrun --nproc_per_node 2"
    ):
        trainer.train()
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize("mode", ["full", "qlora"])
def test_resumed_run_is_bitwise_equal_to_the_uninterrupted_one(runs, mode):
    run = runs[1]["resume"][mode]
    for name, value in run["uninterrupted"].items():
        assert torch.equal(run["resumed"][name], value), name
    # negative control: replaying the epoch from its first batch after resuming is caught
    assert any(not torch.equal(run["replayed"][k], v) for k, v in run["uninterrupted"].items())


@pytest.mark.parametrize("mode", ["full", "qlora"])
def test_fsdp_checkpoint_files_equal_what_one_process_writes(runs, mode):
    out = runs[2]
    one, two = out / f"single-ckpt-{mode}" / "checkpoint-2", out / f"ckpt-{mode}" / "checkpoint-2"
    weights = "model.safetensors" if mode == "full" else "adapter_model.safetensors"
    assert sorted(p.name for p in one.iterdir() if "rng" not in p.name) == \
        sorted(p.name for p in two.iterdir() if "rng" not in p.name)
    a, b = load_file(one / weights), load_file(two / weights)
    assert list(a) == list(b) and a
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=TOL, msg=name)
    opt_a = torch.load(one / "optimizer.pt", weights_only=True)
    opt_b = torch.load(two / "optimizer.pt", weights_only=True)
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert set(opt_a["state"]) == set(opt_b["state"])
    for i, state in opt_a["state"].items():
        for key, value in state.items():
            assert not isinstance(opt_b["state"][i][key], DTensor)  # whole tensors in the file
            torch.testing.assert_close(opt_b["state"][i][key], value, rtol=0, atol=TOL)


@pytest.mark.parametrize("mode", MODES)
def test_save_model_writes_the_files_of_one_process(runs, mode):
    one, two = runs[2] / f"single-saved-{mode}", runs[2] / f"saved-{mode}"
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    weights = "model.safetensors" if mode == "full" else "adapter_model.safetensors"
    a, b = load_file(one / weights), load_file(two / weights)
    assert list(a) == list(b) and a
    for name in a:  # the trained values: one process and FSDP agree to the parity tolerance
        assert a[name].dtype == b[name].dtype, name
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=TOL, msg=name)
    config = "config.json" if mode == "full" else "adapter_config.json"
    assert (one / config).read_text() == (two / config).read_text()
