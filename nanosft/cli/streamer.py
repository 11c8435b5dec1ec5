"""A reply printed as it is generated: the streamer `CausalLM.generate` calls, and one chat turn.

`make_streamer` prints each new token's text as it arrives (what `nanosft generate` and
`nanosft chat` show); `stream_reply` renders the chat template, generates with the command's
sampling flags and streams the reply. Torch is imported only when a reply is generated, so
importing this module (as nanosft.cli does) leaves `nanosft --help` free of torch.
"""

import sys


def make_streamer(tokenizer, out=None):
    """A `streamer(new_ids)` for CausalLM.generate printing text as it arrives (one row), silent
    after EOS. Mirrors: transformers TextStreamer
    Differs: decodes the whole reply each step, prints the new suffix."""
    out = out if out is not None else sys.stdout  # looked up now: callers may swap sys.stdout
    ids, printed, done = [], [""], [False]

    def streamer(new_ids):
        token = int(new_ids[0])
        if done[0] or token == tokenizer.eos_token_id:
            done[0] = True
            return
        ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(text[len(printed[0]):])
            out.flush()
            printed[0] = text

    streamer.text = lambda: printed[0]
    return streamer


def stream_reply(model, tokenizer, messages, args):
    """Render the chat, generate with the sampling flags and stream the reply; returns its text.
    Mirrors: transformers apply_chat_template + generate(streamer=TextStreamer)"""
    import torch

    torch.manual_seed(args.seed)
    if args.no_chat_template:
        prompt = tokenizer.encode(messages[-1]["content"])
    else:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    streamer = make_streamer(tokenizer)
    device = next(model.parameters()).device
    model.generate(torch.tensor([prompt], device=device), max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   eos_token_id=tokenizer.eos_token_id, streamer=streamer)
    print(flush=True)
    return streamer.text()
