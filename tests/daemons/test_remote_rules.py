"""The remote sources' pure decisions: the blocklist, ``Retry-After``, the answers, the give-up.

No I/O and no clock: every time is an argument, so an hour's give-up is checked
at its boundary without waiting for it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.fetch import BadRemoteUrl, filename_of, parse_remote_url
from trio_broker_daemons.fylr.remote import (
    DEFAULT_BLOCKED_HOSTS,
    DEFAULT_RETRY_AFTER,
    MAX_RETRY_AFTER,
    Failure,
    HostPolicy,
    RputConfig,
    Temporary,
    give_up,
    judge_failure,
    judge_status,
    retry_after_seconds,
)

DEFAULT = HostPolicy.from_entries(DEFAULT_BLOCKED_HOSTS)
NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


# -- the blocklist ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "entry"),
    [
        ("127.0.0.1", "127.0.0.0/8"),
        ("127.255.255.254", "127.0.0.0/8"),
        ("::1", "::1/128"),
        ("169.254.169.254", "169.254.0.0/16"),  # the cloud metadata address
        ("fe80::1%eth0", "fe80::/10"),
        ("10.1.2.3", "10.0.0.0/8"),
        ("172.16.0.1", "172.16.0.0/12"),
        ("172.31.255.255", "172.16.0.0/12"),
        ("192.168.1.1", "192.168.0.0/16"),
        ("fc00::1", "fc00::/7"),
        ("fd12:3456::1", "fc00::/7"),
        ("0.0.0.0", "0.0.0.0/8"),
        ("0.1.2.3", "0.0.0.0/8"),
        ("::", "::/128"),
        ("224.0.0.1", "224.0.0.0/4"),
        ("239.255.255.250", "224.0.0.0/4"),
        ("ff02::1", "ff00::/8"),
        ("::ffff:127.0.0.1", "127.0.0.0/8"),  # IPv4 written as IPv6 is judged as IPv4
        ("::ffff:169.254.169.254", "169.254.0.0/16"),
    ],
)
def test_the_default_list_blocks(address: str, entry: str) -> None:
    """Loopback, link-local, private, unique-local, 0.0.0.0/8 and multicast, by the entry."""
    line = DEFAULT.refuse_address(address)
    assert line is not None
    assert line.endswith(f"is in rput.blocked_hosts ({entry})")


@pytest.mark.parametrize(
    "address", ["93.184.215.14", "172.32.0.1", "192.169.0.1", "2606:4700::1111", "8.8.8.8"]
)
def test_the_default_list_lets_public_addresses_through(address: str) -> None:
    """Public addresses, also just beside a blocked range, are not refused."""
    assert DEFAULT.refuse_address(address) is None


def test_the_line_names_the_address_and_what_it_was_resolved_from() -> None:
    """A literal address says itself; a resolved one says the name too."""
    assert DEFAULT.refuse_address("127.0.0.2") == "127.0.0.2 is in rput.blocked_hosts (127.0.0.0/8)"
    assert DEFAULT.refuse_address("10.0.0.7", host="intranet.test") == (
        "intranet.test resolves to 10.0.0.7, which is in rput.blocked_hosts (10.0.0.0/8)"
    )
    assert DEFAULT.refuse_address("not-an-address") == "not-an-address is no IP address"


def test_allowed_hosts_open_exactly_their_ranges() -> None:
    """An allowed address is let through; its neighbours stay blocked; so do the other lists."""
    policy = HostPolicy.from_entries(DEFAULT_BLOCKED_HOSTS, ["127.0.0.1", "10.9.0.0/16"])
    assert policy.refuse_address("127.0.0.1") is None
    assert policy.refuse_address("::ffff:127.0.0.1") is None
    assert policy.refuse_address("127.0.0.2") is not None
    assert policy.refuse_address("10.9.200.1") is None
    assert policy.refuse_address("10.10.0.1") is not None
    assert policy.refuse_address("::1") is not None
    with pytest.raises(ValueError, match=r"allowed host 'a\.test' is no CIDR range or address"):
        HostPolicy.from_entries(DEFAULT_BLOCKED_HOSTS, ["a.test"])


def test_blocked_names_match_exactly_or_below_a_wildcard() -> None:
    """Names compare without case and trailing dot; ``*.x`` covers names below ``x`` only."""
    policy = HostPolicy.from_entries(["metadata.google.internal", "*.corp.test"])
    assert policy.refuse_name("Metadata.Google.Internal.") == (
        "the host metadata.google.internal is in rput.blocked_hosts (metadata.google.internal)"
    )
    assert policy.refuse_name("files.corp.test") == (
        "the host files.corp.test is in rput.blocked_hosts (*.corp.test)"
    )
    assert policy.refuse_name("a.b.corp.test") is not None
    assert policy.refuse_name("corp.test") is None
    assert policy.refuse_name("notcorp.test") is None
    assert policy.refuse_name("google.internal") is None
    assert policy.refuse_address("127.0.0.1") is None  # names only: no range was given


def test_the_rput_key_is_checked_naming_the_entry() -> None:
    """Defaults, a list that replaces the default, and each bad value named with its path."""
    assert RputConfig().blocked_hosts == DEFAULT_BLOCKED_HOSTS
    assert (RputConfig().give_up_after, RputConfig().timeout) == (3600.0, 30.0)
    assert RputConfig().reference_steps == "none"
    config = FylrConfig.from_mapping(
        {"execservers": [], "rput": {"blocked_hosts": ["10.0.0.0/8", "*.Corp.Test"]}}
    )
    assert config.rput.blocked_hosts == ("10.0.0.0/8", "*.corp.test")
    assert config.rput.policy().refuse_address("127.0.0.1") is None  # the default was replaced
    bad = {
        "blocked_hosts": ["10.0.0.0/8", "a b"],
        "allowed_hosts": ["intranet.test"],
        "reference_steps": "some",
        "give_up_after": "0s",
        "timeout": "soon",
    }
    messages = {
        "blocked_hosts": "rput.blocked_hosts[1]: expected a CIDR range (10.0.0.0/8), an address"
        " or a host name, got 'a b'",
        "allowed_hosts": "rput.allowed_hosts[0]: expected a CIDR range (10.0.0.0/8) or an"
        " address, got 'intranet.test'",
        "reference_steps": "rput.reference_steps: expected none, metadata or all, got 'some'",
        "give_up_after": "rput.give_up_after: expected a duration greater than 0, got '0s'",
        "timeout": "rput.timeout: ",
    }
    for key, value in bad.items():
        with pytest.raises(ConfigError) as info:
            FylrConfig.from_mapping({"execservers": [], "rput": {key: value}})
        assert str(info.value).startswith(messages[key]), str(info.value)


# -- URLs --------------------------------------------------------------------------------------


def test_urls_are_http_with_a_host_and_no_credentials() -> None:
    """What ``/eas/rput`` takes, and the one line of each refusal."""
    assert parse_remote_url("https://Files.Example.org:8443/a/b.jpg?x=1").host == (
        "files.example.org"
    )
    for text, line in {
        "": "url: required (the remote file's http or https URL)",
        "file:///etc/passwd": "url: expected an http or https URL, got 'file:///etc/passwd'",
        "http://u:p@host/x": "url: credentials in the URL are not accepted",
        "http://host/a\nb": "url: expected no spaces or control characters",
        "http:///x": "url: expected a host",
        "http://[::1/": "url: not a URL: ",
    }.items():
        with pytest.raises(BadRemoteUrl) as info:
            parse_remote_url(text)
        assert str(info.value).startswith(line), text


def test_a_file_is_named_after_the_last_part_of_its_path() -> None:
    """The path's last part without the query, else the host."""
    assert filename_of(parse_remote_url("http://h/a/photo.jpg?size=2")) == "photo.jpg"
    assert filename_of(parse_remote_url("http://h/a/dir/")) == "dir"
    assert filename_of(parse_remote_url("http://files.test/")) == "files.test"


# -- the answers -------------------------------------------------------------------------------


def test_retry_after_in_seconds_or_as_an_http_date() -> None:
    """Seconds, a date ahead or past, cut at ten minutes; unreadable or absent: None."""
    assert retry_after_seconds("2", now=NOW) == 2.0
    assert retry_after_seconds(" 0 ", now=NOW) == 0.0
    assert retry_after_seconds("86400", now=NOW) == MAX_RETRY_AFTER
    assert retry_after_seconds("Fri, 15 Jan 2027 08:00:30 GMT", now=NOW) == 30.0
    assert retry_after_seconds("Fri, 15 Jan 2027 07:00:00 GMT", now=NOW) == 0.0
    assert retry_after_seconds("Sat, 16 Jan 2027 08:00:00 GMT", now=NOW) == MAX_RETRY_AFTER
    for bad in (None, "", "soon", "-5", "1.5", "Fri, 99 Foo 2027"):
        assert retry_after_seconds(bad, now=NOW) is None, bad


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_busy_answers_are_asked_again_after_their_retry_after(status: int) -> None:
    """429, 502, 503, 504: after ``Retry-After``, a minute without one."""
    assert judge_status(status, "Busy", "7", now=NOW, retry_delay=5.0) == Temporary(
        7.0, f"the remote answered {status} Busy"
    )
    assert judge_status(status, "Busy", None, now=NOW, retry_delay=5.0) == Temporary(
        DEFAULT_RETRY_AFTER, f"the remote answered {status} Busy"
    )


def test_other_answers() -> None:
    """2xx goes on; other 5xx are temporary after ``retry_delay``; other 4xx, 3xx and 1xx
    fail for good, naming the status."""
    for ok in (200, 203, 204, 206):
        assert judge_status(ok, "OK", None, now=NOW, retry_delay=5.0) is None
    assert judge_status(500, "Internal Server Error", "9", now=NOW, retry_delay=5.0) == (
        Temporary(5.0, "the remote answered 500 Internal Server Error")
    )
    for status, phrase in ((404, "Not Found"), (403, "Forbidden"), (410, "Gone"), (400, "")):
        assert judge_status(status, phrase, "1", now=NOW, retry_delay=5.0) == Failure(
            f"the remote answered {status} {phrase}".strip()
        )
    assert judge_status(304, "Not Modified", None, now=NOW, retry_delay=5.0) == Failure(
        "the remote answered 304 Not Modified"
    )
    assert judge_failure("it broke", retry_delay=5.0) == Temporary(5.0, "it broke")


def test_the_give_up_is_an_hour_after_the_clock_started() -> None:
    """Before the hour the delay is kept, or cut to end at the hour; at and after it, the
    failure names the hour and the last reason."""
    busy = Temporary(60.0, "the remote answered 503 Service Unavailable")
    start = NOW
    assert give_up(busy, since=start, now=start + 10, give_up_after=3600) == busy
    assert give_up(busy, since=start, now=start + 3590, give_up_after=3600) == Temporary(
        10.0, busy.reason
    )
    for late in (3600, 3601, 86400):
        assert give_up(busy, since=start, now=start + late, give_up_after=3600) == Failure(
            "gave up after 1h: the remote answered 503 Service Unavailable"
        )
    assert give_up(busy, since=start, now=start + 90, give_up_after=90) == Failure(
        "gave up after 90s: the remote answered 503 Service Unavailable"
    )
    assert give_up(busy, since=start, now=start + 1800, give_up_after=1800) == Failure(
        "gave up after 30m: the remote answered 503 Service Unavailable"
    )


def test_the_rules_are_pure() -> None:
    """Importing the rules pulls in no trio, httpx or database driver."""
    code = (
        "import sys; import trio_broker_daemons.fylr.remote;"
        "layers = ('trio', 'httpx', 'httpcore', 'psycopg');"
        "print(sorted(m for m in layers if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
