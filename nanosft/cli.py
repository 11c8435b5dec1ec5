"""The `nanosft` command line (also `python -m nanosft`).

`nanosft demo` trains a tiny tokenizer, builds a tiny random Llama-family model and greedily
generates a few tokens for a ChatML prompt: the objects of walkthrough 2.1 (model,
processing_class) end to end, in about a second on a CPU.
"""

import argparse
import sys

DEMO_CORPUS = [
    "What is two plus two? Two plus two is four.",
    "What is the capital of France? The capital of France is Paris.",
    "Name a primary colour. Red is a primary colour.",
]


def run_demo(args):
    """Tiny tokenizer + tiny random CausalLM + greedy generation; prints the prompt and new text.

    Walkthrough 2.1 | Mirrors: a transformers `model.generate(**tokenizer.apply_chat_template(...))` call
    """
    import torch  # imported here so `nanosft --help` stays fast

    from nanosft.model import CausalLM, ModelConfig
    from nanosft.tokenizer import Tokenizer

    torch.manual_seed(args.seed)
    tokenizer = Tokenizer.train(DEMO_CORPUS * 4, vocab_size=300)
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=128, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = CausalLM(config).eval()
    messages = [{"role": "user", "content": "What is two plus two?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    output = model.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens)
    new_ids = output[0, len(prompt):].tolist()
    print(f"model: {model.num_parameters():,} parameters (random weights), vocab {len(tokenizer)}")
    print("prompt:", repr(tokenizer.decode(prompt)))
    print(f"generated {len(new_ids)} tokens: {new_ids}")
    print("generated text:", repr(tokenizer.decode(new_ids)))
    return 0


def build_parser():
    """The argparse parser with one sub-command per door. Mirrors: trl's `trl sft` CLI layout"""
    parser = argparse.ArgumentParser(prog="nanosft", description="A from-scratch QLoRA SFT path.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser("demo", help="tiny tokenizer + tiny random model + greedy generation")
    demo.add_argument("--max_new_tokens", type=int, default=8, help="tokens to generate (default 8)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    demo.set_defaults(run=run_demo)
    return parser


def main(argv=None):
    """Parse argv and run the chosen command; returns the exit status. Mirrors: console_scripts entry point"""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.run(args)
