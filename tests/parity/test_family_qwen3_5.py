"""Parity of nanosft.families.gated_deltanet and qwen3_5 with transformers 5.23 / peft 0.21.2.

The gated delta rule: nanosft's chunked and recurrent forms against transformers' torch
implementations (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule: the fallback when
no fused kernel is installed) on the same random inputs, several chunks, grouped heads and a
starting state: outputs and final states within 1e-5. Qwen3_5ForCausalLM on a tiny random model
built by transformers' Qwen3_5TextConfig (fp32; 4 layers: three Gated DeltaNet, one gated full
attention; head_dim 32 with partial_rotary_factor 0.25; norms, A_log and dt_bias randomized): logits
within 1e-5 both ways on a plain batch of 80 tokens (two chunks), a left-padded batch, and in a
training forward (nanosft's unpadded speed path) on a right-padded batch; a packed row equal to
transformers run on each document alone (transformers' torch path does not reset the state at a
document start, so its packed row is not the reference: a negative control shows the leak); greedy
generation with the cache token for token; quantize-while-loading bitwise equal to
load-then-quantize and transformers + bitsandbytes; "all-linear" and the named targets
(linear_attn.in_proj_qkv, in_proj_z, out_proj, ...) wrapping what peft wraps; a trained adapter
moving both ways; nemotron_h refused by name; a multimodal qwen3_5 folder (vision tower
beside the language model) loading its text model as transformers does; gradient checkpointing
giving the plain backward's gradients; bf16 logits bit for bit; a checkpoint's mtp.* weights
left unread, as transformers leaves them; prompt tuning equal to peft's; prefix tuning refused
by name (the recurrent layers have no keys and values to prefix). Hermetic: tmp folders, no
downloads.
Helpers come from test_families.py (same folder).
Run: python -m pytest -q -s tests/parity/test_family_qwen3_5.py
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
                           models_both_ways, save_random)
from tiny import one_thread  # noqa: F401 (an autouse fixture)
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from nanosft.families.auto import AutoModelForCausalLM, config_from_dict
from nanosft.families.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule
from nanosft.peft import LoraConfig, get_peft_model

QWEN3_5 = {**BASE, "num_hidden_layers": 4, "head_dim": 32, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj",
           "v_proj", "o_proj"]
# a regex as Qwen3.5 fine-tuning scripts write it (vision tower excluded)
REGEX_TARGETS = (r"^(?!.*visual).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"
                 r"|in_proj_qkv|in_proj_z|out_proj)$")


def hf_folder(tmp_path):
    """A random transformers Qwen3_5ForCausalLM, saved to tmp_path / "hf"."""
    return save_random(transformers.Qwen3_5TextConfig(**QWEN3_5), tmp_path)


def rule_inputs(B=2, T=150, Hk=2, Hv=4, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, Hk, D, generator=g), torch.randn(B, T, Hk, D, generator=g)
    v = torch.randn(B, T, Hv, D, generator=g)
    decay = -2 * torch.rand(B, T, Hv, generator=g)
    beta = torch.rand(B, T, Hv, generator=g)
    state = 0.1 * torch.randn(B, Hv, D, D, generator=g)
    return q, k, v, decay, beta, state


def test_gated_delta_rule_chunked_and_recurrent_match_transformers_torch():
    q, k, v, decay, beta, state = rule_inputs()  # 150 tokens: 3 chunks of 64, the last padded
    kwargs = {"initial_state": state, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    want_chunk = hf_qwen3_5.torch_chunk_gated_delta_rule(q, k, v, decay, beta, **kwargs)
    want_step = hf_qwen3_5.torch_recurrent_gated_delta_rule(q, k, v, decay, beta, **kwargs)
    got_chunk = chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=state)
    got_step = recurrent_gated_delta_rule(q, k, v, decay, beta, initial_state=state)
    for got, want in ((got_chunk, want_chunk), (got_step, want_step), (got_chunk, want_step)):
        for a, b in zip(got, want):  # output, final state
            torch.testing.assert_close(a, b, **TOL)


def test_logits_match_transformers_both_ways(tmp_path):
    x = torch.randint(3, V, (2, 80))  # two chunks of 64
    padded, mask = left_padded_batch()
    right = (torch.arange(16) < 11).long().expand(2, 16)
    worst = 0.0
    for hf, ours in models_both_ways(*hf_folder(tmp_path), tmp_path):
        with torch.no_grad():
            pairs = [(hf(x).logits, ours(x).logits)]
            real = mask.bool()  # padded queries are never read
            pairs.append((hf(padded, attention_mask=mask).logits[real],
                          ours(padded, attention_mask=mask).logits[real]))
            want_right = hf(x[:, :16], attention_mask=right).logits
        ours.train()  # a training forward: nanosft's unpadded speed path
        got_right = ours(x[:, :16], attention_mask=right).logits.detach()
        pairs.append((want_right[right.bool()], got_right[right.bool()]))
        ours.eval()
        for want, got in pairs:
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
    print(f"\n[qwen3_5] max |logit diff| = {worst:.3e}")


def test_packed_row_equals_its_documents_run_alone(tmp_path):
    hf, folder = hf_folder(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    lengths = (7, 70, 3)  # the middle document spans two chunks
    ids = torch.randint(3, V, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        alone = torch.cat([hf(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
        torch.testing.assert_close(ours(ids, position_ids=pos).logits, alone, **TOL)
        # negative control: transformers' torch path carries the state into the next document
        leaked = hf(ids, position_ids=pos, use_cache=False).logits
        assert (leaked[:, lengths[0]:] - alone[:, lengths[0]:]).abs().max() > 1e-3
    ours.train()  # the unpadded speed path: one row, split by the same document lengths
    torch.testing.assert_close(ours(ids, position_ids=pos).logits.detach(), alone, **TOL)


def test_greedy_generation_is_token_identical(tmp_path):
    assert_greedy_generation_matches(*hf_folder(tmp_path))


def test_quantize_while_loading_is_bitwise_load_then_quantize_and_transformers(tmp_path):
    _, folder = hf_folder(tmp_path)
    assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))


@pytest.mark.parametrize("target_modules", ["all-linear", TARGETS, ["linear_attn.in_proj_qkv"],
                                            REGEX_TARGETS])
def test_lora_targets_the_modules_peft_targets(target_modules, tmp_path):
    hf, folder = hf_folder(tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": target_modules}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    got = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    names = [n for n, _ in got.named_parameters() if "lora_" in n]
    assert names and names == [n for n, _ in ref.named_parameters() if "lora_" in n]
    assert any(".linear_attn.in_proj_qkv.lora_A" in n for n in names)


def test_trained_lora_adapters_move_both_ways(tmp_path):
    hf, folder = hf_folder(tmp_path)
    x = torch.randint(3, V, (2, 12))
    assert_adapters_move_both_ways(hf, folder, tmp_path, x, TARGETS, "qwen3_5")


def test_a_family_still_out_of_scope_is_refused_by_name():
    """(The MoE variant loads now: test_family_qwen3_5_moe.py.)"""
    with pytest.raises(ValueError, match="model_type='nemotron_h'.*Mamba-2"):
        config_from_dict({"model_type": "nemotron_h"})


def test_cached_steps_equal_one_forward(tmp_path):
    """The recurrent form with the (conv state, recurrent state) cache, one token a step after a
    chunked prefill, gives the logits of one chunked forward over the whole row."""
    _, folder = hf_folder(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(3, V, (2, 12))
    with torch.no_grad():
        want = ours(x).logits
        out = ours(x[:, :5], use_cache=True)
        got = [out.logits]
        for t in range(5, 12):
            out = ours(x[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            got.append(out.logits)
    torch.testing.assert_close(torch.cat(got, dim=1), want, **TOL)


def test_multimodal_qwen3_5_folder_loads_its_language_model(tmp_path):
    """model_type qwen3_5 (Qwen3.5's released checkpoints: a vision tower beside the language
    model, keys model.language_model.*): nanosft loads the text model, as transformers'
    AutoModelForCausalLM does, with equal logits; the vision weights are not read."""
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
              "out_hidden_size": 64}
    config = transformers.Qwen3_5Config(text_config=QWEN3_5, vision_config=vision)
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(tmp_path / "vlm")
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "vlm").eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "vlm").eval()
    assert type(ours).__name__ == type(want).__name__ == "Qwen3_5ForCausalLM"
    x = torch.randint(3, V, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, want(x).logits, **TOL)


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    """Checkpointed layers (recomputed in backward, their cache entries and masks passed again)
    give the gradients of the plain backward, on a right-padded batch."""
    assert_checkpointing_keeps_gradients(hf_folder(tmp_path)[1])


def test_bf16_logits_equal_transformers_bitwise(tmp_path):
    """Loaded in bfloat16, the same casts in the same places: logits bit for bit."""
    assert_bf16_logits_equal_transformers(hf_folder(tmp_path)[1])


def test_multi_token_prediction_weights_are_not_read(tmp_path):
    """Released Qwen3.5 checkpoints carry an mtp.* head: transformers ignores it on load, so
    does nanosft (the logits equal transformers' on the same folder)."""
    from safetensors.torch import load_file, save_file

    hf, folder = hf_folder(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    want = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(3, V, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, want(x).logits, **TOL)


def test_prefix_tuning_is_refused_by_name(tmp_path):
    """Gated DeltaNet layers keep a state, not keys and values a prefix could extend."""
    from nanosft.peft import PrefixTuningConfig

    _, folder = hf_folder(tmp_path)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                           PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match="prefix tuning is not supported for qwen3_5_text"):
        model(torch.randint(3, V, (1, 6)))


def test_prompt_tuning_matches_peft(tmp_path):
    """Prompt tuning prepends the prompts as embeddings: they run through the recurrent layers like
    tokens, as in peft over transformers' model."""
    from nanosft.peft import PromptTuningConfig

    hf, folder = hf_folder(tmp_path)
    config = {"task_type": "CAUSAL_LM", "num_virtual_tokens": 4}
    theirs = peft.get_peft_model(hf, peft.PromptTuningConfig(**config))
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder).eval(),
                          PromptTuningConfig(**config))
    x = torch.randint(3, V, (2, 10))
    with torch.no_grad():
        ours.prompt_encoder["default"].embedding.weight.copy_(
            theirs.prompt_encoder["default"].embedding.weight)
        torch.testing.assert_close(ours(x).logits, theirs(input_ids=x).logits, **TOL)
