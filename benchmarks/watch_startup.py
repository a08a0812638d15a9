"""How long `ddpscope watch` takes to show its first screen.

Each run starts `python -m ddpscope watch` on a pseudo-terminal (80x24) and
times from the spawn until the first frame (the header saying where it
listens) has been drawn: interpreter start, imports (no torch), binding the
sockets, loading the detectors and Textual's first render, as a user sees it.
Also timed: `ddpscope --help` (parser only) for comparison.

    python -m benchmarks.watch_startup --runs 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.watch_pty import Terminal

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["TERM"] = "xterm-256color"
    return env


def first_frame() -> float:
    tmp = tempfile.mkdtemp(prefix="ddpscope-startup-")
    argv = [sys.executable, "-m", "ddpscope", "watch", "--endpoint", f"ipc://{tmp}/w.sock"]
    term = Terminal(argv, _env(), size=(80, 24), cwd=str(ROOT))
    try:
        return term.wait_for("listening on", timeout=30) - term.started
    finally:
        term.close()


def help_time() -> float:
    t = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "ddpscope", "--help"], env=_env(), capture_output=True, check=True
    )
    return time.monotonic() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=9)
    args = p.parse_args()
    first_frame()  # warm the page cache, as a second start would be
    frames = [first_frame() for _ in range(args.runs)]
    helps = [help_time() for _ in range(args.runs)]
    print(f"cores: {os.cpu_count()}, python {sys.version.split()[0]}, {args.runs} runs")
    print(
        f"first frame of `ddpscope watch`: median {1000 * statistics.median(frames):.0f} ms, "
        f"min {1000 * min(frames):.0f}, max {1000 * max(frames):.0f}"
    )
    print(
        f"`ddpscope --help`: median {1000 * statistics.median(helps):.0f} ms, "
        f"min {1000 * min(helps):.0f}, max {1000 * max(helps):.0f}"
    )


if __name__ == "__main__":
    main()
