"""The spawned launches the N-D parallel test files share, and the runs they compare with.

Not a test module. Starting processes costs more than the tiny runs themselves on a 2-core box,
so each test file registers its cases (a function every rank calls, returning rank 0's result)
at import, and the first fixture that asks for a world size starts one launch that runs the
cases of every file collected: one spawn of 2 processes and one of 4 for the whole suite (plus
a second 4-process phase for resuming from the first one's checkpoints). Run alone, a file
launches only its own cases. A failing case fails every file's tests of that launch.
Also here: the tiny rows, models and Trainer the files train, and one-process runs cached by
(global batch, mode, width), so files comparing with the same run train it once.
"""

import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp
from tiny import join_as_rank, leave_group, tiny_model

from nanosft import ParallelismConfig, distributed
from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.nf4 import quantize_model
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.trainer import Trainer

VOCAB = 64
BATCH = 2  # per data-parallel rank
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the width NF4 under tp needs (whole 64-value blocks on every rank); o_proj's 64 inputs would
# give each of 2 tp ranks half a block, so it stays float there
WIDE = {"hidden_size": 64, "intermediate_size": 128}
WIDE_SKIP = ("lm_head", "o_proj")


def rows(n=24):
    """Ragged random rows (4-13 tokens: shards pad differently), the first half unsupervised."""
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 14, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        out.append({"input_ids": ids,
                    "labels": [t if j >= length // 2 else -100 for j, t in enumerate(ids)]})
    return out


def lora_config(mode):
    targets = ["q_proj", "v_proj"] if mode == "qlora_qv" else TARGETS  # the rest bare 4-bit
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian",
                      use_dora="dora" in mode, lora_dropout=0.1 if "dropout" in mode else 0.0)


def build(mode, wide=False):
    """The tiny Llama (hidden 32, or 64 when `wide`), 4-bit for modes starting with "q", with
    LoRA / DoRA adapters (on every projection, or q/v for "qlora_qv") unless mode is "full"."""
    model = tiny_model(seed=0, **(WIDE if wide else {}))
    if mode.startswith("q"):
        quantize_model(model, skip_modules=WIDE_SKIP if wide else ("lm_head",))
    return model if mode == "full" else get_peft_model(model, lora_config(mode))


def training_args(output_dir, batch_size, sizes=None, **overrides):
    """3 optimizer steps of accumulation 2, clipping active (max_grad_norm 0.5), logged each."""
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=batch_size,
                  gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
                  logging_steps=1, save_strategy="no", use_cpu=True, optim="adamw_torch",
                  disable_tqdm=True, seed=5, max_grad_norm=0.5, report_to="none",
                  parallelism_config=None if sizes is None else ParallelismConfig(**sizes))
    return TrainingArguments(**{**kwargs, **overrides})


def make_trainer(output_dir, batch_size, sizes=None, mode="full", wide=False, model=None,
                 **overrides):
    args = training_args(output_dir, batch_size, sizes, **overrides)
    return Trainer(build(mode, wide) if model is None else model, args, train_dataset=rows(),
                   data_collator=DataCollatorForLanguageModeling(0))


def trained(trainer):
    """The logged (loss, grad_norm) of each step and every trainable parameter, whole."""
    return {
        "logged": [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h],
        "params": {n: distributed.to_full(p.detach()).clone()
                   for n, p in trainer.model.named_parameters() if p.requires_grad},
    }


def largest_difference(a, b):
    assert set(a) == set(b) and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ----- one-process runs with the global batch, trained once per session
_SINGLE = {}


def single(tmp_path_factory, batch_size, mode="full", wide=False):
    """(trainer, trained(trainer)) of one process at `batch_size` rows (the mesh's global batch)."""
    key = (batch_size, mode, wide)
    if key not in _SINGLE:
        folder = tmp_path_factory.mktemp(f"single-{batch_size}-{mode}{'-wide' if wide else ''}")
        trainer = make_trainer(str(folder), batch_size, mode=mode, wide=wide)
        trainer.train()
        _SINGLE[key] = (trainer, trained(trainer))
    return _SINGLE[key]


# ----- the shared launches
_CASES = {}  # (world size, phase) -> {key: function(folder) -> rank 0's result}
_RESULTS = {}


def register(world_size, key, function, phase="first"):
    """Run `function(folder)` on every rank of the (world_size, phase) launch; `folder` is the
    case's own, beside the other cases' of the world size (phases share them)."""
    _CASES.setdefault((world_size, phase), {})[key] = function


def case_folder(root, key):
    """The folder (a Path) of case `key` under a launch's root."""
    return Path(root) / key.replace(" ", "").replace("/", "-")


def launch_root(tmp_path_factory, world_size):
    return tmp_path_factory.getbasetemp() / f"nd-world{world_size}"


def _worker(rank, port, root, world_size, cases):
    join_as_rank(rank, port, world_size)
    results = {}
    for key, function in cases.items():
        folder = case_folder(root, key)
        os.makedirs(folder, exist_ok=True)
        results[key] = function(str(folder))
    if rank == 0:
        torch.save(results, os.path.join(root, "results.pt"))
    leave_group()


def results(tmp_path_factory, world_size, phase="first"):
    """{case key: rank 0's result} of every case registered for (world_size, phase), launching
    them (once) in `world_size` spawned processes; the "resume" phase runs after "first"."""
    if (world_size, phase) not in _RESULTS:
        if phase != "first":
            results(tmp_path_factory, world_size)
        root = launch_root(tmp_path_factory, world_size)
        root.mkdir(exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.set_num_threads(1)
        try:
            mp.spawn(_worker, args=(port, str(root), world_size, _CASES[world_size, phase]),
                     nprocs=world_size, join=True)
            _RESULTS[world_size, phase] = torch.load(root / "results.pt", weights_only=False)
        except Exception as error:  # once: the other files' fixtures see the same failure
            _RESULTS[world_size, phase] = error
        if (root / "results.pt").exists():  # the next phase writes its own
            os.remove(root / "results.pt")
    outcome = _RESULTS[world_size, phase]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
