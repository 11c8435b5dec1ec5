"""The prompt encoders of walkthrough 2.6's prompt-learning branches: what `get_prompt` reads.

Each holds an `embedding` of the virtual tokens and, while training, the network that
reparameterizes it: prompt tuning uses the rows as they are (`PromptEmbedding`); P-tuning passes
them through an MLP or a bidirectional LSTM + MLP (`PromptEncoder`); prefix tuning makes every
layer's keys and values from them (`PrefixEncoder`). A saved adapter keeps only the encoder's
output, so in inference_mode each is its `embedding` alone. Parameter names equal peft 0.21.2's.
Papers: prompt tuning 2104.08691, P-tuning 2103.10385, prefix tuning 2101.00190.
"""

import warnings

import torch
from torch import nn

from nanosft.adapter_files import prompt_init_token_ids


class PromptEmbedding(nn.Module):
    """The virtual tokens' embedding table, [num_virtual_tokens, token_dim], fp32.
    Mirrors: peft PromptEmbedding"""

    def __init__(self, config, word_embeddings):
        super().__init__()
        total = config.num_virtual_tokens * config.num_transformer_submodules
        self.embedding = nn.Embedding(total, config.token_dim)  # RANDOM: nn.Embedding's N(0, 1)
        if config.prompt_tuning_init == "TEXT" and not config.inference_mode:
            device = word_embeddings.weight.device
            ids = torch.tensor(prompt_init_token_ids(config, total), device=device)
            with torch.no_grad():  # copy the words' embeddings, in fp32
                self.embedding.weight.copy_(word_embeddings(ids))
        elif config.prompt_tuning_init == "SAMPLE_VOCAB" and not config.inference_mode:
            device = word_embeddings.weight.device  # rows of random vocabulary tokens
            ids = torch.randint(0, word_embeddings.num_embeddings, (total,), device=device)
            with torch.no_grad():
                self.embedding.weight.copy_(word_embeddings(ids))

    def forward(self, indices):
        """Look up the virtual tokens' rows.
        Mirrors: peft PromptEmbedding.forward"""
        return self.embedding(indices)  # (B, n_virtual) -> (B, n_virtual, C)


class PromptEncoder(nn.Module):
    """P-tuning's encoder: embedding -> MLP (Linear, ReLU, Linear, ReLU, Linear), or embedding ->
    bidirectional LSTM -> MLP (Linear, ReLU, Linear). Mirrors: peft PromptEncoder
    Args (from PromptEncoderConfig): token_dim (in and out width); encoder_hidden_size;
    encoder_reparameterization_type "MLP" | "LSTM"; encoder_num_layers, encoder_dropout (LSTM)."""

    def __init__(self, config):
        super().__init__()
        C, hidden = config.token_dim, config.encoder_hidden_size
        self.encoder_type = config.encoder_reparameterization_type
        total = config.num_virtual_tokens * config.num_transformer_submodules
        self.embedding = nn.Embedding(total, C)
        if config.inference_mode:  # a loaded adapter: the saved rows are the encoder's output
            return
        if self.encoder_type == "LSTM":
            self.lstm_head = nn.LSTM(input_size=C, hidden_size=hidden,
                                     num_layers=config.encoder_num_layers,
                                     dropout=config.encoder_dropout, bidirectional=True,
                                     batch_first=True)
            self.mlp_head = nn.Sequential(nn.Linear(2 * hidden, 2 * hidden), nn.ReLU(),
                                          nn.Linear(2 * hidden, C))
        else:
            if config.encoder_num_layers != 2:  # peft's words: the MLP has a fixed depth
                warnings.warn("for MLP, the argument `encoder_num_layers` is ignored. "
                              "Exactly 2 MLP layers are used.")
            self.mlp_head = nn.Sequential(nn.Linear(C, hidden), nn.ReLU(),
                                          nn.Linear(hidden, hidden), nn.ReLU(),
                                          nn.Linear(hidden, C))

    def forward(self, indices):
        """(B, n_virtual) token indices -> (B, n_virtual, C) reparameterized embeddings.
        Mirrors: peft PromptEncoder.forward"""
        input_embeds = self.embedding(indices)
        if self.encoder_type == "LSTM":
            return self.mlp_head(self.lstm_head(input_embeds)[0])  # (B, n, 2 * hidden) -> C
        return self.mlp_head(input_embeds)


class PrefixEncoder(nn.Module):
    """Prefix tuning's encoder: every layer's key and value rows of the virtual tokens, flat,
    (B, n_virtual, num_layers * 2 * token_dim); with prefix_projection made by a tanh MLP from a
    (n_virtual, token_dim) embedding. Mirrors: peft PrefixEncoder
    Args (from PrefixTuningConfig): token_dim (KV heads x head_dim); num_layers;
    encoder_hidden_size; prefix_projection; init_weights ("zero": the prefix starts at zero)."""

    def __init__(self, config):
        super().__init__()
        flat = config.num_layers * 2 * config.token_dim  # K and V of every layer
        self.prefix_projection = config.prefix_projection
        if self.prefix_projection and not config.inference_mode:
            self.embedding = nn.Embedding(config.num_virtual_tokens, config.token_dim)
            self.transform = nn.Sequential(nn.Linear(config.token_dim, config.encoder_hidden_size),
                                           nn.Tanh(),
                                           nn.Linear(config.encoder_hidden_size, flat))
            zeroed = [self.transform[-1].weight, self.transform[-1].bias]
        else:  # the prefix itself is the parameter (and what a saved adapter holds)
            self.embedding = nn.Embedding(config.num_virtual_tokens, flat)
            zeroed = [self.embedding.weight]
        if config.init_weights == "zero":
            with torch.no_grad():
                for p in zeroed:
                    p.zero_()

    def forward(self, prefix):
        """(B, n_virtual) indices -> (B, n_virtual, num_layers * 2 * token_dim).
        Mirrors: peft PrefixEncoder.forward"""
        if self.prefix_projection:
            return self.transform(self.embedding(prefix))
        return self.embedding(prefix)
