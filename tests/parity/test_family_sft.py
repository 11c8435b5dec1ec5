"""QLoRA SFT per step, nanosft SFTTrainer against TRL SFTTrainer + peft + bitsandbytes, for the
families beyond Llama: Qwen3 (q/k norms, head_dim != hidden / heads), SmolLM3 (layers without
RoPE), Mistral and Qwen2 with a sliding window shorter than the rows, and Phi-3 (partial RoPE;
all-linear targets the fused qkv_proj and gate_up_proj).

Per family: one tiny random model built by transformers' own config class (norms randomized so
a q_norm / k_norm mix-up shows) saved to a folder; each stack loads that folder in 4-bit (NF4,
double quant, fp32 compute, as TRL's QLoRA recipe minus bf16); the same LoRA config on
all-linear, the same starting adapters (copied from TRL's into ours; TRL then casts both to bf16),
the same pre-tokenized rows, seed and arguments. Compared for each of 3 optimizer steps: loss,
grad_norm and learning_rate at atol 1e-5, the tolerance of the Llama parity in
test_trainer_parity.py. Hermetic: CPU, no downloads (a WordLevel tokenizer built in memory); `-s`
prints the largest loss difference.
Run: python -m pytest -q -s tests/parity/test_family_sft.py
"""

import datasets
import peft
import pytest
import torch
import transformers
import trl
from tiny import one_thread  # noqa: F401 (an autouse fixture)
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from nanosft.args import SFTConfig
from nanosft.model import CausalLM
from nanosft.nf4 import BitsAndBytesConfig, is_quantized
from nanosft.peft import LoraConfig
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer

V, WINDOW = 128, 5
# hidden 64: the NF4 kernels need in_features % 64 == 0
BASE = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": None, "eos_token_id": 1}
FAMILIES = {  # name: (transformers config class, overrides)
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32}),
    "smollm3": (transformers.SmolLM3Config, {"no_rope_layer_interval": 2}),
    "mistral-window": (transformers.MistralConfig, {"sliding_window": WINDOW}),
    "qwen2-window": (transformers.Qwen2Config,  # layer 0 full attention, layer 1 windowed
                     {"use_sliding_window": True, "sliding_window": WINDOW,
                      "max_window_layers": 1}),
    "phi3": (transformers.Phi3Config, {"partial_rotary_factor": 0.5}),
}
QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
         "bnb_4bit_compute_dtype": torch.float32}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_dropout": 0.0}
ARGS = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 3,
        "learning_rate": 5e-3, "warmup_steps": 0, "max_grad_norm": 0.3, "logging_steps": 1,
        "save_strategy": "no", "use_cpu": True, "bf16": False, "fp16": False,
        "optim": "adamw_torch", "seed": 11, "report_to": "none", "disable_tqdm": True,
        "gradient_checkpointing": False, "max_length": None}
KEYS = ("loss", "grad_norm", "learning_rate")


def make_rows(n=12, seed=2):
    """Rows of 8-15 tokens (longer than the window), the first few labelled -100 (the prompt)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(8, 16, (1,), generator=g))
        ids = torch.randint(2, V, (length,), generator=g).tolist()
        prompt = int(torch.randint(1, length - 2, (1,), generator=g))
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def wordlevel_tokenizers():
    """(transformers, nanosft) tokenizers over one WordLevel vocabulary "t2".."t127"."""
    vocab = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, V)}}
    backend = BackendTokenizer(WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.add_special_tokens(["<pad>", "</s>"])
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                               eos_token="</s>")
    return ref, Tokenizer(backend, pad_token="<pad>", eos_token="</s>")


def hf_folder(name, tmp_path):
    config_class, overrides = FAMILIES[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_class(**{**BASE, **overrides}))
    with torch.no_grad():  # norms are built as ones: a q_norm / k_norm mix-up would not show
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def train_logs(trainer):
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_qlora_sft_losses_match_trl(name, tmp_path):
    folder = hf_folder(name, tmp_path)
    rows = make_rows()
    ref_tok, our_tok = wordlevel_tokenizers()
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, device_map="cpu",
        quantization_config=transformers.BitsAndBytesConfig(**QLORA))
    our_model = CausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(**QLORA))
    assert type(our_model).__name__ == type(ref_model).__name__ and is_quantized(our_model)
    ref = trl.SFTTrainer(model=ref_model, args=trl.SFTConfig(str(tmp_path / "ref"), **ARGS),
                         train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=ref_tok, peft_config=peft.LoraConfig(**LORA))
    ours = SFTTrainer(our_model, SFTConfig(str(tmp_path / "ours"), **ARGS), train_dataset=rows,
                      processing_class=our_tok, peft_config=LoraConfig(**LORA))
    # the same starting adapters whatever RNG draws each library's init makes (B is zero in both)
    ref_params = dict(ref.model.named_parameters())
    trainable = {n: p for n, p in ours.model.named_parameters() if p.requires_grad}
    assert sorted(trainable) == sorted(n for n, p in ref_params.items() if p.requires_grad)
    with torch.no_grad():
        for n, p in trainable.items():
            assert p.dtype == ref_params[n].dtype == torch.bfloat16  # TRL's QLoRA adapter cast
            p.copy_(ref_params[n])
    ref_logs, our_logs = train_logs(ref), train_logs(ours)
    assert [h["step"] for h in our_logs] == [h["step"] for h in ref_logs] == [1, 2, 3]
    for a, b in zip(our_logs, ref_logs):
        for key in KEYS:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5,
                                       msg=f"{name} step {a['step']} {key}")
    assert our_logs[-1]["loss"] != our_logs[0]["loss"]  # the adapters moved: the steps differ
    worst = {key: max(abs(a[key] - b[key]) for a, b in zip(our_logs, ref_logs)) for key in KEYS}
    print(f"\n[{name}] QLoRA SFT, 3 steps: max |diff| " +
          ", ".join(f"{key} {value:.2e}" for key, value in worst.items()))
