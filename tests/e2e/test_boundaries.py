"""Import boundaries, checked in fresh interpreters as a user would start them: the
watcher side never needs torch; nothing but the UI needs textual."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.torchrun import ROOT

#: Optional integrations (extras ddpscope[lightning], ddpscope[hf]): only their own
#: modules may import them.
FRAMEWORKS = ("pytorch_lightning", "lightning", "transformers", "accelerate")

# module -> modules it must never pull in
BOUNDARIES = {
    "ddpscope": ("torch", "textual", *FRAMEWORKS),
    "ddpscope.schema": ("torch", "textual"),
    "ddpscope.config": ("torch", "textual"),
    "ddpscope.record": ("torch", "textual"),
    "ddpscope.transport.subscriber": ("torch", "textual"),
    "ddpscope.analysis.engine": ("torch", "textual"),
    "ddpscope.analysis.sources": ("torch", "textual"),
    "ddpscope.analysis.live": ("torch", "textual"),
    "ddpscope.analysis.report": ("torch", "textual"),
    "ddpscope.analysis.monitor": ("torch", "textual"),
    "ddpscope.analysis.compare": ("torch", "textual"),
    # Evidence tables are laid out for the report too, which draws its own text.
    "ddpscope.analysis.evidence": ("torch", "textual", "rich"),
    "ddpscope.replay.player": ("torch", "textual"),
    "ddpscope.export.chrome": ("torch", "textual"),
    "ddpscope.export.table": ("torch", "textual"),
    "ddpscope.transport.relay": ("torch", "textual"),
    "ddpscope.cli.replay": ("torch", "textual"),
    "ddpscope.cli.relay": ("torch", "textual"),
    "ddpscope.ui.replay": ("torch",),
    "ddpscope.cli.watch": ("torch", "textual"),
    "ddpscope.ui.app": ("torch",),
    "ddpscope.cli.main": ("torch", "textual", *FRAMEWORKS),
    "ddpscope.cli.run": ("torch", "textual", *FRAMEWORKS),
    # Rank side: torch yes, textual never. torch._dynamo (0.7 s to import) only
    # when the script compiles.
    "ddpscope.hooks.attach": ("textual", "torch._dynamo", *FRAMEWORKS),
    "ddpscope.hooks.compiled": ("textual", "torch._dynamo", *FRAMEWORKS),
    # Each integration pulls in its framework, not the UI (Lightning itself may
    # import transformers when it is installed, so that is not checked there).
    "ddpscope.lightning": ("textual",),
    "ddpscope.hf": ("textual", "pytorch_lightning", "lightning"),
    "ddpscope.hooks.publisher": ("textual",),
    "ddpscope.hooks.steps": ("textual",),
    "ddpscope.hooks.comm": ("textual",),
    "ddpscope.hooks.samplers": ("textual",),
    "ddpscope.hooks.fingerprint": ("textual",),
    "ddpscope.hooks.autoattach": ("textual",),
    "ddpscope.analysis.detectors": ("torch", "textual"),
}


def _by_forbidden() -> dict[tuple[str, ...], list[str]]:
    groups: dict[tuple[str, ...], list[str]] = {}
    for module, forbidden in sorted(BOUNDARIES.items()):
        groups.setdefault(tuple(sorted(forbidden)), []).append(module)
    return groups


@pytest.mark.parametrize(
    ("forbidden", "modules"),
    [pytest.param(f, m, id="no-" + "-".join(f)) for f, m in _by_forbidden().items()],
)
def test_modules_do_not_import_forbidden_packages(
    forbidden: tuple[str, ...], modules: list[str]
) -> None:
    # The modules that share a forbidden set are imported one after another in one
    # interpreter, checked after each: what appears after a module's import is its
    # own (the check after the one before found none), and an import of a package
    # leaves it in sys.modules whatever was imported first. One interpreter a set
    # instead of one a module: the rank-side modules each paid torch's import.
    code = (
        "import importlib, sys\n"
        f"for module in {modules!r}:\n"
        "    importlib.import_module(module)\n"
        f"    bad = [m for m in {forbidden!r} if m in sys.modules]\n"
        "    if bad:\n"
        "        print(module, 'imported', ','.join(bad)); break\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", out.stdout


def test_all_detectors_load_without_torch_or_textual() -> None:
    code = (
        "import sys\n"
        "from ddpscope.analysis.build import default_detectors\n"
        "default_detectors()\n"
        "print(','.join(m for m in ('torch', 'textual') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _imported(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {name.split(".")[0] for name in out.stdout.split()}


def test_a_feed_with_every_detector_runs_without_torch_or_textual(tmp_path: object) -> None:
    code = (
        "from ddpscope.analysis.live import LiveFeed\n"
        f"feed = LiveFeed('ipc://{tmp_path}/x.sock')\n"
        "feed.start(); snap = feed.snapshot(); feed.stop()\n"
        "assert snap.health.detectors > 0, snap.health.detector_note\n"
    )
    assert not _imported(code) & {"torch", "textual"}


def test_the_watch_command_builds_its_app_without_torch(tmp_path: object) -> None:
    code = (
        "from ddpscope.analysis.live import LiveFeed\n"
        "from ddpscope.ui.app import build_app\n"
        "from ddpscope.cli.main import build_parser\n"
        "build_parser()\n"
        f"feed = LiveFeed('ipc://{tmp_path}/x.sock')\n"
        "build_app(feed); feed.stop()\n"
    )
    assert "torch" not in _imported(code)


def test_the_engine_imports_no_detector() -> None:
    code = (
        "import sys, ddpscope.analysis.engine\n"
        "print(' '.join(m for m in sys.modules if m.startswith('ddpscope.analysis.detectors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# --- the package's own shape -----------------------------------------------------------


#: Lines (as ``wc -l`` counts them) a module may have without saying why at its top.
LONG_MODULE_LINES = 600
#: How a module says why it is longer: a line of its docstring starting with this,
#: followed by the reason.
LONG_MODULE_MARK = "Long module:"

#: (importer, imported) -> line numbers of the imports that make the edge.
Graph = dict[str, dict[str, list[int]]]


def _modules(root: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _packages_of(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT, package: str = "ddpscope") -> Graph:
    """Which module of ``package`` imports which, read from the source with ast.

    Every import statement counts wherever it stands: at module level, inside a
    function body, under ``if TYPE_CHECKING:``, in a ``try``. ``from a.b import c``
    is an edge to ``a.b.c`` when that is a module, else to ``a.b``. An edge also goes
    to each package above the imported module that is not above the importer too
    (Python runs those ``__init__`` files first; the importer's own are already
    running). Names looked up with importlib (cli/main's COMMANDS) are not seen.
    """
    modules = _modules(root, package)
    graph: Graph = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: dict[str, list[int]] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named: list[str] = []
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                named = subs or [base]
            for target in named:
                if target not in modules:
                    continue
                above = [p for p in _packages_of(target) if p not in _packages_of(name)]
                for t in [target, *above]:
                    if t != name and t in modules:
                        targets.setdefault(t, []).append(node.lineno)
        graph[name] = targets
    return graph


def import_cycles(graph: Graph, leave_out: frozenset[str] = frozenset()) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), without the
    edges named in ``leave_out`` ("a -> b"); each group sorted, groups in order."""
    edges = {m: [t for t in out if f"{m} -> {t}" not in leave_out] for m, out in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in edges[m]:
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            group = []
            while True:
                t = stack.pop()
                group.append(t)
                if t == m:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return sorted(groups)


def describe_cycles(graph: Graph, groups: list[list[str]], root: Path = ROOT) -> str:
    """Each group's edges with the file and lines of the imports that make them."""
    out = []
    for group in groups:
        out.append("cycle among " + ", ".join(group) + ":")
        for m in group:
            path = _modules(root, m.split(".")[0])[m].relative_to(root)
            for t in sorted(set(graph[m]) & set(group)):
                lines = ",".join(map(str, sorted(set(graph[m][t]))))
                out.append(f"  {m} -> {t}  ({path}:{lines})")
    return "\n".join(out)


def test_the_import_graph_of_ddpscope_has_no_cycles() -> None:
    graph = import_graph()
    cycles = import_cycles(graph)
    assert not cycles, describe_cycles(graph, cycles)


def _write_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path: Path) -> None:
    _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import helper\n",
            # Hidden in a function body, and relative: still a cycle.
            "pkg/b.py": "def helper():\n    from .a import x\n",
            "pkg/sub/__init__.py": "from pkg import c\n",
            # Importing a module of pkg.sub runs pkg/sub/__init__.py first: a cycle too.
            "pkg/c.py": "import pkg.sub.d\n",
            "pkg/sub/d.py": "",
            # A module importing its own package adds no edge to it through its parents.
            "pkg/e.py": "from pkg.sub import d\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert import_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub"]]
    assert "pkg" not in graph["pkg.sub.d"] and set(graph["pkg.e"]) == {"pkg.sub.d", "pkg.sub"}
    text = describe_cycles(graph, import_cycles(graph), tmp_path)
    assert "pkg.b -> pkg.a  (pkg/b.py:2)" in text
    assert import_cycles(graph, leave_out=frozenset({"pkg.b -> pkg.a"})) == [["pkg.c", "pkg.sub"]]


def long_module_reason(path: Path) -> str:
    """The reason a module's docstring gives for its length, or ""."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    for line in doc.splitlines():
        if line.startswith(LONG_MODULE_MARK):
            return line[len(LONG_MODULE_MARK) :].strip()
    return ""


def test_no_module_is_over_600_lines_without_a_reason_at_its_top() -> None:
    unexplained, stale = [], []
    for path in _modules(ROOT, "ddpscope").values():
        rel = path.relative_to(ROOT).as_posix()
        lines = path.read_text().count("\n")
        reason = long_module_reason(path)
        if lines > LONG_MODULE_LINES and not reason:
            unexplained.append(f"{rel} ({lines} lines)")
        elif reason and lines <= LONG_MODULE_LINES:
            stale.append(f"{rel} ({lines} lines)")
    assert not unexplained, (
        f"over {LONG_MODULE_LINES} lines with no {LONG_MODULE_MARK!r} line in the docstring "
        f"saying why (or split them): {unexplained}"
    )
    assert not stale, f"{LONG_MODULE_MARK!r} on modules no longer long; remove it: {stale}"
