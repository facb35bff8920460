"""The demonstration behind ``make demo``: a fylr turns sample files into versions.

It runs the whole reference system on this machine, on free 127.0.0.1 ports, in
a fresh temporary state folder:

1. writes the sample inputs (``examples/make_samples.py``) and both example
   configurations (``examples/execserver.yml``, ``examples/fylr.yml``), made
   runnable here;
2. starts one execserver (``trio-broker execserver``) and one fylr
   (``trio-broker fylr``), which starts its own private PostgreSQL cluster in
   the state folder;
3. uploads every sample at mixed priorities (background, normal, interactive)
   and shows each file's progress until it has ended;
4. prints each file's versions, checks them against what the example
   configuration promises (a broken image's picture versions fail with the
   converter's message, everything else is ``done``), and where to look;
5. stops everything it started and removes the state folder.

The example fylr leaves uploads and downloads open on loopback and closes its
operator routes (the inspection page, the metrics) with the token in
``examples/fylr-operator.token``: the demo reads the inspection page with it.

Exit status 0 only when every file ended with the expected versions. Ctrl-C
stops everything too. ``--keep`` keeps the daemons running after the check,
until Ctrl-C, so that you can look at the pages it prints.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import demo_checkout  # noqa: F401  (tests.support is this checkout's)
import httpx
import trio
import yaml
from make_samples import localize_execserver_config, make_samples
from rich.console import Console
from trio_broker_daemons.commands.upload import FileOutcome, upload_files
from trio_broker_daemons.fylr.pgcluster import PgCluster, PostgresNotFound, find_pg_bin

from tests.support.processes import open_execserver_process, open_fylr_process

EXAMPLES = Path(__file__).resolve().parent
TIMEOUT = 300.0
"""Seconds the uploads and their processing may take before the demo gives up."""

PRIORITIES = {
    "sunset.jpg": 0,
    "portrait.jpg": 0,
    "diagram.png": -2,
    "logo.png": 2,
    "icon.gif": 3,
    "notes.txt": 2,
    "measurements.csv": -2,
    "broken.png": 0,
    "archive.bin": -2,
}
"""Each sample's priority: background -2, normal 0, interactive 2 (3: its urgent variant)."""

IMAGE_VERSIONS = ("preview", "preview_small", "sha256", "thumbnail")
EXPECTED: dict[str, dict[str, str]] = {
    **{name: dict.fromkeys(IMAGE_VERSIONS, "done") for name in
       ("sunset.jpg", "portrait.jpg", "diagram.png", "logo.png", "icon.gif")},
    "notes.txt": {"gz": "done", "sha256": "done"},
    "measurements.csv": {"gz": "done", "sha256": "done"},
    # a PNG cut short: the converter refuses it, the checksum does not care
    "broken.png": {"preview": "failed", "preview_small": "failed", "sha256": "done",
                   "thumbnail": "failed"},
    "archive.bin": {},
}  # fmt: skip
"""Each sample's versions and their API status, as the example configurations promise."""

T0 = time.monotonic()
console = Console(highlight=False, soft_wrap=True)


def say(text: str) -> None:
    console.print(f"{time.monotonic() - T0:6.1f}s  {text}", markup=False)


def operator_token_file() -> Path:
    """The file of the example fylr's operator token (``tokens.operator_file``, beside it)."""
    document = yaml.safe_load((EXAMPLES / "fylr.yml").read_text(encoding="utf-8"))
    return EXAMPLES / str(document["tokens"]["operator_file"])


def operator_headers() -> dict[str, str]:
    """The example fylr's operator token, as the inspection page wants it."""
    token = operator_token_file().read_text(encoding="utf-8").strip()
    return {"authorization": f"Bearer {token}"}


def write_configs(state: Path) -> tuple[Path, Path]:
    """The example configurations, runnable from this state folder on free ports."""
    text = (EXAMPLES / "execserver.yml").read_text(encoding="utf-8")
    execserver = yaml.safe_load(localize_execserver_config(text))
    execserver.update(listen="127.0.0.1:0", name="demo-exec")
    execserver_path = state / "execserver.yml"
    execserver_path.write_text(yaml.safe_dump(execserver, sort_keys=False), encoding="utf-8")
    fylr = yaml.safe_load((EXAMPLES / "fylr.yml").read_text(encoding="utf-8"))
    fylr.update(
        listen="127.0.0.1:0",
        name="demo-fylr",
        state_dir=str(state / "fylr"),
        database=None,
        execservers=[],  # filled in once the execserver listens
    )
    # the copy lives elsewhere: its operator token stays the file beside the example
    fylr["tokens"]["operator_file"] = str(operator_token_file())
    fylr_path = state / "fylr.yml"
    fylr_path.write_text(yaml.safe_dump(fylr, sort_keys=False), encoding="utf-8")
    return execserver_path, fylr_path


def point_at(fylr_path: Path, address: str) -> None:
    document = yaml.safe_load(fylr_path.read_text(encoding="utf-8"))
    document["execservers"] = [address]
    fylr_path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")


def check(outcomes: Sequence[FileOutcome]) -> list[str]:
    """What differs from :data:`EXPECTED` (empty when everything is as promised)."""
    problems = []
    for outcome in outcomes:
        name = outcome.path.name
        document = outcome.document
        if document is None:
            problems.append(f"{name}: not uploaded: {outcome.error}")
            continue
        if document["status"] != "done":
            problems.append(f"{name}: status {document['status']}, expected done")
        versions = {v: d["status"] for v, d in (document.get("versions") or {}).items()}
        if versions != EXPECTED[name]:
            problems.append(f"{name}: versions {versions}, expected {EXPECTED[name]}")
    return problems


def show(outcome: FileOutcome, base: str) -> None:
    document = outcome.document
    if document is None:
        say(f"{outcome.path.name}: not uploaded ({outcome.error})")
        return
    metadata = document.get("metadata") or {}
    facts = [f"{document['filesize']} bytes", str(document.get("mimetype"))]
    if "width" in metadata:
        facts.append(f"{metadata['width']}x{metadata['height']}")
    say(
        f"{outcome.path.name} (priority {outcome.priority}): {document['status']},"
        f" class {document['class']}, {', '.join(facts)}"
        f"  {base}/api/v1/eas/{document['id']}"
    )
    if document.get("error"):
        say(f"    note: {document['error']}")
    for name, version in sorted((document.get("versions") or {}).items()):
        if version["status"] == "done":
            detail = f"{version['filesize']} bytes {version['mimetype']}  {version['url']}"
        else:
            detail = f"{version['status']}: {version['error']}"
        say(f"    {name:<14} {detail}")


async def run(state: Path, keep: bool) -> int:
    samples = make_samples(state / "samples")
    execserver_path, fylr_path = write_configs(state)
    say(f"state folder {state}: samples, configurations, the fylr's files and database")
    async with open_execserver_process(execserver_path, log_level="warning") as execserver:
        address = f"{execserver.host}:{execserver.port}"
        say(f"execserver pid {execserver.process.pid} serving {execserver.url}")
        point_at(fylr_path, address)
        say("starting the fylr and its private PostgreSQL cluster (initdb on first start)")
        async with open_fylr_process(fylr_path, log_level="warning") as fylr:
            base = fylr.http_url
            say(f"fylr pid {fylr.process.pid} serving {base}")
            say("while it runs, look at:")
            say(f"    {base}/inspect/system/fylr          queue, files, dispatcher, broker client")
            say(f"    {base}/metrics                      Prometheus metrics of the fylr")
            say(f"    (both with the operator token of {operator_token_file()})")
            say(f"    {execserver.http_url}/inspect/system/execserver  slots, services, receipts")
            say(f"    {base}/api/v1/eas/<id>              a file, its versions and metadata")
            files = [(path, PRIORITIES[path.name]) for path in samples]
            started = time.monotonic()
            outcomes = await upload_files(base, files, wait=True, console=console, timeout=TIMEOUT)
            elapsed = time.monotonic() - started
            say(f"{len(outcomes)} files uploaded and followed to their end in {elapsed:.1f}s:")
            for outcome in outcomes:
                show(outcome, base)
            try:
                async with httpx.AsyncClient(timeout=30) as http:
                    inspect_url = f"{base}/inspect/system/fylr"
                    page = (await http.get(inspect_url, headers=operator_headers())).json()
                    exec_url = f"{execserver.http_url}/inspect/system/execserver"
                    exec_page = (await http.get(exec_url)).json()
            except httpx.HTTPError as exc:
                say(f"cannot read the inspection pages: {exc}")
            else:
                summarize(page, exec_page)
            problems = check(outcomes)
            for problem in problems:
                say(f"UNEXPECTED: {problem}")
            if not problems:
                say("every file ended with the versions the example configuration promises")
            if keep:
                say("--keep: the daemons keep running; press Ctrl-C to stop them")
                await trio.sleep_forever()
            say("stopping the fylr (its claimed work goes back to the queue) and the execserver")
    return 1 if problems else 0


def summarize(page: Mapping[str, Any], exec_page: Mapping[str, Any]) -> None:
    dispatcher = page.get("dispatcher") or {}
    say(
        f"fylr: files {page['files']}, queue {page['queue']},"
        f" {dispatcher.get('completed')} steps completed,"
        f" peak {dispatcher.get('peak_exec_in_flight')} jobs in flight"
    )
    for name, service in sorted(exec_page["services"].items()):
        mean = service["mean_runtime_s"]
        say(
            f"execserver service {name}: {service['completed']} runs,"
            f" mean {mean:.2f}s, {service['kind']}"
            if mean is not None
            else f"execserver service {name}: {service['completed']} runs"
        )


def stop_leftover_cluster(state: Path) -> None:
    """Stop the fylr's PostgreSQL if the fylr could not (it was killed)."""
    folder = state / "fylr" / "pg"
    if not (folder / "data" / "postmaster.pid").exists():
        return
    with contextlib.suppress(PostgresNotFound):
        PgCluster(folder, bin_dir=find_pg_bin()).stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--keep", action="store_true", help="keep the daemons running after the check"
    )
    args = parser.parse_args(argv)
    state = Path(tempfile.mkdtemp(prefix="trio-broker-demo-"))
    # the private cluster runs as the 'postgres' user when the demo runs as root
    os.chmod(state, 0o755)
    status = 1
    try:
        status = trio.run(run, state, args.keep)
    except* KeyboardInterrupt:
        say("interrupted: everything the demo started was stopped")
        status = 130
    except* RuntimeError as group:  # a daemon did not start: it said why above
        for problem in group.exceptions:
            say(f"stopped: {problem}")
        status = 1
    finally:
        stop_leftover_cluster(state)
        shutil.rmtree(state, ignore_errors=True)
    say(f"done, exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
