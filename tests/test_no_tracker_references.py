"""No dangling reference to an issue tracker this repository does not ship.

A bare "issue 40" or "issue-26" in a comment, docstring or doc points at a tracker a
reader of the repository cannot open: say what was meant instead. A reference to another
project's tracker is real and citable, so it is allowed when the same line names that
project (one of OWNERS, e.g. "DCGM issue #214", "nvitop issue #75", or a github.com URL).
A reference wrapped over two lines ("... (issue" / "40: ...") is caught too. So is a
name of the development process's own ("helper-41", the agent that ran an adversarial
review): no reader can look it up either; say "an adversarial review" and what it found.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# "issue 40", "Issue #75", "issues #56", "issue-26", "issue_24".
REFERENCE = re.compile(r"\bissues?[ _-]?#?\d+", re.IGNORECASE)
# A line ending in "issue" (or "issue #") whose next line starts with the number.
WRAPPED_HEAD = re.compile(r"\bissues?[ (#-]*$", re.IGNORECASE)
WRAPPED_TAIL = re.compile(r"^[\s#/*\"'>-]*#?\d+\b")

# The development process's own names for its reviewers: "helper-41", "adversary-b".
PROCESS_NAME = re.compile(r"\bhelper-\d+\b|\badversary-[a-z0-9]+\b", re.IGNORECASE)

# Projects whose trackers may be cited: the line must name one of them.
OWNERS = (
    "github.com",
    "gitlab.com",
    "NVIDIA/",
    "DCGM",
    "dcgm-exporter",
    "nvitop",
    "k8s-device-plugin",
    "gpu-operator",
    "pynvml",
    "nvidia-ml-py",
    "kubernetes",
    "prometheus",
    "alertmanager",
    "helm",
    "grpc",
)
OWNER = re.compile("|".join(re.escape(owner) for owner in OWNERS), re.IGNORECASE)

SKIPPED_SUFFIXES = (".json",)


def tracked_text_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [
        path
        for path in listed.split("\0")
        if path and path != THIS and not path.endswith(SKIPPED_SUFFIXES)
    ]


def dangling_references(path: str, text: str) -> list[str]:
    found = []
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        wrapped = (
            WRAPPED_HEAD.search(line) is not None
            and number < len(lines)
            and WRAPPED_TAIL.match(lines[number]) is not None
        )
        if REFERENCE.search(line) is None and not wrapped:
            continue
        context = line + (" " + lines[number] if wrapped else "")
        if OWNER.search(context) is None:
            found.append(f"{path}:{number}: {line.strip()}")
    for number, line in enumerate(lines, start=1):
        if PROCESS_NAME.search(line) is not None:
            found.append(f"{path}:{number}: {line.strip()}")
    return found


def test_the_pattern_tells_a_dangling_reference_from_another_projects() -> None:
    dangling = (
        "# -- issue 40: alerts",
        "(adversary, issue 40: every exited pid was kept)",
        "before the cadence tiers of issue-26",
        '"""Issue 41: the default used to select',
        "the node's wall clock (issue\n40: windows on the monotonic clock)",
        "bounded, per count and in all (helper-41)",
        "adversary-b's auth_flood.py 8 0",
    )
    for text in dangling:
        assert dangling_references("x", text), text
    cited = (
        "in a container without full privileges (DCGM issue #214)",
        "NVIDIA/DCGM issues #56, #106",
        "nvitop issue #75 shows the garbage",
        "k8s-device-plugin's open issue #1974",
        "(github.com/NVIDIA/DCGM/issues/310)",
        "server = ca.issue(tmp, 'e2e-server')",
        "file an issue\n   with the `device_id`",
    )
    for text in cited:
        assert not dangling_references("x", text), text


def test_no_tracked_file_refers_to_a_tracker_the_repository_does_not_have() -> None:
    found = []
    for path in tracked_text_files():
        try:
            data = (ROOT / path).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            continue  # deleted in the work tree, or a submodule
        if b"\0" in data:
            continue  # binary
        found += dangling_references(path, data.decode("utf-8", errors="replace"))
    assert not found, (
        "references to a project issue tracker this repository does not have; say what"
        " was meant, or name the other project on the same line:\n" + "\n".join(found)
    )
