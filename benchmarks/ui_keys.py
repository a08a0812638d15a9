"""How fast does the watch UI answer keys at 1,024 and 4,096 ranks? The real app, its Pilot.

For each world size: a cluster-sized synthetic run (tests/support/cluster.py: 8 ranks
per host, a straggler and a hung rank), fed to a Monitor through the
snapshot-source seam. The snapshots are built once per kind up front (live,
the ingest thread builds them, never the UI's thread), so what is timed is
the UI's own work on its thread: the key's handler, applying the snapshot
(filter, sort, grouping), drawing what changed and turning it into terminal
output. Time runs from the key press to the last frame that key caused
(``App._display``, including rendering the frame's segments the way a
real terminal gets them); the app's own pull timer is off so that no other
work falls in the window.

    python -m benchmarks.ui_keys                       # 1,024 and 4,096 ranks, 200x50
    python -m benchmarks.ui_keys --worlds 4096 --size 80x24 160x45 200x50 --repeat 20

Prints a Markdown table (and JSON with --json): per key, median and the
spread (min, 90th percentile, max) in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from typing import Any

from textual.app import App
from textual.pilot import Pilot

from benchmarks.table import print_rows
from ddpscope.analysis.detectors.hang import HangDetector
from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.ui.app import WatchApp, build_app
from tests.support.cluster import Prebuilt, cluster_run, source

#: (label, keys pressed first and not timed, the timed key). Each returns the
#: app to a state the next one can start from.
KEYS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("down (move the cursor)", (), "down"),
    ("up", (), "up"),
    ("pagedown", (), "pagedown"),
    ("pageup", (), "pageup"),
    ("2 (step times view)", (), "2"),
    ("3 (buckets view)", (), "3"),
    ("4 (findings view)", (), "4"),
    ("5 (job log view)", (), "5"),
    ("6 (phases view)", (), "6"),
    ("7 (hosts view)", (), "7"),
    ("enter (open a host)", (), "enter"),
    ("enter (close it)", (), "enter"),
    ("1 (ranks view)", (), "1"),
    ("> (sort by next column)", (), "greater_than_sign"),
    ("< (sort back)", (), "less_than_sign"),
    ("r (reverse the sort)", (), "r"),
    ("r (back)", (), "r"),
    ("space (pause)", (), "space"),
    ("space (resume)", (), "space"),
    ("/ (open the filter)", (), "slash"),
    ("enter (apply 'node17')", tuple("node17"), "enter"),
    ("esc (clear the filter)", (), "escape"),
    ("enter (rank detail)", (), "enter"),
    ("esc (back from it)", (), "escape"),
)
#: Keys that build every kind of snapshot once before timing (the views ask for
#: different ones, the detail for its rank's).
WARM_UP = ("2", "3", "7", "1", "enter", "escape")


def frames(app: App[Any]) -> list[tuple[float, float]]:
    """(wall, CPU) times at which the app finished a frame, terminal output included."""
    stamps: list[tuple[float, float]] = []
    original = app._display

    def display(screen: Any, renderable: Any) -> None:
        original(screen, renderable)
        if renderable is not None and hasattr(renderable, "render_segments"):
            renderable.render_segments(app.console)
        stamps.append((time.perf_counter(), time.process_time()))

    app._display = display  # type: ignore[method-assign]
    return stamps


async def _press(
    pilot: Pilot[None], stamps: list[tuple[float, float]], key: str
) -> tuple[float, float]:
    """Wall and CPU ms from the key press to the last frame it caused."""
    stamps.clear()
    start, cpu = time.perf_counter(), time.process_time()
    await pilot.press(key)
    await pilot.pause()  # until idle; the last frame drawn is when the key was answered
    if not stamps:
        return float("nan"), float("nan")
    wall_end, cpu_end = stamps[-1]
    return (wall_end - start) * 1000, (cpu_end - cpu) * 1000


def measure(world: int, size: tuple[int, int], repeat: int) -> dict[str, Any]:
    t = time.perf_counter()
    feed = source(cluster_run(world, slow=world // 3, hang=2 * world // 3),
                  [StragglerDetector(), HangDetector()])  # fmt: skip
    built_s = time.perf_counter() - t
    src = Prebuilt(feed)
    app: WatchApp = build_app(src, pull_s=3600.0)
    times: dict[str, list[float]] = {label: [] for label, _, _ in KEYS}
    cpu: dict[str, list[float]] = {label: [] for label, _, _ in KEYS}

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            stamps = frames(app)
            # Every kind of snapshot built once (the 1/7/2/3 views ask for different ones).
            for key in WARM_UP:
                await pilot.press(key)
                await pilot.pause()
            gc.collect()
            gc.freeze()  # as the watcher does after each snapshot (docs/benchmarks.md)
            for _ in range(repeat):
                for label, before, key in KEYS:
                    if before:
                        await pilot.press(*before)
                        await pilot.pause()
                    wall, used = await _press(pilot, stamps, key)
                    times[label].append(wall)
                    cpu[label].append(used)

    asyncio.run(main())
    return {
        "world": world,
        "size": f"{size[0]}x{size[1]}",
        "build_s": built_s,
        "times": times,
        "cpu": cpu,
    }


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(world: int, size: str, label: str, wall: list[float], cpu: list[float]) -> dict[str, str]:
    return {
        "Ranks": f"{world:,}",
        "Size": size,
        "Key": label,
        "Median ms": f"**{statistics.median(wall):.0f}**",
        "Min / p90 / max ms": f"{min(wall):.0f} / {_q(wall, 0.9):.0f} / {max(wall):.0f}",
        "CPU ms median / max": f"{statistics.median(cpu):.0f} / {max(cpu):.0f}",
    }


def rows_of(result: dict[str, Any]) -> list[dict[str, str]]:
    world, size = result["world"], result["size"]
    out = []
    every: list[float] = []
    every_cpu: list[float] = []
    for label, values in result["times"].items():
        every += values
        every_cpu += result["cpu"][label]
        out.append(_row(world, size, label, values, result["cpu"][label]))
    out.append(_row(world, size, f"all keys ({len(every)} presses)", every, every_cpu))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument(
        "--size", nargs="+", default=["200x50"], help="terminal sizes, COLSxROWS each"
    )
    parser.add_argument("--repeat", type=int, default=15, help="presses of each key")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.size]
    results = [measure(w, (s[0], s[1]), args.repeat) for w in args.worlds for s in sizes]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print_rows([r for res in results for r in rows_of(res)])


if __name__ == "__main__":
    main()
