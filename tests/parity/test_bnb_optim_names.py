"""Every bitsandbytes `optim` name transformers 5.23 accepts, built by nanosft as by its Trainer.

Compared, for each of the 15 names (AdamW / Lion / RMSprop / AdEMAMix; 8- or 32-bit; paged or
not): the optimizer class, every param-group hyperparameter and its parameters (by name), the
bitsandbytes args (optim_bits, paging, min_8bit_size, ...), and the weights after one step,
bit-equal (same class, same kernels, same gradients). Paged optimizers run unpaged on a CPU, in
both libraries alike. Hermetic: a 2-layer Llama built in-process.
Run: python -m pytest -q tests/parity/test_bnb_optim_names.py
"""

import bitsandbytes as bnb
import pytest
import torch
import transformers

from nanosft.args import TrainingArguments
from nanosft.optim import BITSANDBYTES_OPTIMIZERS, create_optimizer


def test_the_names_are_transformers_bitsandbytes_names():
    from transformers.trainer_optimizer import _BITSANDBYTES_OPTIMIZERS

    assert sorted(BITSANDBYTES_OPTIMIZERS) == sorted(n.value for n in _BITSANDBYTES_OPTIMIZERS)


def _settings(opt, model):
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
              for g in opt.param_groups]
    return type(opt), groups, vars(opt.args), getattr(opt, "is_paged", None)


def _tiny_llama():
    # hidden 64: embed_tokens, lm_head and the MLP reach bnb's min_8bit_size (4096 elements)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _one_step(model, opt):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    # which tensors got 8-bit state (transformers keeps nn.Embedding at 32 bits)
    return {n: opt.state[p]["state1"].dtype for n, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore::UserWarning")  # bnb on CPU: paged optimizers unsupported
@pytest.mark.parametrize("optim", BITSANDBYTES_OPTIMIZERS)
def test_bitsandbytes_optimizer_equals_transformers(optim, tmp_path):
    kw = {"learning_rate": 1e-2, "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.99,
          "adam_epsilon": 1e-6, "optim": optim}
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                             report_to="none", **kw)
    ours_model, theirs_model = _tiny_llama(), _tiny_llama()
    start = _tiny_llama().state_dict()
    # bnb's per-module overrides are process-wide: each side starts from a clean manager
    bnb.optim.GlobalOptimManager.get_instance().initialize()
    theirs_opt = transformers.Trainer(model=theirs_model, args=hf_args).create_optimizer()
    theirs_states = _one_step(theirs_model, theirs_opt)
    bnb.optim.GlobalOptimManager.get_instance().initialize()
    ours_opt = create_optimizer(ours_model, TrainingArguments(output_dir=str(tmp_path), **kw))
    assert _settings(ours_opt, ours_model) == _settings(theirs_opt, theirs_model)
    assert ours_opt.args.optim_bits == (8 if "8bit" in optim else 32)
    assert _one_step(ours_model, ours_opt) == theirs_states
    if "8bit" in optim:
        assert theirs_states["model.embed_tokens.weight"] == torch.float32
        assert theirs_states["model.layers.0.mlp.up_proj.weight"] == torch.uint8
    for (name, p_ours), p_theirs in zip(ours_model.named_parameters(), theirs_model.parameters()):
        torch.testing.assert_close(p_ours, p_theirs, rtol=0, atol=0, msg=name)
        assert not torch.equal(p_ours, start[name]), name  # the steps moved every weight
    bnb.optim.GlobalOptimManager.get_instance().initialize()
