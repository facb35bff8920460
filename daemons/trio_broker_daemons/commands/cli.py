"""The ``trio-broker`` command line.

Global options (``--log-level``, ``--log-format``) are accepted before and after
the subcommand (``trio-broker --log-format json execserver …`` and
``trio-broker execserver … --log-format json`` are the same); given in both
places, the one after the subcommand wins.

Exit statuses: 0 done; 1 a start-up failure (a port in use, a missing TLS file,
an unreachable database) or, for ``upload``, a file or version that failed; 2 a
bad command line or configuration.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Final

from trio_broker._version import __version__

__all__ = [
    "CLIENT_COMMANDS",
    "DAEMON_MODULES",
    "SERVER_VARIABLE",
    "TOKEN_VARIABLE",
    "build_parser",
    "main",
]

LOG_LEVELS: Final = ("debug", "info", "warning", "error")
LOG_FORMATS: Final = ("logfmt", "json")
SERVER_VARIABLE: Final = "TRIO_BROKER_SERVER"
"""The environment variable ``upload --server`` defaults to."""
TOKEN_VARIABLE: Final = "TRIO_BROKER_FYLR_TOKEN"
"""The environment variable the client commands take the fylr's token from."""
CLIENT_COMMANDS: Final = ("upload", "position", "top", "storage", "work")
"""The commands that talk to a fylr (``--server`` and its token)."""


def _global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``--log-level`` and ``--log-format``; below the top they only override when given."""
    parser.add_argument(
        "--log-level",
        default=None if top else argparse.SUPPRESS,
        choices=LOG_LEVELS,
        help="log level of the daemons (default: info; upload: warning)",
    )
    parser.add_argument(
        "--log-format",
        default="logfmt" if top else argparse.SUPPRESS,
        choices=LOG_FORMATS,
        help="one key=value line per event (logfmt, the default) or one JSON object",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _priority(text: str) -> int:
    from trio_broker_daemons.commands.upload import parse_priority  # no rich or httpx for --help

    try:
        return parse_priority(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _client_options(parser: argparse.ArgumentParser, role: str) -> None:
    """``--server`` and the fylr token options of a command that talks to a fylr."""
    parser.add_argument(
        "--server",
        default=os.environ.get(SERVER_VARIABLE) or None,
        metavar="HOST:PORT",
        help=f"the fylr, e.g. 127.0.0.1:7400 or https://fylr:7400 (default: ${SERVER_VARIABLE})",
    )
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"read the fylr's {role} token from FILE (default: ${TOKEN_VARIABLE})",
    )
    tokens.add_argument(
        "--token",
        metavar="TOKEN",
        help="the token itself (visible to other users in the process list: prefer --token-file)",
    )


def _fylr_token(args: argparse.Namespace) -> str | None:
    """The token a client command sends: --token, --token-file, then the variable.

    Raises:
        ValueError: the file cannot be read or holds no token.
    """
    if args.token is not None:
        return str(args.token) or None
    if args.token_file is not None:
        try:
            with open(args.token_file, encoding="utf-8") as stream:
                text = stream.read().removesuffix("\n").removesuffix("\r")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--token-file: cannot read {args.token_file!r}: {exc}") from None
        if not text:
            raise ValueError(f"--token-file: {args.token_file!r} is empty")
        return text
    return os.environ.get(TOKEN_VARIABLE) or None


def _daemon(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
) -> None:
    """A daemon's subcommand: ``--config``, ``--ready-file`` and the global options."""
    parser = commands.add_parser(name, help=help, description=description)
    parser.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    parser.add_argument(
        "--ready-file",
        metavar="FILE",
        help="write 'HOST PORT' here once listening (for supervisors and tests)",
    )
    _global_options(parser, top=False)


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
    _global_options(parser, top=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _daemon(
        commands,
        "execserver",
        help="run the reference execserver",
        description=(
            "Serve /broker, /livez, /readyz, /inspect/system/execserver and /metrics on "
            "the configured listener and run jobs in the configured services. SIGTERM or "
            "SIGINT drains (running jobs finish, then exit 0); a second signal stops now. "
            "Every configuration key can also be set as TRIO_BROKER_<KEY>."
        ),
    )
    _daemon(
        commands,
        "fylr",
        help="run the reference fylr (file server), or requeue its failed work",
        description=(
            "Serve the file API (PUT /eas/put, GET /api/v1/eas/ID, downloads), the "
            "pipes, /healthz, /inspect/system/fylr and /metrics on the configured "
            "listener; make each file's metadata and versions on the execservers. "
            "SIGTERM or SIGINT stops gracefully (claimed work goes back to the queue). "
            "'trio-broker fylr requeue --failed --config FILE' instead puts the failed "
            "queue rows (see /inspect/system/fylr) back into the queue, in the "
            "configured database, and exits."
        ),
    )
    fylr = commands.choices["fylr"]
    fylr.add_argument(
        "operation",
        nargs="?",
        choices=("requeue",),
        help="requeue: put failed work back into the queue (with --failed) and exit",
    )
    fylr.add_argument(
        "--failed", action="store_true", help="requeue: the failed queue rows (all by default)"
    )
    fylr.add_argument(
        "--id",
        dest="ids",
        type=int,
        action="append",
        metavar="N",
        help="requeue: only the queue row N (repeatable)",
    )
    upload = commands.add_parser(
        "upload",
        help="upload files to a fylr",
        description=(
            "Stream each FILE to a fylr's PUT /eas/put and print its id; with --wait, "
            "follow every file (with progress bars) until it has ended and print its "
            "versions and why any failed. Exit status 0 when every file was uploaded "
            "(and, with --wait, every file and version ended done), 1 otherwise."
        ),
    )
    upload.add_argument("files", nargs="+", metavar="FILE", help="files to upload")
    _client_options(upload, "upload")
    upload.add_argument(
        "--priority",
        type=_priority,
        default=0,
        metavar="BAND",
        help=(
            "background, normal (the default), interactive, synchronous; NAME+1 "
            "(or high-NAME) is the band's high variant; or a number (-2, 0, 2, 4, 3 …)"
        ),
    )
    upload.add_argument(
        "--wait", action="store_true", help="wait until every file is done or failed"
    )
    upload.add_argument(
        "--timeout",
        type=_positive_seconds,
        metavar="SECONDS",
        help="give up after this long (exit 1, naming the files not ended)",
    )
    _global_options(upload, top=False)
    position = commands.add_parser(
        "position",
        help="where a file's waiting steps stand in the queue",
        description=(
            "Print, once, each waiting step of file ID: the running and waiting jobs at "
            "the best execserver, its number in the queue, and a rough time estimate."
        ),
    )
    position.add_argument("file_id", type=int, metavar="ID", help="the file's id")
    _client_options(position, "read")
    top = commands.add_parser(
        "top",
        help="a live view of the installation in the terminal",
        description=(
            "Follow a fylr's topology (every fylr, balancer and execserver) and redraw "
            "it each second until interrupted."
        ),
    )
    _client_options(top, "operator")
    top.add_argument(
        "--once", action="store_true", help="print the view once and exit (no live display)"
    )
    _global_options(position, top=False)
    _global_options(top, top=False)
    _storage_command(commands)
    _work_command(commands)
    _simulate_parser(commands)
    return parser


def _seconds_at_least_0(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _work_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``trio-broker work files|steps|step|cancel|retry|delete|queues``."""
    work = commands.add_parser(
        "work",
        help="list, cancel, retry and delete a fylr's files and steps",
        description=(
            "The work an operator acts on, on a fylr's operator routes (the operator "
            "token): list files and steps with filters, show a step's attempts, cancel "
            "a queued or running step, retry failed steps, delete a file with its "
            "versions and stored bytes, show the admission and the queue by band."
        ),
    )
    subcommands = work.add_subparsers(dest="work_command", metavar="SUBCOMMAND", required=True)
    files = subcommands.add_parser("files", help="files, newest first")
    files.add_argument("--kind", choices=("original", "version"), action="append")
    files.add_argument("--state", action="append", metavar="STATE", help="new, sync, done, error …")
    files.add_argument("--class", dest="class_", action="append", metavar="CLASS")
    steps = subcommands.add_parser("steps", help="queued, running and failed steps, oldest first")
    steps.add_argument(
        "--state", action="append", metavar="STATE", help="ready, delayed, claimed, failed"
    )
    steps.add_argument("--action", action="append", metavar="ACTION")
    steps.add_argument("--service", action="append", metavar="SERVICE")
    steps.add_argument("--file", type=int, metavar="ID", help="an original with its versions")
    for listing in (files, steps):
        listing.add_argument("--priority", type=_priority, action="append", metavar="BAND")
        listing.add_argument(
            "--older-than", type=_seconds_at_least_0, metavar="SECONDS", help="enqueued before"
        )
        listing.add_argument("--limit", type=int, metavar="N", help="rows per page (default 100)")
        listing.add_argument("--cursor", metavar="C", help="the page after the one that named C")
    step = subcommands.add_parser("step", help="one step and its attempts")
    step.add_argument("id", type=int, metavar="STEP")
    cancel = subcommands.add_parser("cancel", help="cancel a queued or running step")
    cancel.add_argument("id", type=int, metavar="STEP")
    retry = subcommands.add_parser("retry", help="put failed steps back into the queue")
    which = retry.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=int, metavar="STEP", help="one failed step")
    which.add_argument("--file", type=int, metavar="ID", help="every failed step of a file")
    delete = subcommands.add_parser("delete", help="delete an original, its versions and bytes")
    delete.add_argument("id", type=int, metavar="FILE")
    subcommands.add_parser("queues", help="the admission and its parts, the queue by band")
    for each in subcommands.choices.values():
        _client_options(each, "operator")
        _global_options(each, top=False)


def _storage_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``trio-broker storage ACTION (--file ID… | --all)``: queue a local action."""
    storage = commands.add_parser(
        "storage",
        help="check, move or repair the stored files of a fylr",
        description=(
            "Ask a fylr to queue a local action for some files (--file, repeatable: an "
            "original with its versions) or for all (--all): checksum (hash the stored "
            "bytes, mark a mismatch), copy-move (move them to another storage location), "
            "sync-check (make again the versions whose stored bytes are missing or "
            "damaged). Needs the operator token."
        ),
    )
    storage.add_argument("action", choices=("checksum", "copy-move", "sync-check"))
    which = storage.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--file", dest="files", type=int, action="append", metavar="ID", help="the file ID"
    )
    which.add_argument("--all", action="store_true", help="every file")
    storage.add_argument(
        "--location", metavar="NAME", help="copy-move: the target (default: storage_location)"
    )
    storage.add_argument(
        "--priority",
        type=_priority,
        default=None,
        metavar="BAND",
        help="the items' priority (default: background)",
    )
    _client_options(storage, "operator")
    _global_options(storage, top=False)


def _seeds(text: str) -> range:
    from trio_broker_daemons.commands.simulate import parse_seeds

    try:
        return parse_seeds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _simulate_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    simulate = commands.add_parser(
        "simulate",
        help="simulate a fleet on the real cores: find defects by seed, plan capacity",
        description=(
            "Run SCENARIO (a shipped one, see --list, or a YAML/JSON file) for each seed in "
            "virtual time, on the library's real cores, and check its invariants. Prints "
            "every violation with its seed and a shrunk trace that replays it (exit 1), "
            "or the capacity report: throughput, slot use, waits per priority, shares, "
            "the queue over time; and the same for a what-if fleet."
        ),
    )
    simulate.add_argument("scenario", nargs="?", metavar="SCENARIO", help="a name or a file")
    simulate.add_argument(
        "--seeds", type=_seeds, default=range(10), metavar="A..B", help="seeds (default 0..9)"
    )
    simulate.add_argument(
        "--jobs", type=_count, default=None, metavar="N", help="processes (default: the CPUs)"
    )
    simulate.add_argument(
        "--add-execservers", type=_count, default=0, metavar="N",
        help="what if: N more execservers like the last one",
    )  # fmt: skip
    simulate.add_argument(
        "--slots", type=_count, default=None, metavar="N", help="what if: N slots each"
    )
    simulate.add_argument(
        "--clients", type=_count, default=None, metavar="N", help="what if: N clients"
    )
    simulate.add_argument(
        "--trace-out", metavar="FILE", help="write the shrunk trace of a failing seed here"
    )
    simulate.add_argument(
        "--replay", action="store_true", help="SCENARIO is a trace file: run it as it is"
    )
    simulate.add_argument("--list", action="store_true", help="list the shipped scenarios")
    simulate.add_argument(
        "--dump", action="store_true", help="print SCENARIO as JSON (to start a file of your own)"
    )
    _global_options(simulate, top=False)


DAEMON_MODULES: Final = frozenset({"yaml", "rich", "psycopg", "psycopg_pool"})
"""Top-level modules of the ``daemons`` extra, which the library alone lacks."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "fylr" and (args.operation is None) == (args.failed or bool(args.ids)):
        what = "requeue needs --failed" if args.operation else "--failed and --id need requeue"
        print(f"trio-broker fylr: {what}", file=sys.stderr)
        return 2
    if args.command == "fylr" and args.operation == "requeue" and not args.failed:
        print("trio-broker fylr: requeue needs --failed", file=sys.stderr)
        return 2
    if args.command == "storage" and args.location is not None and args.action != "copy-move":
        print("trio-broker storage: --location is for copy-move only", file=sys.stderr)
        return 2
    if args.command in CLIENT_COMMANDS and args.server is None:
        print(
            f"trio-broker {args.command}: give --server HOST:PORT or set {SERVER_VARIABLE}",
            file=sys.stderr,
        )
        return 2
    if args.command in CLIENT_COMMANDS:
        try:
            args.fylr_token = _fylr_token(args)
        except ValueError as exc:
            print(f"trio-broker {args.command}: {exc}", file=sys.stderr)
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


def _simulate(args: argparse.Namespace) -> int:
    from trio_broker_daemons.commands import simulate

    if args.list:
        return simulate.list_scenarios()
    if args.scenario is None:
        print("trio-broker simulate: give a SCENARIO (or --list)", file=sys.stderr)
        return 2
    if args.dump:
        return simulate.dump_scenario(args.scenario)
    if args.slots == 0 or args.clients == 0:
        print("trio-broker simulate: --slots and --clients need at least 1", file=sys.stderr)
        return 2
    return simulate.main(
        args.scenario,
        seeds=args.seeds,
        jobs=args.jobs or None,
        add_execservers=args.add_execservers,
        slots=args.slots,
        clients=args.clients,
        trace_out=args.trace_out,
        replay_trace=args.replay,
    )


def _run(args: argparse.Namespace) -> int:
    from trio_broker_daemons.runtime.logfmt import configure_logging

    if args.command in ("position", "top", "storage", "work"):
        from trio_broker_daemons.commands.upload import server_url

        configure_logging(args.log_level or "warning", args.log_format)
        try:
            server = server_url(args.server)
        except ValueError as exc:
            print(f"trio-broker {args.command}: --server: {exc}", file=sys.stderr)
            return 2
        if args.command == "position":
            from trio_broker_daemons.commands.position import main as position_main

            return position_main(server, args.file_id, token=args.fylr_token)
        if args.command == "work":
            from trio_broker_daemons.commands.work import main as work_main

            values = {**vars(args), "class": getattr(args, "class_", None)}
            return work_main(server, args.work_command, values, token=args.fylr_token)
        if args.command == "storage":
            from trio_broker_daemons.commands.storage import main as storage_main

            return storage_main(
                server,
                args.action,
                files=None if args.all else args.files,
                location=args.location,
                priority=args.priority,
                token=args.fylr_token,
            )
        from trio_broker_daemons.commands.top import main as top_main

        return top_main(server, once=args.once, token=args.fylr_token)
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "upload":
        # the progress bars are the upload's output: by default only warnings are logged
        configure_logging(args.log_level or "warning", args.log_format)
        from trio_broker_daemons.commands.upload import main as upload_main

        return upload_main(
            args.server,
            args.files,
            priority=args.priority,
            wait=args.wait,
            timeout=args.timeout,
            token=args.fylr_token,
        )
    if args.command == "fylr" and args.operation == "requeue":
        configure_logging(args.log_level or "warning", args.log_format)
        from trio_broker_daemons.commands.requeue import requeue_main

        return requeue_main(args.config, ids=args.ids)
    configure_logging(args.log_level or "info", args.log_format)
    if args.command == "fylr":
        from trio_broker_daemons.fylr.daemon import run_fylr

        return run_fylr(args.config, ready_file=args.ready_file)
    from trio_broker_daemons.execserver.daemon import run_execserver  # the daemon brings in trio

    return run_execserver(args.config, ready_file=args.ready_file)
