"""CI runs the README's test command: the README, ``.ci/run`` and ``make test`` give the
same pytest arguments, and any that spread the tests over workers keep each file on one
worker (a module's fixture, such as the e2e run's Prometheus, would otherwise start once
per worker that gets one of its tests)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).parent.parent
PYTEST = ".venv/bin/pytest"


def pytest_args(text: str, where: str) -> list[str]:
    """The arguments after ``.venv/bin/pytest`` (or ``$(BIN)/pytest``) on the one line that
    runs every test: no ``-m`` selection, no test path."""
    found = []
    for line in text.replace("$(BIN)/", ".venv/bin/").splitlines():
        if PYTEST not in line:
            continue
        words = shlex.split(line, comments=True)
        if PYTEST in words:
            args = words[words.index(PYTEST) + 1 :]
            if "-m" not in args and not any(a.startswith("tests") for a in args):
                found.append(args)
    assert len(found) == 1, f"{where}: {len(found)} lines run every test: {found}"
    return found[0]


def make_target(makefile: str, target: str) -> str:
    match = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert match, f"Makefile: no target {target}"
    return match[1]


def test_the_readme_ci_and_make_test_run_pytest_alike() -> None:
    readme = pytest_args((ROOT / "README.md").read_text(), "README.md")
    ci = pytest_args((ROOT / ".ci" / "run").read_text(), ".ci/run")
    make = pytest_args(make_target((ROOT / "Makefile").read_text(), "test"), "make test")
    assert readme == ci == make, (readme, ci, make)


def test_tests_spread_over_workers_keep_each_file_on_one_worker() -> None:
    args = pytest_args((ROOT / ".ci" / "run").read_text(), ".ci/run")
    if "-n" in args or "--numprocesses" in args:
        assert "--dist" in args, args
        assert args[args.index("--dist") + 1] in ("loadfile", "loadscope"), args
