"""The ``trio-broker`` command line."""

from __future__ import annotations

import argparse
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
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse exits
    return 2  # pragma: no cover
