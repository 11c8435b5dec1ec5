"""Model families beyond Llama, one small module each: only what the family changes.

Each module subclasses the pieces of model.py that differ (an Attention, and the DecoderLayer /
DecoderModel / CausalLM that name it through their `attention_class`, `layer_class` and
`model_class`) and ModelConfig (the family's extra config.json fields); each CausalLM names its
config through `config_class`, so `Qwen2ForCausalLM.from_pretrained(folder)` reads its own.
`families.auto` (AutoConfig, AutoModelForCausalLM) alone picks a family by `model_type`; the
families import model.py and each other downwards, never the Auto layer.
"""
