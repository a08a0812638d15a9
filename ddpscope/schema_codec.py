"""Fast decoders for the wire schema, one per message kind, generated once at import.

ddpscope.schema describes each field (the exact types its value may have, what a
list's items must be, bounds, a check for the shapes types cannot say) and this
module writes, for each kind, one Python function that takes an unpacked
msgpack map and returns the message when every field is certainly valid, or
None. None is never an error: schema's checking decoder then looks at the same
map and either accepts it or names what is wrong. So a generated decoder may be
stricter than the checking one (it only costs time) but never looser, and the
checking decoder stays the one place that words errors.

Why generated code: the checking decoder calls one checker per field and builds
the message through the frozen dataclass's ``__init__`` (an
``object.__setattr__`` per field); at ~40 fields a step message that was most of
decode's time. Here the values are fetched with one ``itemgetter`` (after one
dict merge with the defaults when the sender left fields out) and their types
compared for the whole message at C speed (``map`` over ``type``), the items of
every int or str list are checked at C speed (one pass over the item types of
all of them), and the message is filled through its slots' descriptors, skipping
``__init__``. The source is made from the message classes' own field names and
the schema's constants, never from input.

Values come from msgpack only, which has no int wider than 64 bits and builds
exact ``int``/``float``/``str``/``list``/``dict`` objects (never subclasses), so
an exact type test is the same test as schema's ``isinstance`` checks, and an
int needs no range check.

This module imports nothing from ddpscope, so the schema can import it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class _Missing:
    """Marks a field without a default."""

    __slots__ = ()


#: The default of a required field: a map without it is left to the checking decoder.
MISSING: Any = _Missing()


@dataclass(frozen=True)
class FieldPlan:
    """What a field's value must be, as schema knows it."""

    name: str
    #: Exact types the value may have; the first is the one senders use.
    types: tuple[type, ...]
    #: A list's items must all have this exact type (int or str); None: not checked here.
    items: type | None = None
    #: A list's most items.
    limit: int = 0
    #: Inclusive bounds of an int.
    low: int | None = None
    high: int | None = None
    #: True when the value is valid; for what the types above cannot say.
    ok: Callable[[Any], bool] | None = None
    #: The value when absent (MISSING: the field is required).
    default: Any = MISSING
    #: Makes the value when absent, instead of ``default``: list or dict (msgpack
    #: builds nothing else mutable).
    factory: Callable[[], Any] | None = None


#: What the generated code writes for a fresh value of each factory.
_FRESH: dict[Any, str] = {list: "[]", dict: "{}"}


Decoder = Callable[[dict[Any, Any]], Any]


def compile_decoder(
    cls: type, plans: Sequence[FieldPlan], parallel: Sequence[Sequence[str]] = ()
) -> Decoder:
    """A function from an unpacked map to a ``cls`` (fields set in ``plans`` order), or
    None unless every plan holds and the lists of each ``parallel`` group have equal
    lengths. ``cls`` must be a slotted class with one slot per plan."""
    names = tuple(p.name for p in plans)
    env: dict[str, Any] = {
        "ALL": operator.itemgetter(*names),
        "USUAL": tuple(p.types[0] for p in plans),
        "ALLOWED": tuple(frozenset(p.types) for p in plans),
        "contains": frozenset.__contains__,
        "new": object.__new__,
        "CLS": cls,
    }
    defaults = []
    local = {p.name: f"f_{p.name}" for p in plans}
    conds: list[str] = []
    limits: dict[str, int] = {}
    by_item: dict[type, list[str]] = {}
    fills = []
    fixes = []
    for i, p in enumerate(plans):
        var = local[p.name]
        if p.factory is not None:
            # A shared stand-in of the right type keeps the common case (a sender that
            # left the field out) on the fast type comparison; it is never handed out.
            empty = p.factory()
            env[f"EMPTY_{i}"] = empty
            defaults.append(empty)
            fresh = _FRESH[p.factory]
            fixes.append(f"        if {var} is EMPTY_{i}:\n            {var} = {fresh}")
        else:
            defaults.append(p.default)
        low = "" if p.low is None else f"{p.low!r} <= "
        high = "" if p.high is None else f" <= {p.high!r}"
        if low or high:
            conds.append(f"{low}{var}{high}")
        if p.items is not None:
            limits[p.name] = p.limit
            by_item.setdefault(p.items, []).append(var)
        if p.ok is not None:
            env[f"OK_{i}"] = p.ok
            conds.append(f"OK_{i}({var})")
        env[f"SET_{i}"] = getattr(cls, p.name).__set__
        fills.append(f"    SET_{i}(msg, {var})")
    for group in parallel:
        lengths = " == ".join(f"len({local[name]})" for name in group)
        bounds = {limits.get(name) for name in group}
        if len(bounds) == 1 and None not in bounds:
            # Equal lengths: one bound covers the group.
            conds.append(f"{lengths} <= {bounds.pop()!r}")
            for name in group:
                del limits[name]
        else:
            conds.append(lengths)
    conds += [f"len({local[name]}) <= {limit!r}" for name, limit in limits.items()]
    for j, (item, lists) in enumerate(by_item.items()):
        # The item types of all the lists in one pass at C speed per message, stopping
        # at the first stranger (issuperset takes an iterator and builds no set).
        env[f"ONLY_{j}"] = frozenset({item}).issuperset
        joined = lists[0] if len(lists) == 1 else "[" + ", ".join(f"*{n}" for n in lists) + "]"
        conds.append(f"ONLY_{j}(map(type, {joined}))")
    env["DEFAULTS"] = {p.name: d for p, d in zip(plans, defaults, strict=True) if d is not MISSING}
    kind = getattr(cls, "KIND", cls.__name__)
    src = [
        f"def decode_{kind}(body):",
        # Fetching every field at once is the quicker way when the sender sent them all.
        f"    partial = len(body) < {len(names)}",
        "    if not partial:",
        "        try:",
        "            vals = ALL(body)",
        "        except KeyError:",
        "            partial = True",
        "    if partial:",
        "        try:",
        "            vals = ALL({**DEFAULTS, **body})",
        "        except KeyError:",
        "            return None  # a required field is missing",
        "    if tuple(map(type, vals)) != USUAL and not all(",
        "        map(contains, ALLOWED, map(type, vals))",
        "    ):",
        "        return None",
        f"    ({', '.join(local[p.name] for p in plans)},) = vals",
    ]
    if conds:
        src += ["    if not (", *(f"        {c} and" for c in conds[:-1]), f"        {conds[-1]}"]
        src += ["    ):", "        return None"]
    if fixes:
        src += ["    if partial:", *fixes]
    src += ["    msg = new(CLS)", *fills, "    return msg"]
    code = "\n".join(src) + "\n"
    exec(compile(code, f"<ddpscope.schema_codec: {kind}>", "exec"), env)
    decoder: Decoder = env[f"decode_{kind}"]
    decoder.__doc__ = code  # what was generated, for whoever debugs it
    return decoder
