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
import os
import warnings

import torch
from torch import nn

# the configs and adapter files, re-exported so nanosft.peft keeps its public names
from nanosft.adapter_files import (  # noqa: F401
    DEFAULT_TARGET_MODULES, PEFT_FORMAT_VERSION, PROMPT_LEARNING_TYPES, LoraConfig, PeftType,
    PrefixTuningConfig, PromptEncoderConfig, PromptLearningConfig, PromptTuningConfig,
    PromptTuningInit, TaskType, find_target_modules, get_peft_model_state_dict,
    load_adapter_files, pattern_value, peft_config_from_dict, prompt_init_token_ids,
    resolve_target_modules, save_adapter_files, set_peft_model_state_dict, target_module_matches,
    warn_if_name_in_prefix, write_model_card)
from nanosft.generation import generate_uncached
from nanosft.lora import (  # noqa: F401
    LoraLinear, ModulesToSaveWrapper, prepare_model_for_kbit_training)
from nanosft.lora_layers import LoraEmbedding  # noqa: F401
from nanosft.nf4 import is_quantized
from nanosft.prompt_learning import PrefixEncoder, PromptEmbedding, PromptEncoder
# the tuner surface (injection, the adapter API), re-exported for the same reason
from nanosft.tuners import (  # noqa: F401
    BaseTunerLayer, LoraLayer, LoraModel, _replace_module, get_base_model_state_dict,
    inject_adapter, mark_only_adapters_as_trainable)

# ----------------------------------------------------------------------------- prompt learning

def prepare_prompt_learning_config(config, model):
    """Fill what a prompt-learning config leaves None from the base model's config: num_layers,
    token_dim, num_attention_heads; prefix tuning sizes its keys and values by the KV heads (GQA:
    token_dim = num_key_value_heads x head_dim); encoder_hidden_size defaults to token_dim.
    Mirrors: peft _prepare_prompt_learning_config"""
    if config.num_virtual_tokens is None:
        raise ValueError(f"{type(config).__name__}.num_virtual_tokens must be a positive int, "
                         "got None")
    base = model.config
    base = base.get_text_config() if hasattr(base, "get_text_config") else base
    config.num_layers = config.num_layers or base.num_hidden_layers
    config.token_dim = config.token_dim or base.hidden_size
    config.num_attention_heads = config.num_attention_heads or base.num_attention_heads
    kv_heads = getattr(base, "num_key_value_heads", None)
    if config.peft_type == "PREFIX_TUNING" and kv_heads is not None:
        # configs without head_dim (GPT-2, OPT, GPT-J, Qwen2): hidden size over the query heads
        head_dim = getattr(base, "head_dim", None) or config.token_dim // config.num_attention_heads
        config.token_dim = head_dim * kv_heads
        config.num_attention_heads = kv_heads
    if hasattr(config, "encoder_hidden_size") and config.encoder_hidden_size is None:
        config.encoder_hidden_size = config.token_dim  # P-tuning's and prefix tuning's MLPs
    return config


# ----------------------------------------------------------------------------- the wrapper

class PeftModel(nn.Module):
    """Any nn.Module with adapters: LoRA layers inside `base_model.model` (a LoraModel), or a
    prompt encoder beside the model (prompt learning); forward passes whatever the base takes.
    Several adapters by name, one active. Mirrors: peft PeftModel"""

    def __init__(self, model, peft_config, adapter_name="default", autocast_adapter_dtype=True,
                 low_cpu_mem_usage=False):
        super().__init__()
        self.active_adapter = adapter_name
        self.peft_type = peft_config.peft_type
        self.peft_config = {adapter_name: peft_config}
        self._adapters_disabled = False
        if not peft_config.is_prompt_learning:
            self.base_model = LoraModel(model, self.peft_config, adapter_name,
                                        autocast_adapter_dtype)
        else:
            self.base_model = model.requires_grad_(False)
            self._setup_prompt_encoder(adapter_name)
        if getattr(model, "is_gradient_checkpointing", False) and not is_quantized(model):
            model.enable_input_require_grads()  # peft _prepare_model_for_gradient_checkpointing

    def __getattr__(self, name):
        """Attributes the wrapper lacks come from the base model (`model.config`, `model.lin0`).
        Mirrors: peft PeftModel.__getattr__"""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)

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
        if not hasattr(self, "prompt_encoder"):  # one encoder per adapter
            self.prompt_encoder = nn.ModuleDict()
            self.prompt_tokens = {}
        self.prompt_encoder[adapter_name] = encoder
        total = config.num_virtual_tokens * config.num_transformer_submodules
        self.prompt_tokens[adapter_name] = torch.arange(total)

    @property
    def active_peft_config(self):
        """The config of the active adapter. Mirrors: peft PeftModel.active_peft_config"""
        return self.peft_config[self.active_adapter]

    @property
    def active_adapters(self):
        """The active adapter names, a list. Mirrors: peft PeftModel.active_adapters"""
        if self.peft_type != "LORA":
            return [self.active_adapter]
        return self.base_model.active_adapters

    @property
    def modules_to_save(self):
        """Every adapter's modules_to_save names as one set (None for none).
        Mirrors: peft PeftModel.modules_to_save"""
        names = set()
        for config in self.peft_config.values():
            names.update(getattr(config, "modules_to_save", None) or [])
        return names or None

    def get_base_model(self):
        """The wrapped model itself. Mirrors: peft PeftModel.get_base_model"""
        return self.base_model if self.peft_type != "LORA" else self.base_model.model

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
        past_key_values = past_key_values.permute(2, 0, 3, 1, 4).split(2)
        base = self.get_base_model()
        if type(base).__module__.startswith("transformers."):  # transformers 5 reads a Cache
            return _transformers_cache(base, past_key_values)
        return past_key_values

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

    def forward(self, *args, **kwargs):
        """The base model's forward, whatever it takes (the LoRA layers sit inside it).
        Mirrors: peft PeftModel.forward"""
        if self.peft_type == "LORA":
            return self.base_model(*args, **kwargs)  # LoraModel: adapter_names, if given
        return self.get_base_model()(*args, **kwargs)

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

    # ------------------------------------------------------------------ the adapter API (peft's)

    def add_adapter(self, adapter_name, peft_config, low_cpu_mem_usage=False,
                    autocast_adapter_dtype=True):
        """Add a fresh adapter under `adapter_name`; it stays inactive until set_adapter.
        Mirrors: peft PeftModel.add_adapter"""
        if adapter_name in self.peft_config:
            raise ValueError(f"Adapter with name '{adapter_name}' already exists.")
        warn_if_name_in_prefix(adapter_name, peft_config.peft_type)
        if peft_config.peft_type != self.peft_type:
            raise ValueError(f"Cannot combine adapters with different peft types. Found "
                             f"{self.peft_type} and {peft_config.peft_type}.")
        if peft_config.is_prompt_learning:
            self.peft_config[adapter_name] = peft_config
            try:
                self._setup_prompt_encoder(adapter_name)
            except Exception:
                del self.peft_config[adapter_name]
                raise
            return
        self.base_model.add_adapter(adapter_name, peft_config, autocast_adapter_dtype)

    def set_adapter(self, adapter_name, inference_mode=False):
        """Make `adapter_name` the active adapter (trainable unless inference_mode).
        Mirrors: peft PeftModel.set_adapter"""
        if adapter_name not in self.peft_config:
            raise ValueError(f"Adapter {adapter_name} not found.")
        self.active_adapter = adapter_name
        if not self.peft_config[adapter_name].is_prompt_learning:
            self.base_model.set_adapter(adapter_name, inference_mode=inference_mode)

    def delete_adapter(self, adapter_name):
        """Remove an adapter; if it was active, another takes its place.
        Mirrors: peft PeftModel.delete_adapter"""
        if adapter_name not in self.peft_config:
            raise ValueError(f"Adapter {adapter_name} does not exist")
        if self.peft_config[adapter_name].is_prompt_learning:
            del self.peft_config[adapter_name]
            del self.prompt_encoder[adapter_name]
            del self.prompt_tokens[adapter_name]
            if adapter_name == self.active_adapter:
                self.active_adapter = next(iter(self.peft_config), [])
            return
        self.base_model.delete_adapter(adapter_name)
        if len(self.active_adapters) == 1:
            self.active_adapter = self.active_adapters[0]

    def set_requires_grad(self, adapter_names, requires_grad=True):
        """Switch gradients of the named adapters on or off (LoRA only).
        Mirrors: peft PeftModel.set_requires_grad"""
        if self.active_peft_config.is_prompt_learning:
            raise TypeError("Setting `requires_grad` is not supported for prompt learning methods "
                            f"like {self.active_peft_config.peft_type.value}.")
        self.base_model.set_requires_grad(adapter_names, requires_grad)

    def supports_lora_conversion(self, adapter_name="default"):
        """False for prompt learning, else the LoRA model's answer.
        Mirrors: peft PeftModel.supports_lora_conversion"""
        if self.active_peft_config.is_prompt_learning:
            return False
        return self.base_model.supports_lora_conversion()

    def load_adapter(self, model_id, adapter_name, is_trainable=False, torch_device=None,
                     autocast_adapter_dtype=True, low_cpu_mem_usage=False, **kwargs):
        """Read a saved adapter into this model under `adapter_name` (inactive); returns the
        load result (missing_keys, unexpected_keys). Mirrors: peft PeftModel.load_adapter"""
        config, state_dict, source = load_adapter_files(_adapter_folder(model_id, kwargs))
        config.inference_mode = not is_trainable
        self.add_adapter(adapter_name, config, autocast_adapter_dtype=autocast_adapter_dtype)
        result = set_peft_model_state_dict(self, state_dict, adapter_name, source=source)
        if torch_device is not None:
            self.to(torch_device)
        if not is_trainable:
            self.eval()
        return result

    @contextlib.contextmanager
    def disable_adapter(self):
        """The base model alone inside the `with` block; the adapters' previous state after it.
        Mirrors: peft PeftModel.disable_adapter"""
        was_disabled = self._adapters_disabled
        if self.active_peft_config.is_prompt_learning:
            old_forward = self.forward
            self.forward = self.get_base_model().forward
            try:
                self._adapters_disabled = True
                yield
            finally:
                self.forward = old_forward
                self._adapters_disabled = was_disabled
            return
        layers = [m for m in self.modules() if isinstance(m, BaseTunerLayer)]
        enabled = [not m.disable_adapters for m in layers]
        if len(set(enabled)) > 1:
            warnings.warn("The model contains some adapter layers that are enabled and others that "
                          "are disabled. This is most likely unintentional. After exiting the "
                          "disable_adapter context, all adapters will be enabled")
        try:
            self.base_model.disable_adapter_layers()
            self._adapters_disabled = True
            yield
        finally:
            if any(enabled) or not layers:
                self.base_model.enable_adapter_layers()
            self._adapters_disabled = was_disabled

    def save_pretrained(self, save_directory, safe_serialization=True, selected_adapters=None,
                        state_dict=None, is_main_process=True, save_embedding_layers="auto",
                        **kwargs):
        """Write each adapter's two files in peft's format (nanosft.adapter_files), "default" in
        `save_directory`, others in a subfolder of their name, and a model card; a given
        `state_dict` (whole tensors gathered under FSDP) is read instead of the model's.
        Mirrors: peft PeftModel.save_pretrained"""
        names = list(self.peft_config) if selected_adapters is None else list(selected_adapters)
        missing = [n for n in names if n not in self.peft_config]
        if missing:
            raise ValueError(f"You passed an invalid `selected_adapters` arguments, current "
                             f"supported adapter names are {list(self.peft_config)} - got "
                             f"{missing}.")
        if not is_main_process:
            return
        base = getattr(self.get_base_model(), "name_or_path", None)
        for name in names:
            state = get_peft_model_state_dict(self, state_dict=state_dict, adapter_name=name,
                                              save_embedding_layers=save_embedding_layers)
            config = self.peft_config[name]
            if config.base_model_name_or_path is None:  # peft fills it at save time too
                config.base_model_name_or_path = base or None
            folder = save_directory if name == "default" else os.path.join(save_directory, name)
            save_adapter_files(folder, config, state, safe_serialization=safe_serialization)
        model = self.get_base_model()
        write_model_card(save_directory, self.active_peft_config.peft_type, base_model=base,
                         is_transformers=hasattr(model, "config"),
                         model_tags=getattr(model, "model_tags", None),
                         causal_lm=isinstance(self, PeftModelForCausalLM))

    def push_to_hub(self, repo_id, commit_message="Upload adapter", private=None, token=None,
                    **kwargs):
        """Save the adapters to a temporary folder and upload it to the Hub repo `repo_id`
        (needs huggingface_hub, the `hub` extra). Mirrors: PushToHubMixin.push_to_hub"""
        import tempfile

        from huggingface_hub import HfApi  # the hub extra: imported on use

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, **kwargs)
            return api.upload_folder(repo_id=repo_id, folder_path=folder,
                                     commit_message=commit_message)

    @classmethod
    def from_pretrained(cls, model, model_id, adapter_name="default", is_trainable=False,
                        config=None, autocast_adapter_dtype=True, low_cpu_mem_usage=False,
                        torch_device=None, device_map=None, **kwargs):
        """Wrap `model` with an adapter folder written by peft or nanosft; frozen and eval()
        unless is_trainable. `config`: use this config object instead of the file's.
        Mirrors: peft PeftModel.from_pretrained, load_adapter
        Differs: low_cpu_mem_usage and device_map change nothing (the adapter is built, then
        filled, on the base model's device)."""
        file_config, state_dict, source = load_adapter_files(_adapter_folder(model_id, kwargs))
        config = file_config if config is None else config
        if config.is_prompt_learning and is_trainable:
            raise ValueError("Cannot set a prompt learning adapter to trainable when loading "
                             "pretrained adapter.")
        config.inference_mode = not is_trainable
        if cls is PeftModel:
            cls = _model_class(model, config)
        peft_model = cls(model, config, adapter_name, autocast_adapter_dtype=autocast_adapter_dtype)
        set_peft_model_state_dict(peft_model, state_dict, adapter_name, source=source)
        if torch_device is not None:
            peft_model.to(torch_device)
        return peft_model if is_trainable else peft_model.eval()

    def merge_and_unload(self, progressbar=False, safe_merge=False, adapter_names=None):
        """Fold the LoRA deltas into the base weights and return the plain model.
        Mirrors: peft LoraModel.merge_and_unload (4-bit: requantized)"""
        if self.active_peft_config.is_prompt_learning:
            raise ValueError("merge_and_unload() applies to LoRA; a prompt-tuned model's base is "
                             "get_base_model()")
        return self.base_model.merge_and_unload(safe_merge=safe_merge, adapter_names=adapter_names)

    # delegates the Trainer and the CLI use
    def generate(self, *args, **kwargs):
        """Generate with the adapted model. Mirrors: peft PeftModel.generate"""
        if self.peft_type == "LORA":
            return self.base_model.generate(*args, **kwargs)  # adapter_names, if given
        return self.get_base_model().generate(*args, **kwargs)

    def prepare_model_for_gradient_checkpointing(self, model):
        """Make the embeddings' output require grad when `model` checkpoints (a frozen base gives
        checkpointed blocks no grad otherwise). Mirrors: peft
        PeftModel.prepare_model_for_gradient_checkpointing"""
        if getattr(model, "is_gradient_checkpointing", True) and hasattr(
                model, "enable_input_require_grads"):
            model.enable_input_require_grads()
        return model

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        """Checkpointing in the base model. Mirrors: transformers gradient_checkpointing_enable"""
        self.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs)

    def enable_input_require_grads(self):
        """Embeddings' output requires grad. Mirrors: transformers enable_input_require_grads"""
        self.get_base_model().enable_input_require_grads()

    def get_input_embeddings(self):
        """The base model's token embedding. Mirrors: transformers get_input_embeddings"""
        return self.get_base_model().get_input_embeddings()




class PeftModelForCausalLM(PeftModel):
    """A causal LM with adapters: LoRA layers inside `base_model.model`, or a prompt encoder
    whose output goes before the input (prompt tuning, P-tuning) or into every layer's cache
    (prefix tuning). Walkthrough 2.6 | Mirrors: peft PeftModelForCausalLM (PeftModel)
    Differs: a subclass of PeftModel, as in peft (the one inheritance beyond the house list)."""
    accepts_loss_kwargs = True

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

    def generate(self, *args, **kwargs):
        """Generate with the adapted model: LoRA through the base model's generate; prompt
        learning by running this forward on the whole sequence each step (no cache), greedy or
        sampled. Mirrors: peft PeftModelForCausalLM.generate
        Differs: no beam search for prompt learning."""
        if not self.active_peft_config.is_prompt_learning:
            return self.base_model.generate(*args, **kwargs)  # LoraModel: adapter_names
        return self._generate_prompt_learning(*args, **kwargs)

    def _generate_prompt_learning(self, input_ids, attention_mask=None, max_new_tokens=None,
                                  do_sample=False, temperature=None, top_k=None, top_p=None,
                                  eos_token_id=None, pad_token_id=None, num_beams=1,
                                  max_length=None, return_dict_in_generate=False, **kwargs):
        if num_beams != 1:
            raise NotImplementedError("nanosft generates prompt-learning models without beams")
        config = self.get_base_model().config
        generation = getattr(self.get_base_model(), "generation_config", None)
        if max_new_tokens is None:  # transformers' default: max_length=20 in all
            max_length = max_length or getattr(generation, "max_length", None) or 20
            max_new_tokens = max(max_length - input_ids.shape[1], 1)
        eos = eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None)
        pad = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
        temperature = (temperature or 1.0) if do_sample else 0.0
        return generate_uncached(self.forward, input_ids, attention_mask, max_new_tokens,
                                 temperature, top_k, top_p, eos, 0 if pad is None else pad,
                                 return_dict_in_generate)


def _transformers_cache(base, past_key_values):
    # a transformers DynamicCache holding layer i's prefix (keys, values) at positions 0..n-1
    from transformers import DynamicCache  # the base is a transformers model: it is installed

    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else None
    cache = DynamicCache(config=config or base.config)
    n = past_key_values[0].shape[3]
    cache_position = torch.arange(n, device=past_key_values[0].device)
    for layer_idx, (keys, values) in enumerate(past_key_values):
        cache.update(keys, values, layer_idx, cache_kwargs={"cache_position": cache_position})
    return cache


def _adapter_folder(model_id, kwargs):
    # a folder (or Hub id, through the Hub cache) and peft's `subfolder`
    from nanosft.io import hub  # the files layer below: imported on use

    folder = os.fspath(model_id)
    if not os.path.exists(folder) and not os.path.isabs(folder):  # a Hub id, not a lost folder
        folder = hub.resolve_pretrained_path(folder, kwargs.get("revision"), "adapter")
    return os.path.join(folder, kwargs.get("subfolder") or "")


def _model_class(model, peft_config):
    # peft picks the class by task_type; nanosft's task_type defaults to CAUSAL_LM, so a module
    # without a config (a custom MLP) gets the generic PeftModel, whose forward takes anything
    if peft_config.is_prompt_learning:
        return PeftModelForCausalLM
    if peft_config.task_type == "CAUSAL_LM" and hasattr(model, "config"):
        return PeftModelForCausalLM
    return PeftModel


def get_peft_model(model, peft_config, adapter_name="default", mixed=False,
                   autocast_adapter_dtype=True, revision=None, low_cpu_mem_usage=False):
    """Wrap `model` with a fresh adapter (LoRA, prompt tuning, P-tuning or prefix tuning); only the
    adapter trains; fp16/bf16 adapters train in fp32 unless autocast_adapter_dtype=False.
    SFTTrainer.__init__ calls it with `peft_config`. Mirrors: peft get_peft_model
    Differs: the config is copied, so the caller's object is not mutated; LoraConfig's task_type
    defaults to CAUSAL_LM, which a module without a config (no causal LM) gets as None."""
    peft_config = dataclasses.replace(peft_config)
    warn_if_name_in_prefix(adapter_name, peft_config.peft_type)
    name = getattr(model, "name_or_path", None)
    peft_config.base_model_name_or_path = name or peft_config.base_model_name_or_path
    cls = _model_class(model, peft_config)
    if cls is PeftModel and peft_config.task_type == "CAUSAL_LM":
        peft_config.task_type = None  # no causal LM: saved as peft saves a custom model's
    return cls(model, peft_config, adapter_name, autocast_adapter_dtype=autocast_adapter_dtype)
