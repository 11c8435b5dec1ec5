"""model.generate with transformers' common arguments, against transformers' generate.

A tiny random transformers Llama (fp32) and nanosft loading its folder. Compared, token for token:
greedy (`do_sample=False`, also with a temperature that greedy must ignore) on a left-padded batch
with eos_token_id / pad_token_id and max_new_tokens or max_length; what a transformers-style
streamer receives (put(prompt), put(each token), end()); seeded sampling (`do_sample=True` with
temperature / top_k / top_p, and with GenerationConfig's defaults T=1, top_k=50 when none is
given). num_beams > 1 and arguments nanosft does not implement are refused by name.
Negative control: sampling under another seed gives other tokens. Hermetic: tmp folder, CPU.
Run: python -m pytest -q tests/parity/test_generate_parity.py
"""

import pytest
import torch
import transformers

from nanosft.model import CausalLM

V, PAD, EOS = 128, 0, 7


class Recorder:
    """A streamer with transformers' protocol that keeps what it was given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, pad_token_id=PAD, eos_token_id=EOS,
                                      bos_token_id=1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    return hf, CausalLM.from_pretrained(folder).eval()


def batch():
    x = torch.randint(8, V, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return {"input_ids": x.masked_fill(mask == 0, PAD), "attention_mask": mask}


@pytest.mark.parametrize("kwargs", [
    {"do_sample": False, "max_new_tokens": 12},
    {"do_sample": False, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12},
    {"do_sample": False, "max_length": 15, "num_beams": 1},
    {"do_sample": False, "max_new_tokens": 12, "eos_token_id": [EOS, 9], "pad_token_id": 3},
])
def test_greedy_is_token_identical(models, kwargs):
    hf, ours = models
    want = hf.generate(**batch(), **kwargs)
    got = ours.generate(**batch(), **kwargs)
    assert got.tolist() == want.tolist()


def test_a_transformers_streamer_receives_what_transformers_gives_it(models):
    hf, ours = models
    x = {k: v[:1] for k, v in batch().items()}  # TextStreamer takes one row
    streams = []
    for model in (hf, ours):
        streams.append(Recorder())
        model.generate(**x, do_sample=False, max_new_tokens=6, streamer=streams[-1])
    assert streams[1].puts == streams[0].puts and streams[1].ended == streams[0].ended == 1


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.8, "top_k": 20, "top_p": 0.9},
    {},  # GenerationConfig's defaults: temperature 1.0, top_k 50
])
def test_seeded_sampling_is_token_identical(models, kwargs):
    hf, ours = models
    x = {k: v[:1] for k, v in batch().items()}
    outs = []
    for model in (hf, ours):
        torch.manual_seed(5)
        outs.append(model.generate(**x, do_sample=True, max_new_tokens=10, **kwargs).tolist())
    assert outs[1] == outs[0]
    torch.manual_seed(6)  # negative control: the seed matters, so the equality above is a test
    assert ours.generate(**x, do_sample=True, max_new_tokens=10, **kwargs).tolist() != outs[0]


def test_what_nanosft_does_not_implement_is_refused_by_name(models):
    _, ours = models
    with pytest.raises(ValueError, match="beam search"):
        ours.generate(**batch(), num_beams=2)
    with pytest.raises(TypeError, match="repetition_penalty"):
        ours.generate(**batch(), repetition_penalty=1.2)
    with pytest.raises(ValueError, match="strictly positive"):
        ours.generate(**batch(), do_sample=True, temperature=0.0)
