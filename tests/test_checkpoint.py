"""Behaviour of nanosft.run.checkpoint: exact resume, atomic saves, rotation, clear errors.

Compared: after save -> more training -> load, the weights, optimizer moments, scheduler
position and the python/numpy/torch random draws equal what they were at save time (draws taken
right after saving vs right after loading); a save that fails mid-way (a write monkeypatched to
raise OSError) leaves the previous checkpoint loadable and no temp folder; rotation keeps the
newest and the best; a folder that is not a checkpoint is named with what it lacks. Hermetic:
tiny nn.Modules on CPU in tmp_path.
Run: python -m pytest -q tests/test_checkpoint.py
"""

import json
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from nanosft.run import checkpoint as ckpt
from nanosft.args import TrainingArguments
from nanosft.optim import create_optimizer, create_scheduler


class TinyTied(nn.Module):
    """Embedding tied to the head, a norm and a biased linear: shapes checkpoints must handle."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.norm(torch.relu(self.proj(self.embed(ids)))))


def _setup(seed=0):
    torch.manual_seed(seed)
    model = TinyTied()
    args = TrainingArguments(
        output_dir="unused",
        learning_rate=1e-2,
        weight_decay=0.1,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        optim="adamw_torch",
    )
    optimizer = create_optimizer(model, args)
    scheduler = create_scheduler(args, optimizer, num_training_steps=10)
    return model, optimizer, scheduler, args


def _train(model, optimizer, scheduler, steps):
    for _ in range(steps):
        ids = torch.randint(0, 16, (4, 5))
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _save(path, model, optimizer, scheduler, args, step):
    ckpt.save_checkpoint(path, model=model, optimizer=optimizer, lr_scheduler=scheduler,
                         trainer_state={"global_step": step, "log_history": []}, args=args)


def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tmp_path):
    model, optimizer, scheduler, args = _setup()
    _train(model, optimizer, scheduler, 3)
    path = str(tmp_path / "checkpoint-3")
    _save(path, model, optimizer, scheduler, args, 3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg_sq"].clone() for s in optimizer.state.values()]
    lr = scheduler.get_last_lr()
    draws_after_save = _draws()

    _train(model, optimizer, scheduler, 2)  # move everything away from the saved state
    state = ckpt.load_checkpoint(path, model=model, optimizer=optimizer, lr_scheduler=scheduler)

    assert state["global_step"] == 3
    assert _draws() == draws_after_save
    assert scheduler.get_last_lr() == lr
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)
    for s, m in zip(optimizer.state.values(), moments):
        torch.testing.assert_close(s["exp_avg_sq"], m, rtol=0, atol=0)
    assert model.head.weight is model.embed.weight  # loading in place keeps the tie
    saved_args = json.loads((tmp_path / "checkpoint-3" / "training_args.json").read_text())
    assert saved_args["learning_rate"] == 1e-2


def test_resumed_training_equals_uninterrupted_training(tmp_path):
    torch.manual_seed(1)
    model_a, opt_a, sched_a, _ = _setup(seed=5)
    _train(model_a, opt_a, sched_a, 6)

    torch.manual_seed(1)
    model_b, opt_b, sched_b, args = _setup(seed=5)
    _train(model_b, opt_b, sched_b, 3)
    path = str(tmp_path / "checkpoint-3")
    _save(path, model_b, opt_b, sched_b, args, 3)
    model_c, opt_c, sched_c, _ = _setup(seed=99)  # a fresh process: other weights, other RNG
    ckpt.load_checkpoint(path, model=model_c, optimizer=opt_c, lr_scheduler=sched_c)
    _train(model_c, opt_c, sched_c, 3)
    for (k, a), c in zip(model_a.state_dict().items(), model_c.state_dict().values()):
        torch.testing.assert_close(c, a, rtol=0, atol=0, msg=k)


def test_tied_weights_are_stored_once(tmp_path):
    model, optimizer, scheduler, args = _setup()
    _save(str(tmp_path / "checkpoint-1"), model, optimizer, scheduler, args, 1)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "checkpoint-1" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "embed.weight" in names and "head.weight" not in names


def test_failed_save_keeps_previous_checkpoint_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    model, optimizer, scheduler, args = _setup()
    _save(str(tmp_path / "checkpoint-1"), model, optimizer, scheduler, args, 1)
    _train(model, optimizer, scheduler, 1)
    real_save = torch.save

    def disk_full_on_scheduler(obj, f, *a, **kw):
        if str(f).endswith("scheduler.pt"):  # optimizer.pt and the weights were already written
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", disk_full_on_scheduler)
    with pytest.raises(
        OSError, match="checkpoint-2 failed.*earlier checkpoints are untouched"
    ) as err:
        _save(str(tmp_path / "checkpoint-2"), model, optimizer, scheduler, args, 2)
    monkeypatch.undo()
    assert err.value.errno == 28
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]
    assert ckpt.get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")
    assert ckpt.load_checkpoint(str(tmp_path / "checkpoint-1"), model=model, optimizer=optimizer,
                                lr_scheduler=scheduler)["global_step"] == 1


def test_saving_the_same_step_twice_replaces_the_folder(tmp_path):
    model, optimizer, scheduler, args = _setup()
    path = str(tmp_path / "checkpoint-4")
    _save(path, model, optimizer, scheduler, args, 4)
    ckpt.save_checkpoint(path, model=model, optimizer=optimizer, lr_scheduler=scheduler,
                         trainer_state={"global_step": 4, "tag": "second"}, args=args)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]
    assert (
        json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["tag"]
        == "second"
    )


def _make_checkpoints(root, steps):
    for step in steps:  # trainer_state.json: what makes a checkpoint valid to resume
        os.makedirs(os.path.join(root, f"checkpoint-{step}"))
        with open(os.path.join(root, f"checkpoint-{step}", "trainer_state.json"), "w") as f:
            f.write("{}")


def test_rotation_keeps_newest_and_best(tmp_path):
    _make_checkpoints(tmp_path, [5, 10, 15, 20, 25])
    deleted = ckpt.rotate_checkpoints(str(tmp_path), save_total_limit=2,
                                      best_model_checkpoint=str(tmp_path / "checkpoint-10"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-25"]
    assert [os.path.basename(d) for d in deleted] == [
        "checkpoint-5",
        "checkpoint-15",
        "checkpoint-20",
    ]


def test_rotation_with_limit_one_still_keeps_the_best(tmp_path):
    # transformers' rule: the newest and the best both survive even when that exceeds the limit.
    _make_checkpoints(tmp_path, [2, 4, 6])
    ckpt.rotate_checkpoints(str(tmp_path), 1, best_model_checkpoint=str(tmp_path / "checkpoint-2"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-6"]


def test_rotation_orders_by_step_number_not_by_name(tmp_path):
    _make_checkpoints(tmp_path, [9, 10, 100])  # as strings, "checkpoint-10" < "checkpoint-9"
    ckpt.rotate_checkpoints(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-100"]
    assert ckpt.rotate_checkpoints(str(tmp_path), None) == []


def test_get_last_checkpoint_ignores_and_warns_about_temp_folders(tmp_path):
    _make_checkpoints(tmp_path, [3, 12])
    os.makedirs(tmp_path / ".tmp-checkpoint-20")
    os.makedirs(tmp_path / "checkpoint-notes")
    with pytest.warns(UserWarning, match=r"\.tmp-checkpoint-20"):
        assert ckpt.get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-12")
    assert ckpt.get_last_checkpoint(str(tmp_path / "missing")) is None


def test_resume_from_a_folder_that_is_not_a_checkpoint_names_what_is_missing(tmp_path):
    model, optimizer, scheduler, _ = _setup()
    (tmp_path / "checkpoint-7").mkdir()
    with pytest.raises(
        FileNotFoundError,
        match=r"missing trainer_state\.json, model\.safetensors, optimizer\.pt, "
        r"scheduler\.pt.*did you mean .*checkpoint-7",
    ):
        ckpt.load_checkpoint(
            str(tmp_path), model=model, optimizer=optimizer, lr_scheduler=scheduler
        )
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        ckpt.load_checkpoint(
            str(tmp_path / "nope"), model=model, optimizer=optimizer, lr_scheduler=scheduler
        )


def test_corrupt_file_is_named(tmp_path):
    model, optimizer, scheduler, args = _setup()
    path = tmp_path / "checkpoint-1"
    _save(str(path), model, optimizer, scheduler, args, 1)
    (path / "optimizer.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"optimizer\.pt could not be read.*delete"):
        ckpt.load_checkpoint(str(path), model=model, optimizer=optimizer, lr_scheduler=scheduler)


def test_optimizer_state_of_another_model_is_refused(tmp_path):
    model, optimizer, scheduler, args = _setup()
    path = tmp_path / "checkpoint-1"
    _save(str(path), model, optimizer, scheduler, args, 1)
    model.proj.weight.requires_grad_(False)  # one fewer trainable tensor: groups no longer match
    other_opt = create_optimizer(model, args)
    with pytest.raises(ValueError, match=r"optimizer\.pt does not fit this AdamW"):
        ckpt.load_checkpoint(str(path), model=model, optimizer=other_opt, lr_scheduler=None)


def test_rng_files_per_rank(tmp_path):
    ckpt.save_rng_state(str(tmp_path), rank=1, world_size=2)
    ckpt.save_rng_state(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["rng_state.pth", "rng_state_1.pth"]
    torch.manual_seed(3)
    ckpt.save_rng_state(str(tmp_path), rank=1, world_size=2)
    expected = torch.rand(2)
    assert ckpt.load_rng_state(str(tmp_path), rank=1, world_size=2) is True
    torch.testing.assert_close(torch.rand(2), expected, rtol=0, atol=0)
    with pytest.warns(UserWarning, match="rng_state_3.pth not found"):
        assert ckpt.load_rng_state(str(tmp_path), rank=3, world_size=4) is False


def test_lora_model_saves_the_adapter_only(tmp_path):
    peft = pytest.importorskip("nanosft.peft")
    model_mod = pytest.importorskip("nanosft.model")
    config = model_mod.ModelConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = peft.get_peft_model(model_mod.CausalLM(config), peft.LoraConfig(r=2, lora_alpha=4))
    args = TrainingArguments(output_dir="unused", learning_rate=1e-2, optim="adamw_torch")
    optimizer = create_optimizer(model, args)
    scheduler = create_scheduler(args, optimizer, num_training_steps=4)
    ids = torch.randint(0, 64, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    path = str(tmp_path / "checkpoint-1")
    _save(path, model, optimizer, scheduler, args, 1)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(path))
    assert "model.safetensors" not in os.listdir(path)
    saved = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    with torch.no_grad():
        for k, p in model.named_parameters():
            if "lora_" in k:
                p.add_(1.0)
    ckpt.load_checkpoint(path, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    for k, v in saved.items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0, msg=k)
