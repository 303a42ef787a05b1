"""`corectl generate`: stream one completion to the terminal."""
from __future__ import annotations

import argparse
import sys

import anyio
from corectl.engine.intake import NO_TOKENIZER
from corectl.errors import ConfigError, CorectlError

from .engine_args import add_engine_args, config_from_args


def register(sub) -> None:
    parser = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("prompt", help="the prompt (with --chat: the user message; with --token-ids: token ids)")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--token-ids", action="store_true",
                        help="the prompt is comma-separated token ids (the only prompt a model without a "
                             "tokenizer takes; it then prints the generated token ids)")
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
    if args.token_ids and args.chat:
        raise ConfigError("chat", "--chat renders text messages; it cannot be used with --token-ids")
    prompt = _token_ids(args.prompt) if args.token_ids else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    try:
        anyio.run(_stream, config, args, prompt, params)
    except* CorectlError as group:
        # The engine's task group wraps what the request raised; main() reports it in one line.
        error = group
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        raise error from None
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ConfigError("prompt", f"--token-ids takes comma-separated integers, got {text!r}") from None


async def _stream(config, args, prompt, params) -> None:
    from corectl.engine.client import EngineClient

    async with EngineClient.in_process(config) as client:
        if client.tokenizer is None and isinstance(prompt, str):
            # Checked here, not before: whether the model has a tokenizer is known once it is loaded.
            what = "--chat cannot render messages" if args.chat else "the prompt must be token ids"
            raise ConfigError("prompt", f"{NO_TOKENIZER}, so {what}; pass --token-ids")
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            prompt = client.tokenizer.encode_chat(messages, add_generation_prompt=True)
        async for out in client.generate(prompt, params):
            sample = out.outputs[0]
            # Without a tokenizer the samples carry no text: the token ids are the output.
            text = sample.text if client.tokenizer is not None else "".join(f"{t} " for t in sample.token_ids)
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
