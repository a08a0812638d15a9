"""What ``find_unused_parameters=True`` costs a DDP model each step, and whether it found any.

With ``find_unused_parameters=True`` (and no ``static_graph``) DDP walks the
autograd graph from the forward's outputs after every forward, in its
``_post_forward``, to find the parameters the loss will not reach; it also
never rebuilds its buckets in the order gradients arrive. That is host time
each step, spent for nothing when every parameter is used in every step; the
Hugging Face Trainer turns it on by default for a model without gradient
checkpointing.

Two figures per step, read on the training thread only for such a model:

* ``search_ns``: time in DDP's ``_post_forward`` over the step's forwards (a
  wrapper set on the instance; two clock reads a forward).
* ``unused``: parameters some rank left unused in the step's synced backward,
  and which (a digest every step; their names when the set changes).
  After such a backward DDP's used map (``reducer._get_local_used_map()``) holds,
  per parameter, how many ranks used it (all-reduced before the buckets are
  finalised), so a count below the group's size is a parameter left unused
  somewhere. -1 when unknown (a backward under ``no_sync()`` reduces no map).

Measured on the 2-core VM (``python -m benchmarks.unused_search``, an
8-layer MLP in a world of one, alternated): ``_post_forward`` takes 25 us a
forward without the search and 84-102 us with it; reading the map at a
step's close 4-5 us, a set of unused parameters to digest included; the
wrapper +3 to +10 us a forward over four runs, two of whose intervals
included zero.
"""

from __future__ import annotations

import time
from typing import Any

from ddpscope.schema import MAX_UNUSED_NAMES

_monotonic_ns = time.monotonic_ns
_MASK = (1 << 63) - 1
#: The instance attribute the wrapper is set under (DDP's own method, looked up there).
_ATTR = "_post_forward"


class UnusedSearch:
    """One DDP model's search cost and findings, taken at each step's close."""

    __slots__ = ("_last_set", "_model", "_names", "_orig", "_size", "_timed", "ns")

    def __init__(self, model: Any, size: int) -> None:
        self._model = model
        self._size = size
        #: Host ns in ``_post_forward`` since the last :meth:`take`.
        self.ns = 0
        #: The digest the last :meth:`take` gave: names go out when it changes.
        self._last_set = 0
        self._names: list[str] | None = None
        self._orig = getattr(model, _ATTR)

        def timed(output: Any) -> Any:
            t0 = _monotonic_ns()
            try:
                return self._orig(output)
            finally:
                self.ns += _monotonic_ns() - t0

        self._timed = timed
        setattr(model, _ATTR, timed)

    @classmethod
    def of(cls, model: Any) -> UnusedSearch | None:
        """A search watcher for ``model`` when DDP searches it every step, else None."""
        if not getattr(model, "find_unused_parameters", False) or getattr(
            model, "static_graph", False
        ):
            return None
        reducer = getattr(model, "reducer", None)
        if reducer is None or not hasattr(reducer, "_get_local_used_map"):
            return None
        if not callable(getattr(model, _ATTR, None)) or _ATTR in vars(model):
            return None  # a torch without the method, or someone else's wrapper there
        try:
            size = int(model.process_group.size())
        except Exception:  # a group torch cannot size: nothing to compare the map with
            return None
        return cls(model, size)

    def take(self, synced: bool) -> tuple[int, int, int, tuple[str, ...] | None]:
        """For a step: the search's ns since the last take, the parameters left unused
        (-1: not known), a digest of which (0: none or not known; the same in every
        process for the same set, never 0 otherwise) and their names when that set
        differs from the last take's (else None): the names travel once, the digest
        with every step."""
        ns, self.ns = self.ns, 0
        if getattr(self._model, "static_graph", False):
            return -1, -1, 0, None  # made static after construction: no search
        if not synced:
            return ns, -1, 0, None
        before, self._last_set = self._last_set, 0
        try:
            used = self._model.reducer._get_local_used_map()
            if used is None or used.numel() == 0:
                return ns, -1, 0, None
            idx = (used < self._size).nonzero().flatten().tolist()
        except Exception:  # the map is DDP's internals: never break the step over it
            return ns, -1, 0, None
        if not idx:
            return ns, 0, 0, None
        # A tuple of ints hashes alike in every process (only str and bytes are salted).
        which = self._last_set = (hash(tuple(idx)) & _MASK) or 1
        names = self._named(idx, used.numel()) if which != before else None
        return ns, len(idx), which, names

    def _named(self, idx: list[int], size: int) -> tuple[str, ...]:
        """The names of parameters ``idx`` (at most :data:`MAX_UNUSED_NAMES`), in DDP's
        order: the module's trainable parameters it does not ignore; () if they do not
        line up with the map's ``size``."""
        if self._names is None:
            skip = getattr(self._model, "parameters_to_ignore", ()) or ()
            module = getattr(self._model, "module", None)
            named = module.named_parameters() if module is not None else ()
            self._names = [n for n, p in named if p.requires_grad and n not in skip]
        if len(self._names) != size:
            return ()
        return tuple(self._names[i] for i in idx[:MAX_UNUSED_NAMES])

    def close(self) -> None:
        """Put DDP's own method back (unless someone wrapped ours since)."""
        if vars(self._model).get(_ATTR) is self._timed:
            delattr(self._model, _ATTR)


__all__ = ["UnusedSearch"]
