"""``cdb generate``: stream a generation from a running server to the terminal.

    cdb generate "Once upon a time" --max-tokens 32            # text as it is generated
    cdb generate "Once upon a time" --show-depth               # each token followed by its loop depth
    cdb generate "Once upon a time" --json                     # one JSON object per token, then the finish
    cdb generate "Hi" --address host:50051 --tls-ca ca.crt --api-key-file key.txt   # a secured server
    cdb generate "Hi" --tls-ca ca.crt --tls-cert me.crt --tls-key me.key             # mTLS
    cdb generate "Hi" --address 10.0.0.5:50051,10.0.0.6:50051                         # any of several replicas
    cdb generate "Hi" --address dns:///cdb-headless.cdb.svc.cluster.local:50051       # every address of a name

The API key comes from ``--api-key-file`` or else ``$CDB_API_KEY`` (never a flag: command lines are visible to
other users). ``--tls`` alone uses the system's trusted CAs. Several replicas: ``--address`` takes IP:PORT
addresses separated by commas or a gRPC target such as ``dns:///NAME:PORT``; ``--lb-policy`` picks gRPC's
policy (``round_robin``, the default, or ``pick_first``); a call refused with UNAVAILABLE or RESOURCE_EXHAUSTED
is sent again, and a stream whose server dies or drains is resumed where it stopped (nothing printed twice),
``--max-attempts`` times in all (1: never; see ``clients.balancing``).

Exit status: 0 on success, 1 when the server reports an error (the gRPC status is printed to stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TextIO

import grpc

from clients.balancing import LbPolicy, RetryPolicy, channel_target
from clients.channel import DEFAULT_RETRY, TlsOptions, api_key_metadata, read_api_key_file
from clients.messages import GenerateOptions, StreamFinish, StreamToken
from clients.sync_client import Client

API_KEY_ENV = "CDB_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdb generate", description="Stream a generation from a cdb server.")
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    p.add_argument(
        "--address",
        default="127.0.0.1:50051",
        help="server address; several IP:PORT separated by commas, or a gRPC target such as dns:///NAME:PORT "
        "(default %(default)s)",
    )
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
    lb = p.add_argument_group("several replicas")
    lb.add_argument("--lb-policy", choices=[x.value for x in LbPolicy], default=LbPolicy.ROUND_ROBIN.value)
    lb.add_argument(
        "--max-attempts",
        type=int,
        default=DEFAULT_RETRY.max_attempts,
        help="attempts of a call refused or broken by an unavailable server, 1 (never again) to 5 "
        "(default %(default)s); a broken stream resumes where it stopped",
    )
    sec = p.add_argument_group("secured server")
    sec.add_argument("--tls", action="store_true", help="connect with TLS (implied by --tls-ca / --tls-cert)")
    sec.add_argument("--tls-ca", metavar="PEM", help="CA bundle that signed the server's certificate")
    sec.add_argument("--tls-cert", metavar="PEM", help="client certificate (mTLS; with --tls-key)")
    sec.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    sec.add_argument("--tls-server-name", metavar="NAME", help="name to expect in the server's certificate")
    sec.add_argument("--api-key-file", metavar="FILE", help=f"file holding the API key (default: ${API_KEY_ENV})")
    return p


def connection_from_args(args: argparse.Namespace) -> tuple[TlsOptions | None, str | None]:
    """The TLS options and API key of the command line (and ``$CDB_API_KEY``); raises ValueError."""
    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        tls = TlsOptions.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    api_key = read_api_key_file(args.api_key_file) if args.api_key_file else os.environ.get(API_KEY_ENV) or None
    api_key_metadata(api_key)  # checks the key
    return tls, api_key


def balancing_from_args(args: argparse.Namespace) -> RetryPolicy | None:
    """The retry policy of ``--max-attempts`` (None for 1); checks ``--address``. Raises ValueError naming the
    flag."""
    try:
        channel_target(args.address)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None
    if args.max_attempts == 1:
        return None
    try:
        return dataclasses.replace(DEFAULT_RETRY, max_attempts=args.max_attempts)
    except ValueError:
        raise ValueError(f"--max-attempts: 1 to 5, got {args.max_attempts}") from None


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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        tls, api_key = connection_from_args(args)
        retry = balancing_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    out = out or sys.stdout
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        client = Client(
            args.address, timeout=args.timeout, tls=tls, api_key=api_key, lb_policy=args.lb_policy, retry=retry
        )
        with client:
            for item in client.stream(prompt, resume_attempts=args.max_attempts - 1, **options_from_args(args)):
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
