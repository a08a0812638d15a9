"""How long the training thread waits inside torch DataLoader iterators.

A step's *data* phase was the whole gap from one step's end to the next
forward. That gap also holds whatever the loop does after
``optimizer.step()``: logging and metrics on rank 0, a checkpoint, Lightning's
and the HF Trainer's callbacks. A rank slowed there was named a straggler in
"data loading" with advice about its input pipeline. So the time the training
thread spends in ``_BaseDataLoaderIter.__next__`` (every torch DataLoader
iterator's, single- or multi-process, and those of Lightning's fetchers and
accelerate's shards, which call it) is summed here; the step tracker caps the
gap's data phase at it and the rest of the gap is the rank's own code
(``other_ns``).

Only the thread that attached counts, and only with gradients on: evaluation
loops draw from their loaders under ``no_grad``, and their time is not waiting
for training data. A loop that never calls a DataLoader iterator on the
training thread (a prefetching thread of its own, an iterable that is not a
torch DataLoader) keeps the whole gap as data: ``calls`` stays 0.

The live phase follows: between steps a rank whose loop draws from a
DataLoader is "idle" (its own code) and "data" only while inside ``__next__``,
so that a rank stuck in a callback after ``optimizer.step()`` is not said to
be loading data.

One Python frame and two clock reads per batch (~0.7 us on the 2-core VM).

The first batches of each pass also leave a digest of what they hold
(hooks/batchdigest.py) for the step that draws them: ranks reading one
unsplit stream show the same digests (``unsharded_data``).

A pass over an ``IterableDataset`` with DataLoader workers is also checked
for copies: each worker runs its own copy of the dataset's ``__iter__``, and
one that does not split its items by ``get_worker_info()`` yields the whole
stream in every worker. The loader takes batches from its workers in turn, so
batch ``j`` is worker ``j % k``'s ``j // k``-th: copies show as the first
round of ``k`` batches all equal and the second all equal and different
(``worker_copies``, analysis/detectors/sampling/worker_copies.py). At most
:data:`MAX_COMPARED` workers' batches of the first two rounds are digested
(16 digests at most, ~30-90 us each: under 1.5 ms once a pass).

A pass that runs out (``__next__`` raises ``StopIteration``) leaves its
dataset in :data:`ran_out` until a batch is drawn from that dataset again (the
loader's next pass), and counts in :data:`stops`. The step tracker reads both
with the step's draws: a loop that trains on drawing fewer batches a step than
before a loader ran out, and never draws from that loader again, is training on
batches kept from its pass (``itertools.cycle`` saves every item of its first
pass and replays them, alone or zipped beside a loader drawn anew:
``replayed_batches``).
A loop can also go on to train from a source that is not a DataLoader (a
second phase on generated data); so once the steps without a draw make a
whole pass, the step tracker asks :func:`cycle_in_process` whether an
``itertools.cycle`` exists at all (one walk of the heap, ~15-30 ms at 200,000
objects, once per run) and stops counting if not.

A loader whose dataset has a ``set_epoch`` (hooks/epochlayer.py) and whose
sampler does not shuffle (a stream's, or a sequential one) also has its
passes' first batches compared with its previous pass's: the same digests in
the same order mean the pass replays the last one, whatever ``set_epoch`` was
given. The step that draws the last of them carries what was seen
(:data:`pass_repeat`): the layer, its epoch at both passes, whether that epoch
is shared with the workers, and the loader's persistent workers
(``repeated_epoch``). One epoch-layer read per pass, a list append per head
batch.
"""

from __future__ import annotations

import functools
import gc
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import dataloader as _torch_dataloader

from ddpscope.hooks.batchdigest import DIGEST_BATCHES, content_digest
from ddpscope.hooks.epochlayer import EpochLayer, epoch_layer
from ddpscope.hooks.shuffling import shuffles

#: Batches at the head of each pass that are looked at more closely (digests, worker
#: copies); past them a draw costs one comparison more.
HEAD_LIMIT = 64
#: Workers whose batches of the first two rounds are compared, at most.
MAX_COMPARED = 8
#: The attribute under which a pass's iterator keeps the digests compared so far.
HEADS_ATTR = "_ddpscope_heads"
_ITERABLE = getattr(getattr(_torch_dataloader, "_DatasetKind", None), "Iterable", 1)

_get_ident = threading.get_ident
_monotonic_ns = time.monotonic_ns
_grad_enabled = torch.is_grad_enabled

_iter_class: type | None = getattr(_torch_dataloader, "_BaseDataLoaderIter", None)
_orig_next: Callable[[Any], Any] | None = None
_patched_next: Callable[[Any], Any] | None = None
#: The thread that attached (the training loop's); 0 while not installed.
_owner = 0
#: The rank's RankState (hooks/publisher.py), whose phase the waits mark.
_state: Any = None

#: Host ns the training thread spent in DataLoader ``__next__`` with gradients on,
#: and how many such calls, since install. Read (never reset) by the step tracker.
waited_ns = 0
calls = 0
#: Digest of the latest of a pass's first batches drawn on the training thread; the
#: step tracker takes it (and sets 0) when the step closes. 0: none since.
batch_digest = 0
#: Workers of a pass that were seen yielding the same batches (0: none seen since the
#: step tracker last took it, which it does at each step's close, setting 0).
worker_copies = 0
#: The attribute under which the sampler probe (hooks/samplers.py) leaves each iterator
#: the pass it is drawing (set at every ``iter()``: persistent workers reuse iterators).
PASS_ATTR = "_ddpscope_pass"
#: The pass of the latest batch drawn on the training thread with gradients on (None:
#: none yet, or a loader the probe did not follow). The step tracker names it as the
#: pass the step trained on: the sampler that yielded last may be an evaluation's whose
#: loader prefetched, and the model's mode at ``iter()`` lags where an engine switches
#: it inside its step function (ignite sets ``model.train()`` after the batch is drawn).
drawn: Any = None
#: id() of the datasets whose pass ran out on the training thread (gradients on) and
#: that no batch has been drawn from since; and the draws that raised StopIteration
#: (counted in ``calls`` too), since install. Read by the step tracker.
ran_out: set[int] = set()
stops = 0
#: The pass (hooks/samplers.py's record, or None: not followed) that last ran out.
last_out: Any = None
#: A pass whose first batches replayed its loader's previous pass, as (epoch layer's
#: type, its epoch at the previous pass and at this one, epoch shared with workers,
#: persistent workers); None since the step tracker last took it (at each close).
pass_repeat: tuple[str, int, int, bool, int] | None = None
#: Loaders whose passes are compared, at most (a loop that builds a loader per epoch).
MAX_FOLLOWED = 16


class _Heads:
    """One loader's first batches: its previous pass's and the current one's."""

    __slots__ = ("cur", "layer", "owner", "prev", "prev_epoch")

    def __init__(self, owner: Callable[[], Any]) -> None:
        self.owner = owner
        self.layer: EpochLayer | None = None
        self.prev: list[int] | None = None
        self.prev_epoch = -1
        self.cur: list[int] = []


#: id() of a loader's index sampler (it lives as long as the loader) -> its heads.
_followed: dict[int, _Heads] = {}


def _next(it: Any) -> Any:
    global waited_ns, calls, batch_digest, drawn, stops, last_out
    run = _orig_next
    assert run is not None
    if _get_ident() != _owner or not _grad_enabled():
        return run(it)
    t0 = _monotonic_ns()
    st = _state
    marks = st is not None and st.phase == "idle"
    if marks:
        st.phase = "data"
        st.since_ns = t0
    try:
        batch = run(it)
    except StopIteration:
        ran_out.add(id(getattr(it, "_dataset", it)))
        stops += 1
        last_out = getattr(it, PASS_ATTR, None)
        raise
    finally:
        t1 = _monotonic_ns()
        waited_ns += t1 - t0
        calls += 1
        if marks and st.phase == "data":
            st.phase = "idle"
            st.since_ns = t1
    drawn = getattr(it, PASS_ATTR, None)
    if ran_out:
        ran_out.discard(id(getattr(it, "_dataset", it)))  # its loader draws again
    # torch counts the batches of the current pass (reset by each iter()).
    n = getattr(it, "_num_yielded", HEAD_LIMIT + 1)
    if n <= HEAD_LIMIT:
        _head(it, n, batch)
    return batch


def _digest(batch: Any) -> int:
    try:
        return content_digest(batch)
    except Exception:  # a digest must never break the training loop
        return 0


def _head(it: Any, n: int, batch: Any) -> None:
    """The ``n``-th batch of a pass (from 1): its digest, and the worker-copies check."""
    global batch_digest, worker_copies
    digest = -1
    if n <= DIGEST_BATCHES:
        digest = batch_digest = _digest(batch)
        _compare_pass(it, n, digest)
    k = getattr(it, "_num_workers", 0)
    if k < 2 or getattr(it, "_dataset_kind", None) != _ITERABLE:
        return
    m = min(k, MAX_COMPARED)
    j = n - 1
    if j >= k + m or j % k >= m:
        return  # not among the first m workers' batches of the first two rounds
    if j == 0:
        heads: list[int] | None = []
        setattr(it, HEADS_ATTR, heads)
    else:
        heads = getattr(it, HEADS_ATTR, None)
    if heads is None:
        return
    heads.append(_digest(batch) if digest < 0 else digest)
    if len(heads) < 2 * m:
        return
    setattr(it, HEADS_ATTR, None)
    first, second = set(heads[:m]), set(heads[m:])
    if len(first) == len(second) == 1 and first != second and 0 not in first | second:
        worker_copies = m


def _compare_pass(it: Any, n: int, digest: int) -> None:
    """Keep the ``n``-th of a pass's first batches; at the last, compare with the
    loader's previous pass."""
    global pass_repeat
    sampler = getattr(it, "_index_sampler", None)
    if sampler is None:
        return
    key = id(sampler)
    heads = _followed.get(key)
    if heads is not None and heads.owner() is not sampler:
        heads = None  # a loader that is gone, its sampler's id reused
    if n == 1:
        heads = _start_pass(it, sampler, key, heads)
    if heads is None or heads.layer is None or len(heads.cur) != n - 1:
        return
    heads.cur.append(digest)
    cur, prev = heads.cur, heads.prev
    if n == DIGEST_BATCHES and cur == prev and 0 not in cur and len(set(cur)) > 1:
        layer = heads.layer
        workers = getattr(it, "_num_workers", 0)
        persistent = workers if getattr(it, "_persistent_workers", False) else 0
        pass_repeat = (layer.name, heads.prev_epoch, layer.epoch, layer.shared, persistent)


def _start_pass(it: Any, sampler: Any, key: int, heads: _Heads | None) -> _Heads | None:
    """A pass's first batch: the loader's last pass becomes the one compared with."""
    if shuffles(getattr(sampler, "sampler", sampler)):
        return None  # its order is the sampler's (missing_set_epoch judges that)
    if heads is None:
        try:
            owner = weakref.ref(sampler)
        except TypeError:
            return None
        if len(_followed) >= MAX_FOLLOWED:
            _followed.pop(next(iter(_followed)))
        heads = _followed[key] = _Heads(owner)
    layer = epoch_layer(getattr(it, "_dataset", None))
    full = len(heads.cur) == DIGEST_BATCHES
    heads.prev = heads.cur if full else None
    heads.prev_epoch = heads.layer.epoch if full and heads.layer is not None else -1
    heads.cur = []
    heads.layer = layer
    return heads


def cycle_in_process() -> bool:
    """An ``itertools.cycle`` exists in this process (walks every object the collector
    tracks: tens of ms in a large process; called at most once a run)."""
    cycle = itertools.cycle
    return any(type(o) is cycle for o in gc.get_objects())


def install(state: Any = None) -> None:
    """Count the current thread's waits from now on (patches once per process);
    ``state``: the RankState whose phase they mark."""
    global _orig_next, _patched_next, _owner, _state
    _owner = _get_ident()
    _state = state
    if _iter_class is None or _patched_next is not None:
        return
    orig = _iter_class.__dict__.get("__next__")
    if orig is None:
        return  # a torch whose iterators are built otherwise: the gap stays data
    _orig_next = orig
    _patched_next = functools.wraps(orig)(_next)
    _iter_class.__next__ = _patched_next  # type: ignore[attr-defined]


def uninstall() -> None:
    """Restore torch's own ``__next__`` unless someone patched on top of ours."""
    global _orig_next, _patched_next, _owner, _state, drawn, worker_copies, last_out
    global pass_repeat
    _owner = 0
    _state = None
    drawn = last_out = pass_repeat = None
    worker_copies = 0
    ran_out.clear()
    _followed.clear()
    if _iter_class is not None and _iter_class.__dict__.get("__next__") is _patched_next:
        _iter_class.__next__ = _orig_next  # type: ignore[attr-defined]
        _orig_next = _patched_next = None


__all__ = [
    "PASS_ATTR",
    "batch_digest",
    "calls",
    "cycle_in_process",
    "drawn",
    "install",
    "last_out",
    "pass_repeat",
    "ran_out",
    "stops",
    "uninstall",
    "waited_ns",
    "worker_copies",
]
