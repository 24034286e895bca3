"""The chart's /metrics security, alert parameters and scheduling options, end to end.

What the chart renders is taken at its word: the web config Secret it writes is served by
the real exporter (``WebSecurity`` behind the real aiohttp server), from files laid out
where the pod's Secret volumes would put them, and scraped the way the rendered
ServiceMonitor tells Prometheus to (its CA, server name, client certificate and
credentials), over real TLS handshakes. The rendered PrometheusRule with other
parameters goes through ``promtool check rules`` and the repository's own promtool unit
tests. kube-rbac-proxy cannot run here (a Go binary, not on PyPI): its flags are checked
against its README's flag list, and its authorisation against Kubernetes' RBAC rule
matching for the attributes it sends.
"""

from __future__ import annotations

import asyncio
import base64
import re
import ssl
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from exporter.config import parse_config
from tests.system_tools import require_tool
from tests.test_alert_rules import RUNBOOK_BASE, github_anchor
from tests.test_helm_chart import (
    BCRYPT_HASH,
    CHART,
    CRD_SCHEMAS,
    DEFAULTS,
    FULLNAME,
    NAMESPACE,
    ROOT,
    SCRAPE_PASSWORD,
    VALUE_SETS,
    by_kind,
    container,
    containers,
    objects,
    one,
    pod_spec,
    render,
)
from tests.test_web_security import serving
from tests.tls_certs import Authority, authority

pytestmark = pytest.mark.slow

SERVER_NAME = f"{FULLNAME}.{NAMESPACE}.svc"  # the chart's Service, the monitors' serverName
MOUNT_ROOT = "/etc/gpu-occupancy-exporter"
FILE_JOB = 'job=~".*gpu-occupancy-exporter.*"'

# -- a pod's files and Prometheus' view of a monitor -----------------------------------


def secret_mounts(values: dict[str, Any], name: str = "exporter") -> dict[str, str]:
    """mountPath -> Secret name, for the Secret volumes mounted into one container."""
    volumes = {v["name"]: v for v in pod_spec(values)["volumes"]}
    mounts = {}
    for mount in containers(values)[name]["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "secret" in volume:
            assert mount.get("readOnly") is True and "subPath" not in mount, mount
            mounts[mount["mountPath"]] = volume["secret"]["secretName"]
    return mounts


def chart_secrets(values: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {s["metadata"]["name"]: s["stringData"] for s in by_kind(values, "Secret")}


def lay_out_pod(
    tmp: Path, values: dict[str, Any], secrets: dict[str, dict[str, str]]
) -> tuple[Path, Path]:
    """Write each Secret mounted into the exporter container under tmp/<mountPath>, as the
    kubelet would; return the web config file the rendered args name, moved under tmp
    with the paths inside it (all absolute, all in mounted Secrets) re-rooted too."""
    available = {**secrets, **chart_secrets(values)}
    for mount_path, secret in secret_mounts(values).items():
        directory = tmp / mount_path.lstrip("/")
        directory.mkdir(parents=True)
        for key, text in available[secret].items():
            (directory / key).write_text(text)
    (arg,) = [a for a in container(values)["args"] if a.startswith("--web-config-file=")]
    path = Path(arg.partition("=")[2])
    assert any(path.parent == Path(m) for m in secret_mounts(values)), path
    config = yaml.safe_load((tmp / str(path).lstrip("/")).read_text())
    tls = config.get("tls_server_config", {})
    for key in ("cert_file", "key_file", "client_ca_file"):
        if key in tls:
            file = Path(tls[key])
            assert any(file.parent == Path(m) for m in secret_mounts(values)), file
            assert (tmp / str(file).lstrip("/")).is_file(), f"{file} is not in its Secret"
            tls[key] = str(tmp / str(file).lstrip("/"))
    rerooted = tmp / "web-config.rerooted.yml"
    rerooted.write_text(yaml.safe_dump(config))
    return path, rerooted


def _selected(selector: dict[str, Any], secrets: dict[str, dict[str, str]]) -> str:
    ref = selector.get("secret", selector)
    return secrets[ref["name"]][ref["key"]]


def as_prometheus(
    endpoint: dict[str, Any], secrets: dict[str, dict[str, str]], tmp: Path
) -> tuple[ssl.SSLContext, str, list[str]]:
    """TLS context, server name and request headers of a scrape the way the operator turns
    this ServiceMonitor endpoint into Prometheus' scrape config."""
    assert endpoint["scheme"] == "https"
    tls = endpoint["tlsConfig"]
    context = ssl.create_default_context(cadata=_selected(tls["ca"], secrets))
    if "cert" in tls:
        cert, key = tmp / "prometheus.crt", tmp / "prometheus.key"
        cert.write_text(_selected(tls["cert"], secrets))
        key.write_text(_selected(tls["keySecret"], secrets))
        context.load_cert_chain(cert, key)
    headers = []
    if "basicAuth" in endpoint:
        auth = endpoint["basicAuth"]
        pair = f"{_selected(auth['username'], secrets)}:{_selected(auth['password'], secrets)}"
        headers.append(f"Authorization: Basic {base64.b64encode(pair.encode()).decode()}")
    return context, tls["serverName"], headers


async def request(
    port: int,
    path: str,
    *,
    context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    headers: list[str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=server_hostname),
        5,
    )
    try:
        lines = [f"GET {path} HTTP/1.1", "Host: localhost", "Connection: close", *(headers or [])]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    if not raw:  # TLS 1.3: a refused client certificate ends the connection after the handshake
        raise ConnectionResetError("closed without a response")
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    return int(status_line.split()[1]), dict(h.split(": ", 1) for h in header_lines), body


def kubelet_context() -> ssl.SSLContext:
    """An HTTPS probe: "the kubelet sends an HTTPS request skipping the certificate
    verification" (Kubernetes docs, configure liveness/readiness probes), no client cert."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def tls_secret(ca: Authority, tmp: Path, name: str, *sans: str) -> dict[str, str]:
    """What cert-manager writes for a Certificate from a CA issuer."""
    pair = ca.issue(tmp, name, server=True, sans=sans)
    return {
        "tls.crt": pair.cert.read_text(),
        "tls.key": pair.key.read_text(),
        "ca.crt": ca.path.read_text(),
    }


# -- TLS and basic auth, served as rendered ---------------------------------------------

TLS_BASIC_AUTH = {
    "tls": {"enabled": True, "secretName": "gpu-exporter-tls"},
    "basicAuth": {"users": {"prometheus": BCRYPT_HASH}},
    "webConfig": {"headers": {"X-Content-Type-Options": "nosniff"}},
    "serviceMonitor": {"enabled": True, "basicAuth": {"secretName": "prometheus-scrape"}},
}


async def test_tls_and_basic_auth_serve_prometheus_as_the_service_monitor_says(
    tmp_path: Path,
) -> None:
    ca = authority(tmp_path, "gpu-exporter-ca")
    secrets = {
        "gpu-exporter-tls": tls_secret(ca, tmp_path, "server", SERVER_NAME),
        "prometheus-scrape": {"username": "prometheus", "password": SCRAPE_PASSWORD},
    }
    web_config, rerooted = lay_out_pod(tmp_path / "pod", TLS_BASIC_AUTH, secrets)
    assert web_config == Path(f"{MOUNT_ROOT}/web/web-config.yml")
    assert set(secret_mounts(TLS_BASIC_AUTH).values()) == {
        f"{FULLNAME}-web-config",
        "gpu-exporter-tls",
    }
    (endpoint,) = one(TLS_BASIC_AUTH, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["tlsConfig"]["serverName"] == SERVER_NAME
    context, server_name, headers = as_prometheus(endpoint, secrets, tmp_path)
    main = container(TLS_BASIC_AUTH)

    async with serving(rerooted) as (port, _):
        status, response_headers, body = await request(
            port, endpoint["path"], context=context, server_hostname=server_name, headers=headers
        )
        assert status == 200 and b"gpu_example 1.0" in body
        assert response_headers["X-Content-Type-Options"] == "nosniff"
        wrong = [f"Authorization: Basic {base64.b64encode(b'prometheus:guess').decode()}"]
        for attempt in ([], wrong):
            status, _, _ = await request(
                port, "/metrics", context=context, server_hostname=server_name, headers=attempt
            )
            assert status == 401
        for probe in (main["livenessProbe"], main["readinessProbe"]):
            assert probe["httpGet"]["scheme"] == "HTTPS"
            status, _, _ = await request(port, probe["httpGet"]["path"], context=kubelet_context())
            assert status == 200, probe


async def test_a_certificate_without_the_service_name_fails_prometheus_verification(
    tmp_path: Path,
) -> None:
    """The serverName the monitors verify must be in the certificate (docs/install.md)."""
    ca = authority(tmp_path, "gpu-exporter-ca")
    secrets = {
        "gpu-exporter-tls": tls_secret(ca, tmp_path, "server", "gpu-exporter.example.com"),
        "prometheus-scrape": {"username": "prometheus", "password": SCRAPE_PASSWORD},
    }
    _, rerooted = lay_out_pod(tmp_path / "pod", TLS_BASIC_AUTH, secrets)
    (endpoint,) = one(TLS_BASIC_AUTH, "ServiceMonitor")["spec"]["endpoints"]
    context, server_name, _ = as_prometheus(endpoint, secrets, tmp_path)
    async with serving(rerooted) as (port, _):
        with pytest.raises(ssl.SSLCertVerificationError, match="match"):
            await request(port, "/metrics", context=context, server_hostname=server_name)


MTLS = VALUE_SETS["mtls"]


async def test_required_client_certificates_admit_prometheus_and_probe_over_tcp(
    tmp_path: Path,
) -> None:
    ca, scraper_ca = authority(tmp_path, "gpu-exporter-ca"), authority(tmp_path, "scraper-ca")
    client = scraper_ca.issue(tmp_path, "prometheus", sans=("prometheus.monitoring",))
    stranger = scraper_ca.issue(tmp_path, "stranger", sans=("intruder.example",))
    secrets = {
        "gpu-exporter-tls": tls_secret(ca, tmp_path, "server", SERVER_NAME),
        "scraper-ca": {"ca.crt": scraper_ca.path.read_text()},
        "prometheus-client": {
            "tls.crt": client.cert.read_text(),
            "tls.key": client.key.read_text(),
        },
    }
    _, rerooted = lay_out_pod(tmp_path / "pod", MTLS, secrets)
    tls = yaml.safe_load(rerooted.read_text())["tls_server_config"]
    assert tls["client_auth_type"] == "RequireAndVerifyClientCert"
    assert tls["client_ca_file"].endswith(f"{MOUNT_ROOT}/client-ca/ca.crt")
    assert tls["client_allowed_sans"] == ["prometheus.monitoring"]
    (endpoint,) = one(MTLS, "ServiceMonitor")["spec"]["endpoints"]
    context, server_name, _ = as_prometheus(endpoint, secrets, tmp_path)
    main = container(MTLS)
    # No client certificate can be given to a probe: tcpSocket on the same port.
    for probe in (main["livenessProbe"], main["readinessProbe"]):
        assert "httpGet" not in probe and probe["tcpSocket"] == {"port": "metrics"}

    async with serving(rerooted) as (port, _):
        status, _, body = await request(
            port, "/metrics", context=context, server_hostname=server_name
        )
        assert status == 200 and b"gpu_example" in body
        without = ssl.create_default_context(cadata=secrets["gpu-exporter-tls"]["ca.crt"])
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await request(port, "/metrics", context=without, server_hostname=server_name)
        other = ssl.create_default_context(cadata=secrets["gpu-exporter-tls"]["ca.crt"])
        other.load_cert_chain(stranger.cert, stranger.key)
        status, _, _ = await request(port, "/metrics", context=other, server_hostname=server_name)
        assert status == 403  # verified, but not an allowed SAN
        _, writer = await asyncio.open_connection("127.0.0.1", port)  # the tcpSocket probe
        writer.close()


async def test_an_existing_web_config_secret_is_mounted_in_place_of_the_charts(
    tmp_path: Path,
) -> None:
    values = VALUE_SETS["existing-web-config"]
    assert not by_kind(values, "Secret")
    assert secret_mounts(values) == {
        f"{MOUNT_ROOT}/web": "gpu-web-config",
        f"{MOUNT_ROOT}/tls": "gpu-exporter-tls",
    }
    ca = authority(tmp_path, "ca")
    own_file = {  # the example of docs/install.md
        "tls_server_config": {
            "cert_file": f"{MOUNT_ROOT}/tls/tls.crt",
            "key_file": f"{MOUNT_ROOT}/tls/tls.key",
        },
        "basic_auth_users": {"prometheus": BCRYPT_HASH},
    }
    secrets = {
        "gpu-exporter-tls": tls_secret(ca, tmp_path, "server", SERVER_NAME),
        "gpu-web-config": {"web.yml": yaml.safe_dump(own_file)},
    }
    web_config, rerooted = lay_out_pod(tmp_path / "pod", values, secrets)
    assert web_config == Path(f"{MOUNT_ROOT}/web/web.yml")
    context = ssl.create_default_context(cadata=ca.path.read_text())
    password = base64.b64encode(f"prometheus:{SCRAPE_PASSWORD}".encode()).decode()
    async with serving(rerooted) as (port, _):
        status, _, _ = await request(
            port,
            "/metrics",
            context=context,
            server_hostname=SERVER_NAME,
            headers=[f"Authorization: Basic {password}"],
        )
        assert status == 200
    assert container(values)["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


def test_pod_monitor_is_wired_like_the_service_monitor() -> None:
    values = VALUE_SETS["tls-basic-auth"]
    (endpoint,) = one(values, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {  # the chart's serverName, the user's CA
        "ca": {"configMap": {"name": "gpu-ca", "key": "ca.crt"}},
        "serverName": SERVER_NAME,
    }
    assert endpoint["basicAuth"] == {
        "username": {"name": "prometheus-scrape", "key": "pod-user"},
        "password": {"name": "prometheus-scrape", "key": "pod-pass"},
    }
    (service_endpoint,) = one(values, "ServiceMonitor")["spec"]["endpoints"]
    assert service_endpoint["tlsConfig"]["serverName"] == "gpu-exporter.example.internal"
    assert service_endpoint["tlsConfig"]["ca"] == {
        "secret": {"name": "gpu-exporter-tls", "key": "ca.crt"}
    }


def test_tls_min_version_reaches_the_exporter() -> None:
    web = yaml.safe_load(
        next(iter(by_kind(VALUE_SETS["tls-basic-auth"], "Secret")))["stringData"]["web-config.yml"]
    )
    assert web["tls_server_config"]["min_version"] == "TLS13"


# -- kube-rbac-proxy --------------------------------------------------------------------

# `kube-rbac-proxy -h` of v0.21.0 (README.md, "All command line flags"): the chart may use
# no other flag.
KUBE_RBAC_PROXY_FLAGS = {
    *("allow-paths", "auth-header-fields-enabled", "auth-header-groups-field-name"),
    *("auth-header-groups-field-separator", "auth-header-user-field-name"),
    *("auth-token-audiences", "client-ca-file", "config-file", "http2-disable"),
    *("http2-max-concurrent-streams", "http2-max-size", "ignore-paths", "kube-api-burst"),
    *("kube-api-qps", "kubeconfig", "oidc-ca-file", "oidc-clientID", "oidc-groups-claim"),
    *("oidc-groups-prefix", "oidc-issuer", "oidc-sign-alg", "oidc-username-claim"),
    *("oidc-username-prefix", "proxy-endpoints-port", "secure-listen-address"),
    *("tls-cert-file", "tls-cipher-suites", "tls-min-version", "tls-private-key-file"),
    *("tls-reload-interval", "upstream", "upstream-ca-file", "upstream-client-cert-file"),
    *("upstream-client-key-file", "upstream-force-h2c"),
}
PROXY = VALUE_SETS["kube-rbac-proxy"]


def flags(args: list[str]) -> dict[str, str]:
    parsed = {}
    for arg in args:
        name, _, value = arg.removeprefix("--").partition("=")
        parsed[name] = value
    return parsed


def rbac_allows(rules: list[dict[str, Any]], verb: str, path: str) -> bool:
    """Kubernetes RBAC for a non-resource request (NonResourceURLMatches: exact, or a
    trailing * prefix)."""
    for rule in rules:
        urls = rule.get("nonResourceURLs", [])
        matched = any(u == path or (u.endswith("*") and path.startswith(u[:-1])) for u in urls)
        if matched and (verb in rule["verbs"] or "*" in rule["verbs"]):
            return True
    return False


def proxy_request_attributes(method: str, path: str) -> tuple[str, str]:
    """kube-rbac-proxy's SubjectAccessReview for a request without --config-file
    (pkg/proxy/proxy.go, GetRequestAttributes): a non-resource request, the path as is,
    the verb from the method."""
    verb = {"POST": "create", "GET": "get", "PUT": "update", "PATCH": "patch"}.get(method, "*")
    return verb, path


def test_kube_rbac_proxy_fronts_the_exporter_on_loopback() -> None:
    pod = containers(PROXY)
    exporter, proxy = pod["exporter"], pod["kube-rbac-proxy"]
    config = parse_config(exporter["args"], {"NODE_NAME": "n"})
    assert (config.listen_host, config.listen_port) == ("127.0.0.1", 19446)
    assert config.web_config_file is None  # TLS and authorisation are the proxy's
    assert "ports" not in exporter
    args = flags(proxy["args"])
    assert set(args) <= KUBE_RBAC_PROXY_FLAGS, set(args) - KUBE_RBAC_PROXY_FLAGS
    assert args["upstream"] == "http://127.0.0.1:19446/"
    (port,) = proxy["ports"]
    assert port == {"name": "metrics", "containerPort": 9445, "protocol": "TCP"}
    assert args["secure-listen-address"] == ":9445"
    assert args["auth-token-audiences"] == "gpu-exporter"  # kubeRbacProxy.extraArgs
    assert args["tls-min-version"] == "VersionTLS12"
    assert {args["tls-cert-file"], args["tls-private-key-file"]} == {
        f"{MOUNT_ROOT}/tls/tls.crt",
        f"{MOUNT_ROOT}/tls/tls.key",
    }
    assert secret_mounts(PROXY, "kube-rbac-proxy") == {f"{MOUNT_ROOT}/tls": "gpu-exporter-tls"}
    assert secret_mounts(PROXY) == {}  # the exporter sees no certificate
    assert proxy["image"] == "registry.example/kube-rbac-proxy:v0.20.2"
    assert proxy["securityContext"]["runAsNonRoot"] is True
    assert proxy["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # The probes pass the proxy without a token, on its port (by number: a named port
    # is looked up in the probed container).
    ignored = args["ignore-paths"].split(",")
    for probe in (exporter["livenessProbe"], exporter["readinessProbe"]):
        assert probe["httpGet"]["port"] == 9445 and probe["httpGet"]["scheme"] == "HTTPS"
        assert probe["httpGet"]["path"] in ignored
    assert "/metrics" not in ignored
    service = one(PROXY, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_kube_rbac_proxy_may_review_tokens_and_prometheus_may_get_metrics() -> None:
    spec = pod_spec(PROXY)
    assert spec["automountServiceAccountToken"] is True  # the proxy calls the API
    account = one(PROXY, "ServiceAccount")["metadata"]["name"]
    assert spec["serviceAccountName"] == account
    roles = {r["metadata"]["name"]: r for r in by_kind(PROXY, "ClusterRole")}
    bindings = {b["metadata"]["name"]: b for b in by_kind(PROXY, "ClusterRoleBinding")}
    assert (
        set(roles)
        == set(bindings)
        == {
            f"{FULLNAME}-kube-rbac-proxy",
            f"{FULLNAME}-metrics-reader",
        }
    )  # kubeApi: off: no pod-watch role
    proxy_role = roles[f"{FULLNAME}-kube-rbac-proxy"]
    assert proxy_role["rules"] == [
        {
            "apiGroups": ["authentication.k8s.io"],
            "resources": ["tokenreviews"],
            "verbs": ["create"],
        },
        {
            "apiGroups": ["authorization.k8s.io"],
            "resources": ["subjectaccessreviews"],
            "verbs": ["create"],
        },
    ]
    assert bindings[f"{FULLNAME}-kube-rbac-proxy"]["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    reader = roles[f"{FULLNAME}-metrics-reader"]["rules"]
    assert rbac_allows(reader, *proxy_request_attributes("GET", "/metrics"))
    assert not rbac_allows(reader, *proxy_request_attributes("GET", "/"))
    assert not rbac_allows(reader, *proxy_request_attributes("POST", "/metrics"))
    assert bindings[f"{FULLNAME}-metrics-reader"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"}
    ]


def test_service_monitor_sends_prometheus_token_over_verified_tls_to_the_proxy() -> None:
    (endpoint,) = one(PROXY, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "gpu-exporter-tls", "key": "ca.crt"}},
        "serverName": SERVER_NAME,
    }
    assert "basicAuth" not in endpoint and "authorization" not in endpoint


def test_token_secrets_replace_the_token_file_for_both_monitors() -> None:
    values = VALUE_SETS["kube-rbac-proxy-token-secrets"]
    (service,) = one(values, "ServiceMonitor")["spec"]["endpoints"]
    (pod,) = one(values, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert service["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "gpu-scraper-token", "key": "jwt"},
    }
    assert pod["authorization"]["credentials"] == {"name": "gpu-scraper-token", "key": "pod-jwt"}
    assert "bearerTokenFile" not in service and "bearerTokenFile" not in pod
    assert containers(values)["kube-rbac-proxy"]["image"] == (
        "quay.io/brancz/kube-rbac-proxy@sha256:" + "cd" * 32
    )
    # allowedServiceAccounts empty: the role exists, nobody is bound, the NOTES say so
    assert f"{FULLNAME}-metrics-reader" not in {
        b["metadata"]["name"] for b in by_kind(values, "ClusterRoleBinding")
    }
    notes = render(values)["gpu-occupancy-exporter/templates/NOTES.txt"]
    assert "No ServiceAccount is bound" in notes


def test_the_crd_field_subsets_hold_the_operators_rules() -> None:
    """A PodMonitor endpoint has no bearerTokenFile, and no endpoint takes both basicAuth
    and authorization (pkg/apis/monitoring/v1: podmonitor_types.go, http_config.go)."""
    values = VALUE_SETS["kube-rbac-proxy-token-secrets"]
    pod_monitor = one(values, "PodMonitor")
    jsonschema.validate(pod_monitor, CRD_SCHEMAS["PodMonitor"])
    endpoint = pod_monitor["spec"]["podMetricsEndpoints"][0]
    endpoint["bearerTokenFile"] = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    with pytest.raises(jsonschema.ValidationError, match="bearerTokenFile"):
        jsonschema.validate(pod_monitor, CRD_SCHEMAS["PodMonitor"])
    monitor = one(values, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["basicAuth"] = {"username": {"name": "s", "key": "u"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, CRD_SCHEMAS["ServiceMonitor"])


# -- what cannot work together ----------------------------------------------------------

TLS_ON = {"enabled": True, "secretName": "gpu-exporter-tls"}
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "tls-without-secret": ({"tls": {"enabled": True}}, r"tls\.enabled needs tls\.secretName"),
    "proxy-without-tls": (
        {"kubeRbacProxy": {"enabled": True}},
        r"kubeRbacProxy\.enabled needs tls\.enabled",
    ),
    "proxy-and-basic-auth": (
        {
            "tls": TLS_ON,
            "kubeRbacProxy": {"enabled": True},
            "basicAuth": {"users": {"u": BCRYPT_HASH}},
        },
        "excludes basicAuth.users",
    ),
    "proxy-and-own-web-config": (
        {"tls": TLS_ON, "kubeRbacProxy": {"enabled": True}, "webConfig": {"existingSecret": "w"}},
        "excludes basicAuth.users and webConfig.existingSecret",
    ),
    "proxy-and-client-certs": (
        {
            "tls": {**TLS_ON, "clientAuthType": "VerifyClientCertIfGiven"},
            "kubeRbacProxy": {"enabled": True},
        },
        "--client-ca-file",
    ),
    "sans-without-required-certs": (
        {"tls": {**TLS_ON, "clientAllowedSans": ["prometheus"]}},
        "needs tls.clientAuthType: RequireAndVerifyClientCert",
    ),
    "client-ca-without-client-auth": (
        {"tls": {**TLS_ON, "clientCASecretName": "ca"}},
        r"tls\.clientCASecretName verifies client certificates",
    ),
    "own-file-and-users": (
        {"webConfig": {"existingSecret": "w"}, "basicAuth": {"users": {"u": BCRYPT_HASH}}},
        "holds the whole web config file",
    ),
    "own-file-and-min-version": (
        {"webConfig": {"existingSecret": "w"}, "tls": {**TLS_ON, "minVersion": "TLS13"}},
        "holds the whole web config file",
    ),
    "users-without-a-password-for-prometheus": (
        {"basicAuth": {"users": {"u": BCRYPT_HASH}}, "podMonitor": {"enabled": True}},
        r"set podMonitor\.basicAuth\.secretName",
    ),
    "tls-config-without-tls": (
        {"serviceMonitor": {"enabled": True, "tlsConfig": {"insecureSkipVerify": True}}},
        r"serviceMonitor\.tlsConfig needs tls\.enabled",
    ),
    "basic-auth-to-the-proxy": (
        {
            "tls": TLS_ON,
            "kubeRbacProxy": {"enabled": True},
            "serviceMonitor": {"enabled": True, "basicAuth": {"secretName": "p"}},
        },
        r"serviceMonitor\.basicAuth and kubeRbacProxy\.enabled exclude each other",
    ),
    "token-without-the-proxy": (
        {"serviceMonitor": {"enabled": True, "bearerToken": {"secretName": "t"}}},
        r"serviceMonitor\.bearerToken is for kubeRbacProxy\.enabled",
    ),
    "pod-monitor-without-token-behind-the-proxy": (
        {"tls": TLS_ON, "kubeRbacProxy": {"enabled": True}, "podMonitor": {"enabled": True}},
        "a PodMonitor endpoint has no bearerTokenFile",
    ),
    "required-client-certs-prometheus-has-none": (
        {
            "tls": {**TLS_ON, "clientAuthType": "RequireAndVerifyClientCert"},
            "serviceMonitor": {"enabled": True},
        },
        r"set serviceMonitor\.tlsConfig\.cert and serviceMonitor\.tlsConfig\.keySecret",
    ),
    "quota-without-priority-class": (
        {"priorityClassName": "", "priorityClassQuota": {"enabled": True}},
        "priorityClassQuota.enabled needs priorityClassName",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_settings_that_cannot_work_together_fail_with_what_to_change(name: str) -> None:
    values, message = REFUSED[name]
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)


SCHEMA_REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "not-a-bcrypt-hash": ({"basicAuth": {"users": {"u": "plaintext"}}}, "/basicAuth/users/u"),
    "unverified-client-certs": (
        {"tls": {"clientAuthType": "RequireAnyClientCert"}},
        "/tls/clientAuthType",
    ),
    "header-exporter-toolkit-refuses": (
        {"webConfig": {"headers": {"Server": "x"}}},
        "invalid propertyName 'Server'",
    ),
    "job-selector-not-matchers": ({"prometheusRule": {"jobSelector": "gpu"}}, "jobSelector"),
    "runbook-base-not-a-url": (
        {"prometheusRule": {"runbookUrlBase": "docs/runbooks.md"}},
        "runbookUrlBase",
    ),
    "tls-config-file-field": (
        {"serviceMonitor": {"tlsConfig": {"caFile": "/etc/ca.crt"}}},
        "caFile",
    ),
    "upstream-port": ({"kubeRbacProxy": {"upstreamPort": 0}}, "/kubeRbacProxy/upstreamPort"),
    "scraper-without-namespace": (
        {"kubeRbacProxy": {"allowedServiceAccounts": [{"name": "prometheus"}]}},
        "/kubeRbacProxy/allowedServiceAccounts/0",
    ),
    "quota-pods": ({"priorityClassQuota": {"pods": 0}}, "/priorityClassQuota/pods"),
    "tolerate-all-not-a-bool": ({"tolerateAll": "yes"}, "/tolerateAll"),
}


@pytest.mark.parametrize("name", sorted(SCHEMA_REFUSED))
def test_schema_rejects_bad_security_and_rule_values(name: str) -> None:
    values, where = SCHEMA_REFUSED[name]
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        render(values)


def test_nothing_new_is_on_by_default() -> None:
    kinds = [o["kind"] for o in objects({})]
    assert "Secret" not in kinds and "ResourceQuota" not in kinds
    assert list(containers({})) == ["exporter"]
    args = container({})["args"]
    assert "--listen=:9445" in args
    assert not [a for a in args if a.startswith("--web-config-file")]
    assert "scheme" not in container({})["livenessProbe"]["httpGet"]
    assert pod_spec({})["tolerations"] == DEFAULTS["tolerations"]
    assert DEFAULTS["prometheusRule"]["runbookUrlBase"] == RUNBOOK_BASE
    assert DEFAULTS["prometheusRule"]["jobSelector"] == FILE_JOB


# -- alert rule parameters ----------------------------------------------------------------

RULES = VALUE_SETS["rule-parameters"]
NEW_BASE = RULES["prometheusRule"]["runbookUrlBase"]


def _rules(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for group in groups for rule in group["rules"]]


def test_rendered_rules_use_the_runbook_base_and_job_selector() -> None:
    repo = [  # the chart's copies (test_helm_chart checks they are the repository's)
        rule
        for path in sorted((CHART / "files" / "alerts").glob("*.yaml"))
        for rule in _rules(yaml.safe_load(path.read_text())["groups"])
    ]
    rendered = _rules(one(RULES, "PrometheusRule")["spec"]["groups"])
    assert len(rendered) == len(repo)
    job_rules = 0
    for before, after in zip(repo, rendered, strict=True):
        url = before.get("annotations", {}).get("runbook_url")
        if url is not None:
            assert url.startswith(RUNBOOK_BASE + "#")
            assert after["annotations"]["runbook_url"] == NEW_BASE + url.removeprefix(RUNBOOK_BASE)
        expr = str(before["expr"])
        if FILE_JOB in expr:
            job_rules += 1
            assert after["expr"] == expr.replace(FILE_JOB, 'job=~".*gpu-telemetry.*"')
        else:
            assert after["expr"] == before["expr"]
        assert {k: v for k, v in after.items() if k not in ("expr", "annotations")} == {
            k: v for k, v in before.items() if k not in ("expr", "annotations")
        }
    # GPUOrphanedMemoryLarge, GPUUnhealthy and GPUExporterNVMLDown (held while their
    # target is not up), GPUExporterDown, GPUExporterDownDuringCriticalAlert,
    # GPUExporterFlapping and GPUExporterAbsent
    assert job_rules == 7
    notes = render(RULES)["gpu-occupancy-exporter/templates/NOTES.txt"]
    assert "does not match this release's job" not in notes


def test_the_notes_warn_when_the_default_job_selector_cannot_match() -> None:
    values = {"prometheusRule": {"enabled": True}, "fullnameOverride": "gpu-telemetry"}
    notes = render(values)["gpu-occupancy-exporter/templates/NOTES.txt"]
    assert 'set prometheusRule.jobSelector, e.g. job="gpu-telemetry"' in notes


def _for_release(text: str, job: str) -> str:
    """The repository's promtool unit tests, restated for a release whose job is `job`
    and whose runbooks live at NEW_BASE."""
    text = re.sub(r'job(=~?)"(prod-)?gpu-occupancy-exporter"', rf'job\g<1>"\g<2>{job}"', text)
    text = text.replace("job: gpu-occupancy-exporter", f"job: {job}")
    text = text.replace("(job gpu-occupancy-exporter)", f"(job {job})")
    return text.replace(RUNBOOK_BASE, NEW_BASE)


def test_rendered_rules_pass_promtool_and_the_repository_unit_tests(tmp_path: Path) -> None:
    """promtool's lint on the whole rendered rule set, then each repository unit test file
    restated for the release, on the rendered counterparts of the rule files it names (the
    groups rendered from them, as it loads those files and no others in alerts/tests).

    A unit test file whose rendered groups are the repository's, unchanged, and never
    mention the job (so restating its tests for the release only renames a label value
    they never select on) is the very run tests/test_alert_rules.py makes on the same
    rules: it is not repeated here (chargeback.test.yaml alone is ~10 s of promtool). The
    files whose groups the parameters do change are run, all in one promtool process."""
    promtool = require_tool("promtool")
    rendered = one(RULES, "PrometheusRule")["spec"]["groups"]
    rules = tmp_path / "rendered.rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rendered}))
    check = subprocess.run(
        [promtool, "check", "rules", "--lint=all", "--lint-fatal", str(rules)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    by_name = {group["name"]: group for group in rendered}
    in_chart = {
        path.name: yaml.safe_load(path.read_text())["groups"]
        for path in sorted((CHART / "files" / "alerts").glob("*.yaml"))
    }
    assert sorted(by_name) == sorted(g["name"] for groups in in_chart.values() for g in groups)
    tests = [
        path
        for path in sorted((ROOT / "alerts" / "tests").glob("*.test.yaml"))
        if {Path(f).name for f in yaml.safe_load(path.read_text())["rule_files"]} <= in_chart.keys()
    ]
    assert tests
    to_run: list[str] = []
    exercised: set[str] = set()
    for source in tests:
        unit = yaml.safe_load(_for_release(source.read_text(), "gpu-telemetry"))
        repo_groups = [g for f in unit["rule_files"] for g in in_chart[Path(f).name]]
        groups = [by_name[g["name"]] for g in repo_groups]
        if groups == repo_groups and "job" not in yaml.safe_dump(groups):
            continue
        rule_file = tmp_path / f"rendered.{source.name}"
        rule_file.write_text(yaml.safe_dump({"groups": groups}))
        unit["rule_files"] = [str(rule_file)]
        path = tmp_path / source.name
        path.write_text(yaml.safe_dump(unit))
        to_run.append(str(path))
        exercised.update(g["name"] for g in groups)
    # every group the parameters changed (job selector, runbook base) is run here
    changed = {g["name"] for gs in in_chart.values() for g in gs if by_name[g["name"]] != g}
    assert changed and changed <= exercised, sorted(changed - exercised)
    result = subprocess.run(
        [promtool, "test", "rules", *to_run],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- scheduling: taints and the priority class quota --------------------------------------


def test_tolerate_all_tolerates_every_taint() -> None:
    tolerations = pod_spec(VALUE_SETS["tolerate-all"])["tolerations"]
    assert tolerations == [{"operator": "Exists"}]
    custom = {"tolerateAll": True, "tolerations": [{"key": "a", "operator": "Exists"}]}
    assert pod_spec(custom)["tolerations"] == [{"operator": "Exists"}]


def quota_admits(pod: dict[str, Any], namespace: str, quotas: list[dict[str, Any]]) -> bool:
    """The ResourceQuota admission plugin with limitedResources {pods, PriorityClass In
    [system-node-critical, system-cluster-critical]} (GKE's configuration): a pod of a
    limited class needs a quota in its namespace whose scopeSelector covers its class."""
    limited = {"system-node-critical", "system-cluster-critical"}
    name = pod.get("priorityClassName")
    if name not in limited:
        return True
    for quota in quotas:
        if quota["metadata"]["namespace"] != namespace:
            continue
        for expression in quota["spec"].get("scopeSelector", {}).get("matchExpressions", []):
            if (
                expression["scopeName"] == "PriorityClass"
                and expression["operator"] == "In"
                and name in expression["values"]
            ):
                return True
    return False


def test_priority_class_quota_admits_the_pods_where_critical_classes_are_limited() -> None:
    assert not quota_admits(pod_spec({}), NAMESPACE, by_kind({}, "ResourceQuota"))
    notes = render({})["gpu-occupancy-exporter/templates/NOTES.txt"]
    assert "priorityClassQuota.enabled=true" in notes
    values = VALUE_SETS["gke-priority-quota"]
    (quota,) = by_kind(values, "ResourceQuota")
    assert quota_admits(pod_spec(values), NAMESPACE, [quota])
    assert quota["spec"]["hard"] == {"pods": "500"}
    assert (
        "priorityClassQuota.enabled=true"
        not in render(values)["gpu-occupancy-exporter/templates/NOTES.txt"]
    )
    own_class = {"priorityClassName": "gpu-agents", "priorityClassQuota": {"enabled": True}}
    (quota,) = by_kind(own_class, "ResourceQuota")
    assert quota["spec"]["scopeSelector"]["matchExpressions"][0]["values"] == ["gpu-agents"]


def test_kube_system_needs_no_quota_note() -> None:
    notes = helm.Chart.load(CHART).render({}, name="gpu", namespace="kube-system")
    assert "priorityClassQuota" not in notes["gpu-occupancy-exporter/templates/NOTES.txt"]


# -- documentation ------------------------------------------------------------------------


def test_install_md_links_to_its_own_sections() -> None:
    text = (ROOT / "docs" / "install.md").read_text()
    anchors = {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}
    links = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert links and not links - anchors, sorted(links - anchors)
