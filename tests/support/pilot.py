"""Driving the watch app with Textual's Pilot: run a scenario, wait for a state, read a view."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from textual.pilot import Pilot

from ddpscope.ui.app import WatchApp
from ddpscope.ui.rows import RowsView

Scenario = Callable[[Pilot[None]], Awaitable[None]]


def drive(app: WatchApp, scenario: Scenario, size: tuple[int, int] = (120, 40)) -> None:
    """Run the app headless at ``size`` through ``scenario``, then close it."""

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await scenario(pilot)

    asyncio.run(main())


async def until(pilot: Pilot[None], condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the app run until ``condition`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)


def lines(view: RowsView) -> list[str]:
    """What the view shows, line by line, as plain text."""
    return [view.render_line(y).text for y in range(view.scrollable_content_region.height)]
