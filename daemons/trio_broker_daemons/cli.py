"""The ``trio-broker`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Final

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
    fylr = commands.add_parser(
        "fylr",
        help="run the reference fylr (file server)",
        description=(
            "Serve the file API (PUT /eas/put, GET /api/v1/eas/ID, downloads), the "
            "pipes, /healthz, /inspect/system/fylr and /metrics on the configured "
            "listener; make each file's metadata and versions on the execservers. "
            "SIGTERM or SIGINT stops gracefully (claimed work goes back to the queue)."
        ),
    )
    fylr.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    fylr.add_argument(
        "--ready-file",
        metavar="FILE",
        help="write 'HOST PORT' here once serving (for supervisors and tests)",
    )
    upload = commands.add_parser(
        "upload",
        help="upload files to a fylr",
        description=(
            "Stream each FILE to a fylr's PUT /eas/put and print its id; with --wait, "
            "follow every file (with progress bars) until it has ended and print its "
            "versions. Exit status 0 when every file was uploaded (and ended done)."
        ),
    )
    upload.add_argument("files", nargs="+", metavar="FILE", help="files to upload")
    upload.add_argument(
        "--server", required=True, metavar="URL", help="the fylr, e.g. http://127.0.0.1:7400"
    )
    upload.add_argument(
        "--priority", type=int, default=0, metavar="N", help="priority of the files (default 0)"
    )
    upload.add_argument(
        "--wait", action="store_true", help="wait until every file is done or failed"
    )
    position = commands.add_parser(
        "position",
        help="where a file's waiting steps stand in the queue",
        description=(
            "Print, once, each waiting step of file ID: the running and waiting jobs at "
            "the best execserver, its number in the queue, and a rough time estimate."
        ),
    )
    position.add_argument("file_id", type=int, metavar="ID", help="the file's id")
    position.add_argument(
        "--server", required=True, metavar="URL", help="the fylr, e.g. http://127.0.0.1:7400"
    )
    top = commands.add_parser(
        "top",
        help="a live view of the installation in the terminal",
        description=(
            "Follow a fylr's topology (every fylr, balancer and execserver) and redraw "
            "it each second until interrupted."
        ),
    )
    top.add_argument(
        "--server", required=True, metavar="URL", help="the fylr, e.g. http://127.0.0.1:7400"
    )
    top.add_argument(
        "--once", action="store_true", help="print the view once and exit (no live display)"
    )
    return parser


DAEMON_MODULES: Final = frozenset({"yaml", "rich", "psycopg", "psycopg_pool"})
"""Top-level modules of the ``daemons`` extra, which the library alone lacks."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _run(args)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in DAEMON_MODULES:
            raise
        print(
            f"trio-broker {args.command}: the daemons need the 'daemons' extra "
            f"(missing module {exc.name!r}): pip install 'trio_broker[daemons]'",
            file=sys.stderr,
        )
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "position":
        from trio_broker_daemons.position import main as position_main

        return position_main(args.server, args.file_id)
    if args.command == "top":
        from trio_broker_daemons.top import main as top_main

        return top_main(args.server, once=args.once)
    if args.command == "upload":
        logging.basicConfig(level=logging.WARNING)
        from trio_broker_daemons.upload import main as upload_main

        return upload_main(args.server, args.files, priority=args.priority, wait=args.wait)
    if args.command == "fylr":
        from trio_broker_daemons.logfmt import LogfmtFormatter

        handler = logging.StreamHandler()
        handler.setFormatter(LogfmtFormatter())
        logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
        # one warning per failed connection attempt; the store reports an outage itself
        logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
        from trio_broker_daemons.daemon import run_fylr

        return run_fylr(args.config, ready_file=args.ready_file)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from trio_broker_daemons.daemon import run_execserver  # the daemon brings in trio

    return run_execserver(args.config, ready_file=args.ready_file)
