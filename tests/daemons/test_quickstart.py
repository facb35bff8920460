"""The quick start of daemons/README.md, as a user runs it: from the repository root.

The example execserver's services name their converter with ``{config_dir}``,
so they work whatever the working directory; the commands run in fresh work
folders, where a path relative to the repository would not exist.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import trio
from PIL import Image

from tests.support.processes import read_fifo
from tests.support.wire import WAIT
from trio_broker.core.client import ClientConfig
from trio_broker.trio.client import open_broker_client

REPOSITORY = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
"""The installed environment's scripts (``trio-broker``, ``python3`` with Pillow)."""


async def chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def test_the_example_execserver_makes_a_thumbnail_run_from_the_repository_root() -> None:
    """`trio-broker execserver --config examples/execserver.yml` from the root makes an image."""
    image = Image.new("RGB", (400, 300), (200, 40, 90))
    original = io.BytesIO()
    image.save(original, "PNG")
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', os.defpath)}",  # an activated venv
        "TRIO_BROKER_LISTEN": "127.0.0.1:0",  # the example's fixed port may be taken
    }
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        os.mkfifo(ready)
        log = os.open(Path(tmp) / "stderr", os.O_WRONLY | os.O_CREAT, 0o600)
        process = await trio.lowlevel.open_process(
            [str(BIN / "trio-broker"), "--log-level", "debug", "execserver",
             "--config", "examples/execserver.yml", "--ready-file", str(ready)],
            cwd=REPOSITORY,
            env=env,
            stderr=log,
        )  # fmt: skip
        try:
            with trio.fail_after(WAIT):
                host, port = (await read_fifo(ready, process)).split()
                config = ClientConfig(
                    backend_id="quickstart",
                    name="quickstart",
                    version="1",
                    addresses=(f"{host}:{port}",),
                )
                async with open_broker_client(config, listen="127.0.0.1") as client:
                    received = bytearray()

                    async def sink(chunk: bytes) -> None:
                        received.extend(chunk)

                    receipt = await client.run(
                        "thumbnail",
                        {"params": {"size": "64x64", "format": "png"}},
                        stdin=client.pipe_in(chunks(original.getvalue())),
                        stdout=client.pipe_out(sink),
                    )
        finally:
            with trio.CancelScope(shield=True):
                process.terminate()
                await process.wait()
                os.close(log)
        lines = (Path(tmp) / "stderr").read_text().splitlines()
    assert receipt.status == "ok", receipt
    thumbnail = Image.open(io.BytesIO(bytes(received)))
    assert (thumbnail.format, thumbnail.size) == ("PNG", (64, 48))
    # one logfmt line for the job; no line names a pipe (a pipe URL is its credential)
    (job,) = [line for line in lines if "ended ok" in line]
    assert "service=thumbnail" in job
    assert "client=quickstart" in job
    assert "status=ok" in job
    assert all("/pipe/" not in line for line in lines), lines
