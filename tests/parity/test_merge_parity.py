"""`nanosft merge` output loads in transformers and gives the logits of nanosft's unmerged adapter.

Compared: transformers AutoModelForCausalLM.from_pretrained(merged folder) logits vs nanosft's base
+ LoRA adapter (unmerged, PeftModelForCausalLM) on the same chat prompt, fp32, atol/rtol 1e-5
(merging only re-associates W x + B A x * scaling, so the difference is float rounding, ~1e-7);
AutoTokenizer ids vs nanosft's. Negative control: the base alone is far from both, so the adapter is
not a no-op. Hermetic: the tiny default model in nanosft/cli/assets/default and an adapter with
random lora_B (init_lora_weights=False) built in-process.
Run: python -m pytest -q tests/parity/test_merge_parity.py
"""

import torch
import transformers

from nanosft.cli import demo
from nanosft.cli import main
from nanosft.model import CausalLM
from nanosft.peft import LoraConfig, PeftModelForCausalLM, get_peft_model
from nanosft.tokenizer import Tokenizer


def test_merged_folder_loads_in_transformers_with_nanosft_logits(tmp_path, capsys):
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(CausalLM.from_pretrained(demo.DEFAULT_DIR), config).save_pretrained(
        tmp_path / "adapter"
    )
    code = main(["merge", "--model", demo.DEFAULT_DIR, "--adapter", str(tmp_path / "adapter"),
                 "--out", str(tmp_path / "merged")])
    assert code == 0, capsys.readouterr().err

    tokenizer = Tokenizer.from_pretrained(demo.DEFAULT_DIR)
    messages = [{"role": "user", "content": "What is 7 plus 5?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"] == ids
    input_ids = torch.tensor([ids])

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32
    ).eval()
    ours = PeftModelForCausalLM.from_pretrained(
        CausalLM.from_pretrained(demo.DEFAULT_DIR), str(tmp_path / "adapter")
    )
    base = CausalLM.from_pretrained(demo.DEFAULT_DIR).eval()
    with torch.no_grad():
        hf_logits = hf(input_ids=input_ids).logits
        our_logits = ours(input_ids=input_ids).logits
        base_logits = base(input_ids=input_ids).logits
    torch.testing.assert_close(hf_logits, our_logits, rtol=1e-5, atol=1e-5)
    # negative control: the adapter changes the model
    assert (base_logits - our_logits).abs().max() > 1e-2
