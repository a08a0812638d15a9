"""See every pass a DataLoader makes over its sampler, without changing it.

The watcher needs, per rank and per pass, which real dataset indices were
drawn: to catch a missing ``set_epoch`` (the order digest repeats), unsharded
data (a plain sampler in a DDP loop: every rank's sketch covers everything),
overlapping shards (two ranks' sketches intersect) and uneven inputs (counts
differ). Training must not notice: no RNG is drawn, the sampler is iterated
exactly once, and every item reaches the loader unchanged.

How it hooks in
---------------
``DataLoader.__iter__`` is patched process-wide. Before calling the original
it ends the loader's previous pass if still open ("abandoned", e.g. a peek
``next(iter(loader))``) and posts ``sampler_pass``. The indices are observed by
a tap generator that replaces the iterator's ``_sampler_iter`` (torch creates
it as ``iter(self._index_sampler)`` in ``_BaseDataLoaderIter.__init__`` and in
``_reset``).

Deviation from wrapping ``_sampler_iter`` after ``__iter__`` returns: the
multi-worker iterator prefetches ``prefetch_factor * num_workers`` batches
inside ``__init__``/``_reset``, so a wrap done afterwards misses the first
batches of every pass (wrong head, count and digest). Instead, while the
original ``__iter__`` runs, a thread-local names the pass being started and a
set-only descriptor on ``_BaseDataLoaderIter._sampler_iter`` wraps the value at
the moment torch assigns it, before any prefetch. The descriptor has no
``__get__``, so reads still come straight from the instance ``__dict__`` at C
speed; uninstalling deletes it and live iterators keep working. If torch
assigns twice in one ``__iter__`` (the multi-worker ``__init__`` does), the
newest tap wins and older ones go quiet. If no assignment was seen (an iterator
class not derived from ``_BaseDataLoaderIter``), ``_sampler_iter`` is wrapped
after the fact as a fallback; if there is none, the pass ends at once with
``count == -1``.

What a pass records
-------------------
Each index is first mapped through the Subset chain (``Subset`` and anything
with ``.dataset`` and ``.indices``) to the index of the innermost dataset, so
manual sharding with Subsets compares correctly across ranks. Then:

* at ``iter()``, ``subset_digest``: a blake2b-64 digest of the real indices the
  Subset chain keeps (computed once per loader and index list), which tells a
  split shared by all ranks from a ``random_split`` drawn on each;
* ``count``, and a blake2b-64 digest of ``array('q', batch)`` bytes, which is
  identical across processes for identical orders;
* ``head``: the first 16 real indices;
* ``sketch``: real indices ``i`` with ``mix64(i) % sketch_mod == 0``
  (splitmix64). Deviation: ``sketch_mod`` is the largest power of two not
  above ``max(1, expected // sketch_target)``, not the quotient itself. Two
  ranks whose ``expected`` differ slightly (uneven manual shards) would
  otherwise use co-prime-ish moduli and their sketches would barely intersect
  even on full overlap; with powers of two the coarser rule implies the finer,
  so a plain intersection of two sketches samples the overlap at the coarser
  rate. If a sketch outgrows ``4 * sketch_target`` (``len(sampler)`` was
  wrong or unknown) the modulus doubles and the sketch is filtered, which keeps
  that property; the final modulus is reported.

Cost: hashing each index in Python costs ~300 ns. When the innermost dataset
has a length N (at most 2**27) and about N / sketch_mod <= 2**16 indices
qualify, the qualifying set over ``range(N)`` is computed once with vectorised
torch ops (~0.1 s for N = 10M, cached per (N, sketch_mod)) and each batch costs
one C-level ``set.intersection``. A batch holding an index outside ``[0, N)``
takes the Python path, so the rule is exact either way; the min/max check that
decides this is skipped for stock samplers that cannot leave the range. The
Python path is used only when a rank's share is small against N (many ranks),
which bounds its cost. Per index the rest is C-level too (``array``, blake2b,
``map`` through Subset index lists); measured on a 1M-index pass with a
do-nothing dataset: ~50 ns per index (``array`` + blake2b ~25, the set
intersection ~20). Single indices (``batch_size=None``) are gathered into
groups of 256 first. Nothing stores the full index list.

An item that is not an index batch (iterable-style datasets never get a tap;
a custom sampler yielding strings does) marks the pass untracked: items flow
through and the end reports ``count == -1``, ``digest == 0``, empty lists.

Attributes read by the step tracker each step: ``last_epoch`` is the epoch of
the most recent DistributedSampler pass whose tap yielded an item (-1 until
one has; passes over other samplers leave it alone so that a validation loader
does not erase the training epoch). ``last_pass`` is the process-wide id
(counter per probe, over all loaders, from 0) of the most recent pass of any
loader whose tap yielded an item, -1 before.

Each iterator ``iter()`` returns also carries its pass (``PASS_ATTR``): the
training thread's draws name the pass a step trained on (hooks/loaderwait.py),
which ``last_pass`` cannot where an evaluation's loader prefetched last.

Any exception in the probe's own code disables it with one warning on the
"ddpscope" logger; the user's loop continues untouched. Forked DataLoader
workers inherit the patch but never post: the pid captured at ``install`` is
compared first.

Long module: one probe (:class:`SamplerProbe` and the pass it records); about 90 lines are
this docstring, which says why it hooks torch's DataLoader iterator the way it does.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import os
import threading
import weakref
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any, SupportsIndex

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    Subset,
)
from torch.utils.data import dataloader as _torch_dataloader

__all__ = ["HEAD_LEN", "SamplerProbe", "mix64", "padded_count", "sketch_mod_for"]

from ddpscope.hooks import runinfo
from ddpscope.hooks.loaderwait import PASS_ATTR
from ddpscope.hooks.ranksplits import rank_splits
from ddpscope.hooks.shuffling import shuffles
from ddpscope.hooks.typename import type_name
from ddpscope.schema import HEAD_LEN, SamplerPass, SamplerPassEnd
from ddpscope.sketch import C1, C2, GOLDEN, M64, keep, mix64

_log = logging.getLogger("ddpscope")

_M64, _GOLDEN, _C1, _C2 = M64, GOLDEN, C1, C2
#: Largest innermost-dataset length for which the qualifying set is precomputed.
_MAX_DOMAIN = 1 << 27
#: Largest precomputed qualifying set (about 4 MiB as a Python set).
_MAX_KEPT = 1 << 16
_MAX_SUBSET_DEPTH = 32
_CHUNK = 1 << 20
#: Single indices (batch_size=None) are observed in groups of this many.
_PENDING = 256
#: Stock samplers (exact types: subclasses may override __iter__) that only yield
#: indices in range(len(their dataset)).
_IN_RANGE = (DistributedSampler, RandomSampler, SequentialSampler)


def sketch_mod_for(expected: int, target: int) -> int:
    """Largest power of two not above ``max(1, expected // target)``."""
    return 1 << (max(1, expected // max(1, target)).bit_length() - 1)


#: Attribute names repeated-augmentation samplers keep their repeat count under
#: (timm and DeiT: num_repeats; torchvision's references: repetitions).
_REPEAT_ATTRS = ("num_repeats", "repetitions", "repeats")
#: Class names of repeated-augmentation samplers whose count is not an attribute
#: (DeiT's first RASampler and its many copies deal every sample to 3 ranks).
_REPEAT_NAMES = ("RASampler", "RepeatAugSampler", "RepeatedAugSampler")


def repeats_of(sampler: Any) -> int:
    """How many ranks ``sampler`` deals each sample to on purpose; 1 for most samplers.

    Repeated augmentation (Hoffer et al. 2019; the DeiT, timm and torchvision
    recipes) gives each sample to several ranks, each augmenting it its own
    way: overlap by design, not a sharding mistake. Such a sampler has a
    ``num_replicas`` and an int repeat count of 2 or more; DeiT's first one
    (copied widely) hard-codes 3 and is known by its class name.
    """
    if sampler is None or not hasattr(sampler, "num_replicas"):
        return 1
    for name in _REPEAT_ATTRS:
        value = getattr(sampler, name, None)
        if type(value) is int:
            return max(value, 1)
    return 3 if type(sampler).__name__ in _REPEAT_NAMES else 1


def _epoch_aware(sampler: Any) -> bool:
    """A sampler of its own that deals shards by rank and reshuffles by ``set_epoch``."""
    return (
        sampler is not None
        and hasattr(sampler, "num_replicas")
        and callable(getattr(sampler, "set_epoch", None))
        and type(getattr(sampler, "epoch", None)) is int
    )


def _int_attr(obj: Any, name: str) -> int:
    value = getattr(obj, name, -1)
    return value if type(value) is int else -1


def padded_count(n: int, num_replicas: int, rank: int, drop_last: bool) -> int:
    """Indices ``rank`` draws twice because DistributedSampler padded ``n`` up.

    Padding fills global positions ``n .. total-1`` with ``total - n < R``
    slots; rank r owns positions congruent to r mod R, so it owns at most one.
    """
    if num_replicas <= 0 or n <= 0 or (drop_last and n % num_replicas):
        return 0
    pad = -n % num_replicas
    return 1 if (rank - n) % num_replicas < pad else 0


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _kept_in_range(n: int, mod: int) -> frozenset[int]:
    """All ``i`` in ``range(n)`` with ``mix64(i) % mod == 0``, vectorised.

    int64 multiply wraps modulo 2**64 in torch, and masking after ``>>`` turns
    its arithmetic shift into the logical one splitmix64 needs.
    """
    g, c1, c2, mask = _signed(_GOLDEN), _signed(_C1), _signed(_C2), mod - 1
    out: list[int] = []
    for lo in range(0, n, _CHUNK):
        x = torch.arange(lo, min(n, lo + _CHUNK), dtype=torch.int64)
        z = x + g
        z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * c1
        z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * c2
        z = z ^ ((z >> 31) & ((1 << 33) - 1))
        out.extend(x[(z & mask) == 0].tolist())
    return frozenset(out)


_pick = keep  # the Python path of the sketch rule (``mask`` is ``sketch_mod - 1``)


def _length(obj: object) -> int:
    try:
        return len(obj)  # type: ignore[arg-type]
    except Exception:  # no __len__, or a user __len__ that raises
        return -1


def _as_index_list(item: object) -> list[Any] | None:
    """Indices in a sampler item that is not a plain list; None if it holds none."""
    if isinstance(item, int):
        return [item]
    if isinstance(item, torch.Tensor):
        if item.is_floating_point() or item.is_complex():
            return None
        v = item.tolist()
        return v if isinstance(v, list) else [v]
    if isinstance(item, tuple | range):
        return list(item)
    tolist = getattr(item, "tolist", None)  # numpy arrays and scalars
    if callable(tolist):
        v = tolist()
        return v if isinstance(v, list) else [v]
    if isinstance(item, SupportsIndex):
        return [operator.index(item)]
    return None


def _map_through(indices: Any, batch: list[Any]) -> list[Any]:
    """``[indices[i] for i in batch]`` at C speed, with Subset's own semantics."""
    if isinstance(indices, torch.Tensor):
        return indices[torch.as_tensor(batch, dtype=torch.long)].tolist()
    return list(map(indices.__getitem__, batch))


def _unwrap(dataset: object) -> tuple[list[Any], object]:
    """Index lists of the Subset-like wrappers, outermost first, and the innermost dataset."""
    chain: list[Any] = []
    while len(chain) < _MAX_SUBSET_DEPTH and (
        isinstance(dataset, Subset) or (hasattr(dataset, "dataset") and hasattr(dataset, "indices"))
    ):
        chain.append(dataset.indices)
        dataset = dataset.dataset
    return chain, dataset


class _Pass:
    """One pass of one loader: its settings and what its tap has seen so far."""

    __slots__ = (
        "cap",
        "chain",
        "count",
        "distributed",
        "domain",
        "epoch",
        "gid",
        "hasher",
        "head",
        "in_range",
        "kept",
        "loader",
        "mod",
        "open",
        "pass_id",
        "pending",
        "share",
        "sketch",
        "started",
        "tapped",
        "token",
        "untracked",
    )

    def __init__(
        self,
        loader: int,
        pass_id: int,
        gid: int,
        chain: list[Any],
        domain: int,
        mod: int,
        kept: frozenset[int] | None,
        cap: int,
    ) -> None:
        self.loader = loader
        self.pass_id = pass_id
        self.gid = gid
        self.chain = chain
        self.domain = domain
        self.mod = mod
        self.kept = kept
        self.cap = cap
        # Indices known to lie in range(domain), so batches skip the range check.
        self.in_range = False
        self.distributed = False
        self.epoch = -1
        # Draws the sketch covers (-1: all): a pass of unknown length (an infinite
        # sampler) is sketched over its first share of the dataset only.
        self.share = -1
        self.open = True
        self.tapped = False
        self.started = False
        # Identity of the one tap allowed to record; None silences every tap.
        self.token: object | None = None
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.hasher = hashlib.blake2b(digest_size=8)
        self.head: list[int] = []
        self.sketch: set[Any] = set()
        self.pending: list[int] = []
        self.untracked = False

    def untrack(self) -> None:
        self.untracked = True
        self.head = []
        self.sketch = set()

    def observe(self, item: object) -> None:
        if self.untracked:
            return
        if type(item) is int:
            # batch_size=None: gather single indices so the per-batch work is shared.
            pending = self.pending
            pending.append(item)
            if len(pending) >= _PENDING:
                self.drain()
            return
        if self.pending:
            self.drain()  # keep the order for the digest
        batch = item if type(item) is list else _as_index_list(item)
        if batch is None:
            self.untrack()
            return
        self.observe_batch(batch)

    def drain(self) -> None:
        batch, self.pending = self.pending, []
        if batch and not self.untracked:
            self.observe_batch(batch)

    def observe_batch(self, batch: list[Any]) -> None:
        for indices in self.chain:
            batch = _map_through(indices, batch)
        try:
            arr = array("q", batch)  # also proves every element is an int-like
        except (TypeError, OverflowError):
            self.untrack()
            return
        n = len(arr)
        if not n:
            return
        self.hasher.update(arr)
        before = self.count
        if before < HEAD_LEN:
            self.head.extend(arr[: HEAD_LEN - before].tolist())
        self.count += n
        if self.share >= 0 and before + n > self.share:
            room = self.share - before
            if room <= 0:
                return
            batch, arr = batch[:room], arr[:room]
        mod = self.mod
        if mod == 1:
            self.sketch.update(batch)
        else:
            kept = self.kept
            if kept is not None and (
                self.in_range or (min(batch) >= 0 and max(batch) < self.domain)
            ):
                picked: Iterable[Any] = kept.intersection(batch)
            else:
                picked = _pick(arr, mod - 1)
            if picked:
                self.sketch.update(picked)
        if len(self.sketch) > self.cap:
            self.coarsen()

    def coarsen(self) -> None:
        # mix % 2m == 0 implies mix % m == 0: the coarser sketch is exactly a subset.
        while len(self.sketch) > self.cap:
            self.mod *= 2
            self.sketch = set(_pick(self.sketch, self.mod - 1))
        if self.kept is not None:
            self.kept = frozenset(_pick(self.kept, self.mod - 1))

    def end_fields(self, step: int, complete: bool) -> dict[str, Any]:
        self.drain()
        tracked = self.tapped and not self.untracked
        fields = {
            "loader": self.loader,
            "pass_id": self.pass_id,
            "global_pass": self.gid,
            "step": step,
            "count": self.count if tracked else -1,
            "complete": complete,
            "digest": int.from_bytes(self.hasher.digest(), "little") if tracked else 0,
            "head": self.head if tracked else [],
            "sketch": sorted(int(i) for i in self.sketch) if tracked else [],
            "sketch_mod": self.mod,
        }
        if tracked and 0 <= self.share < self.count:
            fields["sketch_count"] = self.share
        return fields


class _LoaderState:
    __slots__ = ("loader_id", "next_pass", "open_pass", "split")

    def __init__(self, loader_id: int) -> None:
        self.loader_id = loader_id
        self.next_pass = 0
        self.open_pass: _Pass | None = None
        #: (identities of the Subset index lists, their digest), computed once.
        self.split: tuple[tuple[int, ...], int] | None = None


#: Largest Subset whose index list is digested (a few ms per million indices).
_MAX_SPLIT = 1 << 24


def _split_digest(chain: list[Any]) -> int:
    """Digest of the innermost-dataset indices a Subset chain keeps, in order."""
    if not chain or _length(chain[0]) > _MAX_SPLIT:
        return 0
    real = chain[0].tolist() if isinstance(chain[0], torch.Tensor) else list(chain[0])
    for indices in chain[1:]:
        real = _map_through(indices, real)
    try:
        data = array("q", real)
    except (TypeError, OverflowError):
        return 0
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


class SamplerProbe:
    """Observes every DataLoader pass of this process; see the module docstring."""

    def __init__(
        self,
        post: Callable[[str, dict[str, Any]], None],
        current_step: Callable[[], int],
        training: Callable[[], bool],
        sketch_target: int = 1024,
    ) -> None:
        self._post = post
        self._current_step = current_step
        self._training = training
        self._target = max(1, sketch_target)
        self._lock = threading.RLock()
        self._enabled = True
        self._pid = os.getpid()
        self._loaders: weakref.WeakKeyDictionary[Any, _LoaderState] = weakref.WeakKeyDictionary()
        # For loaders that cannot be weakly referenced; an id may be reused after GC.
        self._loaders_by_id: dict[int, _LoaderState] = {}
        self._next_loader = 0
        self._next_gid = 0
        self._open: dict[int, _Pass] = {}
        self._kept_cache: dict[tuple[int, int], frozenset[int]] = {}
        self.last_epoch = -1
        self.last_pass = -1

    @property
    def enabled(self) -> bool:
        return self._enabled

    # --- installation --------------------------------------------------------

    def install(self) -> None:
        global _active
        with _install_lock:
            if _active is self:
                return
            if _active is not None:
                raise RuntimeError("another SamplerProbe is already installed")
            self._pid = os.getpid()
            _patch()
            _active = self

    def uninstall(self) -> None:
        global _active
        with _install_lock:
            if _active is not self:
                return
            _active = None
            _unpatch()

    # --- passes --------------------------------------------------------------

    def flush(self) -> None:
        """End every open pass with ``complete=False`` (at process exit)."""
        if not self._enabled or os.getpid() != self._pid:
            return
        with self._lock:
            recs = list(self._open.values())
        for rec in recs:
            self._guard(self._end, rec, False)

    def _iter(self, loader: Any, orig: Callable[[Any], Any]) -> Any:
        rec = self._guard(self._begin, loader)
        if rec is None:
            return _tagged(orig(loader), None)
        prev = getattr(_tls, "ctx", None)
        _tls.ctx = (self, rec)
        try:
            it = orig(loader)
        finally:
            _tls.ctx = prev
        if not rec.tapped and rec.open:
            self._guard(self._wrap_late, rec, it)
        return _tagged(it, rec)

    def _state_of(self, loader: Any) -> _LoaderState:
        try:
            state = self._loaders.get(loader)
        except TypeError:
            state = self._loaders_by_id.get(id(loader))
        if state is None:
            state = _LoaderState(self._next_loader)
            self._next_loader += 1
            try:
                self._loaders[loader] = state
            except TypeError:
                self._loaders_by_id[id(loader)] = state
        return state

    def _begin(self, loader: Any) -> _Pass | None:
        with self._lock:
            state = self._state_of(loader)
            prev = state.open_pass
        if prev is not None:
            self._end(prev, False)
        dataset = loader.dataset
        batch_sampler = loader.batch_sampler
        index_sampler = (
            getattr(batch_sampler, "sampler", None) if batch_sampler is not None else loader.sampler
        )
        chain, base = _unwrap(dataset)
        domain = _length(base)
        expected = _length(index_sampler) if index_sampler is not None else -1
        distributed = isinstance(index_sampler, DistributedSampler)
        basis = expected if expected > 0 else domain
        mod = sketch_mod_for(basis, self._target) if basis > 0 else 1
        kept = self._kept(domain, mod)
        with self._lock:
            rec = _Pass(
                state.loader_id,
                state.next_pass,
                self._next_gid,
                chain,
                domain,
                mod,
                kept,
                4 * self._target,
            )
            state.next_pass += 1
            self._next_gid += 1
            state.open_pass = rec
            self._open[rec.gid] = rec
        source = getattr(index_sampler, "dataset", getattr(index_sampler, "data_source", None))
        rec.in_range = (
            not chain and type(index_sampler) in _IN_RANGE and 0 <= _length(source) <= domain
        )
        if expected < 0 < domain:
            # No length: perhaps an infinite sampler (detectron2's TrainingSampler, each
            # rank's share of one stream of permutations, one pass a run). Over the whole
            # run every rank draws every sample; over its first share of the dataset a
            # sharded stream is disjoint, as an epoch of DistributedSampler is.
            rec.share = max(1, domain // runinfo.topology()["world_size"])
        fields: dict[str, Any] = {
            "loader": rec.loader,
            "pass_id": rec.pass_id,
            "global_pass": rec.gid,
            "step": int(self._current_step()),
            "training": bool(self._training()),
            "sampler_type": type_name(
                index_sampler if index_sampler is not None else batch_sampler
            ),
            "batch_sampler_type": type_name(batch_sampler) if batch_sampler is not None else "",
            "dataset_type": type_name(dataset),
            "dataset_len": _length(dataset),
            "expected": expected,
            "distributed": distributed,
            "epoch": -1,
            "seed": -1,
            "num_replicas": -1,
            "sampler_rank": -1,
            "shuffle": shuffles(index_sampler),
            "drop_last": bool(getattr(batch_sampler, "drop_last", False)),
            "padded": 0,
            "subset_depth": len(chain),
            "subset_digest": self._split_of(state, chain),
            "repeats": repeats_of(index_sampler),
            "batches": _length(batch_sampler) if batch_sampler is not None else expected,
            "replacement": getattr(index_sampler, "replacement", False) is True,
        }
        if chain:
            fields["base_len"] = domain
        splits = rank_splits(loader)
        if splits:
            fields["split_types"] = [name for name, _ in splits]
            fields["split_ways"] = [ways for _, ways in splits]
        if isinstance(index_sampler, DistributedSampler):
            # getattr: a subclass may have renamed or dropped an attribute.
            def attr(name: str) -> int:
                return int(getattr(index_sampler, name, -1))

            rec.distributed = True
            rec.epoch = attr("epoch")
            replicas, rank = attr("num_replicas"), attr("rank")
            drop_last = bool(getattr(index_sampler, "drop_last", False))
            source_len = _length(getattr(index_sampler, "dataset", None))
            fields.update(
                epoch=rec.epoch,
                seed=attr("seed"),
                num_replicas=replicas,
                sampler_rank=rank,
                shuffle=bool(getattr(index_sampler, "shuffle", False)),
                drop_last=drop_last,
                padded=padded_count(source_len, replicas, rank, drop_last),
            )
        elif index_sampler is not None and _epoch_aware(index_sampler):
            # A distributed sampler of its own built like DistributedSampler
            # (repeated augmentation's RASampler): it shuffles by its epoch too.
            fields.update(
                epoch=int(index_sampler.epoch),
                seed=_int_attr(index_sampler, "seed"),
                num_replicas=_int_attr(index_sampler, "num_replicas"),
                sampler_rank=_int_attr(index_sampler, "rank"),
            )
        self._post(SamplerPass.KIND, fields)
        if isinstance(dataset, IterableDataset):
            # Its sampler yields None forever; there are no indices to follow.
            self._end(rec, False)
            return None
        return rec

    @staticmethod
    def _split_of(state: _LoaderState, chain: list[Any]) -> int:
        if not chain:
            return 0
        key = tuple(id(c) for c in chain)
        if state.split is None or state.split[0] != key:
            state.split = (key, _split_digest(chain))
        return state.split[1]

    def _kept(self, domain: int, mod: int) -> frozenset[int] | None:
        if mod == 1 or domain <= 0 or domain > _MAX_DOMAIN or domain // mod > _MAX_KEPT:
            return None
        key = (domain, mod)
        kept = self._kept_cache.get(key)
        if kept is None:
            kept = _kept_in_range(domain, mod)
            if len(self._kept_cache) >= 4:
                del self._kept_cache[next(iter(self._kept_cache))]
            self._kept_cache[key] = kept
        return kept

    def _attach(self, rec: _Pass, sampler_iter: Any) -> Any:
        """Return the tap that replaces ``sampler_iter`` for ``rec``."""
        if sampler_iter is None or not rec.open or os.getpid() != self._pid:
            return sampler_iter
        if rec.tapped:
            rec.reset()  # a newer assignment in the same __iter__ supersedes the old one
        rec.tapped = True
        token = rec.token = object()
        return self._tap(rec, token, sampler_iter)

    def _wrap_late(self, rec: _Pass, it: Any) -> None:
        sampler_iter = getattr(it, "_sampler_iter", None)
        if sampler_iter is None or isinstance(sampler_iter, _SamplerIterSlot):
            self._end(rec, False)  # nothing to follow: reported as count == -1
            return
        it._sampler_iter = self._attach(rec, sampler_iter)

    def _tap(self, rec: _Pass, token: object, source: Iterable[Any]) -> Iterator[Any]:
        for item in source:
            if rec.token is token:
                try:
                    if not rec.started:
                        rec.started = True
                        self.last_pass = rec.gid
                        if rec.distributed:
                            self.last_epoch = rec.epoch
                    rec.observe(item)
                except Exception as exc:
                    self._disable(exc)
            yield item
        if rec.token is token:
            self._guard(self._end, rec, True)

    def _end(self, rec: _Pass, complete: bool) -> None:
        with self._lock:
            if not rec.open:
                return
            rec.open = False
            rec.token = None
            self._open.pop(rec.gid, None)
        self._post(SamplerPassEnd.KIND, rec.end_fields(int(self._current_step()), complete))

    # --- failure -------------------------------------------------------------

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self._disable(exc)
            return None

    def _disable(self, exc: BaseException) -> None:
        with self._lock:
            if not self._enabled:
                return
            self._enabled = False
            for rec in self._open.values():
                rec.token = None
        _log.warning("sampler probe disabled after an internal error: %r", exc, exc_info=exc)


def _tagged(it: Any, rec: _Pass | None) -> Any:
    """Leave on the iterator the pass it draws (hooks/loaderwait.py reads it per batch);
    None for a loader without indices to follow, so a reused iterator names no old pass."""
    try:
        setattr(it, PASS_ATTR, rec)
    except (AttributeError, TypeError):
        pass  # a generator or a slotted iterator of its own: steps name the sampler's pass
    return it


# --- process-wide patch ------------------------------------------------------

_install_lock = threading.Lock()
_active: SamplerProbe | None = None
_tls = threading.local()
_orig_iter: Callable[[Any], Any] | None = None
_patched_iter: Callable[[Any], Any] | None = None
_iter_class: type | None = getattr(_torch_dataloader, "_BaseDataLoaderIter", None)


class _SamplerIterSlot:
    """Data descriptor without ``__get__``: sees every assignment, costs reads nothing."""

    def __set__(self, obj: Any, value: Any) -> None:
        ctx = getattr(_tls, "ctx", None)
        if ctx is not None:
            probe, rec = ctx
            if probe._enabled:
                try:
                    value = probe._attach(rec, value)
                except Exception as exc:
                    probe._disable(exc)
        obj.__dict__["_sampler_iter"] = value

    def __delete__(self, obj: Any) -> None:
        del obj.__dict__["_sampler_iter"]


def _patch() -> None:
    global _orig_iter, _patched_iter
    if _iter_class is not None and "_sampler_iter" not in _iter_class.__dict__:
        _iter_class._sampler_iter = _SamplerIterSlot()  # type: ignore[attr-defined]
    if _patched_iter is not None:
        return  # still in the chain below someone else's patch, and inert until now
    orig: Callable[[Any], Any] = DataLoader.__dict__["__iter__"]

    @functools.wraps(orig)
    def __iter__(loader: Any) -> Any:
        probe = _active
        if probe is None or not probe._enabled or os.getpid() != probe._pid:
            return orig(loader)
        return probe._iter(loader, orig)

    _orig_iter, _patched_iter = orig, __iter__
    DataLoader.__iter__ = __iter__  # type: ignore[method-assign]


def _unpatch() -> None:
    global _orig_iter, _patched_iter
    if _iter_class is not None and isinstance(
        _iter_class.__dict__.get("_sampler_iter"), _SamplerIterSlot
    ):
        # Live iterators keep their values (and taps) in their own __dict__.
        del _iter_class._sampler_iter  # type: ignore[attr-defined]
    # Someone may have patched on top of us; then leave theirs: ours is inert.
    if _patched_iter is not None and DataLoader.__dict__.get("__iter__") is _patched_iter:
        DataLoader.__iter__ = _orig_iter  # type: ignore[assignment, method-assign]
        _orig_iter = _patched_iter = None
