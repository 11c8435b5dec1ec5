"""Run TRL's own tests/test_sft_trainer.py under TRL and under nanosft, with only imports changed.

Reads the test file and its tests/testing_utils.py from a TRL checkout named on the command line
(nothing of TRL is kept in this repository) and writes two copies to a temporary folder: one as
written, one whose trl / transformers / peft imports name nanosft's objects (a name nanosft lacks
stays transformers' for transformers, None for trl and peft). Both run offline on CPU against a
fake Hugging Face cache of tiny random models of the families nanosft loads (chat templates from
the installed trl package) and stand-ins for TRL's Hub datasets with the same configs and columns
(zen, toolcall, harmony), plus TRL's real tiny test models of those families (the config arguments
of TRL's generator: OLMo 3 with YaRN, GPT-NeoX with num_key_value_heads, gpt-oss, Qwen3-MoE,
GLM-4-MoE, Cohere 2, LFM2) and tiny-RemoteForCausalLM (TRL's remote code files, read from the
checkout). Models of other families are absent, so their tests fail under TRL too and are not
counted. Prints how many tests TRL passes here and how many of those nanosft passes, with the
first error line of each one it does not.
Run: python scripts/trl_sft_suite.py /path/to/trl-checkout [--nanosft .]  (a few minutes, 2 cores)
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ZEN = ["Beautiful is better than ugly.", "Explicit is better than implicit.",
       "Simple is better than complex.", "Complex is better than complicated.",
       "Flat is better than nested.", "Sparse is better than dense.", "Readability counts.",
       "Special cases aren't special enough to break the rules.",
       "Although practicality beats purity.", "Errors should never pass silently.",
       "Unless explicitly silenced.", "In the face of ambiguity, refuse the temptation to guess.",
       "There should be one obvious way to do it.", "Now is better than never.",
       "Although never is often better than right now.",
       "If the implementation is hard to explain, it's a bad idea.",
       "Namespaces are one honking great idea."]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "The city."}}}}}]
QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>",
        "</think>"]
LLAMA = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
QWEN_TOKENS = {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
LLAMA_TOKENS = {"pad_token": None, "eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"}
MISTRAL_TOKENS = {"pad_token": None, "eos_token": "</s>", "bos_token": "<s>"}
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                    "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}"
                    "{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
# Hub id -> (model_type, special tokens, trl chat template file or None, named tokens)
MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", QWEN, "qwen2_5.jinja", QWEN_TOKENS),
    "tiny-Qwen3ForCausalLM": ("qwen3", QWEN, "qwen3.jinja", QWEN_TOKENS),
    "tiny-LlamaForCausalLM-3": ("llama", LLAMA, "llama3.jinja", LLAMA_TOKENS),
    "tiny-LlamaForCausalLM-3.1": ("llama", LLAMA, "llama3_1.jinja", LLAMA_TOKENS),
    "tiny-LlamaForCausalLM-3.2": ("llama", LLAMA, "llama3_2.jinja", LLAMA_TOKENS),
    "tiny-MistralForCausalLM-0.1": ("mistral", ["<unk>", "<s>", "</s>"], None, MISTRAL_TOKENS),
    "tiny-MistralForCausalLM-0.2": ("mistral", ["<unk>", "<s>", "</s>"], None, MISTRAL_TOKENS),
    "tiny-Phi3ForCausalLM": ("phi3", ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>",
                                      "<|system|>"], "phi3.jinja",
                             {"pad_token": "<|endoftext|>", "eos_token": "<|end|>"}),
}
# TRL's real tiny test models of the families nanosft loads: the config arguments TRL's generator
# (scripts/generate_tiny_models/for_causal_lm/*.py) passes, vocab_size at least the tokenizer
# trained here. Hub id -> (transformers class prefix, config arguments, special tokens, trl chat
# template file or None, named tokens)
TINY = {"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "intermediate_size": 32}
HARMONY = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
           "<|call|>", "<|constrain|>"]
REAL = {
    "tiny-Olmo3ForCausalLM": ("Olmo3", {
        **TINY, "max_position_embeddings": 65536, "rms_norm_eps": 1e-06, "rope_theta": 500000,
        "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32.0,
                         "beta_slow": 1.0, "factor": 8.0,
                         "original_max_position_embeddings": 8192, "rope_type": "yarn"},
        "use_cache": False}, QWEN, None, QWEN_TOKENS),
    "tiny-GPTNeoXForCausalLM": ("GPTNeoX", dict(TINY), ["<|endoftext|>", "<|padding|>"], None,
                                {"pad_token": None, "eos_token": "<|endoftext|>",
                                 "bos_token": "<|endoftext|>"}),
    "tiny-GptOssForCausalLM": ("GptOss", {**TINY, "num_local_experts": 4,
                                          "num_experts_per_tok": 2}, HARMONY, "gptoss.jinja",
                               {"pad_token": "<|endoftext|>", "eos_token": "<|return|>"}),
    "tiny-Qwen3MoeForCausalLM": ("Qwen3Moe", {
        **TINY, "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "norm_topk_prob": True, "head_dim": 128,
        "max_window_layers": 48}, QWEN, "qwen3.jinja", QWEN_TOKENS),
    "tiny-Glm4MoeForCausalLM": ("Glm4Moe", {
        **TINY, "moe_intermediate_size": 32, "head_dim": 2, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "attention_bias": True, "rope_theta": 1000000,
        "routed_scaling_factor": 2.5, "use_qk_norm": True, "num_nextn_predict_layers": 1},
        QWEN, "glm4moe.jinja", QWEN_TOKENS),
    "tiny-Cohere2ForCausalLM": ("Cohere2", {**TINY, "logit_scale": 1.0, "rope_theta": 50000},
                                ["<PAD>", "<BOS_TOKEN>", "<EOS_TOKEN>"], "cohere2.jinja",
                                {"pad_token": "<PAD>", "eos_token": "<EOS_TOKEN>",
                                 "bos_token": "<BOS_TOKEN>"}),
    "tiny-Lfm2ForCausalLM": ("Lfm2", {
        **TINY, "full_attn_idxs": [1], "block_multiple_of": 8, "max_position_embeddings": 128000,
        "norm_eps": 1e-05, "rope_theta": 1000000.0, "conv_bias": False, "conv_L_cache": 3,
        "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "use_cache": False},
        ["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "lfm2.jinja", {"pad_token": "<|pad|>", "eos_token": "<|im_end|>",
                       "bos_token": "<|startoftext|>"}),
}
# What the test copies run with: a fake cache, TRL's datasets replaced, bf16 allowed on CPU.
CONFTEST = '''
import os, pathlib, sys
import pytest
os.environ.update(HF_HUB_CACHE={hub!r}, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                  TOKENIZERS_PARALLELISM="false")
sys.path.insert(0, {nanosft!r})
sys.path.insert(0, {here!r})
import suite_data
import torch
torch.set_num_threads(1)
# TRL's SFTConfig turns bf16 on, which transformers refuses on a CPU-only machine unless use_cpu;
# CPU autocast runs bf16, so the check is let through (nanosft accepts bf16 on CPU itself)
import transformers.training_args
transformers.training_args.is_torch_bf16_gpu_available = lambda *a, **k: True


@pytest.fixture(autouse=True)
def _stand_in_datasets(request, monkeypatch):
    if hasattr(request.module, "load_dataset"):
        monkeypatch.setattr(request.module, "load_dataset", suite_data.load_dataset)


@pytest.fixture
def lazy_shared_datadir():
    return pathlib.Path({data!r})
'''
DATA = '''
import datasets
ZEN = {zen!r}
TOOLS = {tools!r}


def rows(path, config):
    questions = [f"Tell me line {{i}} of the Zen." for i in range(len(ZEN))]
    if path.endswith("harmony"):  # gpt-oss's format: thinking beside content, template kwargs
        kwargs = {{"reasoning_effort": "low", "model_identity": "You are a tiny model."}}
        if config == "language_modeling":
            return [{{"messages": [{{"role": "user", "content": q}}, {{
                "role": "assistant", "thinking": "Think.", "content": z}}],
                "chat_template_kwargs": kwargs}} for q, z in zip(questions, ZEN)]
        return [{{"prompt": [{{"role": "user", "content": q}}], "completion": [{{
            "role": "assistant", "thinking": "Think.", "content": z}}],
            "chat_template_kwargs": kwargs}} for q, z in zip(questions, ZEN)]
    if path.endswith("toolcall"):
        return [{{"messages": [
            {{"role": "user", "content": f"Weather in city {{i}}?"}},
            {{"role": "assistant", "content": None, "tool_calls": [{{"type": "function",
                "function": {{"name": "get_weather", "arguments": {{"city": f"city {{i}}"}}}}}}]}},
            {{"role": "tool", "name": "get_weather", "content": "sunny"}},
            {{"role": "assistant", "content": z}}], "tools": TOOLS_JSON}}
            for i, z in enumerate(ZEN)]
    out = []
    for i, (q, z) in enumerate(zip(questions, ZEN)):
        words = z.split(" ")
        cut = max(1, len(words) // 2)
        prompt, completion = " ".join(words[:cut]), " " + " ".join(words[cut:])
        out.append({{
            "standard_language_modeling": {{"text": z}},
            "conversational_language_modeling": {{"messages": [
                {{"role": "user", "content": q}}, {{"role": "assistant", "content": z}}]}},
            "standard_prompt_completion": {{"prompt": prompt, "completion": completion}},
            "conversational_prompt_completion": {{
                "prompt": [{{"role": "user", "content": q}}],
                "completion": [{{"role": "assistant", "content": z}}]}},
            "standard_implicit_prompt_preference": {{"chosen": z, "rejected": ZEN[i - 1]}},
        }}[config])
    return out


import json
TOOLS_JSON = json.dumps(TOOLS)


def load_dataset(path, name=None, split=None, streaming=False, **kwargs):
    data = rows(path, name)
    splits = datasets.DatasetDict(train=datasets.Dataset.from_list(data[:14]),
                                  test=datasets.Dataset.from_list(data[14:]))
    if split is None:
        if streaming:
            return datasets.IterableDatasetDict(
                {{k: v.to_iterable_dataset() for k, v in splits.items()}})
        return splits
    base, _, part = split.partition("[")
    dataset = splits[base]
    if part:
        start, _, stop = part.rstrip("]").partition(":")
        dataset = dataset.select(range(int(start or 0), int(stop) if stop else len(dataset)))
    return dataset.to_iterable_dataset() if streaming else dataset
'''


def build_models(hub):
    """A snapshot per Hub id under hub/ (refs/main -> 0...0): tokenizer + tiny random model."""
    import torch
    import transformers
    import trl

    from nanosft.tokenizer import Tokenizer

    classes = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "mistral": "Mistral",
               "phi3": "Phi3"}
    templates = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
    for name, (model_type, specials, template, tokens) in MODELS.items():
        repo = os.path.join(hub, f"models--trl-internal-testing--{name}")
        snapshot = os.path.join(repo, "snapshots", "0" * 40)
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write("0" * 40)
        corpus = ZEN * 3 + ["Weather in Paris? It is sunny. get_weather city"] * 3
        tokenizer = Tokenizer.train(corpus, vocab_size=600, special_tokens=specials, **tokens)
        if template is None:
            tokenizer.chat_template = MISTRAL_TEMPLATE
        else:
            with open(os.path.join(templates, template)) as f:
                tokenizer.chat_template = f.read()
        tokenizer.save_pretrained(snapshot)
        config = getattr(transformers, f"{classes[model_type]}Config")(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=model_type.startswith("qwen"),
            **({"head_dim": 4} if model_type == "qwen3" else {}))
        torch.manual_seed(0)
        getattr(transformers, f"{classes[model_type]}ForCausalLM")(config).save_pretrained(snapshot)


def build_real_models(hub, trl_checkout):
    """TRL's real tiny configs (REAL) under their Hub ids, and tiny-RemoteForCausalLM: a Llama's
    weights under model_type "remote" with TRL's remote code files beside them (auto_map)."""
    import shutil

    import torch
    import transformers
    import trl

    from nanosft.tokenizer import Tokenizer

    templates = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
    remote = ("Llama", dict(TINY), LLAMA, "llama3_2.jinja", LLAMA_TOKENS)
    for name, (prefix, kwargs, specials, template, tokens) in {
            **REAL, "tiny-RemoteForCausalLM": remote}.items():
        repo = os.path.join(hub, f"models--trl-internal-testing--{name}")
        snapshot = os.path.join(repo, "snapshots", "0" * 40)
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write("0" * 40)
        corpus = ZEN * 3 + ["Weather in Paris? It is sunny. get_weather city Think."] * 3
        tokenizer = Tokenizer.train(corpus, vocab_size=600, special_tokens=specials, **tokens)
        if template is not None:
            with open(os.path.join(templates, template)) as f:
                tokenizer.chat_template = f.read()
        tokenizer.save_pretrained(snapshot)
        ids = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
        config = getattr(transformers, f"{prefix}Config")(
            **{"vocab_size": len(tokenizer), **ids, **kwargs})
        torch.manual_seed(0)
        getattr(transformers, f"{prefix}ForCausalLM")(config).save_pretrained(snapshot)
        if name == "tiny-RemoteForCausalLM":
            code = os.path.join(trl_checkout, "scripts", "generate_tiny_models", "for_causal_lm",
                                "_remote_code")
            for file in ("configuration_remote.py", "modeling_remote.py"):
                shutil.copy(os.path.join(code, file), snapshot)
            path = os.path.join(snapshot, "config.json")
            with open(path) as f:
                d = json.load(f)
            d.update(model_type="remote", architectures=["RemoteForCausalLM"], auto_map={
                "AutoConfig": "configuration_remote.RemoteConfig",
                "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
            with open(path, "w") as f:
                json.dump(d, f)


IMPORT = re.compile(r"^( *)from (trl\.trainer\.sft_trainer|trl|transformers|peft) import "
                    r"(\(([^)]*)\)|[^\n(]+)$", re.MULTILINE)


def rewrite(text, stack):
    """Each `from trl|transformers|peft import names` as one assignment per name, resolved by
    suite_pick.pick at import time (the names a TRL release lacks resolve to None)."""
    def one(match):
        indent, module, names = match.group(1), match.group(2), match.group(4) or match.group(3)
        names = [n.strip() for n in names.replace("\n", " ").split(",") if n.strip()]
        lines = [f"{indent}from suite_pick import pick"]
        lines += [f"{indent}{n} = pick({module!r}, {n!r}, {stack!r})" for n in names]
        return "\n".join(lines)
    return IMPORT.sub(one, text)


PICK = '''
import importlib

NANOSFT = {"DataCollatorForLanguageModeling": "nanosft.collator", "dft_loss": "nanosft.sft"}


def pick(module, name, stack):
    if stack == "nanosft":
        import nanosft
        if name in NANOSFT:
            return getattr(importlib.import_module(NANOSFT[name]), name)
        if name in dir(nanosft):
            return getattr(nanosft, name)
        if module != "transformers":
            return None
    return getattr(importlib.import_module(module), name, None)
'''


def run(folder, name):
    """pytest on one copy; returns {test id: first error line or None when it passed}."""
    report = os.path.join(folder, f"{name}.json")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                    f"tests/{name}.py", "--junitxml", report + ".xml"],
                   cwd=folder, capture_output=True, text=True, timeout=3600)
    import xml.etree.ElementTree as ET

    results = {}
    for case in ET.parse(report + ".xml").iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if case.find("skipped") is not None:
            continue
        message = None if failure is None else (failure.get("message") or "").split("\n")[0]
        results[f"{case.get('classname').split('.')[-1]}::{case.get('name')}"] = message
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trl_checkout", help="a TRL source folder (holding tests/)")
    parser.add_argument("--nanosft", default=os.path.join(os.path.dirname(__file__), ".."),
                        help="the nanosft source folder to test (default: this one)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="trl_sft_suite_")
    tests, data = os.path.join(folder, "tests"), os.path.join(folder, "data")
    os.makedirs(tests), os.makedirs(data)
    sys.path.insert(0, os.path.abspath(args.nanosft))
    build_models(os.path.join(folder, "hub"))
    build_real_models(os.path.join(folder, "hub"), args.trl_checkout)
    source = os.path.join(args.trl_checkout, "tests")
    for name in ("testing_utils.py", "data/template.jinja"):
        with open(os.path.join(source, name)) as f:
            text = f.read()
        if name == "testing_utils.py":  # is_*_available helpers a TRL release may lack
            text = re.sub(r"from trl\.import_utils import \(([^)]*)\)", lambda m: "\n".join(
                f"{n} = getattr(__import__('trl.import_utils', fromlist=['x']), {n!r}, "
                "lambda: False)" for n in (s.strip() for s in m.group(1).split(",")) if n),
                text)
        with open(os.path.join(tests if name.endswith(".py") else folder, name), "w") as f:
            f.write(text)
    with open(os.path.join(source, "test_sft_trainer.py")) as f:
        original = f.read()
    for stack in ("trl", "nanosft"):
        with open(os.path.join(tests, f"test_sft_{stack}.py"), "w") as f:
            f.write(rewrite(original, stack))
    files = {"__init__.py": "", "conftest.py": CONFTEST.format(
        hub=os.path.join(folder, "hub"), nanosft=os.path.abspath(args.nanosft), here=folder,
        data=data)}
    for name, text in files.items():
        with open(os.path.join(tests, name), "w") as f:
            f.write(text)
    with open(os.path.join(folder, "suite_data.py"), "w") as f:
        f.write(DATA.format(zen=ZEN, tools=TOOLS))
    with open(os.path.join(folder, "suite_pick.py"), "w") as f:
        f.write(PICK)
    reference, ours = run(folder, "test_sft_trl"), run(folder, "test_sft_nanosft")
    with open(os.path.join(folder, "results.json"), "w") as f:  # every test id, both stacks
        json.dump({"trl": reference, "nanosft": ours}, f, indent=1)
    passed = {t.split("::", 1)[1] for t, error in reference.items() if error is None}
    ours = {t.split("::", 1)[1]: error for t, error in ours.items()}
    kept = sorted(t for t in passed if ours.get(t, "missing") is None)
    print(json.dumps({"trl_passes": len(passed), "nanosft_passes_of_those": len(kept),
                      "failing": {t: ours.get(t, "not run") for t in sorted(passed - set(kept))}},
                     indent=1))


if __name__ == "__main__":
    main()
