"""Parity of nanosft.peft with peft 0.21.2 on a tiny Llama: names, init, forward, backward, files.

Compared, on the same weights and the same seed: parameter names and bit-identical initial adapter
weights after get_peft_model (LoRA, rsLoRA, DoRA, all-linear, regex, init False / gaussian,
modules_to_save); logits, loss and every adapter gradient after B is made non-zero (fp32, 1e-5);
prompt tuning logits/loss/grad with the same prompt table; adapter files in both directions
(nanosft save -> peft load, peft save -> nanosft load) and adapter_config.json key for key;
print_trainable_parameters output; LoRA/DoRA over transformers' own 4-bit bitsandbytes loading vs
nanosft's quantize_model, through merge_and_unload. Hermetic: transformers' LlamaForCausalLM is
built in-process from a 2-layer config and its state_dict is loaded into nanosft's CausalLM
(equal keys by design); the 4-bit case goes through a temp folder; nothing is downloaded.
Run: python -m pytest -q tests/parity/test_peft_parity.py
"""

import json

import peft
import pytest
import torch
import transformers

from nanosft.model import CausalLM, ModelConfig
from nanosft.nf4 import quantize_model
from nanosft.peft import LoraConfig, PeftModelForCausalLM, PromptTuningConfig, get_peft_model
from nanosft.reference import reference_mode

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
# fp32; the two sides use the same ops in the same order up to fusion
TOL = {"rtol": 1e-5, "atol": 1e-5}
LORA_CASES = {
    "lora": {"r": 4, "lora_alpha": 8},
    "rslora": {"r": 4, "lora_alpha": 8, "use_rslora": True},
    "dora": {"r": 4, "lora_alpha": 8, "use_dora": True},
    "all_linear": {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"},
    "regex": {"r": 2, "lora_alpha": 4, "target_modules": r".*\.(k_proj|down_proj)"},
    "init_false": {"r": 4, "lora_alpha": 8, "init_lora_weights": False},
    "gaussian_dora": {"r": 4, "lora_alpha": 8, "init_lora_weights": "gaussian", "use_dora": True},
    "modules_to_save": {"r": 4, "lora_alpha": 8, "modules_to_save": ["lm_head"]},
}


def _bases():
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    ours = CausalLM(ModelConfig(**TINY))
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def _batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 5:] = 0  # right padding on row 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :2] = -100  # a "prompt" span
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _wrapped(kwargs):
    hf, ours = _bases()
    torch.manual_seed(42)
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **kwargs))
    torch.manual_seed(42)
    got = get_peft_model(ours, LoraConfig(**kwargs))
    return ref, got


def _randomize_lora_B(ref, got):
    # peft inits B = 0, which would hide any bug in the B path; give both sides the same non-zero B
    g = torch.Generator().manual_seed(2)
    theirs = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in got.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
                theirs[name].copy_(p)


def _assert_train_logits_close(got, ref, attention_mask):
    """Real positions equal peft's. In training nanosft runs a right-padded batch unpadded
    (nanosft.fast.unpad, the convention of transformers' flash-attention path), so its pad
    positions hold zeros; no loss reads them."""
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], ref[real], **TOL)
    assert (got[~real] == 0).all() and not real.all()


def _forward_backward(model, batch):
    model.train()
    out = model(**batch)
    out.loss.backward()
    return out


@pytest.mark.parametrize("case", LORA_CASES)
def test_lora_matches_peft_names_init_logits_loss_grads(case):
    ref, got = _wrapped(LORA_CASES[case])
    ref_params, got_params = dict(ref.named_parameters()), dict(got.named_parameters())
    # adapter names in peft's order (the order their init draws the RNG); base names as a set, since
    # nanosft's decoder layer registers its norms before self_attn (same keys, other order)
    assert [n for n in got_params if "lora_" in n] == [n for n in ref_params if "lora_" in n]
    assert sorted(got_params) == sorted(ref_params)
    for name, p in ref_params.items():
        # bit-identical: same RNG draws in the same order
        assert torch.equal(got_params[name], p), name
        assert got_params[name].requires_grad == p.requires_grad, name
    _randomize_lora_B(ref, got)
    batch = _batch()
    out_ref, out_got = _forward_backward(ref, batch), _forward_backward(got, batch)
    _assert_train_logits_close(out_got.logits, out_ref.logits, batch["attention_mask"])
    torch.testing.assert_close(out_got.loss, out_ref.loss, **TOL)
    trained = [n for n, p in got_params.items() if p.requires_grad]
    assert trained and len(trained) == sum(p.requires_grad for p in ref.parameters())
    for name in trained:
        got_grad, ref_grad = got_params[name].grad, ref_params[name].grad
        torch.testing.assert_close(
            got_grad, ref_grad, **TOL, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_negative_control_wrong_scaling_is_detected():
    # rsLoRA vs plain LoRA differ only in scaling (alpha/sqrt(r) vs alpha/r): the comparison above
    # must see it
    ref, _ = _wrapped(LORA_CASES["rslora"])
    _, got = _wrapped(LORA_CASES["lora"])
    _randomize_lora_B(ref, got)
    batch = _batch()
    with torch.no_grad():
        assert not torch.allclose(got(**batch).logits, ref(**batch).logits, **TOL)


def _prompt_pair():
    hf, ours = _bases()
    ref = peft.get_peft_model(
        hf, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    )
    got = get_peft_model(ours, PromptTuningConfig(num_virtual_tokens=3))
    with torch.no_grad():  # the same prompt table on both sides
        got.prompt_encoder["default"].embedding.weight.copy_(ref.prompt_encoder["default"].embedding.weight)
    return ref, got


def test_prompt_tuning_logits_loss_and_grad_equal_peft(capsys):
    ref, got = _prompt_pair()
    ref.print_trainable_parameters()
    got.print_trainable_parameters()
    theirs, ours = capsys.readouterr().out.splitlines()
    assert ours == theirs  # the embedding shared with word_embeddings is counted once
    assert [n for n, p in got.named_parameters() if p.requires_grad] == [
        "prompt_encoder.default.embedding.weight"
    ]
    assert sorted(n for n, _ in got.named_parameters()) == sorted(
        n for n, _ in ref.named_parameters()
    )
    batch = _batch()
    out_ref, out_got = _forward_backward(ref, batch), _forward_backward(got, batch)
    assert out_got.logits.shape == (2, 3 + 7, TINY["vocab_size"])  # virtual tokens come first
    prefixed_mask = torch.cat([torch.ones(2, 3, dtype=torch.long), batch["attention_mask"]], dim=1)
    _assert_train_logits_close(out_got.logits, out_ref.logits, prefixed_mask)
    torch.testing.assert_close(out_got.loss, out_ref.loss, **TOL)
    torch.testing.assert_close(got.prompt_encoder["default"].embedding.weight.grad,
                               ref.prompt_encoder["default"].embedding.weight.grad, **TOL)


@pytest.mark.parametrize("case", ["dora", "all_linear", "modules_to_save"])
def test_adapter_files_move_both_ways(case, tmp_path):
    ref, got = _wrapped(LORA_CASES[case])
    _randomize_lora_B(ref, got)
    # make the two adapters differ from each other, so a mixed-up load is caught
    with torch.no_grad():
        for p in ref.parameters():
            if p.requires_grad:
                p.add_(0.01)
    got.save_pretrained(tmp_path / "ours")
    ref.save_pretrained(tmp_path / "peft")
    batch = _batch()
    hf, ours = _bases()
    peft_loads_ours = peft.PeftModel.from_pretrained(hf, tmp_path / "ours")
    ours_loads_peft = PeftModelForCausalLM.from_pretrained(ours, tmp_path / "peft")
    got.eval(), ref.eval()
    with torch.no_grad():
        # bit for bit against our own statements (reference mode: peft's order of operations);
        # the speed paths (q/k/v's A as one GEMM) sum in another order, within TOL
        with reference_mode():
            torch.testing.assert_close(
                peft_loads_ours(**batch).logits, got(**batch).logits, rtol=0, atol=0
            )
        torch.testing.assert_close(peft_loads_ours(**batch).logits, got(**batch).logits, **TOL)
        torch.testing.assert_close(ours_loads_peft(**batch).logits, ref(**batch).logits, **TOL)
    ours_cfg = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    peft_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    for cfg in (ours_cfg, peft_cfg):
        # peft writes a set in arbitrary order
        cfg["target_modules"] = sorted(cfg["target_modules"])
    assert ours_cfg == peft_cfg


def test_prompt_tuning_files_move_both_ways(tmp_path):
    ref, got = _prompt_pair()
    with torch.no_grad():
        ref.prompt_encoder["default"].embedding.weight.add_(1.0)  # differ, so each load is visible
    got.save_pretrained(tmp_path / "ours")
    ref.save_pretrained(tmp_path / "peft")
    assert (json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
            == json.loads((tmp_path / "peft" / "adapter_config.json").read_text()))
    batch = _batch()
    hf, ours = _bases()
    with torch.no_grad():
        peft_loads_ours = peft.PeftModel.from_pretrained(hf, tmp_path / "ours")
        torch.testing.assert_close(
            peft_loads_ours(**batch).logits, got.eval()(**batch).logits, **TOL
        )
        ours_loads_peft = PeftModelForCausalLM.from_pretrained(ours, tmp_path / "peft")
        torch.testing.assert_close(
            ours_loads_peft(**batch).logits, ref.eval()(**batch).logits, **TOL
        )


@pytest.mark.parametrize("case", ["lora", "dora", "modules_to_save"])
def test_print_trainable_parameters_equals_peft(case, capsys):
    ref, got = _wrapped(LORA_CASES[case])
    ref.print_trainable_parameters()
    expected = capsys.readouterr().out
    got.print_trainable_parameters()
    assert capsys.readouterr().out == expected
    assert expected.startswith("trainable params: ")


def test_merge_and_unload_equals_peft():
    ref, got = _wrapped(LORA_CASES["dora"])
    _randomize_lora_B(ref, got)
    batch = _batch()
    merged_ref, merged_got = ref.merge_and_unload(), got.merge_and_unload()
    assert type(merged_got) is CausalLM
    assert sorted(merged_got.state_dict()) == sorted(merged_ref.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged_got(**batch).logits, merged_ref(**batch).logits, **TOL)


@pytest.mark.parametrize("case", ["lora", "dora"])
def test_lora_on_4bit_base_matches_peft_on_bnb_linear4bit(case, tmp_path, capsys):
    # transformers' own bitsandbytes loading (BitsAndBytesConfig, device_map="cpu") vs nanosft
    # quantize_model
    hf, _ = _bases()
    hf.save_pretrained(tmp_path)
    bnb_config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    hf4 = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=bnb_config, device_map="cpu", dtype=torch.float32
    )
    ours4 = quantize_model(CausalLM.from_pretrained(tmp_path), compute_dtype=torch.float32)
    kwargs = {**LORA_CASES[case], "target_modules": "all-linear"}
    torch.manual_seed(42)
    ref = peft.get_peft_model(hf4, peft.LoraConfig(task_type="CAUSAL_LM", **kwargs))
    torch.manual_seed(42)
    got = get_peft_model(ours4, LoraConfig(**kwargs))
    ref_params, got_params = dict(ref.named_parameters()), dict(got.named_parameters())
    assert sorted(got_params) == sorted(ref_params)
    # packed codes and adapters
    assert all(torch.equal(got_params[n], p) for n, p in ref_params.items())
    ref.print_trainable_parameters()
    got.print_trainable_parameters()
    theirs, ours = capsys.readouterr().out.splitlines()[-2:]
    assert ours == theirs  # a packed uint8 weight counts 2 parameters per byte on both sides
    _randomize_lora_B(ref, got)
    batch = _batch()
    # train mode: no CPU fast path
    out_ref, out_got = _forward_backward(ref, batch), _forward_backward(got, batch)
    _assert_train_logits_close(out_got.logits, out_ref.logits, batch["attention_mask"])
    torch.testing.assert_close(out_got.loss, out_ref.loss, **TOL)
    for name, p in got_params.items():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL)
    # merge_and_unload on 4-bit: dequantize, add the delta, re-quantize; the same codes come out on
    # both sides
    merged_ref, merged_got = ref.merge_and_unload(), got.merge_and_unload()
    sd_ref, sd_got = merged_ref.state_dict(), merged_got.state_dict()
    assert sorted(sd_got) == sorted(sd_ref)
    assert all(torch.equal(sd_got[k], sd_ref[k]) for k in sd_ref)
