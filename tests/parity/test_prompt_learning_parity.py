"""Parity of walkthrough 2.6's prompt-learning branches (prompt tuning, P-tuning, prefix tuning).

Compared, on a tiny GQA Llama with the same weights and the same seed, nanosft against peft 0.21.2:
parameter names and bit-identical initial encoder weights (prompt tuning; MLP and LSTM P-tuning;
prefix tuning with and without prefix_projection, init_weights="zero"); print_trainable_parameters;
logits, loss and every encoder gradient of one training forward/backward (fp32, 1e-5), with the
speed paths on and in reference mode; prefix tuning with explicit position_ids (peft shifts them by
num_virtual_tokens); adapter files both ways (adapter_config.json key for key, the one
`prompt_embeddings` tensor, and the logits of each side loading the other's folder); SFTTrainer
with P-tuning and prefix tuning against TRL's SFTTrainer + peft (every step's loss, grad_norm,
entropy, token accuracy, num_tokens; test_trainer_parity's rows, tokenizer and arguments);
P-tuning and prefix tuning logits on every model family of test_families (sliding windows,
no-RoPE layers, q/k norms). A negative control shows the logit comparison sees a missing
prefix. Hermetic: transformers' models are built in-process (their state_dicts loaded into
nanosft's CausalLM, or saved to a temp folder and read back); nothing is downloaded.
Run: python -m pytest -q tests/parity/test_prompt_learning_parity.py
"""

import json

import datasets
import peft
import pytest
import torch
import transformers
import trl
from safetensors.torch import load_file
from test_families import FAMILIES, hf_folder
from test_trainer_parity import COMMON, make_models, make_rows, train_logs, wordlevel_tokenizers
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.args import SFTConfig
from nanosft.families.auto import AutoModelForCausalLM
from nanosft.peft import (PeftModelForCausalLM, PrefixTuningConfig, PromptEncoderConfig,
                          PromptTuningConfig, get_peft_model)
from nanosft.reference import reference_mode
from nanosft.sft import SFTTrainer

# 4 query heads over 2 KV heads: prefix tuning must size its keys by the KV heads
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32, the same ops in the same order
N_VIRTUAL = 3
CASES = {
    "prompt_tuning": ("PromptTuningConfig", {}),  # also tests/parity/test_peft_parity.py
    "p_tuning_mlp": ("PromptEncoderConfig", {"encoder_reparameterization_type": "MLP"}),
    "p_tuning_lstm": ("PromptEncoderConfig", {"encoder_reparameterization_type": "LSTM",
                                              "encoder_hidden_size": 16}),
    "prefix": ("PrefixTuningConfig", {}),
    "prefix_projection": ("PrefixTuningConfig", {"prefix_projection": True,
                                                 "encoder_hidden_size": 24}),
    "prefix_zero": ("PrefixTuningConfig", {"init_weights": "zero"}),
}
OURS = {"PromptTuningConfig": PromptTuningConfig, "PromptEncoderConfig": PromptEncoderConfig,
        "PrefixTuningConfig": PrefixTuningConfig}


def _bases():
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    from nanosft.model import CausalLM, ModelConfig

    ours = CausalLM(ModelConfig(**TINY))
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def _pair(case):
    kind, kwargs = CASES[case]
    hf, ours = _bases()
    torch.manual_seed(42)
    ref = peft.get_peft_model(hf, getattr(peft, kind)(task_type="CAUSAL_LM",
                                                      num_virtual_tokens=N_VIRTUAL, **kwargs))
    torch.manual_seed(42)  # the same draws in the same order: bit-identical encoders
    got = get_peft_model(ours, OURS[kind](num_virtual_tokens=N_VIRTUAL, **kwargs))
    return ref, got


def _batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 5:] = 0  # right padding on row 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :2] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _real(logits, attention_mask):
    """The real positions of the logits: prepended prompts come first (P-tuning), a prefix adds no
    position (prefix tuning). Pad positions are zero on nanosft's unpadded training path."""
    n = logits.shape[1] - attention_mask.shape[1]
    return logits[:, n:][attention_mask.bool()]


def _nudge(model, amount):
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(amount)


@pytest.mark.parametrize("reference", [False, True], ids=["speed_paths", "reference_mode"])
@pytest.mark.parametrize("case", CASES)
def test_names_init_logits_loss_grads_equal_peft(case, reference, capsys):
    ref, got = _pair(case)
    ref_params, got_params = dict(ref.named_parameters()), dict(got.named_parameters())
    assert list(n for n in got_params if n.startswith("prompt_encoder")) == [
        n for n in ref_params if n.startswith("prompt_encoder")]
    assert sorted(got_params) == sorted(ref_params)
    for name, p in ref_params.items():
        assert torch.equal(got_params[name], p), name
        assert got_params[name].requires_grad == p.requires_grad, name
    ref.print_trainable_parameters()
    got.print_trainable_parameters()
    theirs, ours = capsys.readouterr().out.splitlines()
    assert ours == theirs
    if case == "prefix_zero":
        _nudge(ref, 0.1), _nudge(got, 0.1)  # a zero prefix would hide a key/value mix-up
    batch = _batch()
    ref.train(), got.train()
    out_ref = ref(**batch)
    with reference_mode(reference):
        out_got = got(**batch)
    out_ref.loss.backward()
    out_got.loss.backward()
    extra = 0 if CASES[case][0] == "PrefixTuningConfig" else N_VIRTUAL  # prompts are prepended
    assert out_got.logits.shape == (2, extra + 7, TINY["vocab_size"])
    torch.testing.assert_close(_real(out_got.logits, batch["attention_mask"]),
                               _real(out_ref.logits, batch["attention_mask"]), **TOL)
    torch.testing.assert_close(out_got.loss, out_ref.loss, **TOL)
    trained = [n for n, p in got_params.items() if p.requires_grad]
    assert trained and all(n.startswith("prompt_encoder.default.") for n in trained)
    for name in trained:
        torch.testing.assert_close(got_params[name].grad, ref_params[name].grad, **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", ["prefix", "prefix_projection"])
def test_prefix_position_ids_shift_by_num_virtual_tokens_as_peft(case):
    ref, got = _pair(case)
    batch = _batch()
    batch["position_ids"] = torch.arange(7).expand(2, 7)  # peft adds num_virtual_tokens to them
    ref.eval(), got.eval()
    with torch.no_grad():
        torch.testing.assert_close(got(**batch).logits, ref(**batch).logits, **TOL)
        # the same logits as without position_ids: the cache's n positions come first either way
        del batch["position_ids"]
        torch.testing.assert_close(got(**batch).logits, ref(**batch).logits, **TOL)


def test_negative_control_missing_prefix_is_detected():
    ref, got = _pair("prefix")
    batch = _batch()
    with torch.no_grad():
        without_prefix = got.get_base_model()(**batch).logits
        assert not torch.allclose(without_prefix, ref.eval()(**batch).logits, **TOL)


@pytest.mark.parametrize("case", ["p_tuning_lstm", "prefix", "prefix_projection"])
def test_adapter_files_move_both_ways(case, tmp_path):
    ref, got = _pair(case)
    _nudge(ref, 0.05)  # the two adapters differ, so a mixed-up load is caught
    got.save_pretrained(tmp_path / "ours")
    ref.save_pretrained(tmp_path / "peft")
    ours_cfg = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    peft_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert ours_cfg == peft_cfg
    ours_w = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    peft_w = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert list(ours_w) == list(peft_w) == ["prompt_embeddings"]
    assert ours_w["prompt_embeddings"].shape == peft_w["prompt_embeddings"].shape
    batch = _batch()
    hf, ours = _bases()
    got.eval(), ref.eval()
    with torch.no_grad():
        peft_loads_ours = peft.PeftModel.from_pretrained(hf, tmp_path / "ours")
        torch.testing.assert_close(_real(peft_loads_ours(**batch).logits, batch["attention_mask"]),
                                   _real(got(**batch).logits, batch["attention_mask"]), **TOL)
        ours_loads_peft = PeftModelForCausalLM.from_pretrained(ours, tmp_path / "peft")
        assert not any(p.requires_grad for p in ours_loads_peft.parameters())
        torch.testing.assert_close(_real(ours_loads_peft(**batch).logits, batch["attention_mask"]),
                                   _real(ref(**batch).logits, batch["attention_mask"]), **TOL)


@pytest.mark.parametrize("kind", ["PromptEncoderConfig", "PrefixTuningConfig"])
def test_sft_trainer_with_p_tuning_and_prefix_tuning_matches_trl(tmp_path, kind):
    rows = make_rows()
    ref_model, our_model = make_models()
    ref_tok, our_tok = wordlevel_tokenizers()
    sft = {**COMMON, "gradient_checkpointing": False, "max_length": None, "num_train_epochs": 3}
    kwargs = {"num_virtual_tokens": N_VIRTUAL, "encoder_hidden_size": 16,
              **({"prefix_projection": True} if kind == "PrefixTuningConfig" else {})}
    ref = trl.SFTTrainer(model=ref_model, args=trl.SFTConfig(str(tmp_path / "ref"), **sft),
                         train_dataset=datasets.Dataset.from_list(rows), processing_class=ref_tok,
                         peft_config=getattr(peft, kind)(task_type="CAUSAL_LM", **kwargs))
    ours = SFTTrainer(our_model, SFTConfig(str(tmp_path / "ours"), **sft), train_dataset=rows,
                      processing_class=our_tok, peft_config=OURS[kind](**kwargs))
    ref_params = dict(ref.model.named_parameters())
    with torch.no_grad():  # the same encoder, whatever each library's init drew
        for name, param in ours.model.named_parameters():
            if param.requires_grad:
                param.copy_(ref_params[name])
    our_logs, ref_logs = train_logs(ours), train_logs(ref)
    assert len(our_logs) == len(ref_logs) == 9
    for a, b in zip(our_logs, ref_logs):
        for key in ("loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy"):
            torch.testing.assert_close(a[key], b[key], **TOL, msg=f"step {a['step']} {key}")
        assert a["num_tokens"] == b["num_tokens"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_p_tuning_and_prefix_tuning_logits_on_the_model_families(name, tmp_path):

    hf, folder = hf_folder(name, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    g = torch.Generator().manual_seed(6)
    x = torch.randint(3, 128, (2, 12), generator=g)  # 3 + 12 tokens: past the windows of 5
    mask = torch.ones_like(x)
    mask[1, 9:] = 0
    for kind in ("PromptEncoderConfig", "PrefixTuningConfig"):
        torch.manual_seed(1)
        ref = peft.get_peft_model(hf, getattr(peft, kind)(task_type="CAUSAL_LM",
                                                          num_virtual_tokens=N_VIRTUAL))
        torch.manual_seed(1)
        got = get_peft_model(ours, OURS[kind](num_virtual_tokens=N_VIRTUAL))
        with torch.no_grad():
            theirs = ref(input_ids=x, attention_mask=mask)
            mine = got(input_ids=x, attention_mask=mask)
        torch.testing.assert_close(_real(mine.logits, mask), _real(theirs.logits, mask), **TOL,
                                   msg=lambda m, kind=kind: f"{kind}: {m}")
        hf, ours = ref.get_base_model(), got.get_base_model()  # prompt learning wraps, not injects
