"""Decoding with a (k, v) cache: greedy or sampled next tokens until eos or max_new_tokens.

What `CausalLM.generate` runs (the demo's before/after answers, `nanosft generate` and `chat`):
the prompt goes through the model once, then one token a step with the cache; left-padded rows
get the positions they would have alone, finished rows only pad.
"""

import torch


def sample_next_token(logits, temperature=0.0, top_k=None, top_p=None):
    """One id per row of (B, V) logits: argmax at temperature 0, else sampling after temperature,
    top-k, top-p. Mirrors: transformers TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper"""
    if not temperature:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # ascending: drop the low tail holding <= 1 - top_p
        sorted_logits, order = logits.sort(dim=-1)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1)[:, 0]


def resolve_decoding(input_len, max_new_tokens=None, max_length=None, do_sample=None,
                     temperature=None, top_k=None, top_p=None, num_beams=1, **unsupported):
    """transformers' generate arguments -> (max_new_tokens, temperature, top_k, top_p) for
    `generate`: do_sample=False is greedy whatever the temperature; do_sample=True samples at
    temperature 1.0 and top_k 50 unless given (GenerationConfig's defaults); do_sample unset
    samples when a temperature > 0 is given (nanosft's own spelling). max_length counts the prompt.
    Mirrors: transformers GenerationConfig defaults, GenerationMixin.generate
    Differs: beam search (num_beams > 1) and the other logits processors are refused;
    generation_config.json is not read; max_new_tokens defaults to 20 new tokens."""
    if unsupported:
        raise TypeError(f"generate() got {sorted(unsupported)}: not implemented in nanosft (it "
                        "takes do_sample, temperature, top_k, top_p, num_beams=1, "
                        "max_new_tokens / max_length, eos_token_id, pad_token_id, streamer)")
    if num_beams != 1:
        raise ValueError(f"num_beams={num_beams}: beam search is not implemented in nanosft; use "
                         "num_beams=1 (greedy with do_sample=False, or sampling)")
    if max_new_tokens is None:
        max_new_tokens = 20 if max_length is None else max(max_length - input_len, 0)
    if do_sample is False:
        return max_new_tokens, 0.0, None, None
    if do_sample:
        if temperature is not None and not temperature > 0:  # transformers' message
            raise ValueError(f"temperature (={temperature}) has to be a strictly positive float "
                             "when do_sample=True")
        temperature = 1.0 if temperature is None else temperature
        top_k = 50 if top_k is None else top_k
    return max_new_tokens, temperature or 0.0, top_k, top_p


def stream_to(streamer):
    """A callable of each step's (B,) ids: nanosft's own streamer, or a transformers streamer's
    put (TextStreamer: put(prompt), put(each new token), end(): the caller does the first and
    the last)."""
    if streamer is None or not hasattr(streamer, "put"):
        return streamer
    return lambda new: streamer.put(new.cpu())


@torch.no_grad()
def generate(model, input_ids, attention_mask=None, max_new_tokens=20, temperature=0.0,
             top_k=None, top_p=None, eos_token_id=None, pad_token_id=None, streamer=None):
    """Prompt + new ids (B, T + n) decoded with a (k, v) cache; rows that hit eos are padded.
    Mirrors: transformers GenerationMixin._sample
    streamer(ids), when given, is called with each step's (B,) new ids (a transformers streamer:
    put / end)."""
    if temperature and not temperature > 0:  # a negative one would invert the distribution
        raise ValueError(f"temperature (={temperature}) has to be a strictly positive float to "
                         "sample, or 0 for greedy decoding (as transformers' "
                         "TemperatureLogitsWarper)")
    eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
    eos = torch.tensor([] if eos is None else eos, dtype=torch.long,
                       device=input_ids.device).reshape(-1)
    pads = (pad_token_id, model.config.pad_token_id, *eos.tolist(), 0)
    pad = next(p for p in pads if p is not None)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    # Positions count real tokens only, so a left-padded row gets the positions it has alone.
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    ids, step_ids, cache = input_ids, input_ids, None
    put = stream_to(streamer)
    if put is not streamer:  # a transformers streamer first receives the prompt
        streamer.put(input_ids.cpu())
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        out = model(step_ids, attention_mask=mask, position_ids=positions,
                   past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        new = sample_next_token(out.logits[:, -1], temperature, top_k, top_p)
        new = new.masked_fill(done, pad)  # finished rows only pad
        done = done | torch.isin(new, eos)
        ids = torch.cat((ids, new[:, None]), dim=1)
        if put is not None:
            put(new)
        if bool(done.all()):
            break
        step_ids, positions = new[:, None], positions[:, -1:] + 1
        mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), dim=1)
    if put is not streamer:
        streamer.end()
    return ids


class GenerateOutput:
    """`sequences` (B, T + n) and per-step `scores` (n tensors (B, V)): what generate returns with
    return_dict_in_generate=True. Mirrors: transformers GenerateDecoderOnlyOutput"""

    def __init__(self, sequences, scores):
        self.sequences = sequences
        self.scores = scores


@torch.no_grad()
def generate_uncached(forward, input_ids, attention_mask=None, max_new_tokens=20, temperature=0.0,
                      top_k=None, top_p=None, eos_token_id=None, pad_token_id=0,
                      return_dict_in_generate=False):
    """Prompt + new ids (B, T + n), each step the whole sequence through `forward` (no cache): what
    prompt learning generates with, since its prompts or prefix go in on every call.
    Mirrors: transformers GenerationMixin._sample (use_cache=False)"""
    eos = torch.tensor([] if eos_token_id is None else eos_token_id, dtype=torch.long,
                       device=input_ids.device).reshape(-1)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    ids = input_ids
    scores = []
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits = forward(input_ids=ids, attention_mask=mask)["logits"]  # (B, n + T, V)
        scores.append(logits[:, -1])
        new = sample_next_token(logits[:, -1], temperature, top_k, top_p)
        new = new.masked_fill(done, pad_token_id)  # finished rows only pad
        done = done | torch.isin(new, eos)
        ids = torch.cat((ids, new[:, None]), dim=1)
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
        if bool(done.all()):
            break
    return GenerateOutput(ids, tuple(scores)) if return_dict_in_generate else ids
