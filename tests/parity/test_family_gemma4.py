"""Parity of nanosft.families.gemma4 with transformers 5.23 / peft 0.21.2 (Gemma4ForCausalLM).

Two tiny random models built by transformers' Gemma4TextConfig (fp32; 5 layers: sliding, full,
sliding, sliding, full, window 5; sliding head_dim 16, full head_dim 32 from per_layer_config; full
layers on proportional RoPE; norms randomized, each layer_scalar set to 1 + 0.1 i): "gemma4" with
per-layer inputs (64 per layer) and the last two layers reading the keys and values of layers 1
and 2; "gemma4-k-eq-v" with values from k_proj in the full layers (one kv head there), double-wide
MLPs in the shared layers, logits soft-capped at 3; "gemma4-plain" with neither per-layer inputs
nor shared layers, use_bidirectional_attention "vision" (causal on text). Logits within 1e-5 both
ways on a plain, a left-padded and a packed batch, in eval and in a training forward (nanosft's
unpadded speed path, packed and right-padded); greedy generation with the cache token for token
(the shared layers read the producers' cache); quantize-while-loading bitwise equal to
load-then-quantize and transformers + bitsandbytes; "all-linear" naming peft's modules; a LoRA
adapter trained 3 steps by one library loading in the other; layer_scalar loaded as a buffer, not
a trainable parameter; bidirectional text attention refused by name; a multimodal gemma4 folder
loading its text model with transformers' logits; gradient checkpointing giving the plain
backward's gradients; bf16 logits bit for bit; prefix tuning refused where layers share keys and
values (the MoE block: test_family_gemma4_moe.py). Hermetic: tmp folders, no downloads.
Helpers come from test_families.py (same folder).
Run: python -m pytest -q -s tests/parity/test_family_gemma4.py
"""

import peft
import pytest
import torch
import transformers
from test_families import assert_greedy_generation_matches
from test_families import (BASE, TOL, V, assert_adapters_move_both_ways,
                           assert_bf16_logits_equal_transformers,
                           assert_checkpointing_keeps_gradients,
                           assert_quantize_while_loading_matches, left_padded_batch,
                           models_both_ways, packed_row, randomize_vectors)
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.families.auto import AutoModelForCausalLM, config_from_dict
from nanosft.peft import LoraConfig, get_peft_model

GEMMA4 = {**BASE, "num_hidden_layers": 5, "head_dim": 16, "global_head_dim": 32,
          "sliding_window": 5, "vocab_size_per_layer_input": V, "hidden_size_per_layer_input": 64,
          "num_kv_shared_layers": 2,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                          "sliding_attention", "full_attention"]}
VARIANTS = {"gemma4": GEMMA4,
            "gemma4-k-eq-v": {**GEMMA4, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
                              "use_double_wide_mlp": True, "final_logit_softcapping": 3.0},
            # transformers' KV-shared path needs the per-layer inputs: none here, no sharing
            # use_bidirectional_attention "vision" (Gemma 4's larger checkpoints): causal on text
            "gemma4-plain": {**GEMMA4, "hidden_size_per_layer_input": 0,
                             "num_kv_shared_layers": 0, "use_bidirectional_attention": "vision"}}


def hf_folder(tmp_path, name="gemma4"):
    """A random transformers Gemma4ForCausalLM (layer_scalar 1 + 0.1 i), saved to tmp_path."""
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(**VARIANTS[name])
    hf = randomize_vectors(transformers.AutoModelForCausalLM.from_config(config)).eval()
    for i, layer in enumerate(hf.model.layers):
        layer.layer_scalar.fill_(1 + 0.1 * i)  # a buffer: randomize_vectors leaves it at 1
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_both_ways(name, tmp_path):
    x = torch.randint(3, V, (2, 16))
    padded, mask = left_padded_batch()
    packed, pos = packed_row()
    right = (torch.arange(16) < 11).long().expand(2, 16)
    worst = 0.0
    for hf, ours in models_both_ways(*hf_folder(tmp_path, name), tmp_path):
        with torch.no_grad():
            pairs = [(hf(x).logits, ours(x).logits)]
            real = mask.bool()  # padded queries are never read
            pairs.append((hf(padded, attention_mask=mask).logits[real],
                          ours(padded, attention_mask=mask).logits[real]))
            want_packed = hf(packed, position_ids=pos, use_cache=False).logits
            pairs.append((want_packed, ours(packed, position_ids=pos).logits))
            want_right = hf(x, attention_mask=right).logits
        ours.train()  # a training forward: nanosft's unpadded speed path
        pairs.append((want_packed, ours(packed, position_ids=pos).logits.detach()))
        got_right = ours(x, attention_mask=right).logits.detach()
        pairs.append((want_right[right.bool()], got_right[right.bool()]))
        ours.eval()
        for want, got in pairs:
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
    print(f"\n[{name}] max |logit diff| = {worst:.3e}")


def test_greedy_generation_is_token_identical(tmp_path):
    # the variant with every option a generation step meets: per-layer inputs, shared layers,
    # values from k_proj, soft-capped logits
    assert_greedy_generation_matches(*hf_folder(tmp_path, "gemma4-k-eq-v"))


def test_quantize_while_loading_is_bitwise_load_then_quantize_and_transformers(tmp_path):
    _, folder = hf_folder(tmp_path)
    assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))


def test_all_linear_targets_the_modules_peft_targets(tmp_path):
    hf, folder = hf_folder(tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    got = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    names = [n for n, _ in got.named_parameters() if "lora_" in n]
    assert names and names == [n for n, _ in ref.named_parameters() if "lora_" in n]
    assert any("per_layer_input_gate.lora_A" in n for n in names)


def test_trained_lora_adapters_move_both_ways(tmp_path):
    hf, folder = hf_folder(tmp_path)
    x = torch.randint(3, V, (2, 12))
    assert_adapters_move_both_ways(hf, folder, tmp_path, x, "all-linear", "gemma4")


def test_layer_scalar_loads_as_a_buffer(tmp_path):
    _, folder = hf_folder(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder)
    assert not any("layer_scalar" in n for n, _ in ours.named_parameters())
    assert [float(layer.layer_scalar) for layer in ours.model.layers] == pytest.approx(
        [1 + 0.1 * i for i in range(5)])


def test_bidirectional_text_is_refused_by_name():
    with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
        config_from_dict({"model_type": "gemma4_text", **GEMMA4,
                          "use_bidirectional_attention": "all"})


def test_multimodal_gemma4_folder_loads_its_language_model(tmp_path):
    """model_type gemma4 (Gemma 4's released checkpoints: vision and audio towers beside the
    language model, keys model.language_model.*): nanosft loads the text model, with the logits
    of transformers' AutoModelForCausalLM (Gemma4ForConditionalGeneration) on text."""
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
              "position_embedding_size": 64}
    config = transformers.Gemma4Config(text_config=GEMMA4, vision_config=vision,
                                       audio_config=None)
    torch.manual_seed(0)
    transformers.Gemma4ForConditionalGeneration(config).save_pretrained(tmp_path / "vlm")
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "vlm").eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "vlm").eval()
    assert type(ours).__name__ == "Gemma4ForCausalLM"
    x = torch.randint(3, V, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, want(input_ids=x).logits, **TOL)


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    """Checkpointed layers (recomputed in backward, their cache entries and masks passed again)
    give the gradients of the plain backward, on a right-padded batch."""
    assert_checkpointing_keeps_gradients(hf_folder(tmp_path)[1])


def test_bf16_logits_equal_transformers_bitwise(tmp_path):
    """Loaded in bfloat16, the same casts in the same places: logits bit for bit."""
    assert_bf16_logits_equal_transformers(hf_folder(tmp_path)[1])


def test_prefix_tuning_is_refused_where_layers_share_or_differ(tmp_path):
    from nanosft.peft import PrefixTuningConfig

    _, folder = hf_folder(tmp_path)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                           PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match="prefix tuning is not supported for this gemma4_text"):
        model(torch.randint(3, V, (1, 6)))
