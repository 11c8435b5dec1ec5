"""Parity of nanosft.families.qwen3_5_moe with transformers 5.23 / peft 0.21.2: Qwen3.5-MoE.

A tiny random Qwen3_5MoeForCausalLM built by transformers' Qwen3_5MoeTextConfig (fp32; 4 layers:
three Gated DeltaNet, one gated full attention; every MLP a sparse block of 4 experts, top 2
renormalised, plus the shared expert scaled by sigmoid(shared_expert_gate(x)); norms, A_log and
dt_bias randomized). Compared: logits within 1e-5 both ways on a plain batch of 80 tokens (two
delta-rule chunks), a left-padded batch and a right-padded training forward (nanosft's unpadded
speed path), and a packed row against transformers run on each document alone (its torch path
carries the state across documents); the auxiliary load-balancing loss and the loss with it added
(output_router_logits, over the real tokens), within 1e-6, and the gradient of loss + aux loss on
every parameter, also with gradient checkpointing; bf16 logits bit for bit; greedy generation
token for token; the
checkpoint files (transformers' per-expert keys both ways), the multimodal qwen3_5_moe folder's
language model and its mtp.* weights left unread; quantize-while-loading bitwise equal to
transformers + bitsandbytes (experts and router stay float; the shared expert and its one-output
gate are 4-bit linears in both). LoRA: "all-linear" wraps what peft wraps (peft rewrites no expert
names for this model type: the shared expert and its gate get LoRA, the 3-D experts none);
target_modules on attention, Gated DeltaNet, the shared expert and its gate with target_parameters
on the 3-D experts and the router: the same names, shapes, logits and every LoRA gradient as peft;
adapters trained by one library load in the other. Negative controls: the shared expert ungated,
and the expert adapters disabled, move the logits. Hermetic: tmp folders, no downloads; `-s`
prints the largest differences.
Run: python -m pytest -q -s tests/parity/test_family_qwen3_5_moe.py
"""

import peft
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_families import (BASE, TOL, V, assert_bf16_logits_equal_transformers,
                           assert_greedy_generation_matches,
                           assert_quantize_while_loading_matches, left_padded_batch,
                           assert_adapters_move_both_ways, models_both_ways, save_random)
from test_family_moe import assert_lora_matches_peft
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.families.auto import AutoModelForCausalLM
from nanosft.peft import LoraConfig, get_peft_model

QWEN3_5_MOE = {**BASE, "num_hidden_layers": 4, "head_dim": 32, "linear_key_head_dim": 16,
               "linear_value_head_dim": 16, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}
# LoRA on linears (attention, Gated DeltaNet, the shared expert and its gate) and parameters
TARGETS = {"target_modules": ["q_proj", "v_proj", "in_proj_qkv", "out_proj", "gate_proj",
                              "up_proj", "down_proj", "shared_expert_gate"],
           "target_parameters": ["experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight"]}


def hf_folder(tmp_path):
    """A random transformers Qwen3_5MoeForCausalLM, saved to tmp_path / "hf"."""
    return save_random(transformers.Qwen3_5MoeTextConfig(**QWEN3_5_MOE), tmp_path)


def test_logits_and_aux_loss_match_transformers_both_ways(tmp_path):
    x = torch.randint(3, V, (2, 80))  # two chunks of 64
    padded, mask = left_padded_batch()
    right = (torch.arange(16) < 11).long().expand(2, 16)
    labels = x[:, :16].masked_fill(right == 0, -100)
    labelled = padded.masked_fill(mask == 0, -100)
    labelled[:, 1:][mask[:, :-1] == 0] = -100  # a padded query's prediction: not read
    worst = aux_worst = 0.0
    for hf, ours in models_both_ways(*hf_folder(tmp_path), tmp_path):
        with torch.no_grad():
            pairs = [(hf(x).logits, ours(x).logits)]
            real = mask.bool()  # padded queries are never read
            pairs.append((hf(padded, attention_mask=mask).logits[real],
                          ours(padded, attention_mask=mask).logits[real]))
            want = hf(padded, attention_mask=mask, labels=labelled, output_router_logits=True)
            got = ours(padded, attention_mask=mask, labels=labelled, output_router_logits=True)
            aux = [(want.aux_loss, got.aux_loss), (want.loss, got.loss)]
            want_right = hf(x[:, :16], attention_mask=right, labels=labels,
                            output_router_logits=True)
        ours.train()  # a training forward: nanosft's unpadded speed path
        got_right = ours(x[:, :16], attention_mask=right, labels=labels,
                         output_router_logits=True)
        ours.eval()
        pairs.append((want_right.logits[right.bool()], got_right.logits[right.bool()].detach()))
        aux += [(want_right.aux_loss, got_right.aux_loss.detach()),
                (want_right.loss, got_right.loss.detach())]
        assert len(got.router_logits) == 4 and got.aux_loss > 0
        for w, g in pairs:
            torch.testing.assert_close(g, w, **TOL)
            worst = max(worst, (g - w).abs().max().item())
        for w, g in aux:
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
            aux_worst = max(aux_worst, (g - w).abs().item())
    print(f"\n[qwen3_5_moe] max |logit diff| = {worst:.3e}, aux loss {aux_worst:.3e}")


def test_loss_and_aux_loss_gradients_match_transformers_with_checkpointing(tmp_path):
    """The gradient of loss + router_aux_loss_coef * aux_loss (coef 0.5, so the aux loss weighs)
    on every parameter, against transformers', also with checkpointed layers (recomputed in
    backward, the routers' logits kept only from the first pass)."""
    hf, folder = save_random(transformers.Qwen3_5MoeTextConfig(
        **QWEN3_5_MOE, router_aux_loss_coef=0.5), tmp_path)
    padded, mask = left_padded_batch()
    labels = padded.masked_fill(mask == 0, -100)
    labels[:, 1:][mask[:, :-1] == 0] = -100  # a padded query's prediction: not read
    out = hf.train()(padded, attention_mask=mask, labels=labels, output_router_logits=True)
    out.loss.backward()
    want = {n: p.grad for n, p in hf.named_parameters()}
    worst = 0.0
    for checkpointing in (False, True):
        ours = AutoModelForCausalLM.from_pretrained(folder).train()
        if checkpointing:
            ours.gradient_checkpointing_enable()
        ours(padded, attention_mask=mask, labels=labels, output_router_logits=True).loss.backward()
        got = {n: p.grad for n, p in ours.named_parameters()}
        assert sorted(got) == sorted(want)
        for n, grad in want.items():
            torch.testing.assert_close(got[n], grad, rtol=0, atol=1e-6, msg=n)
            worst = max(worst, (got[n] - grad).abs().max().item())
        assert all(layer.mlp.router_logits is None for layer in ours.model.layers)
    assert want["model.layers.0.mlp.gate.weight"].abs().max() > 1e-4
    print(f"\n[qwen3_5_moe] loss + aux loss gradients: max |diff| = {worst:.2e}")


def test_bf16_logits_equal_transformers_bitwise(tmp_path):
    """Loaded in bfloat16, the same casts in the same places: logits bit for bit."""
    assert_bf16_logits_equal_transformers(hf_folder(tmp_path)[1])


def test_packed_row_equals_its_documents_run_alone(tmp_path):
    hf, folder = hf_folder(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    lengths = (7, 70, 3)  # the middle document spans two chunks
    ids = torch.randint(3, V, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        alone = torch.cat([hf(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
        torch.testing.assert_close(ours(ids, position_ids=pos).logits, alone, **TOL)
    ours.train()  # the unpadded speed path: one row, split by the same document lengths
    torch.testing.assert_close(ours(ids, position_ids=pos).logits.detach(), alone, **TOL)


def test_greedy_generation_is_token_identical(tmp_path):
    assert_greedy_generation_matches(*hf_folder(tmp_path))


def test_negative_control_the_shared_expert_gate_matters(tmp_path):
    """The shared expert added ungated (its sigmoid taken as 1) moves the logits."""
    hf, folder = hf_folder(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(3, V, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, **TOL)
        for layer in ours.model.layers:
            layer.mlp.shared_expert_gate.weight.fill_(0.0)
            layer.mlp.shared_expert_gate.weight[0, 0] = 1e4  # sigmoid ~ 1 for most tokens
        assert (ours(x).logits - hf(x).logits).abs().max() > 1e-3


def test_checkpoint_files_multimodal_folder_and_mtp_weights(tmp_path):
    """nanosft writes transformers' per-expert keys (every tensor equal) and reads them into the
    3-D parameters; a multimodal qwen3_5_moe folder (vision tower beside the language model, keys
    model.language_model.*, an mtp.* head) loads its text model as transformers'
    AutoModelForCausalLM does, the mtp.* weights unread by both."""
    hf, folder = hf_folder(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder)
    assert ours.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 64, 64)  # (E, 2 I, C)
    ours.save_pretrained(tmp_path / "ours")
    files = []
    for f in (folder, tmp_path / "ours"):
        with safe_open(str(f / "model.safetensors"), "pt") as st:
            files.append({k: st.get_tensor(k) for k in st.keys()})
    assert sorted(files[0]) == sorted(files[1])
    assert "model.layers.3.mlp.experts.3.up_proj.weight" in files[1]
    for key, tensor in files[0].items():
        assert torch.equal(files[1][key], tensor), key
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
              "out_hidden_size": 64}
    config = transformers.Qwen3_5MoeConfig(text_config=QWEN3_5_MOE, vision_config=vision)
    torch.manual_seed(0)
    transformers.Qwen3_5MoeForConditionalGeneration(config).save_pretrained(tmp_path / "vlm")
    tensors = load_file(tmp_path / "vlm" / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, tmp_path / "vlm" / "model.safetensors", metadata={"format": "pt"})
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "vlm").eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "vlm").eval()
    assert type(ours).__name__ == type(want).__name__ == "Qwen3_5MoeForCausalLM"
    x = torch.randint(3, V, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, want(x).logits, **TOL)


def test_quantize_while_loading_is_bitwise_transformers(tmp_path):
    _, folder = hf_folder(tmp_path)
    ours = assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))
    assert ours["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float32
    assert ours["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert "model.layers.0.mlp.shared_expert_gate.weight.absmax" in ours


def test_all_linear_wraps_what_peft_wraps(tmp_path):
    """peft rewrites no expert names for qwen3_5_moe_text (transformers' conversion pattern is
    qwen3_5_text's), so all-linear is LoRA on every nn.Linear: attention, Gated DeltaNet, the
    shared expert and its gate; the 3-D experts and the router get none."""
    hf, folder = hf_folder(tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    got = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    names = [n for n, _ in got.named_parameters() if "lora_" in n]
    assert names == [n for n, _ in ref.named_parameters() if "lora_" in n]
    assert any(".mlp.shared_expert_gate.lora_A" in n for n in names)
    assert not any(".experts." in n or ".mlp.gate." in n for n in names)
    assert not ref.peft_config["default"].target_parameters
    assert not got.active_peft_config.target_parameters


def test_lora_on_experts_router_and_linears_equals_peft(tmp_path):
    """target_parameters on the 3-D experts and the router beside target_modules on the linears:
    the same names, shapes, logits and every LoRA gradient as peft's ParamWrapper."""
    hf, folder = hf_folder(tmp_path)
    config = {"r": 2, "lora_alpha": 4, **TARGETS}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    shapes = [[(n, p.shape) for n, p in m.named_parameters() if "lora_" in n] for m in (ref, ours)]
    assert shapes[0] == shapes[1]
    assert ("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.default.weight",
            (2 * 4, 64)) in shapes[1]  # gate_up_proj: rank 2 per expert, 4 experts, in C
    assert_lora_matches_peft(ref, ours, "qwen3_5_moe")


def test_trained_adapters_move_both_ways_with_peft(tmp_path):
    """An adapter (linears and 3-D experts) trained 3 steps by nanosft loads in peft, and one
    trained by peft loads in nanosft: logits within 1e-5; disabling the adapters moves them."""
    hf, folder = hf_folder(tmp_path)
    assert_adapters_move_both_ways(hf, folder, tmp_path, torch.randint(3, V, (2, 12)),
                                   label="qwen3_5_moe", **TARGETS)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_5_moe_text"])
def test_config_reads_the_text_model_type(model_type):
    """Both model types load (no longer refused) as the text model's config."""
    from nanosft.families.auto import config_from_dict

    d = {"model_type": model_type, "num_hidden_layers": 4}
    config = config_from_dict(d if model_type.endswith("_text") else {
        "model_type": model_type, "text_config": {"num_hidden_layers": 4}})
    assert config.model_type == "qwen3_5_moe_text" and config.norm_topk_prob
    assert "intermediate_size" not in config.to_dict()
