"""Import nothing a configuration does not use: memory that is not the exporter's own.

A package imported is resident whether or not it is used: the ``kubernetes`` client is
~33 MiB of RSS, PyYAML ~1.7, bcrypt ~0.3. So the DCGM bindings are imported only when
DCGM is on, bcrypt only when basic auth checks a password, the Kubernetes client only
when an API server is configured, PyYAML only for ``--web-config-file`` (and by the
simulator, which reads its scenario in YAML).

The exporter runs as a process (``python -m exporter`` through ``runpy``, as ``-m`` runs
it) that writes the names in ``sys.modules`` when it exits: every module it imported,
whenever it did, the lazy imports of a source's first connection included (``python -X
importtime`` would miss those imported with ``importlib.import_module``, as the DCGM
bindings are). A control run with every one of them configured shows that the same
reading sees them when they are there.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import bcrypt

from tests.bench_scripts import load
from tests.exporter_process import free_port, terminate, wait_for

FAKE_BINDINGS = str(Path(__file__).parent / "fake_dcgm")
DCGM_BINDINGS = ("pydcgm", "dcgm_structs", "dcgm_fields", "dcgm_agent")
OPTIONAL = ("kubernetes", "bcrypt", *DCGM_BINDINGS)
USER, PASSWORD = "prometheus", "s3cret"

# ``python -c MODULES_AT_EXIT ARGS...`` is ``python -m exporter ARGS...`` that writes the
# names in sys.modules to $EXPORTER_MODULES_FILE (JSON) on its way out: the same reading
# the benchmark's import floor starts from.
MODULES_AT_EXIT: str = load("memory_floor").MODULES_AT_EXIT


def metrics(url: str, auth: bool) -> bytes:
    request = urllib.request.Request(url + "/metrics")
    if auth:
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return bytes(response.read())
    except OSError:
        return b""


def run_exporter(
    args: list[str], out: Path, *, auth: bool = False, want: tuple[str, ...] = ()
) -> set[str]:
    """Start it, wait until /metrics says the sources in ``want`` are up (their lazy
    imports done), stop it; the top-level names of the modules it imported."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    written = out / "modules.json"
    process = subprocess.Popen(
        [sys.executable, "-c", MODULES_AT_EXIT, *args, "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "EXPORTER_MODULES_FILE": str(written)},
    )
    marks = [f'gpu_exporter_source_up{{source="{s}"}} 1.0'.encode() for s in want]
    wait_for(lambda: all(m in metrics(url, auth) for m in marks), process, timeout_s=60)
    _, stderr = terminate(process)
    assert written.exists(), stderr[-2000:]
    return {name.partition(".")[0] for name in json.loads(written.read_text())}


SIMULATED = ["--simulate", "node-8gpu", "--interval", "0.5", "--log-level", "warning"]


def test_a_configuration_without_them_imports_no_kubernetes_bcrypt_or_dcgm(
    tmp_path: Path,
) -> None:
    modules = run_exporter(
        [*SIMULATED, "--kube-api", "off", "--dcgm", "off"],
        tmp_path,
        want=("nvml", "podresources", "xid"),
    )
    assert "exporter" in modules and "grpc" in modules  # the reading works
    assert sorted(m for m in OPTIONAL if m in modules) == []


def test_the_control_with_all_of_them_configured_imports_each(tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  {USER}: '{hashed}'\n")
    modules = run_exporter(
        [
            *SIMULATED,
            "--web-config-file",
            str(web),
            "--dcgm",
            "auto",
            "--dcgm-bindings-path",
            FAKE_BINDINGS,
        ],
        tmp_path,
        auth=True,
        want=("nvml", "podresources", "kube", "dcgm"),
    )
    assert sorted(m for m in OPTIONAL if m not in modules) == []


def test_importing_the_cli_imports_none_of_them_nor_yaml() -> None:
    """Module-level imports: everything the exporter can run is imported by exporter.cli;
    none of the optional packages may come with it."""
    code = (
        "import sys, exporter.cli\n"
        f"print(','.join(m for m in {(*OPTIONAL, 'yaml')!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == ""
