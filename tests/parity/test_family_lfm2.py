"""Parity of nanosft.families.lfm2 and short_conv with transformers 5.23 / peft 0.21.2
(Lfm2ForCausalLM).

On a tiny random model built by transformers' Lfm2Config (fp32; 4 layers: conv, conv, full
attention, conv; conv_L_cache 3; block_multiple_of 64, so the MLP width is rounded; tied
embeddings; norms randomized): logits within 1e-5 both ways on a plain, a left-padded batch and in
a training forward (nanosft's unpadded speed path) on a right-padded batch; a packed row equal to
transformers run on each document alone (transformers' conv window runs across a document start:
a negative control shows it); the conv window cache stepped token by token equal to one forward;
greedy generation token for token; quantize-while-loading bitwise equal to load-then-quantize and
transformers + bitsandbytes; "all-linear" and LFM2's own names (in_proj, out_proj, w1, w2, w3, ...)
wrapping what peft wraps; a trained adapter moving both ways; gradient checkpointing giving the
plain backward's gradients; bf16 logits bit for bit; block_ff_dim and tie_embedding (older
config names) read as transformers reads them. Hermetic: tmp folders, no downloads.
Helpers come from test_families.py (same folder).
Run: python -m pytest -q -s tests/parity/test_family_lfm2.py
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

from nanosft.families.auto import AutoModelForCausalLM, config_from_dict
from nanosft.peft import LoraConfig, get_peft_model

LFM2 = {**BASE, "num_hidden_layers": 4, "block_multiple_of": 64, "tie_word_embeddings": True,
        "layer_types": ["conv", "conv", "full_attention", "conv"]}
TARGETS = ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "w1", "w2", "w3"]


def hf_folder(tmp_path):
    """A random transformers Lfm2ForCausalLM, saved to tmp_path / "hf"."""
    return save_random(transformers.Lfm2Config(**LFM2), tmp_path)


def test_logits_match_transformers_both_ways(tmp_path):
    x = torch.randint(3, V, (2, 16))
    padded, mask = left_padded_batch()
    right = (torch.arange(16) < 11).long().expand(2, 16)
    worst = 0.0
    for hf, ours in models_both_ways(*hf_folder(tmp_path), tmp_path):
        assert ours.model.layers[0].feed_forward.w1.out_features == 128  # 2/3 x 128 = 85 -> 128
        with torch.no_grad():
            pairs = [(hf(x).logits, ours(x).logits)]
            real = mask.bool()  # padded queries are never read
            pairs.append((hf(padded, attention_mask=mask).logits[real],
                          ours(padded, attention_mask=mask).logits[real]))
            want_right = hf(x, attention_mask=right).logits
        ours.train()  # a training forward: nanosft's unpadded speed path
        got_right = ours(x, attention_mask=right).logits.detach()
        pairs.append((want_right[right.bool()], got_right[right.bool()]))
        ours.eval()
        for want, got in pairs:
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
    print(f"\n[lfm2] max |logit diff| = {worst:.3e}")


def test_packed_row_equals_its_documents_run_alone(tmp_path):
    hf, folder = hf_folder(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    lengths = (7, 6, 3)
    ids = torch.randint(3, V, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        alone = torch.cat([hf(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
        torch.testing.assert_close(ours(ids, position_ids=pos).logits, alone, **TOL)
        # negative control: transformers' conv window reaches back into the previous document
        leaked = hf(ids, position_ids=pos, use_cache=False).logits
        assert (leaked[:, lengths[0]:] - alone[:, lengths[0]:]).abs().max() > 1e-4  # 10 x TOL
    ours.train()  # the unpadded speed path: one row, split by the same document lengths
    torch.testing.assert_close(ours(ids, position_ids=pos).logits.detach(), alone, **TOL)


def test_cached_steps_equal_one_forward(tmp_path):
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


def test_greedy_generation_is_token_identical(tmp_path):
    assert_greedy_generation_matches(*hf_folder(tmp_path))


def test_quantize_while_loading_is_bitwise_load_then_quantize_and_transformers(tmp_path):
    _, folder = hf_folder(tmp_path)
    assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))


@pytest.mark.parametrize("target_modules", ["all-linear", TARGETS])
def test_lora_targets_the_modules_peft_targets(target_modules, tmp_path):
    hf, folder = hf_folder(tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": target_modules}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    got = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    names = [n for n, _ in got.named_parameters() if "lora_" in n]
    assert names and names == [n for n, _ in ref.named_parameters() if "lora_" in n]
    assert any(".conv.in_proj.lora_A" in n for n in names)


def test_trained_lora_adapters_move_both_ways(tmp_path):
    hf, folder = hf_folder(tmp_path)
    x = torch.randint(3, V, (2, 12))
    assert_adapters_move_both_ways(hf, folder, tmp_path, x, TARGETS, "lfm2")


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    """Checkpointed layers (recomputed in backward, their cache entries and masks passed again)
    give the gradients of the plain backward, on a right-padded batch."""
    assert_checkpointing_keeps_gradients(hf_folder(tmp_path)[1])


def test_bf16_logits_equal_transformers_bitwise(tmp_path):
    """Loaded in bfloat16, the same casts in the same places: logits bit for bit."""
    assert_bf16_logits_equal_transformers(hf_folder(tmp_path)[1])


def test_older_config_names_read_as_transformers_reads_them():
    old = {**LFM2, "block_ff_dim": 192, "tie_embedding": False}
    del old["tie_word_embeddings"]
    want = transformers.Lfm2Config(**old)
    got = config_from_dict({"model_type": "lfm2", **old})
    assert (got.intermediate_size, got.tie_word_embeddings) == (want.intermediate_size,
                                                                want.tie_word_embeddings)
    assert (got.intermediate_size, got.tie_word_embeddings) == (192, False)
