"""Import boundaries: the watcher side never needs torch; nothing but the UI needs textual."""

from __future__ import annotations

import subprocess
import sys

import pytest

# module -> modules it must never pull in
BOUNDARIES = {
    "ddpscope": ("torch", "textual"),
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
    "ddpscope.replay.player": ("torch", "textual"),
    "ddpscope.export.chrome": ("torch", "textual"),
    "ddpscope.export.table": ("torch", "textual"),
    "ddpscope.transport.relay": ("torch", "textual"),
    "ddpscope.cli.replay": ("torch", "textual"),
    "ddpscope.cli.relay": ("torch", "textual"),
    "ddpscope.ui.replay": ("torch",),
    "ddpscope.cli.watch": ("torch", "textual"),
    "ddpscope.ui.app": ("torch",),
    "ddpscope.cli.main": ("torch", "textual"),
    "ddpscope.hooks.attach": ("textual",),
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
        "from ddpscope.analysis.detectors import default_detectors\n"
        "default_detectors()\n"
        "print(','.join(m for m in ('torch', 'textual') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
