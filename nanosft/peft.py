"""PEFT wrapping of a CausalLM: LoRA injection, prompt learning, and walkthrough 2.6's forward.

`get_peft_model` (called in SFTTrainer.__init__) swaps each targeted linear for a
`LoraLinear`, or adds virtual prompt tokens, and freezes the base; `PeftModelForCausalLM.forward`
is walkthrough 2.6 line by line. Parameter names equal peft 0.21.2's. The configs, the modules they
target and the adapter files live in nanosft.adapter_files; the layers injected (LoraLinear,
ModulesToSaveWrapper) and prepare_model_for_kbit_training in nanosft.lora (all import from here).
Papers: LoRA (2106.09685), rsLoRA (2312.03732), DoRA (2402.09353), prompt tuning (2104.08691),
P-tuning (2103.10385), prefix tuning (2101.00190); their encoders: nanosft.prompt_learning.
"""

import contextlib
import dataclasses
import warnings

import torch
from torch import nn

# the configs and adapter files, re-exported so nanosft.peft keeps its public names
from nanosft.adapter_files import (  # noqa: F401
    DEFAULT_TARGET_MODULES, PEFT_FORMAT_VERSION, PROMPT_LEARNING_TYPES, LoraConfig,
    PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, find_target_modules,
    get_peft_model_state_dict, load_adapter_files, pattern_value, peft_config_from_dict,
    prompt_init_token_ids, resolve_target_modules, save_adapter_files, set_peft_model_state_dict,
    target_module_matches)
from nanosft.lora import (  # noqa: F401
    LoraLinear, ModulesToSaveWrapper, prepare_model_for_kbit_training)
from nanosft.nf4 import is_quantized
from nanosft.prompt_learning import PrefixEncoder, PromptEmbedding, PromptEncoder

# ----------------------------------------------------------------------------- LoRA injection

def _replace_module(model, name, new):
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def inject_adapter(model, config, adapter_name="default"):
    """Swap each target module for a `LoraLinear`, in named_modules order (peft's RNG order).
    Mirrors: peft BaseTuner.inject_adapter,
    LoraModel._create_and_replace"""
    convert = getattr(model, "convert_peft_config", None)  # a family's rewrite (MoE experts)
    if convert is not None:
        convert(config)
    names = find_target_modules(model, config) if config.target_modules != [] else []
    config.target_modules = resolve_target_modules(model, config)  # saved resolved, as peft does
    for name in names:
        layer = LoraLinear(model.get_submodule(name), adapter_name,
                           r=pattern_value(config.rank_pattern, name, config.r),
                           lora_alpha=pattern_value(config.alpha_pattern, name, config.lora_alpha),
                           lora_dropout=config.lora_dropout, use_rslora=config.use_rslora,
                           use_dora=config.use_dora, init_lora_weights=config.init_lora_weights)
        _replace_module(model, name, layer)
    if config.target_parameters:  # LoRA on parameters: product layer, imported on use
        from nanosft.expert_lora import inject_parameter_adapters

        inject_parameter_adapters(model, config, adapter_name, _replace_module)


def mark_only_adapters_as_trainable(model, config, adapter_name="default"):
    """Freeze the base (bias per `config.bias`), wrap `modules_to_save`, upcast fp16/bf16 adapters.
    Mirrors: peft _mark_only_adapters_as_trainable, _set_trainable"""
    trainable = not config.inference_mode
    for n, p in model.named_parameters():
        bias_trains = config.bias == "all" or (config.bias == "lora_only" and ".base_layer." in n)
        p.requires_grad = ("lora_" in n or (n.endswith(".bias") and bias_trains)) and trainable
        if "lora_" in n and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()  # peft autocast_adapter_dtype: the adapter trains in fp32
    to_save = config.modules_to_save or []
    for name, module in list(model.named_modules()):
        if to_save and ".lora_" not in name and target_module_matches(to_save, name):
            _replace_module(model, name, ModulesToSaveWrapper(module, adapter_name, trainable))


class LoraModel(nn.Module):
    """Holds the CausalLM as `.model` after injection: names read `base_model.model.model.layers`.
    Mirrors: peft LoraModel"""

    def __init__(self, model, peft_config, adapter_name="default"):
        super().__init__()
        self.model = model
        self.peft_config = peft_config
        self.active_adapter = adapter_name
        inject_adapter(model, peft_config[adapter_name], adapter_name)
        mark_only_adapters_as_trainable(model, peft_config[adapter_name], adapter_name)

    def forward(self, *args, **kwargs):
        """The CausalLM's forward; the LoRA layers inside it do the rest.
        What 2.6's `self.base_model(...)` runs. Mirrors: peft BaseTuner.forward"""
        return self.model(*args, **kwargs)


# ----------------------------------------------------------------------------- prompt learning

def prepare_prompt_learning_config(config, model):
    """Fill what a prompt-learning config leaves None from the base model's config: num_layers,
    token_dim, num_attention_heads; prefix tuning sizes its keys and values by the KV heads (GQA:
    token_dim = num_key_value_heads x head_dim); encoder_hidden_size defaults to token_dim.
    Mirrors: peft _prepare_prompt_learning_config"""
    base = model.config
    config.num_layers = config.num_layers or base.num_hidden_layers
    config.token_dim = config.token_dim or base.hidden_size
    config.num_attention_heads = config.num_attention_heads or base.num_attention_heads
    if config.peft_type == "PREFIX_TUNING":
        config.token_dim = base.head_dim * base.num_key_value_heads
        config.num_attention_heads = base.num_key_value_heads
    if hasattr(config, "encoder_hidden_size") and config.encoder_hidden_size is None:
        config.encoder_hidden_size = config.token_dim  # P-tuning's and prefix tuning's MLPs
    return config


# ----------------------------------------------------------------------------- the wrapper

class PeftModelForCausalLM(nn.Module):
    """A CausalLM with one adapter: LoRA layers inside `base_model.model`, or a prompt encoder
    whose output goes before the input (prompt tuning, P-tuning) or into every layer's cache
    (prefix tuning). Walkthrough 2.6 | Mirrors: peft PeftModelForCausalLM (PeftModel)"""
    accepts_loss_kwargs = True

    def __init__(self, model, peft_config, adapter_name="default"):
        super().__init__()
        self.active_adapter = adapter_name
        self.peft_type = peft_config.peft_type
        self.peft_config = {adapter_name: peft_config}
        if peft_config.peft_type == "LORA":
            self.base_model = LoraModel(model, self.peft_config, adapter_name)
        else:
            self.base_model = model.requires_grad_(False)
            self._setup_prompt_encoder(adapter_name)
        if getattr(model, "is_gradient_checkpointing", False) and not is_quantized(model):
            model.enable_input_require_grads()  # peft _prepare_model_for_gradient_checkpointing

    def _setup_prompt_encoder(self, adapter_name):
        config = prepare_prompt_learning_config(self.peft_config[adapter_name], self.base_model)
        self.word_embeddings = self.base_model.get_input_embeddings()
        if config.peft_type == "PROMPT_TUNING":
            encoder = PromptEmbedding(config, self.word_embeddings)
        elif config.peft_type == "P_TUNING":
            encoder = PromptEncoder(config)
        else:  # PREFIX_TUNING: the prefix goes in as the cache, which checkpointing does not keep
            if any(getattr(m, "gradient_checkpointing", False) for m in self.base_model.modules()):
                raise ValueError("PREFIX_TUNING does not work with gradient checkpointing.")
            encoder = PrefixEncoder(config)
        encoder.to(self.word_embeddings.weight.device).requires_grad_(not config.inference_mode)
        self.prompt_encoder = nn.ModuleDict({adapter_name: encoder})
        total = config.num_virtual_tokens * config.num_transformer_submodules
        self.prompt_tokens = {adapter_name: torch.arange(total)}

    @property
    def active_peft_config(self):
        """The config of the active adapter. Mirrors: peft PeftModel.active_peft_config"""
        return self.peft_config[self.active_adapter]

    @property
    def config(self):
        """The base model's ModelConfig. Mirrors: peft PeftModel.__getattr__ (forwards to it)"""
        return self.get_base_model().config

    def get_base_model(self):
        """The CausalLM itself. Mirrors: peft PeftModel.get_base_model"""
        return self.base_model.model if self.peft_type == "LORA" else self.base_model

    def get_prompt(self, batch_size, task_ids=None):
        """Prompt and P-tuning: the virtual tokens' embeddings over the batch, (B, n_virtual, C).
        Prefix tuning: each layer's (key, value) prefix, L tensors (2, B, KV, n_virtual, D).
        What 2.6's `self.get_prompt(...)` call runs. Mirrors: peft PeftModel.get_prompt"""
        config = self.active_peft_config
        encoder = self.prompt_encoder[self.active_adapter]
        prompt_tokens = self.prompt_tokens[self.active_adapter].unsqueeze(0).expand(batch_size, -1)
        prompt_tokens = prompt_tokens.to(encoder.embedding.weight.device)  # (B, n_virtual)
        if config.peft_type == "PREFIX_TUNING":
            return self._prefix_past_key_values(encoder, prompt_tokens, batch_size)
        if config.inference_mode:
            prompts = encoder.embedding.weight
        else:  # one row of token ids through the encoder, then repeat the output (peft issue 2043)
            prompts = encoder(prompt_tokens[:1])
        return prompts.repeat(batch_size, 1, 1)

    def _prefix_past_key_values(self, encoder, prompt_tokens, batch_size):
        # the encoder's flat rows (B, n, L * 2 * KV * D) -> L per-layer (key, value) pairs
        config = self.active_peft_config
        n, heads = config.num_virtual_tokens, config.num_attention_heads  # heads: the KV heads
        if config.inference_mode:
            past_key_values = encoder.embedding.weight.repeat(batch_size, 1, 1)
        else:
            past_key_values = encoder(prompt_tokens[:, :n])
        past_key_values = past_key_values.to(self.word_embeddings.weight.dtype)
        past_key_values = past_key_values.view(batch_size, n, config.num_layers * 2, heads,
                                               config.token_dim // heads)
        # (L * 2, B, KV, n, D), then split into L tensors (2, B, KV, n, D): [0] keys, [1] values
        return past_key_values.permute(2, 0, 3, 1, 4).split(2)

    def get_prompt_embedding_to_save(self, adapter_name):
        """What an adapter file keeps: one pass of the encoder, (n_virtual, C) or, for prefix
        tuning, (n_virtual, L * 2 * token_dim).
        Mirrors: peft PeftModel.get_prompt_embedding_to_save"""
        config = self.peft_config[adapter_name]
        encoder = self.prompt_encoder[adapter_name]
        prompt_tokens = self.prompt_tokens[adapter_name].unsqueeze(0)
        if config.peft_type == "PREFIX_TUNING":
            prompt_tokens = prompt_tokens[:, :config.num_virtual_tokens]
        prompt_embeddings = encoder(prompt_tokens.to(encoder.embedding.weight.device))
        return prompt_embeddings[0].detach().cpu()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                position_ids=None, num_items_in_batch=None, **kwargs):
        """LoRA: straight into the base model. Prefix tuning: the per-layer prefixes as the cache.
        Prompt tuning, P-tuning: prepend the prompts, ones to the mask, -100 to the labels.
        Walkthrough 2.6 | Mirrors: peft PeftModelForCausalLM.forward
        Differs: no output_attentions, output_hidden_states, return_dict (the CausalLM returns loss
        and logits only) or task_ids (one prompt per adapter); num_items_in_batch is named."""
        peft_config = self.active_peft_config
        if peft_config.peft_type == "LORA":  # the LoRA layers already sit inside the base model
            return self.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                   inputs_embeds=inputs_embeds, labels=labels,
                                   position_ids=position_ids,
                                   num_items_in_batch=num_items_in_batch, **kwargs)
        n = peft_config.num_virtual_tokens
        batch_size = input_ids.shape[0] if input_ids is not None else inputs_embeds.shape[0]
        if attention_mask is not None:
            # "concat prompt attention mask": ones for the n virtual tokens, (B, n + T)
            prefix_attention_mask = torch.ones(batch_size, n).to(attention_mask.device)
            attention_mask = torch.cat((prefix_attention_mask, attention_mask), dim=1)
        kwargs["position_ids"] = self._prompt_learning_position_ids(position_ids)
        kwargs.update(attention_mask=attention_mask, labels=labels,
                      num_items_in_batch=num_items_in_batch)
        if peft_config.peft_type == "PREFIX_TUNING":
            # "overwrite past_kv in kwargs": the T real tokens attend to n cached positions first
            kwargs["past_key_values"] = self.get_prompt(batch_size)
            return self.base_model(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (B, T, C)
        if labels is not None:
            # "concat prompt labels": the virtual positions are never targets, (B, n + T)
            prefix_labels = torch.full((batch_size, n), -100).to(labels.device)
            kwargs["labels"] = torch.cat((prefix_labels, labels), dim=1)
        prompts = self.get_prompt(batch_size=batch_size)
        prompts = prompts.to(inputs_embeds.dtype)  # fp32 table -> the model's compute dtype
        inputs_embeds = torch.cat((prompts, inputs_embeds), dim=1)  # (B, n + T, C)
        return self.base_model(inputs_embeds=inputs_embeds, **kwargs)

    def _prompt_learning_position_ids(self, position_ids):
        # peft _adjust_prompt_learning_kwargs: the prefix's cache holds positions 0..n-1, so real
        # tokens move up by n; prepended prompts have no position ids of their own, so they go
        if position_ids is None:
            return None
        if self.active_peft_config.peft_type == "PREFIX_TUNING":
            return position_ids + self.active_peft_config.num_virtual_tokens
        warnings.warn("Position ids are not supported for parameter efficient tuning. "
                      "Ignoring position ids.")
        return None

    def get_nb_trainable_parameters(self):
        """(trainable, all) parameter counts; a packed 4-bit uint8 weight counts 2 per byte.
        Mirrors: peft PeftModel.get_nb_trainable_parameters"""
        trainable = total = 0
        for p in self.parameters():
            n = p.numel() * 2 * p.element_size() if p.dtype == torch.uint8 else p.numel()
            total += n
            trainable += n if p.requires_grad else 0
        return trainable, total

    def print_trainable_parameters(self):
        """Print `trainable params: X || all params: Y || trainable%: Z` exactly as peft does.
        Mirrors: peft PeftModel.print_trainable_parameters"""
        t, a = self.get_nb_trainable_parameters()
        print(f"trainable params: {t:,d} || all params: {a:,d} || trainable%: {100 * t / a:.4f}")

    def save_pretrained(self, save_directory, state_dict=None):
        """Write the active adapter's two files in peft's format (nanosft.adapter_files); a given
        `state_dict` (whole tensors gathered under FSDP) is read instead of the model's.
        Mirrors: peft PeftModel.save_pretrained | Differs: no README.md model card."""
        state = get_peft_model_state_dict(self, state_dict=state_dict,
                                          adapter_name=self.active_adapter)
        config = self.active_peft_config
        if config.base_model_name_or_path is None:  # peft fills it at save time too
            config.base_model_name_or_path = getattr(self.get_base_model(), "name_or_path",
                                                     None) or None
        save_adapter_files(save_directory, config, state)

    @classmethod
    def from_pretrained(cls, model, model_id, adapter_name="default", is_trainable=False):
        """Wrap `model` with an adapter folder written by peft or nanosft; frozen and eval()
        unless is_trainable. Mirrors: peft PeftModel.from_pretrained, load_adapter"""
        config, state_dict, source = load_adapter_files(model_id)
        if config.peft_type in PROMPT_LEARNING_TYPES and is_trainable:
            raise ValueError("Cannot set a prompt learning adapter to trainable when loading "
                             "pretrained adapter.")
        config.inference_mode = not is_trainable
        peft_model = cls(model, config, adapter_name)
        set_peft_model_state_dict(peft_model, state_dict, adapter_name, source=source)
        return peft_model if is_trainable else peft_model.eval()

    @contextlib.contextmanager
    def disable_adapter(self):
        """The base model alone inside the `with` block. Mirrors: peft PeftModel.disable_adapter"""
        if self.peft_type != "LORA":
            raise ValueError("disable_adapter() is implemented for LoRA; for prompt tuning call "
                             "get_base_model()")
        layers = [m for m in self.modules() if hasattr(m, "lora_A")]  # LoraLinear, ParamWrapper
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    def merge_and_unload(self):
        """Fold every LoRA delta into its base weight and return the plain CausalLM.
        Mirrors: peft LoraModel.merge_and_unload (4-bit: requantized)"""
        if self.peft_type != "LORA":
            raise ValueError("merge_and_unload() applies to LoRA; a prompt-tuned model's base is "
                             "get_base_model()")
        model = self.base_model.model
        for name, module in list(model.named_modules()):
            if isinstance(module, LoraLinear):
                module.merge()
                _replace_module(model, name, module.base_layer)
            elif hasattr(module, "parameter_name") and not module.merged:  # ParamWrapper
                while hasattr(module, "parameter_name"):  # nested: one per parameter
                    module.merge()
                    module = module.base_layer
                _replace_module(model, name, module)
            elif isinstance(module, ModulesToSaveWrapper):
                _replace_module(model, name, module.modules_to_save[module.active_adapter])
        return model

    # delegates the Trainer and the CLI use
    def generate(self, *args, **kwargs):
        """Generate with the adapted model (LoRA). Mirrors: peft PeftModelForCausalLM.generate
        Differs: prompt tuning generation is not implemented."""
        if self.peft_type != "LORA":
            raise NotImplementedError("generate() with prompt tuning is not implemented in nanosft")
        return self.get_base_model().generate(*args, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        """Checkpointing in the base model. Mirrors: transformers gradient_checkpointing_enable"""
        self.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs)

    def enable_input_require_grads(self):
        """Embeddings' output requires grad. Mirrors: transformers enable_input_require_grads"""
        self.get_base_model().enable_input_require_grads()

    def get_input_embeddings(self):
        """The base model's token embedding. Mirrors: transformers get_input_embeddings"""
        return self.get_base_model().get_input_embeddings()


def get_peft_model(model, peft_config, adapter_name="default"):
    """Wrap `model` with a fresh adapter (LoRA, prompt tuning, P-tuning or prefix tuning); only the
    adapter trains.
    SFTTrainer.__init__ calls it with `peft_config`. Mirrors: peft get_peft_model
    Differs: the config is copied, so the caller's object is not mutated."""
    peft_config = dataclasses.replace(peft_config)
    name = getattr(model, "name_or_path", None)
    peft_config.base_model_name_or_path = name or peft_config.base_model_name_or_path
    return PeftModelForCausalLM(model, peft_config, adapter_name)
