"""The help screen for people: flags in groups by concern, no abbreviations, and a
"did you mean" for a flag that does not exist, with every flag parsed as before.

``help_screen_before.json`` was recorded from the parser before it was split into
groups (``python -m tests.test_help_screen --record``): every flag's name, dest, default,
type, range, choices, metavar and help text, and the parsed ``Config`` of a few command
lines and environments. The tests compare today's parser with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path

import pytest

from exporter.cli import main
from exporter.config import (
    SERVER_ONLY_FLAGS,
    Bounds,
    Config,
    ConfigError,
    build_parser,
    parse_config,
)
from exporter.model.families import select_families

BEFORE = Path(__file__).with_name("help_screen_before.json")
NODE = {"NODE_NAME": "gpu-node-1"}  # the default node name is the hostname otherwise

# (name, argv, env): the command lines and environments whose Config is compared.
CASES: tuple[tuple[str, list[str], dict[str, str]], ...] = (
    ("defaults", [], NODE),
    (
        "server-flags",
        [
            "--listen",
            "127.0.0.1:9500",
            "--interval",
            "2",
            "--slow-interval=60",
            "--liveness-cycles",
            "20",
            "--ready-grace",
            "0",
            "--web-config-file",
            "/etc/web.yaml",
            "--http-header-timeout",
            "2.5",
            "--http-max-connections=16",
            "--proc-root",
            "/host/proc",
            "--cgroup-root",
            "off",
            "--pod-resources-socket",
            "/tmp/kubelet.sock",
            "--pod-resources-interval",
            "10",
            "--resource-names",
            "nvidia.com/gpu, example.com/*",
            "--dra-drivers",
            "",
            "--node-name",
            "n1",
            "--kube-api=off",
            "--kubeconfig",
            "/root/.kube/config",
            "--kube-events",
            "off",
            "--node-condition",
            "--dra-device-taints",
            "--dra-device-taint-effect",
            "NoSchedule",
            "--kube-writes=shadow=event,node_condition",
            "--kube-writer-lease-namespace",
            "gpu",
            "--kube-writer-lease-duration",
            "0",
            "--per-process-metrics",
            "--families-disable",
            "gpu_clock_event_*",
            "--families-enable",
            "gpu_process_*",
            "--xid-class",
            "13=fatal,94=warning",
            "--health-xid-window",
            "60",
            "--retired-pages-limit",
            "5",
            "--idle-threshold",
            "0.1",
            "--why-idle-throttled-ratio",
            "0.5",
            "--why-idle-pressure-ratio=0.3",
            "--orphan-threshold",
            "1.5",
            "--orphan-cycles",
            "7",
            "--deleted-pod-grace",
            "0",
            "--kmsg",
            "--kmsg-path",
            "/tmp/kmsg",
            "--dcgm",
            "[::1]:5555",
            "--dcgm-bindings-path",
            "/opt/dcgm",
            "--dcgm-library-path",
            "/opt/dcgm/lib",
            "--log-level",
            "debug",
            "--log-format=json",
        ],
        NODE,
    ),
    (
        "dcgm-auto",
        ["--dcgm", "auto", "--dcgm-operator-namespace", "a,b"],
        {**NODE, "DCGM_REMOTE_HOSTENGINE_INFO": "nvidia-dcgm"},
    ),
    (
        "simulator",
        ["--simulate", "node-8gpu", "--simulate-start", "140", "--simulate-speed", "4"],
        NODE,
    ),
    ("simulated-node", ["--simulated-node", "/tmp/node"], NODE),
    ("slow-interval-follows-interval", ["--interval", "60"], NODE),
    ("old-xid-name", ["--xid-severity", "13=fatal"], NODE),
    (
        "environment",
        ["--interval", "7"],
        {
            **NODE,
            "POD_NAMESPACE": "monitoring",
            "GPU_EXPORTER_INTERVAL": "inf",  # overridden by its flag: never parsed
            "GPU_EXPORTER_LISTEN": "127.0.0.1:9999",
            "GPU_EXPORTER_SLOW_INTERVAL": "120",
            "GPU_EXPORTER_KMSG": "yes",
            "GPU_EXPORTER_NODE_CONDITION": "off",
            "GPU_EXPORTER_KUBE_API": "off",
            "GPU_EXPORTER_LOG_FORMAT": "json",
            "GPU_EXPORTER_XID_SEVERITY": "94=warning",
            "GPU_EXPORTER_CGROUP_ROOT": "",
            "GPU_EXPORTER_ORPHAN_THRESHOLD": "512",
            "GPU_EXPORTER_KUBE_WRITER_LEASE_DURATION": "0",
            "GPU_EXPORTER_KUBE_WRITES": "shadow",
            "GPU_EXPORTER_FAMILIES_ENABLE": "*",
        },
    ),
    ("snapshot", ["snapshot"], NODE),
    (
        "snapshot-flags",
        ["snapshot", "--json", "--window=2", "--simulate", "node-8gpu", "--kmsg"],
        {**NODE, "GPU_EXPORTER_INTERVAL": "2", "GPU_EXPORTER_HTTP_MAX_CONNECTIONS": "4"},
    ),
    ("doctor", ["doctor"], NODE),
    (
        "doctor-flags",
        ["doctor", "--json", "--timeout", "5", "--node-condition", "--proc-root", "/p"],
        NODE,
    ),
)

# (argv, env): input refused before as now, with the same one line.
REFUSED: tuple[tuple[list[str], dict[str, str]], ...] = (
    (["--interval", "-1"], NODE),
    (["--interval=inf"], NODE),
    (["--listen", "9445"], NODE),
    (["--kube-api", "maybe"], NODE),
    (["--orphan-cycles", "1.5"], NODE),
    (["--slow-interval", "1", "--interval", "5"], NODE),
    (["--simulate", "node-8gpu", "--simulated-node", "/tmp"], NODE),
    (["--simulate-speed", "2"], NODE),
    (["--per-process-metrics=yes"], NODE),
    (["snapshot", "--window", "0"], NODE),
    (["doctor", "--timeout", "999"], NODE),
    ([], {**NODE, "GPU_EXPORTER_KMSG": "yes-please"}),
    ([], {**NODE, "GPU_EXPORTER_INTERVAL": "x"}),
    ([], {**NODE, "GPU_EXPORTER_LOG_LEVEL": "loud"}),
    ([], {**NODE, "GPU_EXPORTER_DCGM_LIBRARY_PATH": ""}),
    (["snapshot"], {**NODE, "GPU_EXPORTER_READY_GRACE": "-1"}),
)


def plain(value: object) -> object:
    """``value`` as JSON: paths and enums as text, sets sorted, dataclasses as dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return plain(value.value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, frozenset | set):
        return sorted(plain(v) for v in value)  # type: ignore[type-var]
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return f"{type(value).__name__}:{value}"


def describe_type(action: argparse.Action) -> object:
    bounds = getattr(action.type, "__self__", None)
    if isinstance(bounds, Bounds):
        return {"bounds": str(bounds), "whole": bounds.whole}
    return None if action.type is None else repr(action.type)


def describe_parser(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Every flag of ``parser``: what it is called, where it goes, how it is parsed and
    what --help says about it (keyed by flag: the order of --help may change)."""
    actions = {}
    for action in parser._actions:
        key = action.option_strings[-1] if action.option_strings else action.dest
        actions[key] = {
            "option_strings": list(action.option_strings),
            "class": type(action).__name__,
            "dest": action.dest,
            "default": plain(action.default),
            "type": describe_type(action),
            "choices": plain(action.choices),
            "metavar": action.metavar,
            "nargs": action.nargs,
            "const": action.const,
            "required": action.required,
            "help": action.help,
        }
    return {
        "prog": parser.prog,
        "usage": parser.usage,
        "description": parser.description,
        "epilog": parser.epilog,
        "actions": actions,
        "set_defaults": plain(parser._defaults),
        "from_env": sorted(getattr(parser, "from_env", {})),
    }


def every_variable() -> dict[str, str]:
    """Every flag's environment variable set: each default is then the variable's text."""
    flags = {o for a in build_parser({})._actions for o in a.option_strings}
    names = {"GPU_EXPORTER_" + f[2:].replace("-", "_").upper() for f in flags}
    return {**NODE, **dict.fromkeys(sorted(names), "7")}


SAME = "as in the server's parser"


def parsers() -> dict[str, dict[str, object]]:
    described = {}
    for env_name, env in (("no-env", NODE), ("every-variable", every_variable())):
        for kind, options in (
            ("server", {}),
            ("snapshot", {"snapshot": True}),
            ("doctor", {"doctor": True}),
        ):
            described[f"{kind}/{env_name}"] = describe_parser(build_parser(env, **options))
    for name, parser in described.items():  # a flag in full once, or where it differs
        kind, env_name = name.split("/")
        server = described[f"server/{env_name}"]["actions"]
        actions = parser["actions"]
        assert isinstance(server, dict) and isinstance(actions, dict)
        if kind != "server":
            parser["actions"] = {
                flag: SAME if action == server.get(flag) else action
                for flag, action in actions.items()
            }
    return described


def config_record(config: Config) -> object:
    """``config`` as JSON, its families as the difference from the default set."""
    default = select_families("", "", per_process=False)
    record = plain(config)
    assert isinstance(record, dict)
    record["families"] = {
        "added": sorted(config.families - default),
        "removed": sorted(default - config.families),
    }
    return record


def configs() -> dict[str, object]:
    return {name: config_record(parse_config(argv, env=env)) for name, argv, env in CASES}


def refusals() -> list[str]:
    lines = []
    for argv, env in REFUSED:
        with pytest.raises(ConfigError) as raised:
            parse_config(argv, env=env)
        lines.append(str(raised.value))
    return lines


def record() -> dict[str, object]:
    return {"parsers": parsers(), "configs": configs(), "refused": refusals()}


@pytest.fixture(scope="module")
def before() -> dict[str, object]:
    loaded: dict[str, object] = json.loads(BEFORE.read_text())
    return loaded


# -- parsed exactly as before ------------------------------------------------------------


def test_every_flag_keeps_its_name_dest_default_type_choices_and_help(
    before: dict[str, object],
) -> None:
    assert parsers() == before["parsers"]


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_the_config_of_a_command_line_is_what_it_was(before: dict[str, object], name: str) -> None:
    argv, env = next((argv, env) for n, argv, env in CASES if n == name)
    recorded = before["configs"]
    assert isinstance(recorded, dict)
    assert config_record(parse_config(argv, env=env)) == recorded[name]


def test_bad_values_are_refused_with_the_same_line(before: dict[str, object]) -> None:
    assert refusals() == before["refused"]


# -- groups ------------------------------------------------------------------------------

GROUPS = ("serving", "sources", "Kubernetes", "health and thresholds", "simulator", "logging")
GROUPS_LOWER = tuple(title.lower() for title in GROUPS)


def _groups(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    return {
        str(group.title): [a.option_strings[-1] for a in group._group_actions]
        for group in parser._action_groups
    }


def test_help_shows_the_groups_in_order_each_with_a_description() -> None:
    text = build_parser(NODE).format_help()
    at = [text.index(f"\n{title}:\n") for title in GROUPS]
    assert at == sorted(at), "the groups are out of order"
    for group in build_parser(NODE)._action_groups:
        if group.title in GROUPS:
            assert group.description and "\n" not in group.description, group.title
            assert f"\n{group.title}:\n  {group.description}\n" in text


def test_every_flag_is_in_exactly_one_group() -> None:
    for options in ({}, {"snapshot": True}, {"doctor": True}):
        parser = build_parser(NODE, **options)
        grouped = _groups(parser)
        flags = [flag for title in GROUPS for flag in grouped.get(title, [])]
        assert len(flags) == len(set(flags)), flags
        every = {a.option_strings[-1] for a in parser._actions}
        own = {"--help", "--version", "--json", "--window", "--timeout"}
        assert set(flags) == every - own, every - own ^ set(flags)
        assert all(grouped[title] for title in grouped if title in GROUPS), "empty group"


def test_the_subcommands_own_flags_come_first() -> None:
    for options, own in (
        ({"snapshot": True}, ["--json", "--window"]),
        ({"doctor": True}, ["--json", "--timeout"]),
    ):
        parser = build_parser(NODE, **options)
        text = parser.format_help()
        assert text.index("--json") < text.index("\nsources:\n")
        titles = [g.title for g in parser._action_groups if g._group_actions]
        assert titles.index(GROUPS[1]) > 1  # options (--help, --version), the own flags
        assert any(_groups(parser)[str(t)] == own for t in titles)


def test_snapshot_help_has_no_empty_group_and_no_server_flag() -> None:
    text = build_parser(NODE, snapshot=True).format_help()
    assert "\nserving:\n" not in text  # every serving flag is the server's
    for flag in SERVER_ONLY_FLAGS:
        assert flag not in text


README = Path(__file__).parent.parent / "README.md"
# documented in another flag's row of README.md's table, not in one of its own
IN_ANOTHER_ROW = {"--xid-severity": "--xid-class"}


def readme_groups() -> dict[str, list[str]]:
    """README.md's flag tables: each ``###`` heading of "Flags" -> the flags its rows
    name in their first cell, in order."""
    section = README.read_text().split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    groups = {}
    for part in section.split("\n### ")[1:]:
        title, _, body = part.partition("\n")
        rows = [line for line in body.splitlines() if line.startswith("| `--")]
        groups[title.lower()] = [
            flag for row in rows for flag in re.findall(r"`(--[a-z-]+)", row.split(" | ")[0])
        ]
    return groups


def test_the_readme_flag_tables_have_the_groups_and_order_of_help() -> None:
    readme = readme_groups()
    assert [title for title in readme if title in GROUPS_LOWER] == list(GROUPS_LOWER)
    grouped = _groups(build_parser(NODE))
    for title in GROUPS:
        flags = [flag for flag in grouped[title] if flag not in IN_ANOTHER_ROW]
        assert readme[title.lower()] == flags, title
    for flag, row in IN_ANOTHER_ROW.items():
        assert any(f"`{row}" in line and flag in line for line in README.read_text().splitlines())


# -- no abbreviations, and a suggestion --------------------------------------------------


def refused(
    argv: Sequence[str], capsys: pytest.CaptureFixture[str], env: Mapping[str, str] = NODE
) -> str:
    """The CLI's one line for ``argv`` (exit status 2, nothing on stdout). parse_config
    is asked first, so input that is accepted fails here instead of starting a server."""
    with pytest.raises(ConfigError):
        parse_config(argv, env=env)
    with pytest.MonkeyPatch.context() as patch:  # main() reads os.environ
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(SystemExit) as exit_:
            main(list(argv))
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("gpu-occupancy-exporter: error: unrecognized arguments: ")
    return line


@pytest.mark.parametrize(
    "argv",
    [
        ["--interv", "5"],
        ["--interv=5"],
        ["--intervall", "5"],
        ["--intervall=5"],
        ["--inteval", "5"],
    ],
)
def test_a_misspelt_or_abbreviated_flag_is_refused_with_a_suggestion(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused(argv, capsys)
    assert argv[0] in line  # names what was given
    assert "did you mean --interval?" in line


def test_an_abbreviation_is_refused_even_where_it_names_one_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It was accepted: ``--interv 5`` was ``--interval 5``, ``--kmsg-p`` ``--kmsg-path``."""
    with pytest.raises(ConfigError, match="unrecognized arguments: --kmsg-p /dev/kmsg"):
        parse_config(["--kmsg-p", "/dev/kmsg"], env=NODE)
    line = refused(["--log-l", "debug"], capsys)
    assert "did you mean --log-level?" in line and "not abbreviated" in line


def test_an_ambiguous_abbreviation_lists_the_flags_it_could_be(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = refused(["--simulate-s", "2"], capsys)
    assert "did you mean --simulate-start or --simulate-speed?" in line
    line = refused(["--dcgm-b=/opt"], capsys)
    assert "did you mean --dcgm-bindings-path?" in line


def test_each_unknown_flag_gets_its_own_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(["--interv", "5", "--kmgs"], capsys)
    assert "did you mean --interval for --interv, --kmsg for --kmgs?" in line


def test_a_flag_with_no_near_name_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(["--zzzzzz"], capsys)
    assert "did you mean" not in line and line.endswith("(see --help)")


def test_the_subcommands_refuse_abbreviations_and_suggest_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = refused(["snapshot", "--wind", "2"], capsys)
    assert "did you mean --window?" in line
    line = refused(["doctor", "--time", "2"], capsys)
    assert "did you mean --timeout?" in line
    line = refused(["snapshot", "--listen", "127.0.0.1:1"], capsys)
    assert "--listen is the server's, not snapshot's" in line


def test_the_simulator_refuses_abbreviations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from exporter.sim.__main__ import main as sim_main

    with pytest.raises(SystemExit) as exit_:
        sim_main(["single-gpu", "--dir", str(tmp_path / "absent"), "--kube", "off"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --kube off" in capsys.readouterr().err


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    BEFORE.write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n")
