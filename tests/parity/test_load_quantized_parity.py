"""Parity of quantize-while-loading with transformers 5.23 + bitsandbytes 0.50.2.

Compared: the state dict (packed NF4/FP4 bytes, absmax, nested absmax, code tables, the packed
quant-state JSON, and the float embeddings, norms, biases and lm_head) of
CausalLM.from_pretrained(dir, dtype, quantization_config) (the family's class) against
transformers.AutoModelForCausalLM.from_pretrained(dir, dtype, quantization_config=
transformers.BitsAndBytesConfig(...), device_map="cpu") on the same folder, key for key and
bitwise; then the logits in train mode (fp32: 1e-5; bf16: one bf16 step; measured equal).
Hermetic: tiny Llama / Qwen2 folders written to tmp_path, CPU.
Run: python -m pytest -q tests/parity/test_load_quantized_parity.py
"""

import pytest
import torch
import transformers

from nanosft.families.auto import causal_lm_class, config_from_dict, from_config
from nanosft.nf4 import BitsAndBytesConfig

EXACT = {"rtol": 0, "atol": 0}


@pytest.mark.parametrize("model_type, dtype, quant_type, double_quant, max_shard_size", [
    ("llama", torch.float32, "nf4", True, "40KB"),  # QLoRA's options, sharded
    ("qwen2", torch.bfloat16, "nf4", False, "5GB"),  # q/k/v biases, bf16 weights and statistics
    ("llama", torch.float32, "fp4", True, "5GB"),  # transformers' default quant type
])
def test_state_dict_and_logits_equal_transformers(tmp_path, model_type, dtype, quant_type,
                                                  double_quant, max_shard_size):
    torch.manual_seed(0)
    config = config_from_dict({"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "model_type": model_type})
    from_config(config).save_pretrained(tmp_path, max_shard_size=max_shard_size)
    options = {"load_in_4bit": True, "bnb_4bit_quant_type": quant_type,
               "bnb_4bit_use_double_quant": double_quant, "bnb_4bit_compute_dtype": dtype}
    ours = causal_lm_class(config).from_pretrained(tmp_path, dtype=dtype,
                                                   quantization_config=BitsAndBytesConfig(**options))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=dtype, device_map="cpu",
        quantization_config=transformers.BitsAndBytesConfig(**options))
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert sorted(ours_sd) == sorted(ref_sd)
    for key in ref_sd:
        torch.testing.assert_close(ours_sd[key], ref_sd[key], **EXACT, msg=key)
    # a transformers BitsAndBytesConfig is accepted as it is, with the same result
    theirs = causal_lm_class(config).from_pretrained(
        tmp_path, dtype=dtype, quantization_config=ref.config.quantization_config)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(value, ours_sd[key], **EXACT, msg=key)
    x = torch.randint(0, 128, (2, 7))
    ours.train(), ref.train()
    # measured equal bit for bit; bf16 allows one bf16 step at |logit| ~ 1 (2^-7) for op order
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 2**-7}
    torch.testing.assert_close(ours(x).logits, ref(x).logits, **tol)
