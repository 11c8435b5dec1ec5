"""The gated delta rule's two forms and the causal conv agree with themselves, any chunking.

nanosft.families.gated_deltanet: the chunked form equals the recurrent form for chunk sizes that
do and do not divide the length (1, 7, 16, 64 over 40 tokens, a starting state, grouped heads);
a sequence run in two pieces with the state carried equals one run (what generation's cache relies
on); short_conv.causal_conv1d with its window carried equals one conv over the whole; run_documents
restarts the state per document, and without the restart the second document's outputs change (a
negative control). Against transformers: tests/parity/test_family_qwen3_5.py. Hermetic: random
tensors, CPU, fixed seeds.
Run: python -m pytest -q tests/test_gated_deltanet.py
"""

import pytest
import torch
import torch.nn.functional as F

from nanosft.families.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule
from nanosft.families.hybrid import run_documents
from nanosft.families.short_conv import causal_conv1d

TOL = {"rtol": 0, "atol": 1e-5}


def inputs(T=40, B=2, Hk=2, Hv=4, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, Hk, D, generator=g), torch.randn(B, T, Hk, D, generator=g)
    v = torch.randn(B, T, Hv, D, generator=g)
    decay, beta = -torch.rand(B, T, Hv, generator=g), torch.rand(B, T, Hv, generator=g)
    return (q, k, v, decay, beta), 0.1 * torch.randn(B, Hv, D, D, generator=g)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_chunked_equals_recurrent_for_any_chunk_size(chunk_size):
    args, state = inputs()
    want = recurrent_gated_delta_rule(*args, initial_state=state)
    got = chunk_gated_delta_rule(*args, chunk_size=chunk_size, initial_state=state)
    for a, b in zip(got, want):  # outputs and final states
        torch.testing.assert_close(a, b, **TOL)


def test_state_carried_across_two_pieces_equals_one_run():
    args, _ = inputs()
    whole, final = chunk_gated_delta_rule(*args, chunk_size=16)
    first, state = chunk_gated_delta_rule(*(t[:, :25] for t in args), chunk_size=16)
    second, state = chunk_gated_delta_rule(*(t[:, 25:] for t in args), chunk_size=16,
                                           initial_state=state)
    torch.testing.assert_close(torch.cat((first, second), 1), whole, **TOL)
    torch.testing.assert_close(state, final, **TOL)


def test_causal_conv_window_carried_equals_one_conv():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 6, 20, generator=g), torch.randn(6, 1, 4, generator=g)
    whole, _ = causal_conv1d(x, w, activation=F.silu)
    y, window = causal_conv1d(x[..., :13], w, activation=F.silu)
    steps = [y]
    for t in range(13, 20):  # generation: one token at a time
        y, window = causal_conv1d(x[..., t:t + 1], w, state=window, activation=F.silu)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, -1), whole, **TOL)


def test_documents_restart_the_state():
    args, _ = inputs(T=30, B=1)
    rule = lambda *t: chunk_gated_delta_rule(*t, chunk_size=8)[0]
    got = run_documents(rule, [[12, 18]], *args)
    second_alone = rule(*(t[:, 12:] for t in args))
    torch.testing.assert_close(got[:, 12:], second_alone, **TOL)
    leaked = rule(*args)  # the bug: one sequence, the state carried into the second document
    assert (leaked[:, 12:] - second_alone).abs().max() > 1e-3
