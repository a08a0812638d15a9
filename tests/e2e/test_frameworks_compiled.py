"""torch.compile jobs watched by ddpscope, 2 ranks on CPU (gloo): the model
compiled around DDP, inside it, in place before and after attach(), and a
module under torch's composable replicate() compiled whole, with
dynamo's graph-break and frame counters compared to the same job unwatched
(tests/jobs/compiled_job.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddpscope.record import open_run
from ddpscope.schema import Fingerprint, RunInfo
from tests.support.frameworks import COMPILED, assert_phases_add_up, ddpscope_run
from tests.support.recorded import brief, serious, steps_of
from tests.support.recorded import report_json as report
from tests.support.torchrun import job_env, torchrun

pytestmark = [pytest.mark.frameworks, pytest.mark.torchrun]


_BREAKS = re.compile(r"^graph_breaks (\d+)$", re.M)
_FRAMES = re.compile(r"^frames_ok (\d+)$", re.M)


#: The default backend (inductor) for the way the docs show; the others where graph
#: breaks and hooks are decided (dynamo, AOTAutograd, DDPOptimizer's split) without
#: inductor's C++ build, which took 18-52 s a variant on this 2-core machine.
BACKEND = {
    "compile-ddp": "inductor",
    "ddp-compile": "aot_eager",
    "inplace": "aot_eager",
    "inplace-first": "aot_eager",
    "replicate": "aot_eager",
}


def _compiled(tmp: Path, endpoint: str, wrap: str, watched: bool) -> tuple[int, int, Path]:
    rec = tmp / f"rec-{wrap}-{watched}"
    backend = ["--backend", BACKEND[wrap]]
    # Buckets timed from the first step: the comm hook is what must not break graphs.
    timed = {"DDPSCOPE_BUCKET_EVERY": "1"}
    if wrap == "inplace-first" and watched:
        # Compiled in place before the script's own attach(): zero-code would attach first.
        proc = torchrun(
            [COMPILED, "--wrap", wrap, "--attach", *backend],
            env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint, **timed),
            timeout=300,
        )
    else:
        proc = torchrun(
            [COMPILED, "--wrap", wrap, *backend],
            env=job_env(DDPSCOPE_ENDPOINT=endpoint, **timed),
            prefix=ddpscope_run(rec) if watched else None,
            timeout=300,
        )
    breaks, frames = _BREAKS.search(proc.stdout), _FRAMES.search(proc.stdout)
    assert breaks and frames, proc.stdout[-2000:]
    return int(breaks.group(1)), int(frames.group(1)), rec


@pytest.fixture(scope="module")
def unwatched() -> dict[str, tuple[int, int, Path]]:
    """The unwatched jobs' counts, by the job they are: unwatched, "inplace-first"
    differs from "inplace" only in where attach() goes (tests/jobs/compiled_job.py)."""
    return {}


@pytest.mark.parametrize("wrap", list(BACKEND))
def test_a_compiled_model_trains_watched_with_no_extra_graph_break(
    tmp_path: Path, endpoint: str, wrap: str, unwatched: dict[str, tuple[int, int, Path]]
) -> None:
    job = "inplace" if wrap == "inplace-first" else wrap
    if job not in unwatched:
        unwatched[job] = _compiled(tmp_path, endpoint, job, watched=False)
    plain = unwatched[job]
    watched = _compiled(tmp_path, endpoint, wrap, watched=True)
    assert watched[:2] == plain[:2], f"graph breaks, frames compiled: {watched[:2]} vs {plain[:2]}"
    rec = watched[2]
    steps = steps_of(rec)
    assert all(len(ss) == 32 for ss in steps.values())
    assert_phases_add_up(steps)
    for ss in steps.values():
        timed = [s for s in ss if s.b_detail]  # bucket timing is sampled
        assert timed and all(s.b_index and min(s.b_dur_ns) >= 0 for s in timed), "bucket timing"
    # The latest run info of each rank: the first is sent at attach, before the compile.
    infos = [
        [m for m in ms if isinstance(m, RunInfo)][-1] for ms in open_run(str(rec)).messages.values()
    ]
    expected = {
        "compile-ddp": "torch.compile(ddp_model)",
        "inplace": "ddp_model.compile()",
        "inplace-first": "ddp_model.compile()",
    }.get(wrap, "")
    assert {i.compiled for i in infos} == {expected}
    finals = {
        r: [m.params for m in ms if isinstance(m, Fingerprint) and m.reason == "final"]
        for r, ms in open_run(str(rec)).messages.items()
    }
    assert finals[0] and finals[0] == finals[1], "weights fingerprinted, equal on both ranks"
    assert serious(report(rec)) == [], brief(serious(report(rec)))
