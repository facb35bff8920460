"""``trio-broker work …``: the work an operator acts on, from the terminal.

Each subcommand is one request to a fylr's operator routes
(:mod:`~trio_broker_daemons.fylr.work`; the ``operator`` token) and prints
what came back, one line per file, step or attempt:

.. code-block:: text

    $ trio-broker work steps --state delayed --service thumbnial --server 127.0.0.1:7400
    step 41 produce file 12 small [thumbnial] normal delayed, attempt 3: waits: no connected
      execserver offers service 'thumbnial' (did you mean 'thumbnail'?)
    $ trio-broker work step 41
    $ trio-broker work cancel 41
    $ trio-broker work retry --file 12
    $ trio-broker work delete 12
    $ trio-broker work queues

``files`` and ``steps`` take the filters of the routes (``--state``,
``--priority``, ``--kind``, ``--class``, ``--action``, ``--service``,
``--file``, ``--older-than SECONDS``) and print a page (``--limit``); the last
line names the ``--cursor`` of the next page when there is one. The fylr
checks every filter: a refused one is its one-line answer and exit status 2.

Exit status: 0 done; 1 the fylr could not be reached, refused the token, or
knows no such file or step (404), or would not (409: cancel a failed step,
retry one that did not fail, delete a version); 2 a refused filter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import httpx
import trio

from trio_broker_daemons.commands.credentials import auth_headers, refusal_hint
from trio_broker_daemons.commands.position import eta_text

__all__ = ["SUBCOMMANDS", "main"]

SUBCOMMANDS: Final = ("files", "steps", "step", "cancel", "retry", "delete", "queues")
REQUEST_TIMEOUT: Final = 60.0


class _Refused(Exception):
    """The fylr answered something else than 200: its text, and the exit status."""

    def __init__(self, text: str, status: int) -> None:
        super().__init__(text)
        self.status = status


async def _request(
    server: str,
    method: str,
    path: str,
    params: Sequence[tuple[str, str]],
    token: str | None,
) -> Any:
    url = f"{server.rstrip('/')}{path}"
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, headers=auth_headers(token)) as http:
        try:
            response = await http.request(method, url, params=list(params))
        except httpx.HTTPError as exc:
            raise _Refused(f"cannot reach {server}: {type(exc).__name__}: {exc}", 1) from None
    if response.status_code != 200:
        try:
            body = response.json()
            text = str(body["error"]) if isinstance(body, dict) and "error" in body else ""
        except ValueError:
            text = ""
        text = text or response.text.strip()
        hint = refusal_hint(response.status_code, "operator")
        raise _Refused(
            f"the fylr answered {response.status_code}: {text}{hint}",
            2 if response.status_code == 400 else 1,
        )
    return response.json()


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    text = eta_text(seconds) or ""
    return text.removeprefix("roughly ")


def _file_line(f: Mapping[str, Any]) -> str:
    name = f["filename"] if f["kind"] == "original" else f"{f['filename']} {f['version']}"
    line = (
        f"file {f['id']} {f['kind']} {name} ({f['class'] or 'no class'}) {f['state']},"
        f" priority {f['priority']}, {_age(f.get('age_s'))} old"
    )
    if f.get("error"):
        line += f": {' '.join(str(f['error']).split())}"
    return line


def _step_line(s: Mapping[str, Any]) -> str:
    what = s["version"] or s["filename"] or s["file_ref"]
    service = f" [{s['service']}]" if s.get("service") else ""
    line = (
        f"step {s['id']} {s['action']} file {s['file_ref']} {what}{service} {s['band']}"
        f" {s['state']}, attempt {s['attempts']}"
    )
    if s.get("claimed_by"):
        line += f", held by {s['claimed_by']}"
    why = s.get("waits_because") if s["state"] in ("ready", "delayed") else s.get("last_error")
    if why:
        line += f": {'waits: ' if s.get('waits_because') else ''}{' '.join(str(why).split())}"
    return line


def _attempt_line(a: Mapping[str, Any]) -> str:
    line = (
        f"  attempt {a['attempt']}: {a['outcome']} after {a['duration_s']:.1f} s,"
        f" backend {a['backend']}"
    )
    if a.get("instance"):
        line += f", execserver {a['instance']}"
    line += f", started {a['started_at']}"
    if a.get("reason"):
        line += f"\n    reason: {' '.join(str(a['reason']).split())}"
    if a.get("decisive_line"):
        line += f"\n    decisive line: {a['decisive_line']}"
    return line


def _print_page(items: Sequence[Mapping[str, Any]], line: Any, cursor: str | None) -> None:
    for item in items:
        print(line(item))
    if not items:
        print("nothing matches")
    if cursor is not None:
        print(f"more: --cursor {cursor}")


def _print_step(step: Mapping[str, Any]) -> None:
    print(_step_line(step))
    for attempt in step.get("attempts_ended") or ():
        print(_attempt_line(attempt))
    current = step.get("current")
    if current:
        running = current.get("running_s")
        shown = "" if running is None else f" for {running:.1f} s"
        print(
            f"  attempt {current['attempt']}: running{shown}, backend {current['backend']},"
            f" started {current['started_at']}"
        )


def _print_queues(document: Mapping[str, Any]) -> None:
    admission = document.get("admission")
    if admission is None:
        print(f"{document['backend_id']}: no dispatcher (an API-only node)")
    else:
        print(
            f"{document['backend_id']}: admission {admission['exec_limit']}"
            f" (+{admission['odd_reserve']} for odd priorities) ="
            f" base {admission['base']} (share {admission['share']} + {admission['cpus']} CPUs)"
            f" + rise {admission['rise']}, capped at {admission['max_in_flight']};"
            f" {admission['in_flight']} in flight ({admission['odd_in_flight']} odd),"
            f" {admission['waiting_at_execservers']} waiting at execservers"
        )
        local = document["local"]
        print(
            f"  local: {local['in_flight']} of {local['limit']} in flight"
            f" (+{local['reserve']} for odd priorities)"
        )
    for load in document.get("execservers") or ():
        print(
            f"  execserver {load['instance_id']}: {load['processes']} slots,"
            f" {load['clients']} clients, {load['idle']} idle"
        )
    queue = document["queue"]
    print(
        f"  queue: {queue['ready']} ready, {queue['delayed']} delayed,"
        f" {queue['claimed']} claimed, {queue['failed']} failed"
    )
    for band in queue["bands"]:
        oldest = band.get("oldest_ready_s")
        age = "" if oldest is None else f", oldest ready {_age(oldest)} old"
        print(
            f"    {band['band']} ({band['priority']}): {band['ready']} ready,"
            f" {band['delayed']} delayed, {band['claimed']} claimed,"
            f" {band['failed']} failed{age}"
        )


async def _run(server: str, command: str, args: Mapping[str, Any], token: str | None) -> None:
    base = "/inspect/system/fylr"
    if command == "files":
        params = _filters(args, ("kind", "state", "priority", "class", "older_than"))
        document = await _request(server, "GET", f"{base}/files", params, token)
        _print_page(document["files"], _file_line, document["next_cursor"])
    elif command == "steps":
        names = ("state", "priority", "action", "service", "file", "older_than")
        params = _filters(args, names)
        document = await _request(server, "GET", f"{base}/steps", params, token)
        _print_page(document["steps"], _step_line, document["next_cursor"])
    elif command == "step":
        document = await _request(server, "GET", f"{base}/steps/{args['id']}", (), token)
        _print_step(document)
    elif command == "cancel":
        path = f"{base}/steps/{args['id']}/cancel"
        done = (await _request(server, "POST", path, (), token))["cancelled"]
        held = f", held by {done['claimed_by']}" if done.get("claimed_by") else ""
        was = f"{done['was']}{held}"
        print(f"cancelled step {done['id']} {done['action']} of file {done['file']} ({was})")
    elif command == "retry":
        if args.get("step") is not None:
            path = f"{base}/steps/{args['step']}/retry"
        else:
            path = f"{base}/files/{args['file']}/retry"
        requeued = (await _request(server, "POST", path, (), token))["requeued"]
        for item in requeued:
            print(
                f"requeued step {item['id']} {item['action']} of file {item['file_ref']};"
                f" it had failed: {item['error']}"
            )
        print(f"{len(requeued)} failed step(s) requeued")
    elif command == "delete":
        done = (await _request(server, "DELETE", f"{base}/files/{args['id']}", (), token))[
            "deleted"
        ]
        print(
            f"deleted file {done['file']} with {len(done['versions'])} version(s),"
            f" {len(done['steps'])} queued step(s) and {done['stored_files']} stored file(s)"
        )
    else:
        _print_queues(await _request(server, "GET", "/inspect/system/queues", (), token))


def _filters(args: Mapping[str, Any], names: Sequence[str]) -> list[tuple[str, str]]:
    params: list[tuple[str, str]] = []
    for name in (*names, "limit", "cursor"):
        value = args.get(name)
        if value is None:
            continue
        for each in value if isinstance(value, list) else [value]:
            params.append((name, str(each)))
    return params


def main(server: str, command: str, args: Mapping[str, Any], *, token: str | None = None) -> int:
    """The ``trio-broker work`` command; returns the exit status.

    Args:
        server: the fylr's base URL.
        command: one of :data:`SUBCOMMANDS`.
        args: its arguments (filters by the routes' parameter names, ``id``,
            ``step``, ``file``).
        token: the fylr's operator token, if it has tokens.
    """
    try:
        trio.run(_run, server, command, args, token)
    except _Refused as exc:
        print(f"trio-broker work {command}: {exc}")
        return exc.status
    return 0
