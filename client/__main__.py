"""``python -m client "prompt"``: stream one completion from a running engine to stdout."""

from __future__ import annotations

import argparse
import sys

from client.client import Client
from client.common import EngineError, EngineUnreachable, default_endpoint
from protocol.messages import GenerateOutput


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__)
    parser.add_argument("prompt", help="the prompt (a user message unless --raw)")
    parser.add_argument(
        "--endpoint", default=default_endpoint(), help="engine endpoint (default: %(default)s)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each reply")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--chat", dest="chat", action="store_true", default=True, help="apply the chat template"
    )
    mode.add_argument("--raw", dest="chat", action="store_false", help="send the prompt as plain text")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Stream the completion; exit 1 with a message on an engine error, no engine, or a timeout."""
    args = parse_args(argv)
    with Client(args.endpoint, timeout_s=args.timeout) as client:
        messages = [{"role": "user", "content": args.prompt}] if args.chat else None
        stream = client.generate(
            None if args.chat else args.prompt,
            messages=messages,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            stream=True,
        )
        try:
            for delta in stream:
                _write(delta)
        except (EngineError, EngineUnreachable, TimeoutError) as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
    print()
    return 0


def _write(delta: GenerateOutput) -> None:
    sys.stdout.write(delta.text)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
