"""A real headless Chromium for page tests, driven by Playwright from a thread of its own.

Debian's ``chromium`` (``/usr/bin/chromium``) is launched by Playwright for
Python with ``executable_path``: no browser is downloaded. Playwright's sync API
runs its own event loop and is bound to the thread that started it, and ours
is trio's, so :func:`open_browser` starts one dedicated thread that owns the
browser; :meth:`Browser.call` hands it a function of the page and waits (in
trio) for the result, exceptions included.

Every request the page makes is recorded (:attr:`Browser.requests`), and any
request that leaves 127.0.0.1 is aborted, so a page that needed an outside
asset fails visibly instead of fetching it.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

import outcome
import pytest
import trio

if TYPE_CHECKING:
    from playwright.sync_api import Page, Route

T = TypeVar("T")

CHROMIUM: Final = "/usr/bin/chromium"
FLAGS: Final = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
LOCAL_PREFIXES: Final = ("http://127.0.0.1:", "ws://127.0.0.1:", "data:", "about:")


class Browser:
    """One page of a headless Chromium (see the module docstring).

    Args:
        http_credentials: the user name and password the browser answers a
            login prompt (``WWW-Authenticate: Basic``) with; ``None``: it has none.
    """

    def __init__(self, http_credentials: tuple[str, str] | None = None) -> None:
        self.http_credentials = http_credentials
        self._requests: queue.Queue[tuple[Callable[[Any], Any], Callable[[Any], None]] | None] = (
            queue.Queue()
        )
        self._token = trio.lowlevel.current_trio_token()
        self.requests: list[str] = []
        self.blocked: list[str] = []
        self.console: list[str] = []
        self.started = threading.Event()
        self.failure: BaseException | None = None

    async def call(self, fn: Callable[[Page], T]) -> T:
        """Run ``fn(page)`` in the browser's thread; its result (or exception) comes back."""
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            box.append(result)
            done.set()

        self._requests.put((fn, lambda result: self._token.run_sync_soon(deliver, result)))
        await done.wait()
        return box[0].unwrap()

    def _route(self, route: Route) -> None:
        url = route.request.url
        self.requests.append(url)
        if url.startswith(LOCAL_PREFIXES):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()

    def run(self, user_data: str) -> None:
        """The browser's thread: launch, then serve :meth:`call` until told to stop."""
        from playwright.sync_api import sync_playwright

        try:
            with sync_playwright() as playwright:
                credentials = self.http_credentials
                context = playwright.chromium.launch_persistent_context(
                    user_data,
                    executable_path=CHROMIUM,
                    headless=True,
                    args=list(FLAGS),
                    viewport={"width": 1080, "height": 720},
                    http_credentials=(
                        {"username": credentials[0], "password": credentials[1]}
                        if credentials is not None
                        else None
                    ),
                )
                try:
                    context.route("**/*", self._route)
                    page = context.new_page()
                    page.on("console", lambda message: self.console.append(message.text))
                    self.started.set()
                    while (request := self._requests.get()) is not None:
                        fn, reply = request
                        reply(outcome.capture(fn, page))
                finally:
                    context.close()
        except BaseException as exc:
            self.failure = exc
            self.started.set()
            raise


@contextlib.asynccontextmanager
async def open_browser(
    *, http_credentials: tuple[str, str] | None = None
) -> AsyncIterator[Browser]:
    """A headless Chromium with a fresh profile, closed when the block ends.

    ``http_credentials`` (user name, password) answer a login prompt.

    Skips the test when Playwright for Python or Debian's chromium is missing
    (``pip install playwright``, ``apt-get install chromium``; never
    ``playwright install``).
    """
    pytest.importorskip("playwright.sync_api", reason="needs Playwright for Python")
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium)")
    browser = Browser(http_credentials)
    with tempfile.TemporaryDirectory(prefix="trio-broker-chromium-") as user_data:
        thread = threading.Thread(target=browser.run, args=(user_data,), daemon=True)
        thread.start()
        await trio.to_thread.run_sync(browser.started.wait)
        if browser.failure is not None:
            raise browser.failure
        try:
            yield browser
        finally:
            browser._requests.put(None)
            await trio.to_thread.run_sync(thread.join)
