"""Import boundaries, checked in fresh interpreters as a user would start them: the
watcher side never needs torch; nothing but the UI needs textual."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


@pytest.mark.parametrize(("module", "forbidden"), sorted(BOUNDARIES.items()))
def test_module_does_not_import_forbidden_packages(module: str, forbidden: tuple[str, ...]) -> None:
    code = (
        f"import sys, {module}\n"
        f"bad = [m for m in {forbidden!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"


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
