"""The test tree keeps its shape: unit tests stay in-process, helpers are imported
as the package tests.support, an import error of ddpscope fails instead of
skipping, and every test or benchmark path the docs name exists.

Read from the files themselves (their syntax trees), so a test that slips a
subprocess into tests/unit or a benchmark that edits sys.path fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support.torchrun import ROOT

TESTS = ROOT / "tests"
#: What only tests/e2e may use: other processes, terminals, sockets that carry messages.
NOT_IN_UNIT = {
    "subprocess",
    "pty",
    "multiprocessing",
    "zmq",
    "ddpscope.analysis.live",
    "ddpscope.transport.subscriber",
    "ddpscope.transport.relay",
    "tests.support.wire",
    "tests.support.terminal",
    "tests.support.faults",
    "tests.support.multinode",
    "tests.support.recorded",
}
#: Names of tests.support.torchrun that start a job (ROOT and DEMO are only paths).
JOB_STARTERS = {"torchrun", "job_env", "teardown_abort_only"}


def _modules(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, with ``from X import y`` also as ``X.y``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _banned_in_unit(path: Path) -> list[str]:
    imported = _imports(path)
    banned = [m for m in imported if m in NOT_IN_UNIT or m.split(".")[0] in NOT_IN_UNIT]
    banned += [f"tests.support.torchrun.{n}" for n in JOB_STARTERS]
    return sorted(m for m in set(banned) if m in imported or m.split(".")[0] in NOT_IN_UNIT)


@pytest.mark.parametrize("path", _modules("tests/unit"), ids=_rel)
def test_unit_tests_start_no_process_and_open_no_message_socket(path: Path) -> None:
    banned = _banned_in_unit(path)
    assert not banned, f"{_rel(path)} belongs in tests/e2e: it imports {banned}"


def test_the_layout_rule_catches_a_unit_test_that_starts_a_process(tmp_path: Path) -> None:
    slipped = tmp_path / "test_slipped.py"
    slipped.write_text(
        "from subprocess import run\nfrom tests.support.torchrun import ROOT, torchrun\n"
    )
    assert _banned_in_unit(slipped) == [
        "subprocess",
        "subprocess.run",
        "tests.support.torchrun.torchrun",
    ]


def test_tests_and_benchmarks_leave_sys_path_alone() -> None:
    edits = [
        f"{_rel(p)}:{n}"
        for p in _modules("tests", "benchmarks")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"sys\.path\.(insert|append|extend)\(|sys\.path \+?=", line)
        and p.name != "test_layout.py"
    ]
    assert not edits, f"import tests.support as a package instead: {edits}"


def test_the_root_comes_from_support_not_from_a_files_depth() -> None:
    # A file's depth changes when it moves (tests/ -> tests/unit/); ROOT does not.
    counted = [
        f"{_rel(p)}:{n}"
        for p in _modules("tests")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if ".parents[" in line
        and p != TESTS / "support" / "torchrun.py"
        and p.name != "test_layout.py"
    ]
    assert not counted, f"import ROOT from tests.support.torchrun instead: {counted}"


def test_ddpscope_is_imported_never_importorskipped() -> None:
    skipped = []
    for p in _modules("tests"):
        for node in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "importorskip"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(name := node.args[0].value, str)
                and name.split(".")[0] in ("ddpscope", "tests")
            ):
                skipped.append(f"{_rel(p)}:{node.lineno} {name}")
    assert not skipped, f"an import error of our own code must fail, not skip: {skipped}"


def test_helpers_live_in_support_and_tests_only_in_unit_or_e2e() -> None:
    loose = sorted(
        p.name for p in TESTS.glob("*.py") if p.name not in ("__init__.py", "conftest.py")
    )
    assert not loose, f"move {loose} into tests/unit, tests/e2e or tests/support"
    assert not list((TESTS / "support").glob("test_*.py"))


_PATH = re.compile(r"\b((?:tests|benchmarks)/[\w/]+\.py)\b")
_MODULE = re.compile(r"python -m ((?:tests|benchmarks)(?:\.\w+)+)")


def _named_in_docs() -> list[tuple[str, str]]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *_modules("benchmarks")]
    named = []
    for doc in docs:
        text = doc.read_text()
        named += [(_rel(doc), m) for m in _PATH.findall(text)]
        named += [(_rel(doc), m.replace(".", "/") + ".py") for m in _MODULE.findall(text)]
    return named


def test_every_test_and_benchmark_path_the_docs_name_exists() -> None:
    named = _named_in_docs()
    assert any(path.startswith("benchmarks/") for _, path in named)  # the scan finds them
    missing = sorted({f"{doc}: {path}" for doc, path in named if not (ROOT / path).is_file()})
    assert not missing, missing
