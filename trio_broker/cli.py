"""The ``trio-broker`` command line."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from trio_broker._version import __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``trio-broker`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="trio-broker",
        description=(
            "Broker scarce execution slots between the servers that have work and the "
            "servers that run it."
        ),
    )
    parser.add_argument("--version", action="version", version=f"trio-broker {__version__}")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level of the daemons (default: info)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    execserver = commands.add_parser(
        "execserver",
        help="run the reference execserver",
        description=(
            "Serve /broker, /healthz, /inspect/system/execserver and /metrics on the "
            "configured listener and run jobs in the configured services. SIGTERM or "
            "SIGINT drains (running jobs finish, then exit 0); a second signal stops now."
        ),
    )
    execserver.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    execserver.add_argument(
        "--ready-file",
        metavar="FILE",
        help="write 'HOST PORT' here once listening (for supervisors and tests)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from trio_broker.daemon import run_execserver  # the daemon brings in trio

    return run_execserver(args.config, ready_file=args.ready_file)
