"""An adversarial review's web-config findings, each through the real code path: a header value
with a control character, an integer over Python's 4,300-digit limit, a file caught
half-written that parses, users of different bcrypt costs, certificate files that are
FIFOs or huge, and a reload whose parsing takes seconds."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

import bcrypt
import pytest
from aiohttp import web

from exporter.exposition.server import build_app, start_server
from exporter.exposition.web_config import WebConfigError, load_web_config, ssl_context
from exporter.exposition.web_security import WebSecurity
from tests.clock import Clock
from tests.harness import one_gauge_cache
from tests.test_cli import run
from tests.test_web_security import get, look_twice
from tests.tls_certs import authority

PASSWORD = "s3cret-scrape"
LOGGER = "exporter.exposition.web_security"


def hashed(password: str, cost: int = 4) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=cost)).decode()


def users_yaml(**users: str) -> str:
    return "basic_auth_users:\n" + "".join(f"  {u}: '{h}'\n" for u, h in users.items())


async def serve(security: WebSecurity) -> tuple[int, web.AppRunner]:
    runner = await start_server(
        build_app(one_gauge_cache(), "node-a", security=security), "127.0.0.1", 0
    )
    return int(runner.addresses[0][1]), runner


# --- header values ----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["DENY\x01", "DENY\x7f", "a\x00b", "DENY\u2028", "DENY\x1b[0m"])
def test_a_header_value_with_a_control_character_is_refused_at_load(
    tmp_path: Path, value: str
) -> None:
    """aiohttp refuses to write such a header (RFC 9110 5.5), so once accepted it failed
    every answer, /healthz too."""
    path = tmp_path / "web.yml"
    path.write_text(
        'http_server_config:\n  headers:\n    X-Frame-Options: "'
        + value.encode("unicode_escape").decode()
        + '"\n',
        encoding="utf-8",
    )
    with pytest.raises(WebConfigError) as raised:
        load_web_config(path)
    message = str(raised.value)
    assert "http_server_config.headers.X-Frame-Options" in message and "\n" not in message


def test_a_header_value_of_visible_ascii_spaces_and_tabs_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text(
        "http_server_config:\n  headers:\n"
        "    Content-Security-Policy: \"default-src 'self';\\tframe-ancestors 'none'\"\n",
        encoding="utf-8",
    )
    headers = load_web_config(path).headers
    assert headers["Content-Security-Policy"] == "default-src 'self';\tframe-ancestors 'none'"


def test_the_cli_exits_2_with_one_line_for_a_control_character_in_a_header(
    tmp_path: Path,
) -> None:
    path = tmp_path / "web.yml"
    path.write_text('http_server_config:\n  headers:\n    X-Frame-Options: "DENY\\x01"\n')
    result = run(
        "--simulate", "single-gpu", "--listen", "127.0.0.1:0", "--web-config-file", str(path)
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "X-Frame-Options" in lines[0] and "control characters" in lines[0]


async def test_a_reload_to_a_header_with_a_control_character_keeps_the_last_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "web.yml"
    good = "http_server_config:\n  headers:\n    X-Frame-Options: DENY\n"
    path.write_text(good)
    clock = Clock()
    security = WebSecurity(path, clock=clock)
    port, runner = await serve(security)
    try:
        path.write_text(good.replace("DENY", '"DENY\\x01"'))
        await look_twice(security, clock)
        status, headers, _, _ = await get(port, "/healthz")
        assert (status, headers["X-Frame-Options"]) == (200, "DENY")
        assert (await get(port, "/metrics"))[0] == 200
        assert security.reload_errors_total == 1
        assert "keeping the previous one" in caplog.text and "control characters" in caplog.text
    finally:
        await runner.cleanup()


# --- values Python cannot build -----------------------------------------------------------


def test_an_integer_over_4300_digits_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text("basic_auth_users:\n  u: " + "9" * 5000 + "\n")
    with pytest.raises(WebConfigError) as raised:
        load_web_config(path)
    message = str(raised.value)
    assert str(path) in message and "4300 digits" in message and "\n" not in message
    result = run(
        "--simulate", "single-gpu", "--listen", "127.0.0.1:0", "--web-config-file", str(path)
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr


# --- half-written files and dropped protections -------------------------------------------


async def test_a_half_written_file_that_parses_is_not_applied_until_it_is_stable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer that truncates and rewrites the file: its first half (headers, no users
    yet) parses. It used to be applied at the next look, leaving /metrics open."""
    path = tmp_path / "web.yml"
    users = users_yaml(prom=hashed(PASSWORD))
    headers = "http_server_config:\n  headers:\n    X-Frame-Options: DENY\n"
    path.write_text(users)
    clock = Clock()
    security = WebSecurity(path, clock=clock)
    port, runner = await serve(security)
    try:
        assert (await get(port))[0] == 401
        path.write_text(headers)  # caught half-written
        clock.now += 2
        assert (await get(port))[0] == 401  # the look that sees it first
        await security.settled()
        assert (await get(port))[0] == 401
        with open(path, "a") as f:  # the writer finishes before the next look
            f.write(users)
        await look_twice(security, clock)
        status, response_headers, _, _ = await get(port, auth=("prom", PASSWORD))
        assert (status, response_headers.get("X-Frame-Options")) == (200, "DENY")
        assert (await get(port))[0] == 401
        assert security.reloads_total == 1
        assert "WITHOUT" not in caplog.text
    finally:
        await runner.cleanup()


async def test_a_reload_that_drops_basic_auth_says_so_at_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "web.yml"
    path.write_text(users_yaml(prom=hashed(PASSWORD)))
    clock = Clock()
    security = WebSecurity(path, clock=clock)
    port, runner = await serve(security)
    try:
        path.write_text("http_server_config:\n  headers:\n    X-Frame-Options: DENY\n")
        await look_twice(security, clock)
        assert (await get(port))[0] == 200  # meant or not, the file is applied
        dropped = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER]
        assert len(dropped) == 1 and "WITHOUT basic_auth_users" in dropped[0].getMessage()
    finally:
        await runner.cleanup()


# --- bcrypt costs and timing ---------------------------------------------------------------


def test_users_of_different_costs_are_warned_of_at_load_and_reload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An unknown user is checked at the highest cost, so a wrong password for a cheaper
    user answers faster: timing tells that user exists. Said at load, not hidden."""
    path = tmp_path / "web.yml"
    path.write_text(users_yaml(cheap=hashed(PASSWORD, 4), dear=hashed(PASSWORD, 6)))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        WebSecurity(path).close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "costs differ" in warnings[0], warnings
    assert "cheap (4)" in warnings[0] and "dear" not in warnings[0]
    caplog.clear()
    path.write_text(users_yaml(a=hashed(PASSWORD, 4), b=hashed(PASSWORD, 4)))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        WebSecurity(path).close()
    assert "costs differ" not in caplog.text


# --- files the web config names ----------------------------------------------------------


def in_thread(work: object, timeout_s: float = 5.0) -> BaseException | None:
    """Run ``work()`` on a daemon thread; what it raised, or AssertionError if it did
    not return within ``timeout_s`` (a blocked open on a FIFO never does)."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            work()  # type: ignore[operator]
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert outcome, f"still running after {timeout_s} s"
    return outcome[0]


@pytest.mark.parametrize("which", ["cert_file", "key_file", "client_ca_file"])
def test_a_named_file_that_is_a_fifo_is_refused_without_blocking(
    tmp_path: Path, which: str
) -> None:
    ca = authority(tmp_path, "ca")
    server = ca.issue(tmp_path, "server", server=True, sans=("localhost",))
    names = {"cert_file": server.cert, "key_file": server.key, "client_ca_file": ca.path}
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)  # nobody writes: ssl's own open would wait for ever
    names[which] = fifo
    path = tmp_path / "web.yml"
    path.write_text(
        "tls_server_config:\n"
        + "".join(f"  {k}: {v}\n" for k, v in names.items())
        + "  client_auth_type: RequireAndVerifyClientCert\n"
    )
    tls = load_web_config(path).tls
    assert tls is not None
    raised = in_thread(lambda: ssl_context(tls))
    assert isinstance(raised, WebConfigError), raised
    assert "not a regular file" in str(raised) and str(fifo) in str(raised)


def test_a_named_file_over_the_ceiling_is_refused_unread(tmp_path: Path) -> None:
    ca = authority(tmp_path, "ca")
    server = ca.issue(tmp_path, "server", server=True, sans=("localhost",))
    huge = tmp_path / "huge.pem"
    huge.write_bytes(server.cert.read_bytes() * (2 * 1024 * 1024 // len(server.cert.read_bytes())))
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {huge}\n  key_file: {server.key}\n")
    tls = load_web_config(path).tls
    assert tls is not None
    with pytest.raises(WebConfigError) as raised:
        ssl_context(tls)
    assert "larger than 1 MiB" in str(raised.value) and str(huge) in str(raised.value)


@pytest.mark.slow  # a reload made slow on purpose
async def test_a_slow_reload_is_parsed_off_the_event_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An adversarial review's many_keys.yml: 1 MiB of 100,000 keys takes seconds to parse. The
    request that starts the look is answered at once, not after the parse."""
    path = tmp_path / "web.yml"
    path.write_text("http_server_config:\n  headers:\n    X-Frame-Options: DENY\n")
    clock = Clock()
    security = WebSecurity(path, clock=clock)
    port, runner = await serve(security)
    try:
        path.write_text("".join(f"k{n}: 1\n" for n in range(100_000)))  # 966 KiB
        clock.now += 2
        await get(port, "/healthz")  # first look: the change is seen, not yet applied
        await security.settled()
        clock.now += 2
        began = time.perf_counter()
        status, headers, _, _ = await get(port, "/healthz")  # starts the parse
        answered_s = time.perf_counter() - began
        await security.settled()
        parsed_s = time.perf_counter() - began
        assert (status, headers["X-Frame-Options"]) == (200, "DENY")
        assert "keeping the previous one" in caplog.text and "k0: unknown key" in caplog.text
        assert answered_s < 0.5, f"answered in {answered_s:.2f} s; the parse took {parsed_s:.2f}"
        print(f"answered in {answered_s:.3f} s while the look took {parsed_s:.2f} s")
    finally:
        await runner.cleanup()


async def test_settled_returns_at_once_when_nothing_is_looked_at(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text("basic_auth_users: {}\n")
    security = WebSecurity(path, clock=Clock())
    await asyncio.wait_for(security.settled(), 1)


def test_a_file_nested_too_deep_keeps_its_own_message(tmp_path: Path) -> None:
    """WebConfigError is a ValueError: the catch for values Python cannot build must not
    wrap it again."""
    path = tmp_path / "web.yml"
    path.write_text("x: " + "[" * 17 + "]" * 17 + "\n")
    with pytest.raises(WebConfigError) as raised:
        load_web_config(path)
    assert str(raised.value).startswith(f"{path}: line 1: nested deeper than 16 levels")
