"""Import boundaries of the watcher: checked in fresh interpreters, as a user would start them."""

from __future__ import annotations

import subprocess
import sys

import pytest

# module -> packages it must never pull in
BOUNDARIES = {
    # The ingest side runs in the watcher: no torch, and no textual so that a
    # script or report can use it headless.
    "ddpscope.analysis.live": ("torch", "textual"),
    # The command module is imported to build `ddpscope --help`.
    "ddpscope.cli.watch": ("torch", "textual"),
    # The UI itself needs textual, never torch.
    "ddpscope.ui.app": ("torch",),
    # Rank side: torch yes, textual never.
    "ddpscope.hooks.attach": ("textual",),
    "ddpscope.hooks.publisher": ("textual",),
    "ddpscope.hooks.steps": ("textual",),
    "ddpscope.hooks.comm": ("textual",),
    "ddpscope.hooks.samplers": ("textual",),
    "ddpscope.hooks.fingerprint": ("textual",),
    "ddpscope.hooks.autoattach": ("textual",),
    # Diagnosis: neither.
    "ddpscope.analysis.detectors": ("torch", "textual"),
}


def _imported(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {name.split(".")[0] for name in out.stdout.split()}


@pytest.mark.parametrize(("module", "forbidden"), sorted(BOUNDARIES.items()))
def test_module_keeps_its_import_boundary(module: str, forbidden: tuple[str, ...]) -> None:
    loaded = _imported(f"import {module}")
    assert not loaded & set(forbidden), f"{module} imported {sorted(loaded & set(forbidden))}"


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
