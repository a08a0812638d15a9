"""The launched job's output, tailed from the log file ``ddpscope run`` writes."""

from __future__ import annotations

import os

from textual.widgets import Log

#: Bytes read per poll; a job printing faster than this skips ahead (the file keeps it all).
CHUNK = 1 << 20


class LogView(Log):
    DEFAULT_CSS = """
    LogView { height: 1fr; }
    """

    def __init__(self, path: str | None, *, id: str | None = None) -> None:
        super().__init__(max_lines=5000, auto_scroll=True, id=id)
        self.path = path
        self._offset = 0
        self._partial = ""
        self._said_empty = False

    def on_mount(self) -> None:
        if self.path is None:
            self.write_lines(
                [
                    "No job log here.",
                    "`ddpscope run -- COMMAND` shows the job's output in this view;",
                    "`ddpscope watch --log FILE` shows any file.",
                ]
            )
        else:
            self.write_line(f"[ddpscope] output of the job: {self.path}")

    def poll(self) -> None:
        """Append what the file gained since the last poll (cheap when nothing changed)."""
        if self.path is None:
            return
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return
        if size < self._offset:  # truncated or replaced: start over
            self._offset, self._partial = 0, ""
        if size == self._offset:
            return
        if size - self._offset > CHUNK:
            skipped = size - CHUNK - self._offset
            self.write_line(f"[ddpscope] ... {skipped} bytes skipped (see {self.path}) ...")
            self._offset, self._partial = size - CHUNK, ""
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        self._offset += len(data)
        text = self._partial + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        # Progress bars redraw one line with carriage returns: keep the last drawing.
        self.write_lines([line.rsplit("\r", 1)[-1] for line in lines])
