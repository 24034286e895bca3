"""``--web-config-file``: TLS, client certificates, basic auth and response headers, in
the Prometheus exporter-toolkit's file format, so the files node_exporter users already
have work here (https://github.com/prometheus/exporter-toolkit/blob/master/docs/
web-configuration.md).

This module only reads and checks the file: ``load_web_config`` turns it into a frozen
``WebConfig`` or raises ``WebConfigError`` with one line naming the key, and
``ssl_context`` builds the server's ``ssl.SSLContext``. Serving it (re-reading on
change, the auth middleware) is ``exposition/web_security.py``.

What Python's ``ssl`` cannot do is refused with a reason rather than silently dropped:
``client_auth_type`` RequestClientCert and RequireAnyClientCert (a client certificate
that is not verified), ``curve_preferences`` and ``rate_limit``. ``http2`` is accepted
and has no effect (the server speaks HTTP/1.1, which Prometheus uses anyway).

The file comes from outside, so reading it is bounded: a regular file of at most
``MAX_FILE_BYTES``, UTF-8, nested at most ``MAX_DEPTH`` levels, bcrypt costs at most
``BCRYPT_MAX_COST``, header values of visible ASCII, spaces and tabs only. So are the
certificate, key and CA files it names: regular files of at most ``MAX_TLS_FILE_BYTES``,
read here (never opened by ``ssl`` itself, which would block on a FIFO). Anything else
is one ``WebConfigError`` line, never a traceback: at start the exporter exits 2, at a
reload it keeps the last good settings.
"""

from __future__ import annotations

import os
import re
import ssl
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import yaml

# Go's crypto/tls constant names -> OpenSSL's names, TLS 1.2 and below.
# (https://pkg.go.dev/crypto/tls#pkg-constants; OpenSSL's ciphers(1) name table.)
CIPHER_SUITES: dict[str, str] = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
}
# TLS 1.3 suites are not configurable (in Go either): listed names are accepted, unused.
TLS13_SUITES = frozenset(
    {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}
)
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# client_auth_type -> (verify_mode, needs client CA); None: cannot be done with ssl
CLIENT_AUTH: dict[str, tuple[ssl.VerifyMode, bool] | None] = {
    "NoClientCert": (ssl.CERT_NONE, False),
    "VerifyClientCertIfGiven": (ssl.CERT_OPTIONAL, True),
    "RequireAndVerifyClientCert": (ssl.CERT_REQUIRED, True),
    "RequestClientCert": None,
    "RequireAnyClientCert": None,
}
HEADERS = (
    "Content-Security-Policy",
    "X-Frame-Options",
    "X-Content-Type-Options",
    "X-XSS-Protection",
    "Strict-Transport-Security",
)
_TLS_KEYS = {
    "cert",
    "key",
    "client_ca",
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "client_allowed_sans",
    "min_version",
    "max_version",
    "cipher_suites",
    "prefer_server_cipher_suites",
    "curve_preferences",
}
# Ceilings on what the file may ask for. A real web config is a few KiB (inline PEM
# included) and three levels deep (tls_server_config.cipher_suites).
MiB = 1024 * 1024
MAX_FILE_BYTES = 1 * MiB
# A certificate chain or key is a few KiB; Mozilla's whole CA bundle is ~220 KiB.
MAX_TLS_FILE_BYTES = 1 * MiB
MAX_DEPTH = 16
# bcrypt's cost is log2 of its rounds: a check at cost 12 takes ~0.24 s of one core
# (bcrypt 5.0, 2-core AMD EPYC), at 14 a second, at 31 days. Every check runs on the
# one password worker (exposition/basic_auth.py), so the ceiling bounds its queue's wait.
BCRYPT_MAX_COST = 12
BCRYPT_HASH = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
_HASH_HINT = "htpasswd -nBC 10 '' | tr -d ':\\n'"
# RFC 9110 section 5.5 field-value, without obs-text: visible ASCII, spaces and tabs. A
# control character would pass the file and then fail every answer (aiohttp refuses
# to write it: http_writer.py _safe_header, _http_writer.pyx _write_str_raise_on_nlcr).
HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")
_UNSUPPORTED = {
    "tls_server_config.curve_preferences": "Python's ssl cannot set a curve list",
    "rate_limit": "rate limiting is not implemented here",
}


class WebConfigError(ValueError):
    """One line: the file, the key and what is wrong with it."""


@dataclass(frozen=True)
class TlsConfig:
    cert_pem: str | None  # inline (``cert``) or None
    key_pem: str | None
    cert_file: Path | None
    key_file: Path | None
    client_auth_type: str = "NoClientCert"
    client_ca_pem: str | None = None
    client_ca_file: Path | None = None
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True

    @property
    def files(self) -> tuple[Path, ...]:
        """The files whose change means the context must be built again."""
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)


@dataclass(frozen=True)
class WebConfig:
    tls: TlsConfig | None = None
    basic_auth_users: Mapping[str, str] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Mapping[str, str] = field(default_factory=dict)


def load_web_config(path: Path) -> WebConfig:
    """Read and check the file; relative file names are relative to the file's folder
    (as exporter-toolkit resolves them)."""
    import yaml  # only where a web config is given (~1.7 MiB resident otherwise unused)

    text = _read_text(path)
    try:
        _check_depth(text, path)
        raw = yaml.load(text, Loader=_loader())  # a safe loader: plain data only
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None)
        why = f": {' '.join(str(problem).split())}" if problem else ""
        raise WebConfigError(f"{path}:{where} not valid YAML{why}") from None
    except WebConfigError:
        raise  # a ValueError too, already one line
    except ValueError as exc:  # a value YAML parses but Python cannot build (an integer
        # over 4,300 digits, a date like 2024-13-45): the first clause of its reason
        why = " ".join(str(exc).split(";")[0].split())
        raise WebConfigError(f"{path}: a value that cannot be read: {why}") from None
    return parse_web_config(raw if raw is not None else {}, path)


def bcrypt_cost(hashed: str) -> int | None:
    """The cost of a well-formed bcrypt hash (``$2y$10$`` + 53 characters), else None."""
    match = BCRYPT_HASH.fullmatch(hashed)
    return int(match.group(1)) if match else None


def _loader() -> type[yaml.SafeLoader]:
    """libyaml's parser (in PyYAML's wheels) is ~8x faster than the pure-Python one: a
    reload parses on the event loop."""
    import yaml

    loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return loader


def read_bounded(path: Path, limit: int, kind: str, too_big: str) -> bytes:
    """A regular file's bytes (a FIFO or device could block or never end; opened
    non-blocking, checked on the open descriptor), at most ``limit`` of them, read no
    further than that. ``kind`` names what the file should be, ``too_big`` says what
    to do about a larger one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise WebConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory
        os.close(fd)
        raise WebConfigError(f"{path}: not a regular file; give the path of {kind}")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise WebConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise WebConfigError(f"{path}: larger than {limit / MiB:g} MiB; {too_big}")
    return data


def _read_text(path: Path) -> str:
    """The web config's text: bounded as ``read_bounded``, decoded as UTF-8."""
    data = read_bounded(
        path,
        MAX_FILE_BYTES,
        "a YAML file",
        "a web config is a few KiB (name certificate files with cert_file rather than "
        "inlining large bundles)",
    )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WebConfigError(
            f"{path}: not UTF-8 text (byte {exc.start}); is this the right file?"
        ) from None


def _read_pem(path: Path) -> str:
    """A certificate, key or CA file named by the web config, bounded as ``read_bounded``."""
    data = read_bounded(
        path, MAX_TLS_FILE_BYTES, "a PEM file", "a certificate, key or CA bundle is a few KiB"
    )
    try:
        return data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise WebConfigError(
            f"{path}: not PEM text (byte {exc.start} is not ASCII); give a PEM file"
        ) from None


def mixed_cost_warning(users: Mapping[str, str]) -> str | None:
    """A warning when users' bcrypt costs differ. An unknown user is checked against a
    made-up hash of the highest cost (exposition/basic_auth.py), so a wrong password
    for a cheaper user answers measurably faster than one for a name that does not
    exist: timing then tells that the cheaper users exist. One cost for all hides it."""
    costs = {user: bcrypt_cost(hashed) or 0 for user, hashed in users.items()}
    if len(set(costs.values())) < 2:
        return None
    top = max(costs.values())
    cheaper = sorted(user for user, cost in costs.items() if cost < top)
    named = ", ".join(f"{u} ({costs[u]})" for u in cheaper[:5]) + (" ..." if cheaper[5:] else "")
    return (
        f"basic_auth_users: bcrypt costs differ (highest {top}; lower: {named}): a wrong "
        "password for a lower-cost user is answered faster than one for a user that does "
        f"not exist, so answer times tell that these users exist; hash every user at one "
        f"cost: {_HASH_HINT}"
    )


def _check_depth(text: str, path: Path) -> None:
    """Refuse nesting deeper than MAX_DEPTH before building anything from it (PyYAML's
    composer recurses once per level)."""
    import yaml

    starts = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
    ends = (yaml.MappingEndEvent, yaml.SequenceEndEvent)
    depth = 0
    for event in yaml.parse(text, Loader=_loader()):
        if isinstance(event, starts):
            depth += 1
            if depth > MAX_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark else 0
                raise WebConfigError(
                    f"{path}: line {line}: nested deeper than {MAX_DEPTH} levels; "
                    "a web config is at most three levels deep"
                )
        elif isinstance(event, ends):
            depth -= 1


def parse_web_config(raw: Any, path: Path) -> WebConfig:
    def fail(key: str, message: str) -> WebConfigError:
        return WebConfigError(f"{path}: {key}: {message}")

    top = _mapping(raw, "the file", fail)
    _known(top, {"tls_server_config", "http_server_config", "basic_auth_users"}, "", fail)
    tls = _tls(top.get("tls_server_config"), path.parent, fail)
    users = _users(top.get("basic_auth_users"), fail)
    headers = _headers(top.get("http_server_config"), fail)
    return WebConfig(tls=tls, basic_auth_users=users, headers=headers)


def ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """The server context for ``tls``; raises WebConfigError when a file is unusable."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[tls.min_version]
    context.maximum_version = TLS_VERSIONS[tls.max_version]
    tls12 = [CIPHER_SUITES[s] for s in tls.cipher_suites if s in CIPHER_SUITES]
    if tls12:
        context.set_ciphers(":".join(tls12))
    if tls.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    if tls.cert_file and tls.key_file:  # read here, bounded: ssl would open a FIFO and wait
        cert_pem, key_pem = _read_pem(tls.cert_file), _read_pem(tls.key_file)
    else:
        cert_pem, key_pem = tls.cert_pem or "", tls.key_pem or ""
    try:
        _load_inline_chain(context, cert_pem, key_pem)
    except (OSError, ssl.SSLError) as exc:
        raise WebConfigError(
            f"tls_server_config: cannot load the certificate and key: {_reason(exc)}"
        ) from None
    mode = CLIENT_AUTH[tls.client_auth_type]
    assert mode is not None  # refused at parse time
    context.verify_mode = mode[0]
    if mode[1]:
        ca_pem = _read_pem(tls.client_ca_file) if tls.client_ca_file else tls.client_ca_pem
        try:
            context.load_verify_locations(cadata=ca_pem)
        except (OSError, ssl.SSLError, ValueError) as exc:  # ValueError: empty cadata
            raise WebConfigError(
                f"tls_server_config: cannot load the client CA: {_reason(exc)}"
            ) from None
    return context


# --- parsing helpers ----------------------------------------------------------------


def _tls(raw: Any, base: Path, fail: Any) -> TlsConfig | None:
    if raw is None:
        return None
    prefix = "tls_server_config"
    tls = _mapping(raw, prefix, fail)
    _known(tls, _TLS_KEYS, prefix, fail)

    def text(key: str) -> str | None:
        value = tls.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise fail(f"{prefix}.{key}", "must be a string")
        return value

    def file(key: str) -> Path | None:
        name = text(key)
        return None if name is None else (base / name)

    cert_file, key_file = file("cert_file"), file("key_file")
    cert, key = text("cert"), text("key")
    if cert and cert_file:
        raise fail(f"{prefix}.cert", "give cert or cert_file, not both")
    if key and key_file:
        raise fail(f"{prefix}.key", "give key or key_file, not both")
    if not (cert or cert_file) or not (key or key_file):
        raise fail(prefix, "needs cert_file and key_file (or inline cert and key)")
    auth = text("client_auth_type") or "NoClientCert"
    if auth not in CLIENT_AUTH:
        raise fail(f"{prefix}.client_auth_type", f"{auth!r} is not one of {', '.join(CLIENT_AUTH)}")
    if CLIENT_AUTH[auth] is None:
        raise fail(
            f"{prefix}.client_auth_type",
            f"{auth} (a client certificate that is not verified) cannot be done with "
            "Python's ssl; use RequireAndVerifyClientCert with client_ca_file",
        )
    ca_file, ca = file("client_ca_file"), text("client_ca")
    mode = CLIENT_AUTH[auth]
    needs_ca = mode is not None and mode[1]
    if needs_ca and not (ca_file or ca):
        raise fail(f"{prefix}.client_ca_file", f"client_auth_type {auth} needs a client CA")
    sans = _strings(tls.get("client_allowed_sans"), f"{prefix}.client_allowed_sans", fail)
    if sans and auth != "RequireAndVerifyClientCert":
        raise fail(
            f"{prefix}.client_allowed_sans", "needs client_auth_type RequireAndVerifyClientCert"
        )
    versions = {}
    for key, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        value = text(key) or default
        if value not in TLS_VERSIONS:
            raise fail(f"{prefix}.{key}", f"{value!r} is not one of {', '.join(TLS_VERSIONS)}")
        versions[key] = value
    if TLS_VERSIONS[versions["min_version"]] > TLS_VERSIONS[versions["max_version"]]:
        raise fail(f"{prefix}.min_version", "is above max_version")
    suites = _strings(tls.get("cipher_suites"), f"{prefix}.cipher_suites", fail)
    for suite in suites:
        if suite not in CIPHER_SUITES and suite not in TLS13_SUITES:
            raise fail(f"{prefix}.cipher_suites", f"unknown or insecure suite {suite!r}")
    prefer = tls.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise fail(f"{prefix}.prefer_server_cipher_suites", "must be true or false")
    return TlsConfig(
        cert_pem=cert,
        key_pem=key,
        cert_file=cert_file,
        key_file=key_file,
        client_auth_type=auth,
        client_ca_pem=ca,
        client_ca_file=ca_file,
        client_allowed_sans=sans,
        min_version=versions["min_version"],
        max_version=versions["max_version"],
        cipher_suites=suites,
        prefer_server_cipher_suites=prefer,
    )


def _users(raw: Any, fail: Any) -> dict[str, str]:
    if raw is None:
        return {}
    users = _mapping(raw, "basic_auth_users", fail)
    out: dict[str, str] = {}
    for user, hashed in users.items():
        if not isinstance(user, str) or not user:
            raise fail("basic_auth_users", "user names must be non-empty strings")
        if ":" in user:
            raise fail(f"basic_auth_users.{user}", "a user name cannot contain ':'")
        cost = bcrypt_cost(hashed) if isinstance(hashed, str) else None
        if cost is None or cost < 4:
            raise fail(f"basic_auth_users.{user}", f"must be a bcrypt hash ($2y$...): {_HASH_HINT}")
        if cost > BCRYPT_MAX_COST:
            raise fail(
                f"basic_auth_users.{user}",
                f"bcrypt cost {cost} is above the ceiling of {BCRYPT_MAX_COST} (each check "
                f"would take ~{0.24 * 2 ** (cost - 12):,.1f} s of CPU); hash it again at "
                f"cost 10: {_HASH_HINT}",
            )
        out[user] = hashed
    return out


def _headers(raw: Any, fail: Any) -> dict[str, str]:
    if raw is None:
        return {}
    server = _mapping(raw, "http_server_config", fail)
    _known(server, {"http2", "headers"}, "http_server_config", fail)
    headers = _mapping(server.get("headers") or {}, "http_server_config.headers", fail)
    out: dict[str, str] = {}
    for name, value in headers.items():
        if name not in HEADERS:
            raise fail(f"http_server_config.headers.{name}", f"not one of {', '.join(HEADERS)}")
        if value is None or value == "":
            continue  # "unset if blank"
        if not isinstance(value, str) or not HEADER_VALUE.fullmatch(value):
            raise fail(
                f"http_server_config.headers.{name}",
                "must be one line of visible ASCII, spaces and tabs (no control characters)",
            )
        out[name] = value
    return out


def _mapping(raw: Any, where: str, fail: Any) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise fail(where, "must be a mapping of keys to values")
    return raw


def _known(raw: Mapping[str, Any], known: set[str], prefix: str, fail: Any) -> None:
    for key in raw:
        qualified = f"{prefix}.{key}" if prefix else str(key)
        if qualified in _UNSUPPORTED:
            raise fail(qualified, f"not supported: {_UNSUPPORTED[qualified]}; remove it")
        if key not in known:
            raise fail(qualified, f"unknown key (known: {', '.join(sorted(known))})")


def _strings(raw: Any, where: str, fail: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(v, str) and v for v in raw):
        raise fail(where, "must be a list of strings")
    return tuple(raw)


def _load_inline_chain(context: ssl.SSLContext, cert: str, key: str) -> None:
    """ssl loads a chain only from files: write inline PEM to a private temporary file."""
    fd, name = tempfile.mkstemp(prefix="web-config-", suffix=".pem")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(cert.rstrip("\n") + "\n" + key.rstrip("\n") + "\n")
        context.load_cert_chain(name)
    finally:
        os.unlink(name)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{getattr(exc, 'filename', '') or ''} {exc.strerror}".strip()
    return " ".join(str(exc).split())
