"""Two "nodes" on one machine: a real 2-node torchrun job, each node launched by its own
``ddpscope run`` (so each runs a relay), the second node in its own UTS and time
namespaces: another host name, and a monotonic clock a day ahead, as a host that
booted a day earlier would have. The wall clock is shared, as NTP would keep it.

Used by tests/test_multinode.py and benchmarks/clock_alignment.py. Linux only;
:func:`namespaces_work` says whether this machine lets us make the namespaces.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support.torchrun import DEMO, ROOT, job_env

#: How far ahead the second node's monotonic clock runs.
DAY_NS = 86_400 * 10**9


def namespaces_work() -> bool:
    try:
        probe = subprocess.run(
            ["unshare", "--time", "--monotonic", "1", "--uts", "--fork", "true"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Nodes:
    record: Path
    endpoint: str
    outputs: list[subprocess.CompletedProcess[str]]


def run_two_nodes(
    tmp: Path,
    endpoint: str,
    demo_args: list[str],
    skew_ns: int = DAY_NS,
    rdzv_id: str = "mn",
    timeout: float = 240,
    **env_extra: str,
) -> Nodes:
    """Launch both nodes, wait for both; the second in namespaces when ``skew_ns``.
    ``env_extra``: more environment for both launchers (ddpscope options)."""
    record = tmp / "rec"
    port = free_port()
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id={rdzv_id}",
        str(DEMO),
        *demo_args,
    ]
    launcher = [sys.executable, "-m", "ddpscope", "run", "--headless", "--record", str(record)]
    launcher += ["--endpoint", endpoint, "--"]
    env = job_env(**env_extra)
    procs = []
    for node in range(2):
        cmd = launcher + torchrun
        if node == 1 and skew_ns:
            inner = " ".join(_quote(c) for c in cmd)
            cmd = [
                "unshare",
                "--time",
                "--monotonic",
                str(skew_ns // 10**9),
                "--uts",
                "--fork",
                "sh",
                "-c",
                f"hostname node-b && exec {inner}",
            ]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        outputs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return Nodes(record, endpoint, outputs)


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'" if any(c in arg for c in " '\"$") else arg


def bucket_end_skew_ms(record: Path) -> list[float]:
    """Per step, how far apart the two ranks' last all-reduce ended, on the aligned clock.

    The last bucket's all-reduce completes at nearly one instant on every rank
    (a collective ends for all at once, give or take the loopback transfer),
    so after alignment the two ends should coincide; what is left is the
    alignment error plus that transfer.
    """
    from ddpscope.analysis.sources import rank_shifts
    from ddpscope.record import open_run
    from ddpscope.schema import Step

    recording = open_run(str(record))
    shifts = rank_shifts(recording)
    ends: dict[int, dict[int, int]] = {}
    for rank, msgs in recording.messages.items():
        for m in msgs:
            if isinstance(m, Step) and m.b_offset_ns and m.clock == "cpu":
                last = max(o + d for o, d in zip(m.b_offset_ns, m.b_dur_ns, strict=True))
                ends.setdefault(m.step, {})[rank] = m.t_start + last + shifts.get(rank, 0)
    return [
        abs(by_rank[0] - by_rank[1]) / 1e6
        for _, by_rank in sorted(ends.items())
        if len(by_rank) == 2
    ]


def shift_error_ns(record: Path, skew_ns: int) -> int:
    """The estimated shift of the second host minus the true one (the namespace's offset)."""
    from ddpscope.analysis.sources import rank_shifts
    from ddpscope.record import open_run

    shifts = rank_shifts(open_run(str(record)))
    return shifts[1] - shifts[0] + skew_ns
