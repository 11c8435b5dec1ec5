"""Context parallel (nanosft.parallel.context_parallel): the online-softmax merge equals one
softmax over all keys, and the Trainer under parallelism_config cp (2 CPU processes), dp_shard x cp
and cp x tp (4 processes each, gloo) trains to what one process trains with the same global batch.

Single process: attention of simulated cp ranks (load-balanced split, odd lengths padded, right
and left padding, packed rows, GQA) merged block by block, against torch SDPA over
nanosft.masking's mask: outputs in fp32 within 1e-6, q/k/v gradients within 1e-6 plus 1e-6
relative (they reach ~5: a few fp32 ulps); every rank scores as many causal (query, key) pairs;
the loss of the parts summed equals the whole rows' loss.
Under spawn: the logged loss and grad_norm of 3 optimizer steps (gradient accumulation 2,
clipping active) and every trainable parameter afterwards equal one process within 1e-5, for full
fine-tuning, LoRA and QLoRA (NF4 base) under the three meshes (cp x tp's QLoRA on the hidden-64
model, whose tp pieces are whole quantization blocks; measured largest parameter differences: cp
full 5.3e-7, LoRA 4.5e-8, QLoRA 3.0e-8; dp_shard x cp full 3.1e-7, LoRA 3.5e-7, QLoRA 6.0e-8;
cp x tp full 5.3e-7, LoRA 4.5e-8, QLoRA 7.6e-7).
Negative controls in the cp launch:
- each rank's tokens at local positions 0..T_local-1, not their global ones: the logged values
  move 4.4e-4 and the parameters 3.9e-3 from one process;
- the loss returned without the cp factor (FSDP's average over cp ranks not undone): the logged
  losses and gradient norms halve.
Trainer.evaluate after cp training (whole rows on every rank, the sharded weights gathered by
FSDP) gives one process's eval_loss within 1e-5. SFTTrainer under dp_shard x cp (its loss from
each cp rank's tokens, the fused head's per-token outputs gathered over cp for TRL's metrics):
the logged loss, grad_norm, entropy, mean_token_accuracy and num_tokens of 3 steps within 1e-5 of
one process, parameters within 1e-5 (measured 2.7e-6 at lr 1e-2); with compute_loss_func or in
reference mode (loss paths reading the whole rows' logits) refused at construction.
Hermetic: torch.multiprocessing spawn on localhost (the launches of tests/nd_launch.py, of 2 and
4 processes, shared with the other N-D files), a tiny model (hidden 32, 2 layers), random token
rows, one thread per process.
Run: python -m pytest -q tests/test_context_parallel.py
"""

import dataclasses
import functools
import os
from unittest import mock

import nd_launch
import pytest
import torch
import torch.nn.functional as F
from nd_launch import BATCH, build, make_trainer, rows, trained
from tiny import tiny_model

from nanosft import distributed
from nanosft.loss import causal_lm_loss
from nanosft.masking import build_attention_mask
from nanosft.parallel import context_parallel
from nanosft.parallel.context_parallel import (build_layout, load_balanced_index,
                                               online_softmax_attention, padded_length,
                                               shard_rows)

VOCAB = 64
TOL = 1e-5


# ----- single process: simulated cp ranks
def simulated(q, k, v, attention_mask, position_ids, cp, scale=0.3):
    """Every simulated rank's queries over every rank's keys, merged online; back in row order."""
    B, H, T, D = q.shape
    padded = padded_length(T, cp)

    def pad(x):
        return F.pad(x, (0, 0, 0, padded - T))

    layouts = [build_layout(attention_mask, position_ids, T, cp, r) for r in range(cp)]
    keys = [pad(k)[:, :, lay.query_index] for lay in layouts]
    values = [pad(v)[:, :, lay.query_index] for lay in layouts]
    out = q.new_zeros(B, H, padded, D)
    for lay in layouts:
        masks = [lay.block_mask(j) for j in range(cp)]
        y = online_softmax_attention(pad(q)[:, :, lay.query_index], keys, values, masks, scale)
        out = out.index_copy(2, lay.query_index, y)
    return out[:, :, :T]


def qkv(B=2, H=4, KV=2, T=11, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, D, generator=g, requires_grad=True) for n in (H, KV, KV)]


PADDED = torch.tensor([[1] * 9 + [0] * 2, [0] * 3 + [1] * 8])  # right and left padding
PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("rows", ["plain", "padded", "packed"])
def test_online_softmax_equals_one_softmax(cp, rows):
    q, k, v = qkv()
    T = q.shape[2]  # 11: odd, padded to 12 for cp 2 and 3
    attention_mask = PADDED if rows == "padded" else None
    position_ids = PACKED if rows == "packed" else torch.arange(T)[None]
    mask = build_attention_mask(attention_mask, position_ids, T, 0)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                               enable_gqa=True, is_causal=mask is None)
    merged = simulated(q, k, v, attention_mask, position_ids, cp)
    torch.testing.assert_close(merged, reference, rtol=0, atol=1e-6)
    weights = torch.randn_like(reference)
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    got = torch.autograd.grad((merged * weights).sum(), (q, k, v))
    for a, b in zip(got, expected):  # gradients up to ~5: a few fp32 ulps of rounding apart
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_split_is_load_balanced():
    cp, T = 4, 24
    index = [load_balanced_index(T, cp, r) for r in range(cp)]
    assert sorted(torch.cat(index).tolist()) == list(range(T))  # every token on one rank
    assert index[0].tolist() == [0, 1, 2, 21, 22, 23]  # chunks 0 and 7 of 8
    pairs = [int((i + 1).sum()) for i in index]  # causal (query, key) pairs each rank scores
    assert len(set(pairs)) == 1
    contiguous = [int((torch.arange(r * 6, (r + 1) * 6) + 1).sum()) for r in range(cp)]
    assert max(contiguous) > 3 * min(contiguous)  # what the balance avoids


def test_parts_of_the_loss_add_up_to_the_rows_loss():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 9), generator=g)
    labels = ids.masked_fill(torch.rand(2, 9, generator=g) < 0.3, -100)
    logits = torch.randn(2, 9, VOCAB, generator=g)
    whole = causal_lm_loss(logits, labels, num_items_in_batch=17.0)
    cp = 3
    padded = F.pad(logits, (0, 0, 0, padded_length(9, cp) - 9))
    total = 0
    for r in range(cp):
        part = shard_rows(ids, None, None, labels, cp, r)
        assert part.num_items == labels[:, 1:].ne(-100).sum()  # the whole rows' count
        assert part.position_ids.tolist()[0] == part.layout.query_index.tolist()  # global
        local = padded[:, part.layout.query_index]
        total = total + F.cross_entropy(local.flatten(0, 1), part.shift_labels.flatten(),
                                        ignore_index=-100, reduction="sum") / 17.0
    torch.testing.assert_close(total, whole, rtol=0, atol=1e-6)


# ----- under spawn: the Trainer with parallelism_config
def local_positions(*args, **kwargs):
    part = shard_rows(*args, **kwargs)
    B, T = part.input_ids.shape
    return dataclasses.replace(part, position_ids=torch.arange(T).expand(B, T))


class WithoutCpFactor(context_parallel.ContextParallel):
    def forward(self, *args, **kwargs):
        outputs = super().forward(*args, **kwargs)
        outputs.loss = outputs.loss / self.cp_size
        return outputs


def _mode(mode):
    """("qlora", True) for "wide qlora" (hidden 64: NF4 pieces under tp need whole blocks)."""
    return mode.split()[-1], mode.startswith("wide")


def _mesh_case(folder, sizes, modes):
    result = {}
    for mode in modes:
        name, wide = _mode(mode)
        trainer = make_trainer(os.path.join(folder, mode.replace(" ", "-")), BATCH, sizes, name,
                               wide)
        trainer.train()
        result[mode] = trained(trainer)
        if mode == "full" and distributed.get_world_size() == 2:  # whole rows on every rank
            result["eval_loss"] = trainer.evaluate(rows(8))["eval_loss"]
    result["rows"] = [list(b) for b in trainer.get_train_dataloader().batch_sampler]
    if distributed.get_world_size() == 2:  # the negative controls
        with mock.patch.object(context_parallel, "shard_rows", local_positions):
            wrong = make_trainer(os.path.join(folder, "local"), BATCH, sizes)
            wrong.train()
        result["local_positions"] = trained(wrong)
        with mock.patch.object(context_parallel, "ContextParallel", WithoutCpFactor):
            wrong = make_trainer(os.path.join(folder, "factor"), BATCH, sizes)
            wrong.train()
        result["without_cp_factor"] = trained(wrong)
    per_rank = [None] * distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, result["rows"])
    result["per_rank_rows"] = per_rank
    return result


MESHES = {"cp": (2, {"cp_size": 2}), "dp_shard x cp": (4, {"dp_shard_size": 2, "cp_size": 2}),
          "cp x tp": (4, {"cp_size": 2, "tp_size": 2})}
MODES = {"cp": ("full", "lora", "qlora"), "dp_shard x cp": ("full", "lora", "qlora"),
         "cp x tp": ("full", "lora", "wide qlora")}
for _name, (_world_size, _sizes) in MESHES.items():
    nd_launch.register(_world_size, f"cp/{_name}", functools.partial(
        _mesh_case, sizes=_sizes, modes=MODES[_name]))


# SFTTrainer: prompt + completion rows (the completion one repeated token, so the token accuracy
# moves off 0 within 3 steps), pre-tokenized; its loss from the fused head's per-token outputs
SFT_MESH = {"dp_shard_size": 2, "cp_size": 2}


def sft_rows():
    out = []
    for row in rows():
        ids, half = row["input_ids"], len(row["input_ids"]) // 2
        out.append({"input_ids": ids[:half] + [7] * (len(ids) - half),
                    "completion_mask": [0] * half + [1] * (len(ids) - half)})
    return out


def sft_trainer(output_dir, batch_size, sizes=None):
    from nanosft.args import SFTConfig
    from nanosft.sft import SFTTrainer
    from nanosft.tokenizer import Tokenizer

    tokenizer = Tokenizer.train(["the cat sat on the mat", "red green blue"], vocab_size=260)
    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=batch_size,
                     gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2,
                     logging_steps=1, save_strategy="no", use_cpu=True, bf16=False,
                     optim="adamw_torch", disable_tqdm=True, seed=5, max_grad_norm=0.5,
                     report_to="none", parallelism_config=sizes)
    return SFTTrainer(tiny_model(seed=0, vocab_size=len(tokenizer)), args,
                      train_dataset=sft_rows(), processing_class=tokenizer)


SFT_LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")


def sft_trained(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"logged": [[h[k] for k in SFT_LOGGED] for h in logs],
            "params": trained(trainer)["params"]}


def _own_tokens_only(self, outputs, logits, part, length):
    """The negative control: each rank's per-token fields alone (zeros for the other cp ranks'
    tokens instead of their gathered fields)."""
    def own_piece(pieces, x, group=None):
        for j, piece in enumerate(pieces):
            piece.copy_(x if j == self.cp_rank else torch.zeros_like(x))

    with mock.patch.object(torch.distributed, "all_gather", own_piece):
        original_token_outputs(self, outputs, logits, part, length)


original_token_outputs = context_parallel.ContextParallel._token_outputs


def _sft_case(folder):
    trainer = sft_trainer(os.path.join(folder, "sft"), BATCH, SFT_MESH)
    trainer.train()
    result = sft_trained(trainer)
    with mock.patch.object(context_parallel.ContextParallel, "_token_outputs", _own_tokens_only):
        wrong = sft_trainer(os.path.join(folder, "own"), BATCH, SFT_MESH)
        wrong.train()
    result["own tokens only"] = sft_trained(wrong)["logged"]
    return result


nd_launch.register(4, "cp/sft", _sft_case)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for name, (world_size, sizes) in MESHES.items():
        dp = sizes.get("dp_shard_size", 1)
        single = {}
        for mode in MODES[name]:  # one process, the global batch
            trainer, single[mode] = nd_launch.single(tmp_path_factory, BATCH * dp, *_mode(mode))
            if mode == "full" and name == "cp":
                single[mode] = {**single[mode],
                                "eval_loss": trainer.evaluate(rows(8))["eval_loss"]}
        results[name] = (single, nd_launch.results(tmp_path_factory, world_size)[f"cp/{name}"])
    trainer = sft_trainer(str(tmp_path_factory.mktemp("sft")), 2 * BATCH)
    trainer.train()
    results["sft"] = (sft_trained(trainer), nd_launch.results(tmp_path_factory, 4)["cp/sft"])
    return results


def worst(a, b):
    assert set(a) == set(b) and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name, mode", [(n, m) for n in MESHES for m in MODES[n]])
def test_mesh_trains_as_one_process(runs, name, mode):
    single, nd = runs[name][0][mode], runs[name][1][mode]
    assert len(single["logged"]) == len(nd["logged"]) == 3
    assert single["logged"][0][1] > 0.5  # clipping was active
    torch.testing.assert_close(nd["logged"], single["logged"], rtol=0, atol=TOL)
    difference = worst(nd["params"], single["params"])
    start = {n: p.detach() for n, p in build(*_mode(mode)).named_parameters()
             if p.requires_grad}
    moved = worst(single["params"], start)
    print(f"{name} {mode}: largest parameter difference from one process {difference:.2e} "
          f"(moved {moved:.2e})")
    assert difference <= TOL and moved > 100 * TOL


def test_evaluate_after_cp_training_is_one_process_evaluate(runs):
    single, nd = runs["cp"][0]["full"], runs["cp"][1]
    assert abs(nd["eval_loss"] - single["eval_loss"]) < TOL


def test_cp_ranks_read_the_same_rows(runs):
    batches = runs["dp_shard x cp"][1]["per_rank_rows"]  # ranks (dp_shard, cp): 0 1 | 2 3
    assert batches[0] == batches[1] and batches[2] == batches[3]
    assert not set(map(tuple, batches[0])) & set(map(tuple, batches[2]))
    batches = runs["cp x tp"][1]["per_rank_rows"]  # one data shard: all 4 ranks
    assert batches[0] == batches[1] == batches[2] == batches[3]


def test_local_positions_are_wrong(runs):
    single, nd = runs["cp"][0]["full"], runs["cp"][1]["local_positions"]
    logged = max(abs(a - b) for x, y in zip(nd["logged"], single["logged"]) for a, b in zip(x, y))
    params = worst(nd["params"], single["params"])
    print(f"local positions: logged {logged:.2e}, parameters {params:.2e} from one process")
    assert logged > 3 * TOL and params > 10 * TOL  # RoPE at the wrong positions: caught


def test_loss_without_the_cp_factor_is_wrong(runs):
    single, nd = runs["cp"][0]["full"], runs["cp"][1]["without_cp_factor"]
    for (loss, norm), (wrong, wrong_norm) in zip(single["logged"], nd["logged"]):
        assert abs(wrong - loss / 2) < 1e-4 * loss  # FSDP's mean over the 2 cp ranks kept
        # the gradient halves too (the parameters hide it: clipping and Adam undo a scale)
        assert abs(wrong_norm - norm / 2) < 1e-4 * norm


# ----- refused before any work
def test_sft_trainer_under_cp_trains_as_one_process(runs):
    single, nd = runs["sft"]
    accuracy = SFT_LOGGED.index("mean_token_accuracy")
    assert len(single["logged"]) == 3 and single["logged"][-1][accuracy] > 0.2
    # loss, grad_norm and TRL's token metrics (entropy, accuracy: the per-token outputs of the
    # cp ranks gathered; num_tokens: each data shard counted once)
    torch.testing.assert_close(nd["logged"], single["logged"], rtol=0, atol=TOL)
    difference = worst(nd["params"], single["params"])
    print(f"SFTTrainer under dp_shard x cp: largest parameter difference {difference:.2e}")
    assert difference <= TOL
    # negative control: each cp rank's metrics over its own tokens only are not one process's
    entropy = SFT_LOGGED.index("entropy")
    assert max(abs(a[entropy] - b[entropy]) + abs(a[accuracy] - b[accuracy])
               for a, b in zip(nd["own tokens only"], single["logged"])) > 1e-3


@pytest.mark.parametrize("how", ["compute_loss_func", "reference mode"])
def test_sft_trainer_under_cp_reading_whole_logits_is_refused(tmp_path, monkeypatch, how):
    from nanosft import reference
    from nanosft.args import SFTConfig
    from nanosft.sft import SFTTrainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                     parallelism_config={"cp_size": 2})
    loss_func = (lambda outputs, labels, num_items_in_batch=None: outputs.loss) \
        if how == "compute_loss_func" else None
    if how == "reference mode":
        monkeypatch.setattr(reference, "_enabled", True)
    with pytest.raises(ValueError, match=f"SFTTrainer with parallelism_config cp_size=2 and {how}"):
        SFTTrainer(tiny_model(seed=0), args, train_dataset=rows(), compute_loss_func=loss_func)


@pytest.mark.parametrize("change, words", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor > 0"),
    ({"loss_type": "dft"}, "loss_type='dft'"),
])
def test_what_cp_does_not_split_is_refused(change, words):
    from types import SimpleNamespace

    from nanosft.parallel.context_parallel import check_context_parallel

    model = tiny_model(seed=0, **{k: v for k, v in change.items() if k == "rope_scaling"})
    args = SimpleNamespace(label_smoothing_factor=change.get("label_smoothing_factor", 0),
                           loss_type=change.get("loss_type", "nll"))
    with pytest.raises(ValueError, match=words):
        check_context_parallel(model, args)
