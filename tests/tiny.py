"""Tiny in-process pieces shared by the trainer-level tests: a seeded 2-layer Llama CausalLM and
a one-thread fixture.

Not a test module (pytest collects test_*.py only). Test files import it as `from tiny import ...`:
pytest puts tests/ on sys.path because tests/conftest.py lives there. Sizes stay within the
hermetic-test budget (hidden <= 64, vocab <= 512, 2 layers); seeds are explicit, so a model is the
same in every file that builds it.
"""

import os

import pytest
import torch

from nanosft.model import CausalLM, ModelConfig

TINY_LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def tiny_model(seed=0, **overrides) -> CausalLM:
    """A CausalLM of TINY_LLAMA (fields overridable), initialised right after manual_seed(seed)."""
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(**{**TINY_LLAMA, **overrides}))


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread for the test: on a shared 2-core box two threads spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def join_as_rank(rank, port, world_size=2):
    """In a process started by torch.multiprocessing.spawn: the torchrun environment of `rank` on
    localhost, and one torch thread (the ranks share the machine's cores)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def leave_group():
    """The last line of a spawned rank that sharded with DTensors (FSDP2, tensor parallel): leave
    the process group together, then end the process without its exit-time destructors. After
    DTensor collectives, one exit in a few dozen aborted in C++ ("terminate called without an
    active exception", SIGABRT) after all the rank's work was done, which failed a whole run."""
    import sys

    from nanosft import distributed

    distributed.cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
