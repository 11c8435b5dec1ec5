"""Ranks agree before training: two gloo ranks holding different data stop together, at once, with
one ValueError naming the rank that differs and what differs; equal data trains.

Compared, in one launch of 2 ranks (starting processes is the slow part):
- different counts (12 rows on rank 0, 4 on rank 1): both ranks raise the same message, naming
  rank 1 against rank 0 and num_examples, the fingerprint and the step plan, long before
  ddp_timeout. Negative control of the old hang: the ranks' update-step counts (written out here
  from the sharding rule) differ, so their collectives could never meet;
- same count, one token changed on rank 1: only examples_fingerprint is named (the step plans
  agree, so without the check they would silently train on different data);
- equal data: the check passes and 2 steps train;
- a rank that never reaches a collective (rank 1 waits outside train()): rank 0 stops after
  ddp_timeout=3 s with a TimeoutError naming ddp_timeout, not after gloo's 30 minutes.
One-process tests cover the message for 3 ranks (only the odd rank is named) and the fingerprint.
Hermetic: torch.multiprocessing spawn on localhost, the tiny CausalLM of tests/tiny.py, random
rows, one thread per process; the launch is joined under a deadline and killed past it, so a hang
fails the test instead of stalling the suite.
Run: python -m pytest -q tests/test_ranks_agree.py
"""

import json
import math
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from tiny import join_as_rank, tiny_model

from nanosft import distributed
from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.distributed import (check_ranks_agree, cleanup, fingerprint_examples,
                                 ranks_disagree_message)
from nanosft.trainer import Trainer

DDP_TIMEOUT = 20  # seconds: the data checks must end far sooner
STUCK_TIMEOUT = 3  # seconds: the stuck-rank check waits this long
BATCH = 2
WORLD = 2


def rows(n=12):
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 14, (1,), generator=g))
        ids = torch.randint(1, 64, (length,), generator=g).tolist()
        labels = [t if j >= length // 2 else -100 for j, t in enumerate(ids)]
        out.append({"input_ids": ids, "labels": labels})
    return out


def one_token_changed(examples):
    changed = [dict(e) for e in examples]
    changed[5] = {**changed[5], "input_ids": [7, *changed[5]["input_ids"][1:]]}
    assert changed[5]["input_ids"] != examples[5]["input_ids"]
    return changed


def rank_data(rank):
    """scenario -> (this rank's rows, TrainingArguments overrides)."""
    return {
        "count": (rows(12) if rank == 0 else rows(4), {"num_train_epochs": 1}),
        "content": (rows(12) if rank == 0 else one_token_changed(rows(12)), {"max_steps": 2}),
        "equal": (rows(12), {"max_steps": 2}),
    }


def make_trainer(output_dir, examples, ddp_timeout=DDP_TIMEOUT, **overrides):
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=BATCH,
                             save_strategy="no", use_cpu=True, disable_tqdm=True, seed=5,
                             ddp_timeout=ddp_timeout, **overrides)
    return Trainer(tiny_model(), args, train_dataset=examples,
                   data_collator=DataCollatorForLanguageModeling(0))


def _worker(rank, ports, out):
    join_as_rank(rank, ports[0])
    results = {}
    for scenario, (examples, overrides) in rank_data(rank).items():
        start = time.monotonic()
        try:
            trainer = make_trainer(os.path.join(out, scenario), examples, **overrides)
            trainer.train()
            results[scenario] = {"steps": trainer.state.global_step}
        except ValueError as error:  # raised on every rank, so the group stays usable
            results[scenario] = {"error": str(error)}
        results[scenario]["seconds"] = time.monotonic() - start
    cleanup()
    # a new group whose collectives wait STUCK_TIMEOUT s; rank 1 never calls train()
    os.environ["MASTER_PORT"] = str(ports[1])
    trainer = make_trainer(os.path.join(out, "stuck"), rows(12), ddp_timeout=STUCK_TIMEOUT,
                           max_steps=2)
    if rank == 0:
        start = time.monotonic()
        try:
            trainer.train()
            results["stuck"] = {"steps": trainer.state.global_step}
        except TimeoutError as error:
            results["stuck"] = {"error": str(error),
                                "group_closed": not distributed.is_initialized()}
        results["stuck"]["seconds"] = time.monotonic() - start
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if rank == 1:  # stay alive (rank 0 must see a timeout, not a closed connection), then go
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "rank0.json")) and time.monotonic() < deadline:
            time.sleep(0.2)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every rank's results from one launch of 2 gloo ranks, joined under a 180 s deadline."""
    out = str(tmp_path_factory.mktemp("ranks_agree"))
    context = mp.spawn(_worker, args=((free_port(), free_port()), out), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 180
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the 2 ranks hung past 180 s")
    results = []
    for rank in range(WORLD):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def update_steps(num_examples):
    """Update steps per epoch on each rank: global batches of BATCH, shared out over WORLD ranks
    (the last round topped up), gradient accumulation 1."""
    return math.ceil(math.ceil(num_examples / BATCH) / WORLD)


pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")


def test_different_counts_stop_every_rank_naming_rank_1(two_ranks):
    rank0, rank1 = (r["count"] for r in two_ranks)
    assert "error" in rank0 and rank0["error"] == rank1["error"]  # one message, every rank
    message = rank0["error"]
    assert message.startswith("rank 1 does not hold the same training data and step plan as "
                              "rank 0 (")
    assert "num_examples: 12 on rank 0, 4 on rank 1;" in message
    assert update_steps(12) != update_steps(4)  # the old hang: collectives that never meet
    assert (f"num_update_steps_per_epoch: {update_steps(12)} on rank 0, {update_steps(4)} on "
            "rank 1;") in message
    assert f"max_steps: {update_steps(12)} on rank 0, {update_steps(4)} on rank 1" in message
    fingerprints = (fingerprint_examples(rows(12)), fingerprint_examples(rows(4)))
    assert (f"examples_fingerprint: '{fingerprints[0]}' on rank 0, '{fingerprints[1]}' on "
            "rank 1;") in message
    assert "copy the same file to each node" in message
    assert max(rank0["seconds"], rank1["seconds"]) < DDP_TIMEOUT  # fails fast, no waiting


def test_same_count_different_tokens_names_only_the_fingerprint(two_ranks):
    rank0, rank1 = (r["content"] for r in two_ranks)
    assert "error" in rank0 and rank0["error"] == rank1["error"]
    message = rank0["error"]
    assert message.startswith("rank 1 does not hold the same training data")
    fingerprints = (fingerprint_examples(rows(12)),
                    fingerprint_examples(one_token_changed(rows(12))))
    assert (f"(examples_fingerprint: '{fingerprints[0]}' on rank 0, '{fingerprints[1]}' on "
            "rank 1)") in message
    for name in ("num_examples", "max_steps", "num_update_steps_per_epoch"):
        assert name not in message
    assert max(rank0["seconds"], rank1["seconds"]) < DDP_TIMEOUT


def test_equal_data_trains(two_ranks):
    assert [r["equal"].get("error") for r in two_ranks] == [None, None]
    assert [r["equal"]["steps"] for r in two_ranks] == [2, 2]


def test_a_rank_that_never_comes_ends_the_run_after_ddp_timeout(two_ranks):
    stuck = two_ranks[0]["stuck"]
    assert stuck["error"].startswith(f"rank 0 waited longer than ddp_timeout={STUCK_TIMEOUT} s "
                                     "for the other ranks in a collective (")
    assert "timed out" in stuck["error"].lower()  # gloo's own words, kept in the message
    assert stuck["group_closed"]  # closed, so the process exits instead of aborting
    assert STUCK_TIMEOUT <= stuck["seconds"] < STUCK_TIMEOUT + 15


def test_message_names_only_the_rank_that_differs():
    agree = {"num_examples": 40, "examples_fingerprint": "3fa2", "max_steps": 10}
    per_rank = [agree, dict(agree), {**agree, "num_examples": 37, "examples_fingerprint": "9b1c"},
                dict(agree)]
    message = ranks_disagree_message(per_rank)
    assert message.startswith("rank 2 does not hold the same training data and step plan as "
                              "rank 0 (num_examples: 40 on ranks 0, 1 and 3, 37 on rank 2; "
                              "examples_fingerprint: '3fa2' on ranks 0, 1 and 3, '9b1c' on "
                              "rank 2). ")
    assert ranks_disagree_message([agree, dict(agree)]) is None
    check_ranks_agree(agree)  # one process: nothing to compare, no process group needed


def test_fingerprint_sees_every_token_label_and_the_order():
    examples = rows(6)
    as_tensors = [{k: torch.tensor(v) for k, v in e.items()} for e in examples]
    assert fingerprint_examples(as_tensors) == fingerprint_examples(examples)
    assert fingerprint_examples(rows(6)) == fingerprint_examples(examples)  # deterministic
    relabelled = [dict(e) for e in examples]
    relabelled[0] = {**relabelled[0], "labels": [-100] * len(relabelled[0]["labels"])}
    for other in (one_token_changed(rows(6)), relabelled, examples[::-1], examples[:-1]):
        assert fingerprint_examples(other) != fingerprint_examples(examples)
