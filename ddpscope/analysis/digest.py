"""A digest of the code that makes findings, for results cached beside a recording.

The replay's index file keeps the findings of its pass. Keyed by the ddpscope
version alone, an index built before a detector changed kept showing the old
findings wherever the version string stayed the same (every development
install, and a patched one). The digest covers the analysis package and the
schema it decodes with, so any change there rebuilds the index once.
"""

from __future__ import annotations

import functools
import hashlib
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Besides every module of ddpscope/analysis: what turns records into messages.
_ALSO = ("schema.py", "schema_codec.py")


@functools.cache
def analysis_digest() -> str:
    """16 hex digits over the analysis code's sources ("" where they cannot be read)."""
    h = hashlib.blake2b(digest_size=8)
    paths = [os.path.join(_ROOT, name) for name in _ALSO]
    for folder, dirs, files in os.walk(os.path.join(_ROOT, "analysis")):
        dirs.sort()
        paths += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    try:
        for path in paths:
            h.update(os.path.relpath(path, _ROOT).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    except OSError:  # a zipped or stripped install: the version alone keys the cache
        return ""
    return h.hexdigest()


__all__ = ["analysis_digest"]
