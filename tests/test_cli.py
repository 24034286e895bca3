"""The command line as an operator meets it: real subprocesses, real ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from exporter.config import SERVER_ONLY_FLAGS, Bounds, ConfigError, build_parser, parse_config
from exporter.model import DcgmMode

EXE = [sys.executable, "-m", "exporter"]


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EXE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # one exporter process per case (~0.6 s each)
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--interval", "-1"], "--interval: -1 is not in the range 0.1..3600 seconds"),
        (["--interval", "0.05"], "not in the range 0.1..3600"),
        (["--interval", "soon"], "--interval: 'soon' is not a number in 0.1..3600 seconds"),
        (["--interval", "inf"], "--interval: inf is not in the range 0.1..3600 seconds"),
        (["--orphan-threshold", "inf"], "--orphan-threshold: inf is not in the range"),
        (["--listen", "9445"], "--listen: '9445' is not HOST:PORT"),
        (["--http-max-connections", "0"], "--http-max-connections: 0 is not in the range 1.."),
        (["--http-header-timeout", "0"], "--http-header-timeout: 0 is not in the range 0.1.."),
        (["--listen", "0.0.0.0:70000"], "is not HOST:PORT"),
        (["--kube-api", "maybe"], "invalid choice: 'maybe'"),
        (["--log-format", "xml"], "invalid choice: 'xml'"),
        (
            ["--families-disable", "gpu_fp*,gpu_temprature_celsius"],
            "--families-disable: 'gpu_temprature_celsius' matches no metric family",
        ),
        (
            ["--simulate", "/nonexistent/scenario.yaml"],
            "cannot read scenario '/nonexistent/scenario.yaml'",
        ),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_status_2(args: list[str], needle: str) -> None:
    result = run(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpu-occupancy-exporter: error: ")
    assert needle in lines[0]
    assert result.stdout == ""


def test_invalid_scenario_yaml_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  - name: [unclosed\n")
    result = run("--simulate", str(bad))
    assert result.returncode == 2
    assert "is not valid YAML at line" in result.stderr


def test_scenario_with_an_unknown_key_is_rejected_with_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "typo.yaml"
    bad.write_text("gpus:\n  - temprature: 40\n")
    result = run("--simulate", str(bad))
    assert result.returncode == 2
    assert "gpus[0]: unknown key 'temprature'" in result.stderr


def test_http_limits_are_parsed_with_documented_defaults() -> None:
    default = parse_config([], env={})
    assert (default.http_header_timeout_s, default.http_max_connections) == (10.0, 128)
    set_ = parse_config(["--http-header-timeout", "2.5", "--http-max-connections", "16"], env={})
    assert (set_.http_header_timeout_s, set_.http_max_connections) == (2.5, 16)


def test_environment_variable_sets_a_flag_and_the_flag_wins() -> None:
    env = {"GPU_EXPORTER_INTERVAL": "2.5", "GPU_EXPORTER_LISTEN": "127.0.0.1:9999"}
    assert parse_config([], env=env).interval_s == 2.5
    assert parse_config(["--interval", "7"], env=env).interval_s == 7.0
    assert parse_config([], env=env).listen_port == 9999
    assert parse_config([], env={"NODE_NAME": "gpu-node-7"}).node_name == "gpu-node-7"
    assert parse_config([], env={"GPU_EXPORTER_PER_PROCESS_METRICS": "true"}).per_process_metrics


def test_a_variable_overridden_by_its_flag_is_not_parsed() -> None:
    """--help says the flag wins: a bad variable under a given flag is no error (it was:
    --interval 2 with GPU_EXPORTER_INTERVAL=inf stopped the exporter)."""
    env = {"GPU_EXPORTER_INTERVAL": "inf", "GPU_EXPORTER_KMSG": "yes-please"}
    config = parse_config(["--interval", "2", "--kmsg"], env=env)
    assert (config.interval_s, config.kmsg) == (2.0, True)
    window = {"GPU_EXPORTER_HEALTH_XID_WINDOW": "x"}
    snapshot = parse_config(["snapshot", "--health-xid-window", "60"], env=window)
    assert snapshot.health_xid_window_s == 60.0
    # without the flag the variable is parsed, and named when bad
    with pytest.raises(ConfigError, match="GPU_EXPORTER_INTERVAL: inf is not in the range"):
        parse_config(["--kmsg"], env=env)
    with pytest.raises(ConfigError, match="GPU_EXPORTER_KMSG: 'yes-please' is not a boolean"):
        parse_config(["--interval", "2"], env=env)
    with pytest.raises(ConfigError, match="GPU_EXPORTER_INTERVAL: 'x' is not a number"):
        parse_config(["snapshot"], env={"GPU_EXPORTER_INTERVAL": "x"})
    assert parse_config([], env={"GPU_EXPORTER_KMSG": "off"}).kmsg is False


@pytest.mark.parametrize("code", ["0", "65536", "99999999999999999999"])
def test_an_xid_code_out_of_range_is_refused(code: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(["--xid-class", f"13=fatal,{code}=fatal"], env={})
    assert f"XID {code} is not in the range 1..65535" in str(raised.value)
    assert parse_config(["--xid-class", "65535=fatal"], env={}).xid_classes == {65535: "fatal"}


def test_xid_severity_is_still_accepted_as_the_old_name_of_xid_class() -> None:
    assert parse_config(["--xid-severity", "13=fatal"], env={}).xid_classes == {13: "fatal"}
    both = parse_config(["--xid-severity", "13=fatal", "--xid-class", "13=warning"], env={})
    assert both.xid_classes == {13: "warning"}  # the new name wins
    old_env = parse_config([], env={"GPU_EXPORTER_XID_SEVERITY": "94=warning"})
    assert old_env.xid_classes == {94: "warning"}


def test_bad_environment_value_is_reported_under_its_variable_name() -> None:
    with pytest.raises(ConfigError, match="GPU_EXPORTER_KUBE_API: 'sometimes' is not one of"):
        parse_config([], env={"GPU_EXPORTER_KUBE_API": "sometimes"})
    with pytest.raises(ConfigError, match="GPU_EXPORTER_INTERVAL: 'x' is not a number"):
        parse_config([], env={"GPU_EXPORTER_INTERVAL": "x"})


def test_help_shows_one_real_default_per_flag_and_names_the_subcommand() -> None:
    text = build_parser({}).format_help()
    assert "(default: None)" not in text and "(default: )" not in text
    for block in text.split("\n  --")[1:]:  # one block per flag
        assert " ".join(block.split()).count("default:") <= 1, block
    assert text.startswith("usage: gpu-occupancy-exporter [snapshot|doctor]")


def test_snapshot_help_offers_only_flags_that_act_there() -> None:
    text = build_parser({}, snapshot=True).format_help()
    assert "--json" in text and "--window" in text and "--simulate" in text
    for flag in SERVER_ONLY_FLAGS:
        assert flag not in text
    with pytest.raises(ConfigError, match="unrecognized arguments: --listen"):
        parse_config(["snapshot", "--listen", "127.0.0.1:1"], env={})
    assert parse_config(["snapshot"], env={}).listen_port == 9445  # still a Config


def test_help_explains_every_flag_with_its_environment_variable() -> None:
    result = run("--help")
    assert result.returncode == 0
    flags = [
        "--listen",
        "--interval",
        "--proc-root",
        "--pod-resources-socket",
        "--node-name",
        "--kube-api",
        "--simulate",
        "--log-level",
        "--log-format",
        "--kubeconfig",
        "--per-process-metrics",
        "--resource-names",
        "--dra-drivers",
        "--pod-resources-interval",
    ]
    for flag in flags:
        assert flag in result.stdout
        env_name = "GPU_EXPORTER_" + flag[2:].replace("-", "_").upper()
        assert env_name in result.stdout, env_name


def test_every_flag_is_in_the_readme_flag_table() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    flags = {
        option
        for action in build_parser({})._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    assert flags
    missing = sorted(flag for flag in flags if f"`{flag}" not in readme)
    assert not missing, f"README.md's flag table lacks {missing}"


def test_every_numeric_flag_has_its_range_in_the_readme() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    rows = {}
    for snapshot in (False, True):
        for action in build_parser({}, snapshot=snapshot)._actions:
            bounds = getattr(action.type, "__self__", None)
            if isinstance(bounds, Bounds):
                flag = action.option_strings[-1]
                only = " (snapshot)" if snapshot and flag not in rows else ""
                rows[flag] = f"| `{flag}`{only} | {bounds} |"
    assert "--interval" in rows and "--window" in rows
    missing = [row for row in rows.values() if row not in readme]
    assert not missing, f"README.md's range table lacks or misstates {missing}"


def test_dra_drivers_and_dcgm_are_stored_parsed() -> None:
    config = parse_config(
        ["--dra-drivers", " gpu.nvidia.com, , example.com/gpu ", "--dcgm", "[::1]:5555"], env={}
    )
    assert config.dra_drivers == ("gpu.nvidia.com", "example.com/gpu")
    assert config.dcgm == DcgmMode("hostengine", "[::1]:5555")
    assert parse_config(["--dra-drivers", ""], env={}).dra_drivers == ()
    assert parse_config([], env={}).dcgm == DcgmMode("auto")
    with pytest.raises(ConfigError, match="--dcgm must be 'auto', 'off' or HOST:PORT"):
        parse_config(["--dcgm", "localhost"], env={})


def test_dcgm_errors_name_the_environment_variable_the_value_came_from() -> None:
    with pytest.raises(ConfigError, match=r"^GPU_EXPORTER_DCGM must be 'auto', 'off' or"):
        parse_config([], env={"GPU_EXPORTER_DCGM": "localhost"})
    with pytest.raises(ConfigError, match=r"^GPU_EXPORTER_DCGM_OPERATOR_NAMESPACE: 'Bad_NS' is"):
        parse_config([], env={"GPU_EXPORTER_DCGM_OPERATOR_NAMESPACE": "Bad_NS"})
    with pytest.raises(ConfigError, match=r"^--dcgm-operator-namespace: 'Bad_NS' is"):
        parse_config(["--dcgm-operator-namespace", "Bad_NS"], env={})


def test_empty_dcgm_paths_are_refused_not_taken_as_the_working_directory() -> None:
    for flag in ("--dcgm-library-path", "--dcgm-bindings-path"):
        with pytest.raises(ConfigError, match=f"^{flag} is empty: give the directory"):
            parse_config([f"{flag}="], env={})
    env = {"GPU_EXPORTER_DCGM_LIBRARY_PATH": ""}
    with pytest.raises(ConfigError, match=r"^GPU_EXPORTER_DCGM_LIBRARY_PATH is empty"):
        parse_config([], env=env)
    assert parse_config(["--dcgm-library-path", "/opt/dcgm/lib"], env={}).dcgm_library_path == (
        "/opt/dcgm/lib"
    )


def _wait_ready(url: str, process: subprocess.Popen[str], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("exporter did not become ready")


def _run_until_ready(args: list[str]) -> tuple[str, subprocess.Popen[str]]:
    port = free_port()
    process = subprocess.Popen(
        [*EXE, *args, "--listen", f"127.0.0.1:{port}", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, process)
    return url, process


def test_simulated_node_serves_metrics_and_stops_cleanly_on_sigterm() -> None:
    url, process = _run_until_ready(["--simulate", "single-gpu", "--log-format", "json"])
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            body = response.read().decode()
        assert 'gpu_memory_used_bytes{gpu="0"' in body
        assert "gpu_exporter_nvml_up 1.0" in body
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=15)
    assert process.returncode == 0
    assert '"message": "stopped"' in stderr  # json logs, one object per line


def test_the_landing_page_names_the_simulated_node_not_this_host() -> None:
    url, process = _run_until_ready(
        ["--simulate", "single-gpu", "--kube-api", "off", "--node-name", "the-real-host"]
    )
    try:
        with urllib.request.urlopen(url + "/", timeout=5) as response:
            page = response.read().decode()
        assert "sim-single" in page and "the-real-host" not in page
    finally:
        process.terminate()
        process.communicate(timeout=15)


def test_no_driver_keeps_serving_nvml_down() -> None:
    url, process = _run_until_ready(["--simulate", "no-gpu", "--kube-api", "off"])
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            body = response.read().decode()
        assert "gpu_exporter_nvml_up 0.0" in body
        assert "gpu_info" not in body
        assert process.poll() is None
    finally:
        process.terminate()
        process.communicate(timeout=15)


def test_a_value_of_the_wrong_kind_in_a_scenario_is_one_line_too(tmp_path: Path) -> None:
    bad = tmp_path / "kinds.yaml"
    bad.write_text("gpus: [{}]\nhost_processes:\n  - {gpu: 0, sm: lots}\n")
    result = run("--simulate", str(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "scenario 'kinds': invalid value:" in lines[0]
