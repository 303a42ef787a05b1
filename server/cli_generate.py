"""`corectl generate`: stream one completion to the terminal."""
from __future__ import annotations

import argparse
import sys

import anyio

from .engine_args import add_engine_args, config_from_args


def register(sub) -> None:
    parser = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("prompt", help="the prompt (with --chat: the user message)")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed for this request's sampling")
    add_engine_args(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from corectl.sampling_params import SamplingParams

    config = config_from_args(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    anyio.run(_stream, config, args, params)
    return 0


async def _stream(config, args, params) -> None:
    from corectl.engine.client import EngineClient

    async with EngineClient.in_process(config) as client:
        prompt = args.prompt
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            prompt = client.tokenizer.encode_chat(messages, add_generation_prompt=True)
        async for out in client.generate(prompt, params):
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
        sys.stdout.write("\n")
