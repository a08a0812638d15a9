"""What the training thread hands the publisher thread for one step.

A NamedTuple rather than a dataclass: it is built once per step on the
training thread, and a NamedTuple is a tuple underneath (measured with
timeit, 17 fields: a bare tuple 43 ns, this 290 ns, a slotted dataclass
231 ns with mutability nobody needs; the step's other savings pay for it
many times over, see docs/benchmarks.md). Fields hold clock tokens, not
times: the publisher thread resolves them (CUDA events) in
:meth:`ddpscope.hooks.steps.StepTracker.finish`.
"""

from __future__ import annotations

from typing import NamedTuple

#: One phase interval: (phase constant, start token, end token).
Interval = tuple[int, int, int]
#: One timed collective: (is DDP's, op, group, bytes, call site, start token,
#: end token, ran inside an evaluation forward).
Collective = tuple[bool, str, str, int, str, int, int, bool]


class StepRecord(NamedTuple):
    step: int
    start: int
    end: int
    intervals: list[Interval]
    b_index: list[int]
    b_nbytes: list[int]
    b_start: list[int]
    #: End tokens, -1 until the bucket's Future completes (written from its callback).
    b_end: list[int]
    micro_batches: int
    optimizer_steps: int
    epoch: int
    loader_pass: int
    layout: int
    eval_ns: int
    collectives: list[Collective]
    collectives_lost: int
    joined: bool
    #: The bucket arrays were measured this step (False between samples: empty).
    b_detail: bool
    #: Steps between two with bucket detail, as chosen when this step began.
    b_every: int
    #: The optimizer stepped on gradients no backward of the step all-reduced.
    unsynced: bool
    #: Host ns the training thread spent in DataLoader ``__next__`` since the last
    #: step's close, and in how many calls (hooks/loaderwait.py; 0: none seen).
    fetch_ns: int
    fetch_calls: int
    #: A backward of the step reached the model with no forward through DDP in the
    #: step: the loop called the wrapped module itself, and DDP all-reduced nothing.
    bypassed: bool
    #: Content digest of the latest of a pass's first batches the step drew
    #: (hooks/batchdigest.py); 0 past them or with none.
    batch_digest: int
    #: ``loader_pass`` names the pass the training thread last drew a batch from
    #: (hooks/loaderwait.py), not only the one whose sampler last yielded.
    drawn: bool
    #: Workers of a DataLoader pass the step drew from that yielded the same batches
    #: (hooks/loaderwait.py: each ran the whole stream); 0 when none were seen.
    worker_copies: int
    #: Host ns in DDP's post-forward (its search for unused parameters) over the
    #: step's forwards, and the parameters some rank left unused in its synced
    #: backward (hooks/unusedsearch.py); -1 where DDP does not search / not known.
    search_ns: int
    unused_params: int
    #: Digest of which parameters went unused (0: none or not known), and their names
    #: when the set changed since the step before (else None).
    unused_set: int
    unused_names: tuple[str, ...] | None
    #: Steps in a row, this one included, that drew fewer batches than before a
    #: DataLoader pass ran out whose loader was not drawn from since, and how many steps
    #: drew up to that pass's end (0, 0 on other steps; see StepTracker._count_replay).
    replayed: int
    replay_of: int
    #: The process-wide id of that pass (-1: a loader the sampler probe did not follow).
    replay_pass: int
    #: Every training forward of the step ran with the model in eval mode, and on the
    #: first such step the kinds of layer that mode changes (else None).
    eval_mode: bool
    eval_layers: tuple[str, ...] | None
    #: The step drew the last of a pass's first batches, and they replayed the loader's
    #: previous pass (hooks/loaderwait.py's ``pass_repeat``); else None.
    pass_repeat: tuple[str, int, int, bool, int] | None


__all__ = ["Collective", "Interval", "StepRecord"]
