"""Decoding telemetry in worker processes, for a watcher whose one core is full.

At thousands of ranks the typed decoder is most of the watcher's ingest cost
(a 32-bucket step: ~11 us to unpack and check with the generated decoders,
docs/benchmarks.md "Publisher and decoder", against ~15-25 us for the run model and every
detector at 4,096 ranks), and one Python thread cannot go faster than one
core. A pool moves that work to ``workers`` processes: the ingest thread
hands them raw messages in batches (as they came off the socket) and gets
back the decoded messages, already checked, as one ``marshal`` blob per
batch (each message as its kind and its fields' values, plain data that
marshal reads at C speed), rebuilt here through the slots' own descriptors:
a few microseconds a message instead of the decode (pickle's generic path for
frozen dataclasses measured 10-17 us).

A step's timing lists travel as the bytes of an ``array('q')`` and come back
as that array (what the run model keeps anyway), so no int object is made
for them here; the lists that repeat across a batch (bucket order and sizes,
collective names) are sent once per batch and shared by its messages, which
marshal keeps as one object. Messages are frozen and nothing appends to
their lists, so sharing is safe.

Order is kept: batch n goes to worker n % workers, each worker answers its
batches in order, and results are taken in batch order, so every rank's
messages reach the analysis in the order the socket delivered them, exactly
as without a pool. Rejections travel back as (reason, text) and are counted
by the subscriber as its own would be.

Workers are spawned (never forked: the watcher has sockets and threads) and
import only the schema; nothing here imports torch or textual.
"""

from __future__ import annotations

import dataclasses
import marshal
import multiprocessing
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from ddpscope import schema
from ddpscope.schema import Message, SchemaError, decode

#: Batches a worker may hold before the ingest thread waits for its answer. One:
#: a pipe holds 64 KB, so with two a worker blocked writing an answer nobody
#: reads yet and the ingest thread blocked writing it the next batch would wait
#: for each other forever. A burst queues in ZeroMQ (bounded by its high-water
#: mark) instead.
IN_FLIGHT = 1


#: A refusal in a batch's answer: in the kind's place, then (reason, text).
REFUSED = ""


def _kinds(cls: type = Message) -> Iterator[type[Message]]:
    sub: type[Message]
    for sub in cls.__subclasses__():
        # slots=True makes a new class: the one schema exports is the one decode builds.
        if getattr(schema, sub.__name__, None) is sub:
            yield sub
        yield from _kinds(sub)


#: Per kind, its fields in order (what a worker sends).
_FIELDS: dict[str, tuple[str, ...]] = {
    k.KIND: tuple(f.name for f in dataclasses.fields(k)) for k in _kinds()
}


#: Per kind, the indices of its int-list fields sent as array('q') bytes.
_PACKED: dict[str, tuple[int, ...]] = {
    "step": tuple(
        _FIELDS["step"].index(n) for n in ("b_offset_ns", "b_dur_ns", "c_offset_ns", "c_dur_ns")
    ),
}
#: Per kind, the indices of its list fields that repeat from message to message.
_SHARED: dict[str, tuple[int, ...]] = {
    "step": tuple(
        _FIELDS["step"].index(n)
        for n in ("b_index", "b_nbytes", "c_op", "c_class", "c_group", "c_nbytes", "c_site")
    ),
}


def _builder(kind: type[Message]) -> Callable[[Any], Message]:
    """Build a ``kind`` from its values: the slots' descriptors set each one, as
    the frozen dataclass's own __init__ would but without its per-field checks
    (the worker's decoder made them)."""
    setters = [getattr(kind, name).__set__ for name in _FIELDS[kind.KIND]]
    packed = [(i, setters[i]) for i in _PACKED.get(kind.KIND, ())]
    new = object.__new__

    def build(values: Any) -> Message:
        msg = new(kind)
        for put, value in zip(setters, values, strict=True):
            put(msg, value)
        for i, put in packed:
            if type(values[i]) is bytes:
                ints = array("q")
                ints.frombytes(values[i])
                put(msg, ints)
        return msg

    return build


_BUILD: dict[str, Callable[[Any], Message]] = {k.KIND: _builder(k) for k in _kinds()}


def flatten(msg: Message, shared: dict[Any, Any] | None = None) -> tuple[str, tuple[Any, ...]]:
    """A decoded message as plain data for marshal: its kind and its fields' values,
    int timings packed; ``shared``: the batch's repeating lists, by value."""
    kind = msg.KIND
    values = [getattr(msg, name) for name in _FIELDS[kind]]
    for i in _PACKED.get(kind, ()):
        if values[i]:
            try:
                values[i] = array("q", values[i]).tobytes()
            except OverflowError:  # beyond 64 bits (the decoder allows it): as it is
                pass
    if shared is not None:
        for i in _SHARED.get(kind, ()):
            v = values[i]
            values[i] = shared.setdefault((i, tuple(v)), v)
    return kind, tuple(values)


def answer(raws: list[bytes]) -> bytes:
    """A worker's answer to one batch: each message decoded and flattened, or
    (REFUSED, (reason, text)) in its place."""
    out: list[Any] = []
    shared: dict[Any, Any] = {}
    for raw in raws:
        try:
            out.append(flatten(decode(raw), shared))
        except SchemaError as exc:
            out.append((REFUSED, (exc.reason, str(exc))))
    return marshal.dumps(out)


def _serve(conn: Connection) -> None:  # pragma: no cover - runs in the worker process
    """A worker: batches of raw messages in, decoded messages (or why not) out."""
    while True:
        try:
            blob = conn.recv_bytes()
        except EOFError:
            return
        if not blob:
            return
        conn.send_bytes(answer(marshal.loads(blob)))


def rebuild(blob: bytes, out: list[Message | tuple[str, str]]) -> None:
    """A worker's answer as messages (and refusals as (reason, text)), onto ``out``."""
    build = _BUILD
    for kind, values in marshal.loads(blob):
        out.append(build[kind](values) if kind else values)


class DecodePool:
    """``workers`` decoding processes; one thread submits and collects."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a decode pool needs at least one worker, not {workers}")
        ctx = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        try:
            for i in range(workers):
                here, there = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_serve, args=(there,), name=f"ddpscope-decode-{i}", daemon=True
                )
                proc.start()
                there.close()
                self._conns.append(here)
                self._procs.append(proc)
        except BaseException:
            self.close()
            raise
        #: Worker index of each batch submitted and not yet collected, oldest first.
        self._pending: deque[int] = deque()
        self._next = 0
        self._closed = False

    @property
    def workers(self) -> int:
        return len(self._conns)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, raws: list[bytes], out: list[Message | tuple[str, str]]) -> None:
        """Hand a batch to the next worker; appends to ``out`` whatever had to be
        collected first to stay within IN_FLIGHT batches per worker."""
        if len(self._pending) >= IN_FLIGHT * len(self._conns):
            self._collect_one(out)
        i = self._next
        self._next = (i + 1) % len(self._conns)
        self._conns[i].send_bytes(marshal.dumps(raws))
        self._pending.append(i)

    def collect(self, out: list[Message | tuple[str, str]], wait: bool = False) -> None:
        """Append to ``out`` every batch that is ready, in submission order
        (``wait``: everything submitted, waiting for it)."""
        while self._pending:
            if not wait and not self._conns[self._pending[0]].poll(0):
                return
            self._collect_one(out)

    def _collect_one(self, out: list[Message | tuple[str, str]]) -> None:
        i = self._pending.popleft()
        try:
            rebuild(self._conns[i].recv_bytes(), out)
        except EOFError:
            raise RuntimeError(f"decode worker {i} exited") from None

    def close(self) -> None:
        """Stop the workers (idempotent); batches not collected are dropped."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2.0)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> DecodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
