"""Quantize while loading: CausalLM.from_pretrained(dir, dtype, quantization_config=...) (here
mostly a Qwen2 family class, for its q/k/v biases).

Compared: peak RSS growth of the load, measured in a fresh process (/proc/self/status VmHWM after
resetting it through /proc/self/clear_refs), against 1.25x the loaded model's bytes plus the
largest tensor in the file, on a ~100M-parameter Llama this file writes with random weights; the
state dict and logits of the streamed model against load-then-quantize_model (bitwise); the dtype
of every tensor that reaches the quantizer under dtype=bfloat16; and the errors for bad options,
a shape mismatch in a later shard, a missing shard and a truncated shard, raised before any
weight is read. Hermetic: models written to pytest's tmp_path, CPU, no network.
Run: python -m pytest -q tests/test_load_quantized.py
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanosft.families.auto import config_from_dict, from_config
from nanosft.families.qwen2 import Qwen2ForCausalLM
from nanosft.io import hub
from nanosft.model import CausalLM, ModelConfig
from nanosft.nf4 import BitsAndBytesConfig, Linear4bit, quantize_model

EXACT = {"rtol": 0, "atol": 0}
QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}

# ----- peak memory on a ~100M-parameter model --------------------------------------------------

# Runs in a fresh process: imports (torch, bitsandbytes) and first-use costs come before the
# baseline, so the growth is what loading adds. One thread: the run is not timed, and OpenMP's
# small parallel ops crawl on a shared 2-core machine.
WORKER = """
import json, sys
import torch
import bitsandbytes  # noqa: F401
from nanosft import nf4
from nanosft.model import CausalLM

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

torch.set_num_threads(1)
nf4.Linear4bit(64, 64)
config = nf4.BitsAndBytesConfig(**json.loads(sys.argv[3]))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM (peak RSS) := current RSS
base = status("VmRSS")
model = CausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]),
                                 quantization_config=config)
peak = status("VmHWM")
storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in model.state_dict().values()}
print(json.dumps({"growth": peak - base, "model_bytes": sum(storages.values()),
                  "linear4bit": sum(isinstance(m, nf4.Linear4bit) for m in model.modules())}))
"""


@pytest.fixture(scope="module")
def model_100m(tmp_path_factory):
    """A 97.5M-parameter Llama (hidden 768, 12 layers, vocab 8192, untied) in fp32, 390 MB."""
    folder = tmp_path_factory.mktemp("llama100m")
    config = ModelConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048,
                         num_hidden_layers=12, num_attention_heads=12)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(shape, generator=g) * 0.02 for k, shape in shapes.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    hub.write_json(config.to_dict(), folder / "config.json")
    return folder


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="peak RSS is read from Linux /proc (VmHWM, reset through clear_refs)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_rss_growth_is_within_the_model_plus_one_tensor(model_100m, dtype):
    out = subprocess.run([sys.executable, "-c", WORKER, str(model_100m), dtype, json.dumps(QLORA)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    index = hub.safetensors_index(model_100m)
    largest = max(i.end - i.begin for i in index.values())  # 25 MB: an fp32 (8192, 768) matrix
    bound = 1.25 * got["model_bytes"] + largest
    print(f"{dtype}: peak RSS growth {got['growth'] / 1e6:.1f} MB, model "
          f"{got['model_bytes'] / 1e6:.1f} MB, bound {bound / 1e6:.1f} MB")
    assert got["linear4bit"] == 12 * 7  # every q/k/v/o/gate/up/down, not lm_head
    assert got["growth"] <= bound
    # control: a loader holding the float model at once (load, then quantize) cannot pass
    float_bytes = sum(i.shape.numel() for i in index.values()) * getattr(torch, dtype).itemsize
    assert float_bytes > 1.5 * bound


# ----- the streamed model equals load-then-quantize ---------------------------------------------


def tiny(tmp_path, max_shard_size="5GB", **overrides):
    kw = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "model_type": "qwen2"}  # q/k/v bias
    torch.manual_seed(0)
    model = from_config(config_from_dict({**kw, **overrides}))
    model.save_pretrained(tmp_path, max_shard_size=max_shard_size)
    return tmp_path


@pytest.mark.parametrize("dtype, double_quant, max_shard_size", [
    (torch.float32, True, "40KB"),  # shards
    (torch.bfloat16, False, "5GB"),
])
def test_streamed_model_is_bitwise_load_then_quantize_model(tmp_path, dtype, double_quant,
                                                            max_shard_size):
    folder = tiny(tmp_path, max_shard_size)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                bnb_4bit_use_double_quant=double_quant)
    streamed = Qwen2ForCausalLM.from_pretrained(folder, dtype=dtype, quantization_config=config)
    reference = quantize_model(Qwen2ForCausalLM.from_pretrained(folder, dtype=dtype),
                               compute_dtype=torch.float32, compress_statistics=double_quant)
    ours, ref = streamed.state_dict(), reference.state_dict()
    assert list(ours) == list(ref)
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], **EXACT, msg=key)
    x = torch.randint(0, 128, (2, 9))
    for mode in ("train", "eval"):
        getattr(streamed, mode)(), getattr(reference, mode)()
        torch.testing.assert_close(streamed(x).logits, reference(x).logits, **EXACT)


def test_bfloat16_reaches_the_quantizer_with_no_float32_copy(tmp_path, monkeypatch):
    folder = tiny(tmp_path)  # an fp32 file: each tensor is cast as it is read
    seen = []
    set_weight = Linear4bit.set_weight
    monkeypatch.setattr(Linear4bit, "set_weight",
                        lambda self, w: seen.append(w.dtype) or set_weight(self, w))
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype="bfloat16", quantization_config=QLORA)
    assert seen == [torch.bfloat16] * 14  # 2 layers x 7 linears, each in the load dtype
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.bfloat16}
    layer = model.model.layers[0].mlp.up_proj
    assert layer.quant_state.dtype == torch.bfloat16 and layer.dequantize().dtype == torch.bfloat16


def test_skip_modules_and_a_tied_lm_head_stay_in_float(tmp_path):
    folder = tiny(tmp_path, tie_word_embeddings=True)
    skip = ["up_proj", "model.layers.1.self_attn"]  # a name's last part; an enclosing module
    model = Qwen2ForCausalLM.from_pretrained(folder, quantization_config={
        **QLORA, "llm_int8_skip_modules": skip})
    layers = model.model.layers
    assert type(layers[0].mlp.up_proj) is torch.nn.Linear
    assert type(layers[1].self_attn.q_proj) is type(layers[1].self_attn.o_proj) is torch.nn.Linear
    assert isinstance(layers[0].self_attn.q_proj, Linear4bit)
    assert isinstance(layers[1].mlp.gate_proj, Linear4bit)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, so never quantized


# ----- bad input: clear errors, raised before any weight is read -------------------------------


@pytest.mark.parametrize("options, culprit", [
    ({"load_in_8bit": True}, "load_in_8bit"),
    ({"load_in_4bit": False}, "load_in_4bit"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type"),
    ({"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"}, "bnb_4bit_quant_storage"),
    ({"load_in_4bit": True, "bnb_4bit_compute_dtype": "bf16"}, "bnb_4bit_compute_dtype='bf16'"),
    ({"load_in_4bit": True, "llm_int8_has_fp16_weight": True}, "llm_int8_has_fp16_weight"),
])
def test_unsupported_quantization_options_are_named(options, culprit):
    with pytest.raises(ValueError, match=culprit.replace("(", r"\(")):
        BitsAndBytesConfig(**options)


def test_compute_dtype_spellings():
    assert BitsAndBytesConfig(load_in_4bit=True).bnb_4bit_compute_dtype == torch.float32
    for spelling in ("bfloat16", "torch.bfloat16", torch.bfloat16):
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=spelling)
        assert config.bnb_4bit_compute_dtype == torch.bfloat16


@pytest.fixture
def no_reads(monkeypatch):
    """Fails the test if any tensor data is read: checks must come from the headers alone."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read before the checkpoint was checked")

    monkeypatch.setattr(hub, "iter_tensors", refuse)


def shards(folder):
    return sorted(p for p in os.listdir(folder) if p.startswith("model-"))


def test_a_shape_mismatch_in_a_later_shard_is_named_before_any_read(tmp_path, no_reads):
    folder = tiny(tmp_path, "40KB")
    last = folder / shards(folder)[-1]
    tensors = load_file(last)
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, 5)
    save_file(tensors, last, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}.*\(3, 5\).*{last.name}.*config.json"):
        Qwen2ForCausalLM.from_pretrained(folder, quantization_config=QLORA)


def test_a_missing_shard_is_named_before_any_read(tmp_path, no_reads):
    folder = tiny(tmp_path, "40KB")
    missing = shards(folder)[2]
    os.remove(folder / missing)
    with pytest.raises(FileNotFoundError, match=rf"{missing}: shard named in .* is missing"):
        Qwen2ForCausalLM.from_pretrained(folder, quantization_config=QLORA)


def test_a_truncated_shard_is_named_before_any_read(tmp_path, no_reads):
    folder = tiny(tmp_path, "40KB")
    cut = folder / shards(folder)[1]
    cut.write_bytes(cut.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{cut.name}.*past the end of the file"):
        Qwen2ForCausalLM.from_pretrained(folder, quantization_config=QLORA)
