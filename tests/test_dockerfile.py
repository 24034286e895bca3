"""The container image's install cannot silently rot.

Wherever Python runs (no container engine needed), the test repeats what the Dockerfile does:
it reads the Dockerfile's instructions, copies what each COPY copies (after the
.dockerignore rules, as the build context would), runs each RUN step's ``pip`` commands
with a fresh virtualenv's pip, then runs the installed console script. A RUN command the
test does not know how to repeat fails it, so a new build step cannot slip past.
tests/test_image_build.py builds and runs the real image where buildah is installed.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from exporter.config import build_parser, parse_host_port

# The install steps pip-install the package into a fresh venv (~15 s; the first run on a
# machine also downloads its wheels, ~30 s more): the slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


# -- Dockerfile and .dockerignore, read the way the builder reads them ------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order: comments dropped, backslash continuations joined."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # a comment inside a continuation
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a line continuation"
    return instructions


def exec_form(args: str) -> list[str] | None:
    """``["a", "b"]`` (the JSON exec form) as a list, else None (the shell form)."""
    if not args.startswith("["):
        return None
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def parse_key_values(args: str) -> dict[str, str]:
    """``LABEL``/``ENV``/``ARG`` arguments in the ``key=value ...`` form."""
    pairs = {}
    for token in shlex.split(args):
        key, sep, value = token.partition("=")
        pairs[key] = value if sep else ""
    return pairs


def dockerignore_patterns(text: str) -> list[tuple[bool, str]]:
    """``(exclude, pattern)`` per rule; ``!`` re-includes. Paths are cleaned like Docker's."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((exclude, pattern))
    return rules


def _pattern_matches(pattern: str, path: str) -> bool:
    """Docker's filepath.Match plus ``**``: ``*`` stays within one path segment."""
    regex = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            regex += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            regex += ".*"
            i += 2
        elif pattern[i] == "*":
            regex += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            regex += "[^/]"
            i += 1
        else:
            regex += re.escape(pattern[i])
            i += 1
    return re.fullmatch(regex, path) is not None


def is_ignored(path: str, rules: list[tuple[bool, str]]) -> bool:
    """The last rule matching the path or one of its parent directories decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for exclude, pattern in rules:
        if any(_pattern_matches(pattern, candidate) for candidate in candidates):
            ignored = exclude
    return ignored


def build_context(root: Path) -> set[str]:
    """Every file the builder would send (relative paths), after .dockerignore."""
    rules = dockerignore_patterns(DOCKERIGNORE.read_text())
    files = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if d not in {".git", ".venv", "venv"}]
        for name in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if not is_ignored(rel, rules):
                files.add(rel)
    return files


# -- replaying the build in a temporary "container root" --------------------------------


@dataclass
class Build:
    """A replayed image: ``root`` stands for the image's /, ``venv`` for its Python."""

    root: Path
    venv: Path
    env: dict[str, str]
    pip_commands: list[list[str]] = field(default_factory=list)

    def host_path(self, container_path: str) -> Path:
        assert container_path.startswith("/"), container_path
        return self.root / container_path.lstrip("/")

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.venv / "bin" / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )


def _copy(build: Build, context: set[str], args: str, workdir: str) -> None:
    tokens = [t for t in shlex.split(args) if not t.startswith("--")]  # --chown= etc.
    *sources, dest = tokens
    dest_abs = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
    target = build.host_path(dest_abs)
    copied = 0
    for source in sources:
        source = os.path.normpath(source)
        matched = sorted(p for p in context if fnmatch.fnmatch(p, source))
        below = sorted(p for p in context if p.startswith(source.rstrip("/") + "/"))
        if matched:  # files (a literal name or a wildcard)
            assert len(sources) == 1 or dest.endswith("/"), f"COPY {args}: dest must end in /"
            for rel in matched:
                out = target / Path(rel).name if dest.endswith("/") else target
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, out)
                copied += 1
        elif below:  # a directory: its contents go into dest
            for rel in below:
                out = target / os.path.relpath(rel, source)
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, out)
                copied += 1
        else:
            pytest.fail(f"COPY {args}: {source!r} is not in the build context (.dockerignore?)")
    assert copied, f"COPY {args} copied nothing"


def _map_paths(build: Build, argv: list[str]) -> list[str]:
    return [str(build.host_path(a)) if a.startswith("/") else a for a in argv]


# Where the replayed `pip install`s find their wheels: a wheelhouse that `pip download`
# fills from the package index with the same requirements and constraints (plus the
# build-system's requirements, for the isolated build of /src), kept between runs under
# the user's cache directory like pip's own cache, one folder per key (below). The install
# itself is the Dockerfile's command, unchanged (--no-cache-dir and all), run with
# PIP_NO_INDEX and PIP_FIND_LINKS set: pip still resolves the package's dependencies
# under the constraints, builds /src and installs real wheels; what it no longer does
# each run is fetch and sift the index's pages (tens of thousands of links, ~20 s of CPU).
WHEELHOUSE_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "gpu-occupancy-exporter-tests"
    / "image-wheelhouse"
)


def _wheelhouse_key(command: str) -> str:
    """What decides which wheels an install needs: the command as the Dockerfile writes it,
    the package's metadata (its dependencies and build requirements), the constraints and
    the Python that installs them."""
    digest = hashlib.sha256()
    for part in (
        command.encode(),
        (ROOT / "pyproject.toml").read_bytes(),
        (ROOT / "image" / "constraints.txt").read_bytes(),
        f"{sys.implementation.cache_tag} {sys.platform} {platform.machine()}".encode(),
    ):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:24]


def _fill_wheelhouse(build: Build, install_args: list[str], command: str) -> Path:
    """The wheelhouse for one `pip install` (its arguments after ``install``): downloaded
    once, then reused. A concurrent run that fills the same key first wins the rename."""
    target = WHEELHOUSE_CACHE / _wheelhouse_key(command)
    if target.is_dir():
        return target
    WHEELHOUSE_CACHE.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=WHEELHOUSE_CACHE, prefix=".partial-"))
    download = [
        str(build.venv / "bin" / "python"),
        "-m",
        "pip",
        "download",
        "-d",
        str(partial),
        *install_args,
        *PYPROJECT["build-system"]["requires"],
    ]
    result = subprocess.run(
        download, capture_output=True, text=True, env=build.env, timeout=500, check=False
    )
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        pytest.fail(f"{shlex.join(download)} failed:\n{result.stdout}\n{result.stderr}")
    try:
        partial.rename(target)
    except OSError:  # another run got there first: theirs is as good
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _pip_install(build: Build, pip: list[str], command: str) -> subprocess.CompletedProcess[str]:
    """Run one of the Dockerfile's `pip install`s as written, its wheels from the
    wheelhouse. Skipping the .pyc compilation changes nothing the image runs (it sets
    PYTHONDONTWRITEBYTECODE; Python imports the sources either way) and saves ~10 s."""
    install_args = pip[pip.index("install") + 1 :]
    for attempt in range(2):
        wheelhouse = _fill_wheelhouse(build, install_args, command)
        env = {
            **build.env,
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(wheelhouse),
            "PIP_COMPILE": "0",  # pip's switch for --no-compile
        }
        result = subprocess.run(
            pip, capture_output=True, text=True, env=env, timeout=500, check=False
        )
        if result.returncode == 0 or attempt:
            return result
        # A wheelhouse from an earlier run that lacks something: download it anew once.
        shutil.rmtree(wheelhouse, ignore_errors=True)
    raise AssertionError("unreachable")


def _run_step(build: Build, command: str) -> None:
    """Repeat one RUN step: each ``&&``-joined command the test knows how to repeat."""
    for part in re.split(r"\s*&&\s*", command.strip()):
        argv = shlex.split(part)
        if argv[:1] in (["pip"], ["pip3"]):
            pip = [str(build.venv / "bin" / "python"), "-m", "pip", *_map_paths(build, argv[1:])]
        elif argv[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
            pip = [str(build.venv / "bin" / "python"), "-m", "pip", *_map_paths(build, argv[3:])]
        elif argv[:2] == ["rm", "-rf"]:
            for path in argv[2:]:
                shutil.rmtree(build.host_path(path), ignore_errors=True)
            continue
        else:
            pytest.fail(
                f"RUN {part!r}: tests/test_dockerfile.py does not know how to repeat this "
                "command; teach _run_step, so the image's build stays tested"
            )
        build.pip_commands.append(pip)
        if "install" in pip:
            result = _pip_install(build, pip, part)
        else:
            result = subprocess.run(
                pip, capture_output=True, text=True, env=build.env, timeout=500, check=False
            )
        assert result.returncode == 0, f"{part} failed:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def build(
    instructions: list[Instruction], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Build]:
    """The image, replayed once for the module (a fresh virtualenv: ~15 s with its wheels)."""
    tmp = tmp_path_factory.mktemp("image")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    result = Build(root=tmp / "rootfs", venv=venv, env=env)
    context = build_context(ROOT)
    workdir = "/"
    for ins in instructions:
        if ins.keyword == "ENV":
            result.env.update(parse_key_values(ins.args))
        elif ins.keyword == "WORKDIR":
            workdir = ins.args if ins.args.startswith("/") else f"{workdir}/{ins.args}"
        elif ins.keyword == "COPY":
            assert "--from" not in ins.args, "multi-stage COPY: teach the test about stages"
            _copy(result, context, ins.args, workdir)
        elif ins.keyword == "RUN":
            argv = exec_form(ins.args)
            _run_step(result, shlex.join(argv) if argv else ins.args)
    yield result


# -- the Dockerfile's contract ----------------------------------------------------------


def test_base_image_is_a_slim_python_that_satisfies_requires_python(
    instructions: list[Instruction],
) -> None:
    bases = [i.args for i in instructions if i.keyword == "FROM"]
    assert len(bases) == 1, f"one stage expected (the test replays one): {bases}"
    match = re.fullmatch(r"python:(\d+)\.(\d+)-slim(?:-\w+)?", bases[0])
    assert match, f"base image {bases[0]!r} is not python:X.Y-slim"
    minimum = re.fullmatch(r">=\s*(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert minimum
    assert (int(match[1]), int(match[2])) >= (int(minimum[1]), int(minimum[2]))


def test_image_carries_oci_labels(instructions: list[Instruction]) -> None:
    labels: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "LABEL":
            labels.update(parse_key_values(ins.args))
    for key in ("title", "description", "version", "revision", "licenses", "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), f"missing OCI label {key}"
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]
    args = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            args.update(parse_key_values(ins.args))
    assert args.get("VERSION") == PYPROJECT["project"]["version"], (
        "ARG VERSION (the image's version label) must default to pyproject's version"
    )


def test_entrypoint_is_the_console_script(instructions: list[Instruction]) -> None:
    entrypoints = [exec_form(i.args) for i in instructions if i.keyword == "ENTRYPOINT"]
    assert entrypoints == [["gpu-occupancy-exporter"]]
    assert "gpu-occupancy-exporter" in PYPROJECT["project"]["scripts"]


def test_exposed_port_is_the_exporters_default_listen_port(
    instructions: list[Instruction],
) -> None:
    exposed = [i.args for i in instructions if i.keyword == "EXPOSE"]
    _, default_port = parse_host_port(build_parser({}).get_default("listen"))
    assert exposed == [str(default_port)]


def test_image_runs_as_root_by_default_for_nvml_and_the_pod_resources_socket(
    instructions: list[Instruction],
) -> None:
    # A USER here would break PodResources (root-owned socket) for every chart user;
    # non-root is opt-in (podSecurityContext.runAsUser), see docs/install.md.
    assert not [i for i in instructions if i.keyword == "USER"]


def test_dockerignore_rules_follow_docker_semantics() -> None:
    rules = dockerignore_patterns("*\n!exporter/\n**/__pycache__\n!keep.md\n")
    assert is_ignored("tests/test_cli.py", rules)
    assert is_ignored(".git/config", rules)
    assert not is_ignored("exporter/sim/scenarios/node-8gpu.yaml", rules)
    assert is_ignored("exporter/__pycache__/agent.cpython-311.pyc", rules)
    assert not is_ignored("keep.md", rules)
    assert not _pattern_matches("*", "exporter/agent.py")  # * stays in one segment


def test_build_context_holds_the_package_sources_and_nothing_else() -> None:
    context = build_context(ROOT)
    assert {"pyproject.toml", "README.md", "exporter/__init__.py", "exporter/cli.py"} <= context
    # package data the exporter needs at run time (pyproject's package-data)
    assert any(p.startswith("exporter/sim/scenarios/") and p.endswith(".yaml") for p in context)
    assert any(p.endswith(".proto") for p in context)
    strays = {p for p in context if p.split("/")[0] in {"tests", "charts", "benchmarks", "docs"}}
    assert not strays, f"the image build context should not carry {sorted(strays)[:5]}"
    assert not [p for p in context if "__pycache__" in p or p.endswith(".pyc")]


# -- the replayed install ---------------------------------------------------------------


def test_install_steps_run_pip_from_the_dockerfile(build: Build) -> None:
    installs = [c for c in build.pip_commands if "install" in c]
    assert installs, "the Dockerfile installs nothing with pip"
    assert all("--no-cache-dir" in c for c in installs)
    assert not build.host_path("/src").exists(), "the sources should not stay in the image"


def test_install_is_pinned_by_the_image_constraints(build: Build) -> None:
    # image/constraints.txt (image/lock.py) pins every runtime dependency; pip's -c makes
    # the image install exactly those versions (tests/test_image_build.py checks them).
    installs = [c for c in build.pip_commands if "install" in c]
    for command in installs:
        assert "-c" in command, f"pip install without -c constraints: {command}"
        constraints = Path(command[command.index("-c") + 1])
        assert constraints.name == "constraints.txt"
    assert "image/constraints.txt" in build_context(ROOT)


def test_installed_console_script_reports_the_package_version(build: Build) -> None:
    result = build.run("gpu-occupancy-exporter", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"gpu-occupancy-exporter {PYPROJECT['project']['version']}"


def test_installed_console_script_prints_help(build: Build) -> None:
    result = build.run("gpu-occupancy-exporter", "--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--listen", "--proc-root", "--pod-resources-socket", "--kube-api"):
        assert flag in result.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_healthcheck_passes_against_the_installed_exporter(
    build: Build, instructions: list[Instruction]
) -> None:
    healthchecks = [i.args for i in instructions if i.keyword == "HEALTHCHECK"]
    assert len(healthchecks) == 1
    command = exec_form(healthchecks[0].partition("CMD ")[2].strip())
    assert command and command[0] == "python"
    port = _free_port()
    env = {**build.env, "GPU_EXPORTER_LISTEN": f"127.0.0.1:{port}"}
    program = str(build.venv / "bin" / "gpu-occupancy-exporter")
    exporter = subprocess.Popen(
        [program, "--simulate", "single-gpu", "--kube-api", "off", "--dcgm", "off"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            check = subprocess.run(
                [str(build.venv / "bin" / "python"), *command[1:]],
                env=env,
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            if check.returncode == 0:
                break
            assert exporter.poll() is None, f"exporter exited: {exporter.communicate()[1]}"
            assert time.monotonic() < deadline, f"HEALTHCHECK kept failing: {check.stderr}"
            time.sleep(0.2)
    finally:
        exporter.terminate()
        exporter.wait(timeout=10)
