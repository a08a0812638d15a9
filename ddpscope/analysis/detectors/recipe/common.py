"""What the recipe checks share: names of collectives and call sites in words.

Not a detector.
"""

from __future__ import annotations

from ddpscope.schema import DDP_BUFFERS

#: Sites and ranks listed one by one in evidence.
MAX_LISTED = 16


def short_site(site: str) -> str:
    """``/a/b/demos/train.py:12 in main`` -> ``demos/train.py:12 (in main)``."""
    loc, sep, func = site.partition(" in ")
    path, _, line = loc.rpartition(":")
    if not path:
        return site
    parts = path.replace("\\", "/").split("/")
    short = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{short}:{line}" + (f" (in {func})" if sep else "")


def op_text(op: str) -> str:
    if op == DDP_BUFFERS:
        return "a forward of the DDP model (which broadcasts its buffers from rank 0)"
    return f"torch.distributed.{op}()"
