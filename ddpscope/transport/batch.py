"""Relay batches: the messages a relay has checked, many to one frame, to the watcher.

A relay's upstream (its node's ranks, or whatever reaches its socket) is
untrusted, so the relay decodes and checks every frame with the schema's own
decoder and refuses, counts and names what fails. What passes goes on to the
watcher in batches, one frame per burst, built so that the watcher's side costs
a few microseconds a message instead of a decode:

    ["ddpscope-batch", SCHEMA_VERSION, FINGERPRINT, source, tables, messages]

- FINGERPRINT: 8 bytes of a hash over every kind's fields and their checks, so
  a relay of another ddpscope build (or anything else that speaks msgpack) is
  refused as foreign rather than misread;
- source: who packed it (the relay's host and pid), for error messages;
- tables: the lists that repeat across a batch (bucket order and sizes, the
  collectives' names), each sent once, as ``[ints, strs]``;
- messages: per message either ``[code, value, ...]``, its fields by position
  (code: the kind's index in KINDS), a repeating list as its index in its
  table, a step's timing lists as the bytes of an ``array('q')``; or, for kinds
  whose fields nest (run info, layouts, stacks, ...: a few a second per rank),
  the rank's original frame, which the watcher decodes as if it came direct.

The watcher does not take a relay's word for anything: every field of every
message goes through the checks the schema's generated decoder makes (types at
C speed over the whole message, bounds, list items, parallel lengths; the
tables once per batch), in code generated here from ``schema.field_plans``. A
message that fails is refused by itself (the rest of its batch is kept), with
the schema's reasons; a batch whose frame is wrong is refused whole, reason
"relay batch". Both are counted where the watcher counts its other refusals.
"""

from __future__ import annotations

import hashlib
import operator
from array import array
from collections.abc import Callable
from typing import Any

import msgpack

from ddpscope import schema
from ddpscope.schema import (
    MAX_ITEMS,
    MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Message,
    SchemaError,
    decode,
)
from ddpscope.schema_codec import FieldPlan

TAG = "ddpscope-batch"
#: Messages a relay packs into one batch at most (a burst of a node's ranks is tens).
MAX_BATCH = 1024
#: Reason of a refused batch (its frame, not one of its messages).
BATCH_REASON = "relay batch"
#: Per kind, the int-list fields sent as ``array('q')`` bytes: timings, which
#: differ from message to message, so a table would not share them.
PACKED: dict[str, frozenset[str]] = {
    "step": frozenset({"b_offset_ns", "b_dur_ns", "c_offset_ns", "c_dur_ns"}),
}
#: What a packed field becomes when empty: one list for all (messages are frozen,
#: and no reader appends to their lists).
_EMPTY: list[Any] = []


def _positional(plans: list[FieldPlan]) -> bool:
    """Whether every field is a scalar or a flat list of ints or strs (checkable here)."""
    return all(p.ok is None and (p.items is not None or list not in p.types) for p in plans)


_PLANS = {kind: schema.field_plans(kind) for kind in MESSAGE_TYPES}
#: The kinds sent by position, by code.
KINDS: tuple[str, ...] = tuple(sorted(k for k, plans in _PLANS.items() if _positional(plans)))
CODES = {kind: i for i, kind in enumerate(KINDS)}


def _fingerprint() -> bytes:
    # Only ordered things: a set's order changes from process to process.
    packed = sorted((k, sorted(v)) for k, v in PACKED.items())
    parts: list[Any] = [TAG, SCHEMA_VERSION, KINDS, packed]
    for kind in sorted(_PLANS):
        for p in _PLANS[kind]:
            names = [t.__name__ for t in p.types]
            item = p.items.__name__ if p.items else ""
            parts.append((kind, p.name, names, item, p.limit, p.low, p.high, p.ok is None))
        parts.append(schema.parallel_fields(kind))
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()


FINGERPRINT = _fingerprint()


#: How every batch frame begins: a 6-item array whose first item is TAG.
_PREFIX = b"\x96" + msgpack.packb(TAG)


def is_batch(raw: bytes) -> bool:
    """A frame that says it is a relay batch. Anything else, junk that happens to
    be a msgpack array included, goes to the message decoder and is refused there
    with its own reason ("not a msgpack message", "not a map", ...)."""
    return raw[:16] == _PREFIX


# --- the relay's side ----------------------------------------------------------


class BatchPacker:
    """Collects checked messages (each with its original frame) into one batch frame."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._messages: list[Any] = []
        self._ints: list[list[int]] = []
        self._strs: list[list[str]] = []
        self._index: dict[tuple[type, tuple[Any, ...]], int] = {}
        self._get = {k: operator.attrgetter(*(p.name for p in _PLANS[k])) for k in KINDS}
        # Per kind: (field position, how it goes): 1 packed, 2 an int table, 3 a str table.
        self._lists: dict[str, list[tuple[int, int]]] = {}
        for kind in KINDS:
            how = []
            for i, p in enumerate(_PLANS[kind]):
                if p.items is not None:
                    packed = p.name in PACKED.get(kind, ())
                    how.append((i, 1 if packed else 2 if p.items is int else 3))
            self._lists[kind] = how

    def __len__(self) -> int:
        return len(self._messages)

    def add(self, msg: Message, raw: bytes) -> None:
        kind = msg.KIND
        code = CODES.get(kind)
        if code is None:
            self._messages.append(raw)
            return
        values = [code, *self._get[kind](msg)]
        for i, how in self._lists[kind]:
            v = values[i + 1]
            if how == 1:
                try:
                    values[i + 1] = array("q", v).tobytes()
                except OverflowError:  # beyond 64 bits signed (the decoder allows it)
                    self._messages.append(raw)
                    return
            else:
                key = (int if how == 2 else str, tuple(v))
                ref = self._index.get(key)
                if ref is None:
                    table = self._ints if how == 2 else self._strs
                    ref = self._index[key] = len(table)
                    table.append(v)
                values[i + 1] = ref
        self._messages.append(values)

    def take(self) -> bytes:
        """The batch frame of everything added since the last take."""
        tables = [self._ints, self._strs]
        body = [TAG, SCHEMA_VERSION, FINGERPRINT, self.source, tables, self._messages]
        frame = msgpack.packb(body, use_bin_type=True)
        self._messages = []
        self._ints = []
        self._strs = []
        self._index.clear()
        return frame


# --- the watcher's side --------------------------------------------------------


def _no_ext(code: int, data: bytes) -> Any:
    raise SchemaError(BATCH_REASON, f"extension type {code} is not used by ddpscope")


Taker = Callable[[list[Any], list[Any], list[Any], int, int], Any]


def _compile_taker(kind: str) -> Taker:
    """The check and build of one positional ``kind``: ``take(m, ints, strs, n_ints,
    n_strs)`` returns the message, or None when any check fails (``_why`` then says
    which); ``ints``, ``strs``: the batch's tables, already checked. The source is
    made from the schema's plans only, never from input."""
    plans = _PLANS[kind]
    cls = MESSAGE_TYPES[kind]
    packed = PACKED.get(kind, frozenset())
    env: dict[str, Any] = {"new": object.__new__, "CLS": cls, "array": array, "EMPTY": _EMPTY}
    usual: list[type] = [int]
    allowed: list[frozenset[type]] = [frozenset({int})]
    local = {p.name: f"f{i}" for i, p in enumerate(plans)}
    conds: list[str] = []
    resolve: list[str] = []
    fills: list[str] = []
    limits: dict[str, int] = {}
    for i, p in enumerate(plans):
        var = local[p.name]
        if p.items is not None:
            if p.name in packed:
                usual.append(bytes)
                allowed.append(frozenset({bytes}))
                conds.append(f"not len({var}) & 7")
                resolve.append(
                    f"    if {var}:\n        a = array('q')\n        a.frombytes({var})\n"
                    f"        {var} = a\n    else:\n        {var} = EMPTY"
                )
            else:
                usual.append(int)
                allowed.append(frozenset({int}))
                table = "ints" if p.items is int else "strs"
                conds.append(f"0 <= {var} < {'n_ints' if p.items is int else 'n_strs'}")
                resolve.append(f"    {var} = {table}[{var}]")
            limits[p.name] = p.limit
        else:
            usual.append(p.types[0])
            allowed.append(frozenset(p.types))
            low = "" if p.low is None else f"{p.low!r} <= "
            high = "" if p.high is None else f" <= {p.high!r}"
            if low or high:
                conds.append(f"{low}{var}{high}")
        env[f"SET_{i}"] = getattr(cls, p.name).__set__
        fills.append(f"    SET_{i}(msg, {var})")
    env["USUAL"] = tuple(usual)
    env["ALLOWED"] = tuple(allowed)
    env["contains"] = frozenset.__contains__
    after: list[str] = []
    for group in schema.parallel_fields(kind):
        after.append(" == ".join(f"len({local[n]})" for n in group))
    after += [f"len({local[n]}) <= {limit!r}" for n, limit in limits.items()]
    src = [
        f"def take_{kind}(m, ints, strs, n_ints, n_strs):",
        f"    if len(m) != {len(plans) + 1}:",
        "        return None",
        "    if tuple(map(type, m)) != USUAL and not all(map(contains, ALLOWED, map(type, m))):",
        "        return None",
        f"    (_, {', '.join(local[p.name] for p in plans)},) = m",
    ]
    if conds:
        src += ["    if not (" + " and ".join(conds) + "):", "        return None"]
    src += resolve
    if after:
        src += ["    if not (" + " and ".join(after) + "):", "        return None"]
    src += ["    msg = new(CLS)", *fills, "    return msg"]
    code = "\n".join(src) + "\n"
    exec(compile(code, f"<ddpscope.transport.batch: {kind}>", "exec"), env)
    taker: Taker = env[f"take_{kind}"]
    taker.__doc__ = code  # what was generated, for whoever debugs it
    return taker


def _why(kind: str, m: list[Any], n_ints: int, n_strs: int) -> SchemaError:
    """What is wrong with a positional message a taker refused, in the schema's words."""
    plans = _PLANS[kind]
    if len(m) != len(plans) + 1:
        return SchemaError(kind, f"{len(m) - 1} values where {kind} has {len(plans)} fields")
    packed = PACKED.get(kind, frozenset())
    for p, v in zip(plans, m[1:], strict=True):
        where = f"{kind}.{p.name}"
        if p.items is not None:
            if p.name in packed:
                if type(v) is not bytes or len(v) % 8:
                    return SchemaError(where, "expected the bytes of 64-bit ints")
                continue
            size = n_ints if p.items is int else n_strs
            if type(v) is not int or not 0 <= v < size:
                return SchemaError(where, f"expected a table index below {size}")
            continue
        if type(v) not in p.types:
            expected = " or ".join(t.__name__ for t in p.types)
            return SchemaError(where, f"expected {expected}, got {type(v).__name__}")
        if (p.low is not None and v < p.low) or (p.high is not None and v > p.high):
            return SchemaError(where, f"{v} is not in {p.low}..{p.high}")
    return SchemaError(kind, "lists of unequal lengths, or longer than allowed")


_TAKERS: tuple[Taker, ...] = tuple(_compile_taker(k) for k in KINDS)


def _check_table(table: Any, item: type, limit: int) -> None:
    if type(table) is not list:
        raise SchemaError(BATCH_REASON, "tables are not lists")
    only = frozenset({item}).issuperset
    for entry in table:
        if type(entry) is not list or len(entry) > limit or not only(map(type, entry)):
            raise SchemaError(BATCH_REASON, f"a table entry is not a list of {item.__name__}")


def unpack(raw: bytes, out: list[Message], refused: Callable[[str, str], None]) -> int:
    """The messages of one batch frame onto ``out``; each one refused goes to
    ``refused(reason, text)``. Returns the messages the batch held (taken or not).
    Raises SchemaError when the frame itself is wrong: nothing of it is taken."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise SchemaError(BATCH_REASON, f"{len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        body = schema.unpack_untrusted(raw, ext_hook=_no_ext, max_bin_len=MAX_MESSAGE_BYTES)
    except SchemaError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types for malformed input
        raise SchemaError(BATCH_REASON, f"not msgpack: {type(exc).__name__}") from None
    if type(body) is not list or len(body) != 6 or body[0] != TAG:
        raise SchemaError(BATCH_REASON, "not a ddpscope relay batch")
    _, version, fingerprint, source, tables, messages = body
    if version != SCHEMA_VERSION:
        raise SchemaError(
            "schema version",
            f"relay batch has version {str(version)[:40]}; this ddpscope reads {SCHEMA_VERSION}",
        )
    if type(source) is not str:
        raise SchemaError(BATCH_REASON, "its source is not a string")
    if fingerprint != FINGERPRINT:
        raise SchemaError(
            BATCH_REASON,
            f"from {source[:80]!r}: another ddpscope build's schema (fingerprint "
            f"{bytes(fingerprint)[:8].hex() if isinstance(fingerprint, bytes) else '?'}, "
            f"this one {FINGERPRINT.hex()}): run the same ddpscope on relays and watcher",
        )
    if type(tables) is not list or len(tables) != 2 or type(messages) is not list:
        raise SchemaError(BATCH_REASON, f"from {source[:80]!r}: malformed frame")
    ints, strs = tables
    _check_table(ints, int, MAX_ITEMS)
    _check_table(strs, str, MAX_ITEMS)
    n_ints, n_strs = len(ints), len(strs)
    takers = _TAKERS
    n_kinds = len(takers)
    append = out.append
    for m in messages:
        if type(m) is list:
            code = m[0] if m else None
            if type(code) is not int or not 0 <= code < n_kinds:
                refused(BATCH_REASON, f"from {source[:80]!r}: a message of no known kind")
                continue
            msg = takers[code](m, ints, strs, n_ints, n_strs)
            if msg is None:
                err = _why(KINDS[code], m, n_ints, n_strs)
                refused(err.reason, f"from relay {source[:80]!r}: {err}")
                continue
            append(msg)
        elif type(m) is bytes:
            try:
                append(decode(m))
            except SchemaError as exc:
                refused(exc.reason, f"from relay {source[:80]!r}: {exc}")
        else:
            refused(BATCH_REASON, f"from {source[:80]!r}: a message that is neither")
    return len(messages)
