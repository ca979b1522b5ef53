"""``cdb stage`` and ``cdb scheduler``: one process of the tree each (the launcher's and compose's commands)."""

from __future__ import annotations

import argparse
import logging

from cdb_engine.config import DType
from cdb_engine.options import add_engine_args, engine_config_from_args
from cdb_scheduler.plan import Stage
from services.launcher import die_with_parent, pin_cpus
from services.net import is_host_port, parse_stage_addrs


def stage_main(argv: list[str] | None = None) -> int:
    """``cdb stage``: serve one stage of a looped LM (``cdb.v1.Stage``) until SIGTERM/SIGINT."""
    from services.transport.stage_server import run_stage

    die_with_parent()
    parser = argparse.ArgumentParser(prog="cdb stage", description=stage_main.__doc__)
    parser.add_argument("--role", required=True, choices=Stage.roles())
    parser.add_argument("--listen", required=True, help="unix:PATH or a loopback HOST:PORT (port 0: any)")
    parser.add_argument("--model", default="ouro-tiny", help="preset name or checkpoint folder")
    parser.add_argument("--dtype", type=DType, choices=list(DType), default=DType.FLOAT32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    args = parser.parse_args(argv)
    pin_cpus(args.role)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.role} %(levelname)s %(message)s")
    try:
        run_stage(args.role, args.model, args.listen, dtype=args.dtype, device=args.device, ready_file=args.ready_file)
    except ValueError as exc:
        parser.error(str(exc))
    return 0


def scheduler_main(argv: list[str] | None = None) -> int:
    """``cdb scheduler``: serve ``cdb.v1.Generation`` over stage servers until SIGTERM/SIGINT, then drain."""
    from services.scheduler.server import run_scheduler

    die_with_parent()
    parser = argparse.ArgumentParser(prog="cdb scheduler", description=scheduler_main.__doc__)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0: any) or unix:PATH")
    parser.add_argument("--stage", action="append", default=[], metavar="ROLE=ADDR", help="prelude|loop|head")
    parser.add_argument("--in-process", action="store_true", help="run the stages in this process instead")
    parser.add_argument("--ready-file", help="write the bound address here once ready")
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: $CDB_METRICS_ADDR; unset or empty: none)",
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)
    pin_cpus("scheduler")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    try:
        stage_addrs = None if args.in_process else parse_stage_addrs(args.stage)
        config = engine_config_from_args(args)
        if args.metrics_listen and not is_host_port(args.metrics_listen):
            raise ValueError(f"--metrics-listen must be HOST:PORT, got {args.metrics_listen!r}")
    except ValueError as exc:
        parser.error(str(exc))
    run_scheduler(config, args.listen, stage_addrs, ready_file=args.ready_file, metrics_listen=args.metrics_listen)
    return 0
