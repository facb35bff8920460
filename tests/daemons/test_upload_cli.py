"""``trio-broker fylr`` and ``trio-broker upload`` as real processes, end to end.

The execserver, the fylr and the upload command all run as subprocesses of the
installed command line, against the test session's PostgreSQL.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml
from PIL import Image
from trio_broker_daemons.commands.upload import (
    RETRY_AFTER_MAX,
    PositionFollowers,
    UploadError,
    parse_priority,
    retry_delay,
    server_url,
    upload,
)

from tests.support.processes import open_execserver_process, open_fylr_process

REPOSITORY = Path(__file__).resolve().parents[2]
CONVERTER = REPOSITORY / "examples" / "convert_image.py"
WAIT = 180.0
LINE = re.compile(r"^(?P<name>\S+): id (?P<id>\d+) (?P<status>\w+)(?: \((?P<versions>.*)\))?$")

EXECSERVER = {
    "listen": "127.0.0.1:0",
    "name": "cli-exec",
    "slots": 2,
    "fast_reserve": 0,
    "unknown_share": 1.0,
    "services": {
        "mime": {"argv": ["file", "--mime-type", "--brief", "-"]},
        "sha256": {"argv": ["sha256sum"]},
        "gzip": {"argv": ["gzip", "-c", "-n", "-{level}"]},
        "thumbnail": {
            "argv": [sys.executable, str(CONVERTER), "thumbnail", "--size", "{size}",
                     "--format", "png"],
        },
    },
}  # fmt: skip

CLASSES = {
    "text": {
        "extensions": ["txt"],
        "metadata": {"service": "mime"},
        "versions": {
            "gz": {"service": "gzip", "params": {"level": 6}, "mimetype": "application/gzip"},
            "sha256": {"service": "sha256"},
        },
    },
    "image": {
        "extensions": ["png"],
        "versions": {
            "thumbnail": {"service": "thumbnail", "params": {"size": "32x32"}},
            "sha256": {"service": "sha256"},
        },
    },
    "data": {"extensions": ["bin"], "metadata": {"service": "mime"}},
}
EXPECTED_VERSIONS = {
    "txt": {"gz", "sha256"},
    "png": {"sha256", "thumbnail"},
    "bin": set(),
    "xyz": set(),
}


def trio_broker(*args: str) -> list[str]:
    return [sys.executable, "-m", "trio_broker_daemons", *args]


def fylr_config(dsn: str, state_dir: Path, execserver: str) -> str:
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "name": "cli-fylr",
            "state_dir": str(state_dir),
            "database": dsn,
            "database_pool": 6,
            "execservers": [execserver],
            "heartbeat_interval": "0.5s",
            "stale_after": "2s",
            "classes": CLASSES,
        }
    )


def png(seed: int) -> bytes:
    image = Image.new("RGB", (64 + seed, 48), (seed * 5 % 256, 120, 200))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def make_files(folder: Path) -> dict[str, bytes]:
    """50 files of four kinds: text, images, data, and a class nobody configured."""
    folder.mkdir()
    files: dict[str, bytes] = {}
    for n in range(20):
        files[f"text-{n:02d}.txt"] = b"".join(b"%d: row %d\n" % (n, i) for i in range(300 + n))
    for n in range(10):
        files[f"image-{n:02d}.png"] = png(n)
    for n in range(12):
        files[f"data-{n:02d}.bin"] = hashlib.sha256(b"%d" % n).digest() * (50 + n)
    for n in range(8):
        files[f"other-{n:02d}.xyz"] = b"unclassified %d\n" % n
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def parse(stdout: str) -> dict[str, tuple[int, str, dict[str, str]]]:
    """The upload command's lines: name → (id, status, version → status)."""
    found = {}
    for line in stdout.splitlines():
        match = LINE.match(line)
        assert match is not None, line
        versions: dict[str, str] = {}
        if match["versions"]:
            for item in match["versions"].split(", "):
                name, _, status = item.partition(" ")
                versions[name] = status
        found[match["name"]] = (int(match["id"]), match["status"], versions)
    return found


async def upload_cli(
    server: str, paths: Sequence[Path], *args: str
) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(WAIT):
        return await trio.run_process(
            trio_broker("upload", *map(str, paths), "--server", server, *args),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


async def test_fifty_uploads_of_mixed_classes_end_done_with_their_versions(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Two upload commands at two priorities send 50 files; each ends done with its versions."""
    files = make_files(tmp_path / "in")
    paths = sorted(tmp_path / "in" / name for name in files)
    async with open_execserver_process(yaml.safe_dump(EXECSERVER)) as execserver:
        config = fylr_config(pg_dsn, tmp_path / "state", f"{execserver.host}:{execserver.port}")
        async with open_fylr_process(config) as fylr:
            results: list[subprocess.CompletedProcess[bytes]] = []

            async def run(batch: Sequence[Path], priority: str) -> None:
                results.append(
                    await upload_cli(fylr.http_url, batch, "--priority", priority, "--wait")
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, paths[0::2], "0")
                nursery.start_soon(run, paths[1::2], "2")
            outcomes: dict[str, tuple[int, str, dict[str, str]]] = {}
            for result in results:
                assert result.returncode == 0, result.stderr.decode()
                outcomes.update(parse(result.stdout.decode()))
            assert sorted(outcomes) == sorted(files)
            for name, (_, status, versions) in outcomes.items():
                assert status == "done", name
                expected = EXPECTED_VERSIONS[name.rsplit(".", 1)[1]]
                assert versions == dict.fromkeys(expected, "done"), name
            async with httpx.AsyncClient(base_url=fylr.http_url, timeout=60) as http:
                await check_contents(http, files, outcomes)
                page = (await http.get("/inspect/system/fylr")).json()
    assert page["files"]["original"] == {"done": 50}
    assert page["files"]["version"] == {"done": 60}
    # nothing failed or left to do (the last outcomes may still be being written)
    assert page["queue"]["failed"] == page["queue"]["ready"] == page["queue"]["delayed"] == 0


async def check_contents(
    http: httpx.AsyncClient,
    files: Mapping[str, bytes],
    outcomes: Mapping[str, tuple[int, str, Mapping[str, str]]],
) -> None:
    """Spot checks: every version's bytes are what its command makes of the upload."""
    for name in ("text-00.txt", "text-19.txt", "image-03.png", "data-05.bin"):
        file_id = outcomes[name][0]
        document: dict[str, Any] = (await http.get(f"/api/v1/eas/{file_id}")).json()
        original = (await http.get(f"/api/v1/eas/download/{file_id}/original")).content
        assert original == files[name]
        if name.endswith(".txt"):
            assert document["metadata"] == {"mimetype": "text/plain"}
            gz = (await http.get(f"/api/v1/eas/download/{file_id}/gz")).content
            assert gzip.decompress(gz) == files[name]
        if name.endswith(".png"):
            thumbnail = (await http.get(f"/api/v1/eas/download/{file_id}/thumbnail")).content
            image = Image.open(io.BytesIO(thumbnail))
            assert image.format == "PNG"
            assert max(image.size) <= 32
        if name.endswith(".bin"):
            assert document["metadata"] == {"mimetype": "application/octet-stream"}
        if "sha256" in document["versions"]:
            line = (await http.get(f"/api/v1/eas/download/{file_id}/sha256")).content
            assert line == hashlib.sha256(files[name]).hexdigest().encode() + b"  -\n"


async def test_upload_without_wait_prints_each_id_and_url(pg_dsn: str, tmp_path: Path) -> None:
    """Without --wait the command prints one line per file with its id and exits 0."""
    (tmp_path / "a.bin").write_bytes(b"a")
    (tmp_path / "b.xyz").write_bytes(b"b")
    config = yaml.safe_dump(
        {"listen": "127.0.0.1:0", "state_dir": str(tmp_path / "state"), "database": pg_dsn,
         "database_pool": 2, "execservers": [], "classes": {}}
    )  # fmt: skip
    async with open_fylr_process(config) as fylr:
        result = await upload_cli(fylr.http_url, [tmp_path / "a.bin", tmp_path / "b.xyz"])
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stdout.decode().splitlines()
    assert len(lines) == 2
    for line, name in zip(lines, ("a.bin", "b.xyz"), strict=True):
        assert re.fullmatch(
            rf"{re.escape(name)}: id \d+ (processing|sync)"
            rf" {re.escape(fylr.http_url)}/api/v1/eas/\d+",
            line,
        ), line


async def test_upload_to_an_unreachable_server_exits_1(tmp_path: Path) -> None:
    """A fylr that cannot be reached makes the command say so for each file and exit 1."""
    (tmp_path / "a.txt").write_bytes(b"a")
    listener = trio.socket.socket()
    with listener:  # a port nobody listens on: bound, never listening
        await listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        result = await upload_cli(f"http://127.0.0.1:{port}", [tmp_path / "a.txt"], "--wait")
    assert result.returncode == 1
    assert result.stdout.decode().startswith("a.txt: not uploaded: cannot reach")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("execservers: [\n", "line"),
        ("execservers: []\nlisten: nowhere\n", "listen:"),
        ("execservers: []\nheartbeat_interval: 10s\nstale_after: 15s\n", "stale_after:"),
        (
            "execservers: []\nclasses: {a: {extensions: [x], versions: {v: {service: s,"
            " source: w}}}}\n",
            "classes.a.versions.v.source:",
        ),
    ],
    ids=["yaml", "listen", "stale-after", "source"],
)
def test_bad_fylr_config_exits_2_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    """A bad configuration prints one line naming the key path and exits 2."""
    config = tmp_path / "fylr.yml"
    config.write_text(text)
    result = subprocess.run(
        trio_broker("fylr", "--config", str(config)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("trio-broker fylr: ")
    assert key in lines[0]


# -- failures, timeouts and the command line's values ------------------------------------

FAILING_EXECSERVER = {
    "listen": "127.0.0.1:0",
    "slots": 2,
    "fast_reserve": 0,
    "unknown_share": 1.0,
    "services": {
        "broken": {"argv": ["sh", "-c", "cat >/dev/null; echo 'convert: bad input' >&2; exit 3"]},
        "sha256": {"argv": ["sha256sum"]},
    },
}


async def test_wait_prints_each_failed_versions_reason_and_exits_1(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A version whose command fails: its reason on its own line, exit 1, the rest done."""
    (tmp_path / "a.txt").write_bytes(b"some text\n")
    classes = {
        "text": {
            "extensions": ["txt"],
            "versions": {"bad": {"service": "broken"}, "sum": {"service": "sha256"}},
        }
    }
    async with open_execserver_process(yaml.safe_dump(FAILING_EXECSERVER)) as execserver:
        config = yaml.safe_load(
            fylr_config(pg_dsn, tmp_path / "state", f"{execserver.host}:{execserver.port}")
        )
        config["classes"] = classes
        async with open_fylr_process(yaml.safe_dump(config)) as fylr:
            server = f"{fylr.host}:{fylr.port}"  # no scheme: http is assumed
            result = await upload_cli(
                server, [tmp_path / "a.txt"], "--wait", "--priority", "interactive+1"
            )
            async with httpx.AsyncClient(base_url=fylr.http_url, timeout=60) as http:
                file_id = int(result.stdout.decode().split()[2])
                document = (await http.get(f"/api/v1/eas/{file_id}")).json()
    assert result.returncode == 1, result.stderr.decode()
    first, reason = result.stdout.decode().splitlines()
    assert re.fullmatch(r"a\.txt: id \d+ done \(bad failed, sum done\)", first), first
    assert reason.startswith("  bad failed: ")
    assert "convert: bad input" in reason
    assert document["priority"] == 3


async def test_wait_gives_up_after_the_timeout(pg_dsn: str, tmp_path: Path) -> None:
    """--timeout: a file that cannot end (no execserver) is reported as not ended, exit 1."""
    (tmp_path / "a.txt").write_bytes(b"text\n")
    config = yaml.safe_load(fylr_config(pg_dsn, tmp_path / "state", "127.0.0.1:9"))
    config["execservers"] = []
    config["classes"] = {"text": {"extensions": ["txt"], "versions": {"v": {"service": "s"}}}}
    async with open_fylr_process(yaml.safe_dump(config)) as fylr:
        result = await upload_cli(fylr.http_url, [tmp_path / "a.txt"], "--wait", "--timeout", "1.5")
    assert result.returncode == 1
    (line,) = result.stdout.decode().splitlines()
    assert re.fullmatch(r"a\.txt: id \d+ \w+( \(.*\))?: not ended within 1\.5s", line), line


def test_upload_without_a_server_says_how_to_give_one(tmp_path: Path) -> None:
    """No --server and no TRIO_BROKER_SERVER: one line naming both, exit 2."""
    env = {key: value for key, value in os.environ.items() if key != "TRIO_BROKER_SERVER"}
    result = subprocess.run(
        trio_broker("upload", str(tmp_path / "a.txt")),
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "trio-broker upload: give --server HOST:PORT or set TRIO_BROKER_SERVER"
    ]


def test_upload_takes_its_server_from_the_environment(tmp_path: Path) -> None:
    """TRIO_BROKER_SERVER is --server's default (here a port nobody serves: exit 1)."""
    (tmp_path / "a.txt").write_bytes(b"a")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        env = {**os.environ, "TRIO_BROKER_SERVER": f"127.0.0.1:{port}"}
        result = subprocess.run(
            trio_broker("upload", str(tmp_path / "a.txt")),
            capture_output=True, text=True, timeout=60, check=False, env=env,
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stdout.startswith(f"a.txt: not uploaded: cannot reach http://127.0.0.1:{port}")


@pytest.mark.parametrize(
    ("text", "priority"),
    [
        ("background", -2),
        ("normal", 0),
        ("Interactive", 2),
        ("synchronous", 4),
        ("interactive+1", 3),
        ("high-background", -1),
        ("-2", -2),
        ("7", 7),
    ],
)
def test_priority_names_and_numbers(text: str, priority: int) -> None:
    """Band names, their high variants (NAME+1, high-NAME) and integers."""
    assert parse_priority(text) == priority


def test_a_bad_priority_is_refused_naming_the_bands() -> None:
    """Anything else is a ValueError that lists what is accepted (argparse: exit 2)."""
    with pytest.raises(ValueError, match=r"expected a band \(background, normal, interactive"):
        parse_priority("urgent")
    result = subprocess.run(
        trio_broker("upload", "x", "--server", "h:1", "--priority", "urgent"),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "argument --priority: expected a band" in result.stderr


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("127.0.0.1:7400", "http://127.0.0.1:7400"),
        ("fylr:7400", "http://fylr:7400"),
        ("[::1]:7400", "http://[::1]:7400"),
        ("https://fylr.example:8443/", "https://fylr.example:8443"),
        ("http://fylr", "http://fylr"),
    ],
)
def test_server_url_takes_host_port_with_or_without_a_scheme(text: str, url: str) -> None:
    """host:port assumes http; a URL keeps its scheme; a trailing slash is dropped."""
    assert server_url(text) == url


@pytest.mark.parametrize("text", ["fylr", "ftp://fylr:21", "fylr:99999", "http://fylr:1/api", ""])
def test_server_url_refuses_what_is_no_server(text: str) -> None:
    """No port without a scheme, another scheme, a bad port, a path: ValueError."""
    with pytest.raises(ValueError, match="expected"):
        server_url(text)


def test_retry_delay_honours_retry_after_else_backs_off() -> None:
    """A 503's Retry-After is waited for (capped); without it the wait doubles, capped."""
    assert retry_delay(0, "2") == 2.0
    assert retry_delay(5, " 7 ") == 7.0
    assert retry_delay(0, "3600") == RETRY_AFTER_MAX
    assert [retry_delay(n, None) for n in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert retry_delay(0, "Wed, 21 Oct 2015 07:28:00 GMT") == 0.5  # a date: backs off
    assert retry_delay(20, None) == RETRY_AFTER_MAX


async def test_upload_retries_503_a_bounded_number_of_times(tmp_path: Path) -> None:
    """Against a server that always answers 503 with Retry-After: 0, the upload is sent
    1 + ``retries`` times, then fails naming the answer."""
    source = tmp_path / "a.txt"
    source.write_bytes(b"text\n")
    seen: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.read())
        return httpx.Response(503, json={"error": "the database is unavailable"},
                              headers={"retry-after": "0"})  # fmt: skip

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        with pytest.raises(UploadError, match="503: the database is unavailable"):
            await upload(http, "http://fylr.test", source, retries=3)
    assert seen == [b"text\n"] * 4  # the whole body each time


def test_at_most_a_few_files_are_followed_at_the_pace_of_their_position() -> None:
    """The first files whose steps wait hold the places; a place frees when its steps run."""
    positions = PositionFollowers(2)
    assert [positions.wants(n, waiting=True) for n in (1, 2, 3)] == [True, True, False]
    assert positions.wants(1, waiting=True)  # kept while it waits
    assert not positions.wants(1, waiting=False)  # its step runs: the place is free
    assert positions.wants(3, waiting=True)
    positions.ended(2)
    assert positions.wants(4, waiting=True)
    assert not PositionFollowers(0).wants(1, waiting=True)  # nothing shown: never


async def test_the_client_commands_take_the_fylrs_token(pg_dsn: str, tmp_path: Path) -> None:
    """Against a fylr with tokens: upload, position and top --once without a token exit 1
    saying which token to give and how; with it (--token-file, $TRIO_BROKER_FYLR_TOKEN,
    --token) they work; an unreadable token file is a usage error (exit 2)."""
    tokens = {"upload": "cli-upload-token", "read": "cli-read-token", "operator": "cli-op-token"}
    for role, token in tokens.items():
        (tmp_path / f"{role}.token").write_text(token + "\n")
    (tmp_path / "a.txt").write_bytes(b"a text\n")
    config = yaml.safe_dump(
        {"listen": "127.0.0.1:0", "state_dir": str(tmp_path / "state"), "database": pg_dsn,
         "database_pool": 2, "execservers": [], "classes": {}, "tokens": tokens}
    )  # fmt: skip

    async def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        with trio.fail_after(WAIT):
            result = await trio.run_process(
                trio_broker(*args),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env={**os.environ, **(env or {})},
            )
        return result.returncode, result.stdout.decode(), result.stderr.decode()

    async with open_fylr_process(config) as fylr:
        server = fylr.http_url
        status, out, _ = await cli("upload", str(tmp_path / "a.txt"), "--server", server)
        assert status == 1
        assert out.startswith(
            "a.txt: not uploaded: the fylr answered 401: a token is required: the upload token"
            " (give the fylr's token: --token-file FILE or $TRIO_BROKER_FYLR_TOKEN;"
            " this command needs the upload token)"
        ), out
        status, out, _ = await cli(
            "upload", str(tmp_path / "a.txt"), "--server", server, "--wait",
            "--token-file", str(tmp_path / "upload.token"),
        )  # fmt: skip
        assert status == 0, out
        file_id = parse(out)["a.txt"][0]
        status, out, _ = await cli("position", str(file_id), "--server", server)
        assert (status, out.splitlines()[0]) == (
            1,
            f"file {file_id}: the fylr answered 401: a token is required: the read token"
            " (give the fylr's token: --token-file FILE or $TRIO_BROKER_FYLR_TOKEN;"
            " this command needs the read token)",
        )
        status, out, _ = await cli(
            "position", str(file_id), "--server", server,
            env={"TRIO_BROKER_FYLR_TOKEN": tokens["read"]},
        )  # fmt: skip
        assert (status, out) == (0, f"a.txt #{file_id}: done, nothing waits\n")
        status, out, _ = await cli("top", "--once", "--server", server, "--token", tokens["read"])
        assert (status, out) == (
            1,
            f"trio-broker top: {server}: the fylr answered 403: this token may read, not"
            " operator: use the operator token (this command needs the operator token)\n",
        )
        status, out, _ = await cli(
            "top", "--once", "--server", server,
            "--token-file", str(tmp_path / "operator.token"),
        )  # fmt: skip
        assert status == 0, out
        assert "1 fylr, 0 balancer, 0 execserver" in out
        status, _, err = await cli(
            "top", "--once", "--server", server, "--token-file", str(tmp_path / "missing")
        )
        assert status == 2
        assert err.startswith("trio-broker top: --token-file: cannot read")
