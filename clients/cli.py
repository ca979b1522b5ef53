"""``cdb generate``: stream a generation from a running server to the terminal.

    cdb generate "Once upon a time" --max-tokens 32            # text as it is generated
    cdb generate "Once upon a time" --show-depth               # each token followed by its loop depth
    cdb generate "Once upon a time" --json                     # one JSON object per token, then the finish

Exit status: 0 on success, 1 when the server reports an error (the gRPC status is printed to stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

import grpc

from clients.common import GenerateOptions, StreamFinish, StreamToken
from clients.sync_client import Client


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdb generate", description="Stream a generation from a cdb server.")
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    p.add_argument("--address", default="127.0.0.1:50051", help="server address (default %(default)s)")
    p.add_argument("--max-tokens", type=int, help="tokens to generate (server default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[], help="stop token id (repeatable)")
    p.add_argument("--exit-threshold", type=float, help="per-request exit threshold override")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, metavar="N", help="return logprobs with N alternatives (--json)")
    p.add_argument("--timeout", type=float, help="deadline in seconds")
    p.add_argument("--show-depth", action="store_true", help="print each token's loop depth after it")
    p.add_argument("--json", action="store_true", help="JSON lines: one per token, then the finish")
    return p


def options_from_args(args: argparse.Namespace) -> GenerateOptions:
    opts = GenerateOptions(temperature=args.temperature, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.max_tokens is not None:
        opts["max_tokens"] = args.max_tokens
    if args.top_p is not None:
        opts["top_p"] = args.top_p
    if args.exit_threshold is not None:
        opts["exit_threshold"] = args.exit_threshold
    if args.logprobs is not None:
        opts["logprobs"] = True
        opts["top_logprobs"] = args.logprobs
    if args.stop:
        opts["stop"] = args.stop
    if args.stop_token_id:
        opts["stop_token_ids"] = args.stop_token_id
    return opts


def _print_item(item: StreamToken | StreamFinish, args: argparse.Namespace, out: TextIO) -> None:
    if args.json:
        record = {"type": "token" if item.is_token else "finish"}
        record.update({k: getattr(item, k) for k in item.__slots__ if k != "is_token"})
        out.write(json.dumps(record) + "\n")
    elif isinstance(item, StreamToken):
        out.write(f"{item.text}[{item.depth}]" if args.show_depth else item.text)
    else:
        out.write(item.text)
        if args.show_depth:
            out.write(
                f"\n[{item.finish_reason}: {item.generated_tokens} tokens, {item.total_loop_steps} loop steps, "
                f"mean depth {item.total_loop_steps / max(1, item.generated_tokens):.2f}]"
            )
        out.write("\n")
    out.flush()


def generate_main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """Entry point of ``cdb generate``; returns the exit status."""
    args = build_parser().parse_args(argv)
    out = out or sys.stdout
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        with Client(args.address, timeout=args.timeout) as client:
            for item in client.stream(prompt, **options_from_args(args)):
                _print_item(item, args, out)
                if isinstance(item, StreamFinish) and item.finish_reason == "error":
                    print(f"error: {item.error}", file=sys.stderr)
                    return 1
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(generate_main())
