"""The chart's DCGM wiring (docs/dcgm.md, "With the chart"): occupancy on GPUs before Hopper.

Real Helm renders the chart; the dcgm-bindings init container's own script runs here
under /bin/sh against a directory laid out as NVIDIA's DCGM image lays out its bindings
and libdcgm; then the exporter runs with the flags the chart rendered (the volume's
mount path mapped to that directory) on the simulated A100 node, against the DCGM
stand-in (tests/fake_dcgm) serving as the GPU Operator's host engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from exporter.config import parse_config
from tests.harness import simulated_exporter
from tests.test_helm_chart import VALUE_SETS, container, pod_spec, render
from tests.test_occupancy_source import OPERATOR_HOSTENGINE, a100_dcgm_state, served_source

pytestmark = pytest.mark.slow

FAKE_BINDINGS = Path(__file__).parent / "fake_dcgm"
MOUNT = "/etc/gpu-occupancy-exporter/dcgm"


@pytest.fixture
def tmp_path(tmp_path: Path) -> Path:
    """pytest's directory, opened to the pod's user (uid 65532) that the scripts run as;
    an emptyDir is world-writable too."""
    for parent in [tmp_path, *tmp_path.parents]:
        if parent == Path("/tmp"):
            break
        parent.chmod(parent.stat().st_mode | 0o711)
    tmp_path.chmod(0o777)
    return tmp_path


def volume(tmp_path: Path) -> Path:
    """An emptyDir: world-writable."""
    out = tmp_path / "volume"
    out.mkdir()
    out.chmod(0o777)
    return out


def init_container(values: dict[str, Any]) -> dict[str, Any] | None:
    found = [c for c in pod_spec(values).get("initContainers", []) if c["name"] == "dcgm-bindings"]
    return found[0] if found else None


def dcgm_args(values: dict[str, Any]) -> list[str]:
    return [a for a in container(values)["args"] if a.startswith("--dcgm")]


def test_defaults_on_the_operator_copy_dcgm_and_read_it_from_the_volume() -> None:
    init = init_container({})
    assert init is not None
    assert init["image"] == "nvcr.io/nvidia/cloud-native/dcgm:4.6.0-1-ubuntu24.04"
    assert init["command"] == ["/bin/sh", "-c"]
    assert init["volumeMounts"] == [{"name": "dcgm", "mountPath": "/dcgm"}]
    assert init["securityContext"]["runAsNonRoot"] is True
    assert dcgm_args({}) == [
        "--dcgm=auto",
        f"--dcgm-bindings-path={MOUNT}/bindings",
        f"--dcgm-library-path={MOUNT}/lib",
    ]
    mounts = {m["name"]: m for m in container({})["volumeMounts"]}
    assert mounts["dcgm"] == {"name": "dcgm", "mountPath": MOUNT, "readOnly": True}
    volumes = {v["name"]: v for v in pod_spec({})["volumes"]}
    assert "emptyDir" in volumes["dcgm"]
    config = parse_config(container({})["args"], {"NODE_NAME": "n"})
    assert config.dcgm.kind == "auto"
    assert config.dcgm_library_path == f"{MOUNT}/lib"


@pytest.mark.parametrize("platform", ["gke", "plain"])
def test_other_platforms_leave_dcgm_off_and_copy_nothing(platform: str) -> None:
    values = {"platform": platform}
    assert init_container(values) is None
    assert dcgm_args(values) == ["--dcgm=off"]
    assert "dcgm" not in {v["name"] for v in pod_spec(values)["volumes"]}


def test_an_explicit_mode_wins_on_every_platform() -> None:
    assert dcgm_args({"dcgm": {"mode": "off"}}) == ["--dcgm=off"]
    assert init_container({"dcgm": {"mode": False}}) is None
    on_gke = {"platform": "gke", "dcgm": {"mode": "auto"}}
    assert dcgm_args(on_gke)[0] == "--dcgm=auto" and init_container(on_gke) is not None


def test_own_image_bindings_or_no_bindings_image_add_no_init_container() -> None:
    own = {"dcgm": {"bindingsPath": "/usr/share/datacenter-gpu-manager-4/bindings/python3"}}
    assert init_container(own) is None
    assert dcgm_args(own) == [
        "--dcgm=auto",
        "--dcgm-bindings-path=/usr/share/datacenter-gpu-manager-4/bindings/python3",
    ]
    assert init_container(VALUE_SETS["dcgm-no-bindings-image"]) is None
    assert dcgm_args(VALUE_SETS["dcgm-no-bindings-image"]) == ["--dcgm=auto"]


@pytest.mark.parametrize(
    ("version", "tag"),
    [
        ("23.9.0", "3.2.6-1-ubuntu20.04"),
        ("24.9.2", "3.3.9-1-ubuntu22.04"),
        ("v25.3.0", "4.1.1-2-ubuntu22.04"),
        ("25.10.1", "4.4.2-1-ubuntu22.04"),
        ("26.3.3", "4.5.2-1-ubuntu22.04"),
        ("v26.7.0", "4.6.0-1-ubuntu24.04"),
        ("26.7.5", "4.6.0-1-ubuntu24.04"),  # a patch not in the table: its series
        ("24.9.7", "3.3.9-1-ubuntu22.04"),
    ],
)
def test_the_dcgm_image_follows_the_operators_host_engine(version: str, tag: str) -> None:
    init = init_container({"gpuOperator": {"version": version}})
    assert init is not None and init["image"] == f"nvcr.io/nvidia/cloud-native/dcgm:{tag}"


def test_image_and_paths_are_values() -> None:
    init = init_container(VALUE_SETS["dcgm-image-paths"])
    assert init is not None
    assert init["image"] == "registry.example.com/nvidia/dcgm:4.2.3-1-ubuntu22.04"
    assert init["imagePullPolicy"] == "Always"
    env = {e["name"]: e["value"] for e in init["env"]}
    assert env["BINDINGS_DIRS"] == "/opt/dcgm/python3 /opt/dcgm3/python3"
    assert env["LIBRARY_DIRS"] == "/opt/dcgm/lib"


def test_a_digest_pins_the_dcgm_image_and_bad_references_are_refused() -> None:
    init = init_container(VALUE_SETS["dcgm-image-digest"])
    assert init is not None
    assert init["image"] == "nvcr.io/nvidia/cloud-native/dcgm@sha256:" + "ab" * 32
    for bad in ({"repository": "nvcr.io/x y"}, {"repository": "nvcr.io/dcgm:4.0"}, {"tag": " "}):
        with pytest.raises(helm.HelmValuesError):
            render({"dcgm": {"bindingsImage": bad}})


def dcgm_image(root: Path, *, library: str = "libdcgm.so.4") -> tuple[Path, Path]:
    """A directory laid out as the DCGM image keeps the bindings and libdcgm (the
    library a versioned file behind a symlink, as the Debian package installs it)."""
    bindings = root / "usr/share/datacenter-gpu-manager-4/bindings/python3"
    shutil.copytree(FAKE_BINDINGS, bindings, ignore=shutil.ignore_patterns("__pycache__"))
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / f"{library}.6.0").write_bytes(b"\x7fELF stand-in")
    (lib / library).symlink_to(f"{library}.6.0")
    return bindings, lib


def as_pod_user() -> list[str]:
    """The init container runs as uid 65532 without capabilities; as root here, so do we
    (root would overwrite read-only files and read unreadable ones)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return []
    return ["setpriv", "--reuid=65532", "--regid=65532", "--clear-groups", "--inh-caps=-all"]


def run_init_script(values: dict[str, Any], out: Path) -> subprocess.CompletedProcess[str]:
    init = init_container(values)
    assert init is not None
    env = {e["name"]: e["value"] for e in init["env"]}
    env["OUT"] = str(out)  # the volume's mount path, /dcgm in the pod
    command = [*as_pod_user(), *init["command"], *init["args"]]
    return subprocess.run(
        command, env={**env, "PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=30
    )


def image_values(root: Path) -> dict[str, Any]:
    return {
        "dcgm": {
            "bindingsImage": {
                "bindingsDir": f"{root}/usr/share/datacenter-gpu-manager-4/bindings/python3",
                "libraryDir": f"{root}/usr/lib/x86_64-linux-gnu {root}/usr/lib64",
            }
        }
    }


def test_the_init_script_copies_bindings_and_the_library_behind_its_symlink(
    tmp_path: Path,
) -> None:
    dcgm_image(tmp_path / "image")
    out = volume(tmp_path)
    done = run_init_script(image_values(tmp_path / "image"), out)
    assert done.returncode == 0, done.stderr
    assert (out / "bindings/pydcgm.py").is_file()
    copied = out / "lib/libdcgm.so.4"
    assert copied.is_file() and not copied.is_symlink()
    assert copied.read_bytes() == b"\x7fELF stand-in"


def test_an_image_without_dcgm_leaves_the_volume_empty_and_the_pod_starting(
    tmp_path: Path,
) -> None:
    (tmp_path / "image").mkdir()
    out = volume(tmp_path)
    done = run_init_script(image_values(tmp_path / "image"), out)
    assert done.returncode == 0  # DCGM is optional: the exporter must still start
    assert "no pydcgm.py" in done.stderr and "dcgm.mode=off" in done.stderr
    assert list(out.iterdir()) == []


def test_a_rerun_over_its_own_read_only_copy_succeeds(tmp_path: Path) -> None:
    """The init container runs again when the pod sandbox is recreated; the emptyDir keeps
    the first run's files, read-only where the image's were (an adversarial review)."""
    bindings, lib = dcgm_image(tmp_path / "image")
    for f in [*bindings.iterdir(), lib / "libdcgm.so.4.6.0"]:
        if f.is_file():
            f.chmod(0o444)
    out = volume(tmp_path)
    for _ in range(2):
        done = run_init_script(image_values(tmp_path / "image"), out)
        assert done.returncode == 0 and "dcgm-bindings: copied" in done.stdout, done.stderr
    assert (out / "bindings/pydcgm.py").is_file() and (out / "lib/libdcgm.so.4").is_file()
    assert not (out / ".staging").exists()


def test_a_failed_copy_leaves_the_volume_empty_and_the_pod_starting(tmp_path: Path) -> None:
    """A copy error (here: the volume is not a directory, so nothing can be made in it;
    as root no permission bit stops cp) is logged, nothing is left: DCGM is optional, the
    exporter must still start."""
    dcgm_image(tmp_path / "image")
    out = tmp_path / "volume"
    out.write_text("not a directory")
    done = run_init_script(image_values(tmp_path / "image"), out)
    assert done.returncode == 0
    assert "failed" in done.stderr and "DCGM stays unavailable" in done.stderr
    assert out.read_text() == "not a directory"


def test_a_library_that_is_a_directory_or_dangling_is_not_taken(tmp_path: Path) -> None:
    _, lib = dcgm_image(tmp_path / "image")
    (lib / "libdcgm.so.4").unlink()
    (lib / "libdcgm.so.4").mkdir()
    (lib / "libdcgm.so.3").symlink_to("missing.so")
    out = volume(tmp_path)
    done = run_init_script(image_values(tmp_path / "image"), out)
    assert done.returncode == 0 and "no pydcgm.py" in done.stderr
    assert list(out.iterdir()) == []


def rendered_dcgm_flags(values: dict[str, Any], volume: Path) -> list[str]:
    """The chart's --dcgm flags, its volume's mount path replaced by where it is here."""
    return [a.replace(MOUNT, str(volume)) for a in dcgm_args(values)]


def copied_and_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The init script run over a DCGM image's layout into a volume; the DCGM stand-in
    serving the a100 scenario as the Operator's host engine, its libdcgm in no system
    directory of the exporter's image (its loader logs where it loaded from)."""
    dcgm_image(tmp_path / "image")
    volume_dir = volume(tmp_path)
    assert run_init_script(image_values(tmp_path / "image"), volume_dir).returncode == 0
    state = a100_dcgm_state(tmp_path / "dcgm.json")
    data = json.loads(state.read_text())
    data["library_dirs"] = [str(tmp_path / "exporter-image-usr-lib")]
    data["calls_log"] = str(tmp_path / "calls.jsonl")
    state.write_text(json.dumps(data))
    monkeypatch.setenv("FAKE_DCGM_STATE", str(state))
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    return volume_dir


async def test_an_a100_gets_sm_activity_from_dcgm_through_the_default_chart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pre-Hopper occupancy via the chart: defaults, the init script, the exporter's own DCGM path.
    libdcgm is in no system directory of the exporter's image: only the copy reaches it."""
    volume_dir = copied_and_served(tmp_path, monkeypatch)
    argv = rendered_dcgm_flags({}, volume_dir)
    assert argv[0] == "--dcgm=auto"
    async with simulated_exporter("a100", argv=argv) as h:
        await h.advance(5)
        scrape = await h.scrape()
    assert scrape.get("gpu_exporter_source_up", source="dcgm") == 1
    assert scrape.get("gpu_sm_active_ratio", gpu="0") == 0.41
    assert served_source(scrape, "0") == "dcgm"
    loads = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert {"fn": "_LoadDcgmLibrary", "from": str(volume_dir / "lib")} in loads
    hostengines = [c for c in loads if c["fn"] == "dcgmConnect_v3"]
    assert hostengines and OPERATOR_HOSTENGINE in json.dumps(hostengines)


async def test_without_the_library_path_the_copied_bindings_find_no_libdcgm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What --dcgm-library-path is for: the bindings alone look only in system
    directories (and DCGM 4 in $LD_LIBRARY_PATH), where the exporter's image has none."""
    volume_dir = copied_and_served(tmp_path, monkeypatch)
    argv = [a for a in rendered_dcgm_flags({}, volume_dir) if not a.startswith("--dcgm-library")]
    async with simulated_exporter("a100", argv=argv) as h:
        await h.advance(5)
        scrape = await h.scrape()
    assert scrape.find("gpu_sm_active_ratio", gpu="0") == []
    assert served_source(scrape, "0") == "none"
