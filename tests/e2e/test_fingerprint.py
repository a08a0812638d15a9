"""Weight fingerprints in another process: the digest does not depend on the process.

(The digests, the schedule and hyperparameters in-process: tests/unit/test_fingerprint.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from ddpscope.hooks.fingerprint import digest_tensors
from tests.support.torchrun import ROOT

_CHILD = """
import torch
from ddpscope.hooks.fingerprint import digest_tensors
ts = [torch.arange(n, dtype=d) for n in (0, 5, 4097, 20000) for d in (torch.float32, torch.int8)]
print(digest_tensors(ts).values())
"""


def test_digests_are_identical_in_another_process() -> None:
    ts = [
        torch.arange(n, dtype=d) for n in (0, 5, 4097, 20000) for d in (torch.float32, torch.int8)
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="12345", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == str(digest_tensors(ts).values())
