"""--web-config-file through real TLS handshakes (Python's ssl client against the real
aiohttp server), real bcrypt hashes, and certificate rotation on disk."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import bcrypt
import pytest
import yaml
from cryptography import x509

from exporter.exposition.server import build_app, start_server
from exporter.exposition.web_config import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    WebConfigError,
    load_web_config,
)
from exporter.exposition.web_security import WebSecurity
from tests.clock import Clock
from tests.harness import one_gauge_cache
from tests.test_cli import run
from tests.tls_certs import Authority, Pair, authority

PASSWORD = "s3cret-scrape"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, object]:
    ca = authority(tmp_path, "ca")
    other = authority(tmp_path, "other-ca")
    return {
        "ca": ca,
        "other": other,
        "server": ca.issue(tmp_path, "server", server=True, sans=("127.0.0.1", "localhost")),
        "client": ca.issue(tmp_path, "client", sans=("prometheus.monitoring",)),
        "client_other_san": ca.issue(tmp_path, "client-x", sans=("intruder.example",)),
        "client_other_ca": other.issue(tmp_path, "client-o", sans=("prometheus.monitoring",)),
        "client_expired": ca.issue(
            tmp_path, "client-e", sans=("prometheus.monitoring",), expired=True
        ),
    }


def hashed(password: str) -> str:
    return (
        bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4))
        .decode()
        .replace(
            "$2b$",
            "$2y$",  # htpasswd's prefix, as people's files have it
        )
    )


def write_config(path: Path, body: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump(body), encoding="utf-8")
    return path


@asynccontextmanager
async def serving(
    config: Path, clock: Clock | None = None
) -> AsyncIterator[tuple[int, WebSecurity]]:
    security = WebSecurity(config, clock=clock or Clock())
    runner = await start_server(
        build_app(one_gauge_cache(), "node-a", security=security),
        "127.0.0.1",
        0,
        ssl_context=security.server_context(),
    )
    try:
        yield int(runner.addresses[0][1]), security
    finally:
        await runner.cleanup()


async def look_twice(security: WebSecurity, clock: Clock) -> None:
    """Two looks more than a second apart, each applied: a change is applied once it
    has stayed the same across two looks."""
    for _ in range(2):
        clock.now += 2
        security.refresh()
        await security.settled()


def client_context(ca: Authority, cert: Pair | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca.path))
    if cert is not None:
        context.load_cert_chain(cert.cert, cert.key)
    return context


async def get(
    port: int,
    path: str = "/metrics",
    *,
    context: ssl.SSLContext | None = None,
    auth: tuple[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes, int | None]:
    """One HTTP/1.1 request over a fresh connection: status, headers, body, and the
    serial number of the certificate the server presented (TLS only)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="localhost" if context else None
        ),
        5,
    )
    try:
        serial = None
        if context is not None:
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
            serial = x509.load_der_x509_certificate(der).serial_number
        lines = [f"GET {path} HTTP/1.1", "Host: localhost", "Connection: close"]
        if auth is not None:
            token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            lines.append(f"Authorization: Basic {token}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, body, serial


def tls_config(pki: dict[str, object], **extra: object) -> dict[str, object]:
    server = pki["server"]
    assert isinstance(server, Pair)
    return {
        "tls_server_config": {"cert_file": str(server.cert), "key_file": str(server.key), **extra}
    }


# --- TLS ------------------------------------------------------------------------------


async def test_tls_serves_metrics_to_a_client_that_trusts_the_ca(
    tmp_path: Path, pki: dict[str, object]
) -> None:
    config = write_config(tmp_path / "web.yml", tls_config(pki))
    async with serving(config) as (port, security):
        assert security.tls
        status, _, body, serial = await get(port, context=client_context(pki["ca"]))  # type: ignore[arg-type]
        assert status == 200 and b"gpu_example 1.0" in body
        assert serial == pki["server"].serial  # type: ignore[attr-defined]


async def test_a_client_trusting_another_ca_fails_the_handshake(
    tmp_path: Path, pki: dict[str, object]
) -> None:
    config = write_config(tmp_path / "web.yml", tls_config(pki))
    async with serving(config) as (port, _):
        with pytest.raises(ssl.SSLCertVerificationError):
            await get(port, context=client_context(pki["other"]))  # type: ignore[arg-type]


async def test_plain_http_to_a_tls_listener_gets_no_metrics(
    tmp_path: Path, pki: dict[str, object]
) -> None:
    config = write_config(tmp_path / "web.yml", tls_config(pki))
    async with serving(config) as (port, _):
        with pytest.raises((ValueError, IndexError, ConnectionError)):
            await get(port)


@pytest.mark.parametrize(
    ("client", "ok"),
    [("client", True), (None, False), ("client_other_ca", False), ("client_expired", False)],
)
async def test_required_client_certificates_are_verified(
    tmp_path: Path, pki: dict[str, object], client: str | None, ok: bool
) -> None:
    ca = pki["ca"]
    assert isinstance(ca, Authority)
    config = write_config(
        tmp_path / "web.yml",
        tls_config(pki, client_auth_type="RequireAndVerifyClientCert", client_ca_file=str(ca.path)),
    )
    async with serving(config) as (port, _):
        context = client_context(ca, pki[client] if client else None)  # type: ignore[arg-type]
        if ok:
            assert (await get(port, context=context))[0] == 200
        else:
            # TLS 1.3: the server's alert arrives with the first read after the handshake
            with pytest.raises((ssl.SSLError, ConnectionError, ValueError, IndexError)):
                await get(port, context=context)


async def test_client_allowed_sans_admits_only_the_listed_names(
    tmp_path: Path, pki: dict[str, object]
) -> None:
    ca = pki["ca"]
    assert isinstance(ca, Authority)
    config = write_config(
        tmp_path / "web.yml",
        tls_config(
            pki,
            client_auth_type="RequireAndVerifyClientCert",
            client_ca_file=str(ca.path),
            client_allowed_sans=["prometheus.monitoring"],
        ),
    )
    async with serving(config) as (port, _):
        allowed = client_context(ca, pki["client"])  # type: ignore[arg-type]
        other = client_context(ca, pki["client_other_san"])  # type: ignore[arg-type]
        assert (await get(port, context=allowed))[0] == 200
        assert (await get(port, context=other))[0] == 403


async def test_a_rotated_certificate_is_served_on_the_next_handshake(
    tmp_path: Path, pki: dict[str, object]
) -> None:
    ca, server = pki["ca"], pki["server"]
    assert isinstance(ca, Authority) and isinstance(server, Pair)
    config = write_config(tmp_path / "web.yml", tls_config(pki))
    clock = Clock()
    async with serving(config, clock) as (port, security):
        context = client_context(ca)
        assert (await get(port, context=context))[3] == server.serial
        renewed = ca.issue(tmp_path / "..", "renewed", server=True, sans=("localhost",))
        shutil.copy(renewed.cert, server.cert)  # cert-manager rewrites the Secret's files
        shutil.copy(renewed.key, server.key)
        await look_twice(security, clock)
        assert (await get(port, context=context))[3] == renewed.serial
        assert security.reloads_total == 1


async def test_a_half_written_rotation_keeps_the_last_good_certificate(
    tmp_path: Path, pki: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    ca, server = pki["ca"], pki["server"]
    assert isinstance(ca, Authority) and isinstance(server, Pair)
    config = write_config(tmp_path / "web.yml", tls_config(pki))
    clock = Clock()
    async with serving(config, clock) as (port, security):
        server.key.write_text("-----BEGIN PRIVATE KEY-----\ntrunc", encoding="utf-8")
        await look_twice(security, clock)
        status, _, _, serial = await get(port, context=client_context(ca))
        assert (status, serial) == (200, server.serial)
        assert security.reload_errors_total == 1
        assert "keeping the previous one" in caplog.text


# --- basic auth and headers -------------------------------------------------------------


async def test_basic_auth_wrong_or_missing_password_is_401_and_probes_stay_open(
    tmp_path: Path,
) -> None:
    config = write_config(
        tmp_path / "web.yml",
        {
            "basic_auth_users": {"prometheus": hashed(PASSWORD)},
            "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}},
        },
    )
    async with serving(config) as (port, security):
        assert not security.tls
        status, headers, _, _ = await get(port)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
        assert (await get(port, auth=("prometheus", "wrong")))[0] == 401
        assert (await get(port, auth=("nobody", PASSWORD)))[0] == 401
        status, headers, body, _ = await get(port, auth=("prometheus", PASSWORD))
        assert status == 200 and b"gpu_example" in body
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert (await get(port, "/healthz"))[0] == 200  # kubelet probes carry no password
        assert (await get(port, "/readyz"))[0] == 200
        assert (await get(port, "/"))[0] == 401


async def test_changed_users_apply_without_a_restart(tmp_path: Path) -> None:
    config = write_config(tmp_path / "web.yml", {"basic_auth_users": {"a": hashed(PASSWORD)}})
    clock = Clock()
    async with serving(config, clock) as (port, security):
        assert (await get(port, auth=("a", PASSWORD)))[0] == 200
        write_config(config, {"basic_auth_users": {"b": hashed("new-one")}})
        await look_twice(security, clock)
        assert (await get(port, auth=("a", PASSWORD)))[0] == 401
        assert (await get(port, auth=("b", "new-one")))[0] == 200


# --- the file ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tls_server_config": {"cert_file": "a.crt"}}, "needs cert_file and key_file"),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "TLS14"}},
            "tls_server_config.min_version: 'TLS14' is not one of",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "client_auth_type": "RequireAnyClientCert",
                }
            },
            "cannot be done with Python's ssl",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "client_auth_type": "RequireAndVerifyClientCert",
                }
            },
            "needs a client CA",
        ),
        ({"basic_auth_users": {"u": "plain-text"}}, "basic_auth_users.u: must be a bcrypt hash"),
        ({"rate_limit": {"interval": "1s"}}, "rate_limit: not supported"),
        ({"tls_config": {}}, "tls_config: unknown key"),
        ({"http_server_config": {"headers": {"Server": "x"}}}, "headers.Server: not one of"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_key(
    tmp_path: Path, body: dict[str, object], message: str
) -> None:
    path = write_config(tmp_path / "web.yml", body)
    with pytest.raises(WebConfigError) as raised:
        load_web_config(path)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value) and str(path) in str(raised.value)


def test_relative_file_names_are_relative_to_the_file(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "web.yml", {"tls_server_config": {"cert_file": "s.crt", "key_file": "s.key"}}
    )
    tls = load_web_config(path).tls
    assert tls is not None and tls.cert_file == tmp_path / "s.crt"


def test_the_cli_exits_2_with_one_line_for_a_bad_file(tmp_path: Path) -> None:
    path = write_config(tmp_path / "web.yml", {"basic_auth_users": {"u": "plain"}})
    result = run(
        "--simulate", "single-gpu", "--listen", "127.0.0.1:0", "--web-config-file", str(path)
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--web-config-file" in lines[0] and "basic_auth_users.u" in lines[0]


def test_a_hostile_file_is_one_line_and_read_no_further_than_the_ceiling(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yml"
    os.mkfifo(fifo)  # nobody writes: opening it must not block
    cases = {
        tmp_path / "binary.yml": (b"\xff\xfe" + bytes(range(256)), "not UTF-8 text (byte 0)"),
        tmp_path / "deep.yml": (
            "".join("  " * n + f"k{n}:\n" for n in range(MAX_DEPTH + 2)).encode(),
            f"nested deeper than {MAX_DEPTH} levels",
        ),
        tmp_path / "big.yml": (b"#" * (MAX_FILE_BYTES + 1), "larger than 1 MiB"),
        tmp_path / "half.yml": (b"basic_auth_users: {u: '$2y", "not valid YAML: found unexpected"),
    }
    for path, (body, _) in cases.items():
        path.write_bytes(body)
    for path, message in [*((p, m) for p, (_, m) in cases.items()), (fifo, "not a regular file")]:
        with pytest.raises(WebConfigError) as raised:
            load_web_config(path)
        assert message in str(raised.value) and str(path) in str(raised.value)
        assert "\n" not in str(raised.value)
