"""Parity of nanosft.families with transformers 5.23 / peft 0.21.2: Qwen3, SmolLM3, Qwen2 and
Mistral with their sliding windows.

Per family, on a tiny random model built by transformers' own config class (fp32, norms and biases
randomized so a q_norm / k_norm or bias mix-up shows): logits within 1e-5 both ways (transformers
save -> nanosft load, nanosft save -> transformers load) on a plain, a left-padded and a packed
batch (position_ids restarting per document), every sequence longer than the 5-token window of the
windowed families, and in a training step where nanosft unpads (padding-free); greedy generation
with the KV cache token for token; quantize-while-loading bitwise equal to load-then-quantize and
to transformers + bitsandbytes; target_modules="all-linear" naming peft's modules; a LoRA adapter
trained 3 steps by one library loading in the other with logits within 1e-5. A negative control
shows the window changes the logits. Hermetic: tmp folders, no downloads; `-s` prints the largest
logit difference. Run: python -m pytest -q -s tests/parity/test_families.py
"""

import peft
import pytest
import torch
import transformers
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

from nanosft.adapter_files import DEFAULT_TARGET_MODULES
from nanosft.families.auto import (AutoModelForCausalLM, config_from_dict, from_config,
                                   supported_model_types)
from nanosft.nf4 import BitsAndBytesConfig, quantize_model
from nanosft.peft import LoraConfig, PeftModelForCausalLM, get_peft_model

PAD, V, WINDOW = 0, 128, 5
BASE = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": None}
WINDOWED = {"use_sliding_window": True, "sliding_window": WINDOW}
FAMILIES = {  # name: (transformers config class, overrides)
    # head_dim 32: H * D = 128 != hidden_size 64, as Qwen3's own checkpoints have
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32}),
    "qwen3-window": (transformers.Qwen3Config, {"head_dim": 32, **WINDOWED,
                                                "max_window_layers": 1}),
    # interval 2: layers 1 and 3 have no RoPE
    "smollm3": (transformers.SmolLM3Config, {"num_hidden_layers": 4, "no_rope_layer_interval": 2,
                                             "tie_word_embeddings": True}),
    "mistral-window": (transformers.MistralConfig, {"sliding_window": WINDOW}),
    "qwen2-window": (transformers.Qwen2Config, {**WINDOWED, "num_hidden_layers": 3,
                                                "max_window_layers": 1}),
}
TOL = {"rtol": 0, "atol": 1e-5}
QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
         "bnb_4bit_compute_dtype": torch.float32}


def randomize_vectors(model):
    with torch.no_grad():  # norms are built as ones and biases as zeros: either would hide a mix-up
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def hf_folder(name, tmp_path):
    """A random transformers model of the family, saved to tmp_path / "hf"."""
    config_class, overrides = FAMILIES[name]
    return save_random(config_class(**{**BASE, **overrides}), tmp_path)


def save_random(config, tmp_path):
    """(model, folder): a seeded random transformers model of `config`, vectors randomized,
    saved to tmp_path / "hf"."""
    torch.manual_seed(0)
    hf = randomize_vectors(transformers.AutoModelForCausalLM.from_config(config)).eval()
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


def models_both_ways(hf, folder, tmp_path):
    """[(transformers, nanosft)] with the weights made on each side and loaded on the other;
    the config read back by transformers keeps its RoPE and layer types."""
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    theirs = randomize_vectors(from_config(config_from_dict(hf.config.to_dict()))).eval()
    theirs.save_pretrained(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is type(hf) and type(ours).__name__ == type(hf).__name__
    assert back.config.rope_parameters == hf.config.rope_parameters
    assert getattr(back.config, "layer_types", None) == getattr(hf.config, "layer_types", None)
    return [(hf, ours), (back, theirs)]


def both_ways(name, tmp_path):
    return models_both_ways(*hf_folder(name, tmp_path), tmp_path)


def left_padded_batch():
    x = torch.randint(3, V, (3, 12))
    mask = torch.ones_like(x)
    mask[1, :3], mask[2, :6] = 0, 0
    return x.masked_fill(mask == 0, PAD), mask


def packed_row():
    """One row of three documents (7, 6 and 3 tokens) with position_ids restarting at each."""
    pos = torch.cat([torch.arange(n) for n in (7, 6, 3)])[None]
    return torch.randint(3, V, (1, 16)), pos


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers_both_ways(name, tmp_path):
    x = torch.randint(3, V, (2, 16))
    padded, mask = left_padded_batch()
    packed, pos = packed_row()
    worst = 0.0
    for hf, ours in both_ways(name, tmp_path):
        with torch.no_grad():
            pairs = [(hf(x).logits, ours(x).logits)]
            real = mask.bool()  # padded queries are never read
            pairs.append((hf(padded, attention_mask=mask).logits[real],
                          ours(padded, attention_mask=mask).logits[real]))
            # use_cache=False: transformers reads packed documents only without a cache
            pairs.append((hf(packed, position_ids=pos, use_cache=False).logits,
                          ours(packed, position_ids=pos).logits))
            want_right = hf(x, attention_mask=(torch.arange(16) < 11).long().expand(2, 16)).logits
        # a training forward: nanosft's unpadded speed path (documents > window: one mask each)
        ours.train()
        pairs.append((hf(packed, position_ids=pos, use_cache=False).logits.detach(),
                      ours(packed, position_ids=pos).logits.detach()))
        right = (torch.arange(16) < 11).long().expand(2, 16)
        got_right = ours(x, attention_mask=right).logits.detach()
        pairs.append((want_right[right.bool()], got_right[right.bool()]))
        ours.eval()
        for want, got in pairs:
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
    print(f"\n[{name}] max |logit diff| = {worst:.3e}")


def test_negative_control_the_window_changes_the_logits(tmp_path):
    hf, folder = hf_folder("mistral-window", tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(3, V, (1, 16))
    for layer in ours.model.layers:
        layer.self_attn.sliding_window = None  # the bug: a full causal mask
    with torch.no_grad():
        diff = (ours(x).logits - hf(x).logits).abs()
    assert diff[:, :WINDOW].max() < 1e-5 and diff[:, WINDOW:].max() > 1e-3


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_is_token_identical(name, tmp_path):
    assert_greedy_generation_matches(*hf_folder(name, tmp_path))


def assert_greedy_generation_matches(hf, folder):
    """nanosft's generate equals transformers' greedy generate token for token: one 8-token
    prompt (with a window, the cache outgrows it) and a left-padded batch, 20 new tokens each."""
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.randint(3, V, (1, 8))  # the cache outgrows the window after the prompt
    want = hf.generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    assert ours.generate(prompt, max_new_tokens=20).tolist() == want.tolist()
    padded, mask = left_padded_batch()
    want = hf.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=20,
                       pad_token_id=PAD)
    assert ours.generate(padded, attention_mask=mask, max_new_tokens=20).tolist() == want.tolist()


def assert_quantize_while_loading_matches(folder, x):
    """The folder quantized while loading equals load-then-quantize and transformers +
    bitsandbytes bitwise (every key), and its logits on x equal transformers' within TOL.
    Returns the streamed state dict."""
    streamed = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=BitsAndBytesConfig(**QLORA))
    loaded = quantize_model(AutoModelForCausalLM.from_pretrained(folder),
                            compute_dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, device_map="cpu",
        quantization_config=transformers.BitsAndBytesConfig(**QLORA))
    ours = streamed.state_dict()
    for other in (loaded.state_dict(), ref.state_dict()):
        assert sorted(ours) == sorted(other)
        for key in other:
            torch.testing.assert_close(ours[key], other[key], rtol=0, atol=0, msg=key)
    with torch.no_grad():  # train mode: nanosft's eval-mode CPU 4-bit path is off
        torch.testing.assert_close(streamed.train()(x).logits, ref.train()(x).logits, **TOL)
    return ours


@pytest.mark.parametrize("name", ["qwen3", "smollm3", "qwen2-window"])
def test_quantize_while_loading_is_bitwise_load_then_quantize_and_transformers(name, tmp_path):
    _, folder = hf_folder(name, tmp_path)
    assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))


@pytest.mark.parametrize("name", ["qwen3", "smollm3"])
def test_all_linear_targets_the_modules_peft_targets(name, tmp_path):
    hf, folder = hf_folder(name, tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    got = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    names = [n for n, _ in got.named_parameters() if "lora_" in n]
    assert names and names == [n for n, _ in ref.named_parameters() if "lora_" in n]


@pytest.mark.parametrize("model_type", supported_model_types())
def test_default_target_modules_are_peft_defaults(model_type):
    """target_modules=None: nanosft wraps what peft's table names for each model_type nanosft
    loads, and where peft has no entry (phi3, smollm3) both refuse rather than guess."""
    want = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    assert DEFAULT_TARGET_MODULES.get(model_type) == (None if want is None else list(want))


def test_no_default_target_modules_is_refused_as_peft_refuses(tmp_path):
    hf, folder = hf_folder("smollm3", tmp_path)
    with pytest.raises(ValueError, match="target_modules"):
        peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match="no default target_modules for model_type='smollm3'"):
        get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig())


def assert_checkpointing_keeps_gradients(folder):
    """Checkpointed layers (recomputed in backward, their cache entries and masks passed again)
    give the gradients of the plain backward, on a right-padded batch."""
    x = torch.randint(3, V, (2, 20))
    mask = (torch.arange(20) < torch.tensor([[20], [15]])).long()
    grads = []
    for checkpointing in (False, True):
        ours = AutoModelForCausalLM.from_pretrained(folder).train()
        if checkpointing:
            ours.gradient_checkpointing_enable()
        labels = x.masked_fill(mask == 0, -100)
        ours(input_ids=x, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in ours.named_parameters() if p.grad is not None})
    assert sorted(grads[0]) == sorted(grads[1])
    for n, grad in grads[0].items():
        torch.testing.assert_close(grads[1][n], grad, rtol=0, atol=1e-6, msg=n)


def assert_bf16_logits_equal_transformers(folder):
    """Loaded in bfloat16, the same casts in the same places: logits bit for bit."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    x = torch.randint(3, V, (2, 80))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, rtol=0, atol=0)


def train_a_few_steps(model, batch):
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def assert_adapters_move_both_ways(hf, folder, tmp_path, x, target_modules, label, **lora):
    """A LoRA adapter trained a few steps by nanosft loads in peft, and one trained by peft loads
    in nanosft: logits equal within TOL both ways, and disabling the loaded adapter moves them.
    `lora`: more LoraConfig fields (target_parameters). Returns the largest logit difference; the
    adapters are left in tmp_path / "ours_adapter" and "peft_adapter"."""
    batch = {"input_ids": x, "labels": x}
    config = {"r": 4, "lora_alpha": 8, "target_modules": target_modules, **lora}
    torch.manual_seed(1)
    ours = train_a_few_steps(get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                                            LoraConfig(**config)), batch)
    ours.save_pretrained(tmp_path / "ours_adapter")
    theirs = train_a_few_steps(peft.get_peft_model(
        hf, peft.LoraConfig(task_type="CAUSAL_LM", **config)), batch)
    theirs.save_pretrained(tmp_path / "peft_adapter")
    fresh = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    peft_loads_ours = peft.PeftModel.from_pretrained(fresh, tmp_path / "ours_adapter")
    ours_loads_peft = PeftModelForCausalLM.from_pretrained(
        AutoModelForCausalLM.from_pretrained(folder), tmp_path / "peft_adapter")
    with torch.no_grad():
        want, got = ours(x).logits, peft_loads_ours(x).logits
        torch.testing.assert_close(got, want, **TOL)
        diff = (got - want).abs().max().item()
        want, got = theirs(x).logits, ours_loads_peft(x).logits
        torch.testing.assert_close(got, want, **TOL)
        diff = max(diff, (got - want).abs().max().item())
        with ours_loads_peft.disable_adapter():  # the trained adapter is not a no-op
            assert (ours_loads_peft(x).logits - want).abs().max() > 1e-4
    print(f"\n[{label}] adapter max |logit diff| = {diff:.3e}")
    return diff


@pytest.mark.parametrize("name", ["qwen3", "smollm3", "mistral-window"])
def test_trained_lora_adapters_move_both_ways(name, tmp_path):
    hf, folder = hf_folder(name, tmp_path)
    x = torch.randint(3, V, (2, 12))
    assert_adapters_move_both_ways(hf, folder, tmp_path, x, "all-linear", name)
