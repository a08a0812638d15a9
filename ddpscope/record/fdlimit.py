"""Room for open files: replay keeps each rank's file open, and a cluster has thousands.

The usual soft limit is 1,024 open files while the hard limit is far higher,
so a 1,024-rank recording would fail to replay on a default shell. The soft
limit is raised towards the hard one (a process may do so without privilege);
where even the hard limit is too low, the error says how many files are
needed and how to allow them.
"""

from __future__ import annotations

import errno

try:
    import resource
except ImportError:  # not on Windows: nothing to raise there
    resource = None  # type: ignore[assignment]

#: Descriptors left for everything else (sockets, the terminal, libraries).
MARGIN = 64


def ensure_open_files(needed: int) -> None:
    """Make room for ``needed`` more open files, or raise OSError(EMFILE) saying why not."""
    if resource is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + MARGIN
    if soft == resource.RLIM_INFINITY or want <= soft:
        return
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < want:
        raise OSError(
            errno.EMFILE,
            f"this needs {needed} open files (one per rank file) but the open-file limit is "
            f"{hard}; allow more with `ulimit -n {want}` (or raise the hard limit, "
            "e.g. in /etc/security/limits.conf) and run it again",
        )
