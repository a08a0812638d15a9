"""The schema decoder as it was before the generated fast decoders (main at 78bf5a1),
kept as the oracle the new one is held to (tests/unit/test_decode_equivalence.py)
and as the "before" side of `python -m benchmarks.decode`: every field through its
checker, the message through the dataclass's ``__init__``. The message classes,
the limits and SchemaError are the schema's own, imported from it. Not used by
ddpscope itself."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, Union, get_args, get_origin

import msgpack

from ddpscope.schema import (
    MAX_BUCKETS,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_EVAL_LAYERS,
    MAX_ITEMS,
    MAX_MESSAGE_BYTES,
    MAX_STEP_COLLECTIVES,
    MAX_STRING_BYTES,
    MAX_TENSORS,
    MAX_UNUSED_NAMES,
    MAX_WORLD_SIZE,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Message,
    SchemaError,
)

_U64 = (1 << 64) - 1
_I64_MIN = -(1 << 63)


class _Invalid(Exception):
    """A value that does not fit its field; the path to it is collected on the way out."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        self.path: list[str] = []

    def text(self) -> str:
        return (f"at {''.join(self.path)}: " if self.path else "") + self.detail


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _too_many(n: int, limit: int) -> _Invalid:
    return _Invalid(f"{n} items, more than {limit}")


def _check_plain(value: Any, depth: int) -> None:
    """A free-form (``any``) value: any msgpack value, nested at most MAX_DEPTH deep."""
    if type(value) is list:
        if depth >= MAX_DEPTH:
            raise _Invalid(f"nested deeper than {MAX_DEPTH}")
        for i, v in enumerate(value):
            try:
                _check_plain(v, depth + 1)
            except _Invalid as bad:
                bad.path.insert(0, f"[{i}]")
                raise
    elif type(value) is dict:
        if depth >= MAX_DEPTH:
            raise _Invalid(f"nested deeper than {MAX_DEPTH}")
        for k, v in value.items():
            try:
                _check_plain(v, depth + 1)
            except _Invalid as bad:
                bad.path.insert(0, f"[{_short(k)}]")
                raise


def _check(value: Any, hint: Any, limit: int = MAX_ITEMS) -> None:
    """Raise _Invalid unless ``value`` fits ``hint``; ``limit`` bounds a list's length."""
    _checker(hint, limit)(value)


Checker = Callable[[Any], None]


@functools.cache
def _checker(hint: Any, limit: int = MAX_ITEMS) -> Checker:
    """The check for ``hint``, built once per type: walking the type with
    get_origin/get_args on every value took half of decode's time."""
    if hint is Any:
        return _check_any
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return _union(hint, tuple(_checker(alt) for alt in get_args(hint)))
    scalar = _SCALARS.get(hint)
    if scalar is not None:
        return scalar
    if origin is list:
        (item,) = get_args(hint)
        if item is int:
            return _int_list(limit)
        return _list(limit, _checker(item), item is str)
    if origin is dict:
        key, item = get_args(hint)
        return _dict(_checker(key), _checker(item))

    def unsupported(value: Any) -> None:  # pragma: no cover
        raise _Invalid(f"unsupported type {hint}")

    return unsupported


def _check_any(value: Any) -> None:
    _check_plain(value, 0)


def _union(hint: Any, alts: tuple[Checker, ...]) -> Checker:
    def check(value: Any) -> None:
        for alt in alts:
            try:
                alt(value)
                return
            except _Invalid:
                pass
        raise _Invalid(f"{type(value).__name__} is not {hint}")

    return check


def _check_bool(value: Any) -> None:
    if not isinstance(value, bool):
        raise _Invalid(f"expected bool, got {type(value).__name__}")


def _check_int(value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Invalid(f"expected int, got {type(value).__name__}")
    if not _I64_MIN <= value <= _U64:
        raise _Invalid("integer out of range")


def _check_float(value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _Invalid(f"expected number, got {type(value).__name__}")


def _check_str(value: Any) -> None:
    if not isinstance(value, str):
        raise _Invalid(f"expected str, got {type(value).__name__}")


_SCALARS: dict[Any, Checker] = {
    bool: _check_bool,
    int: _check_int,
    float: _check_float,
    str: _check_str,
}
_STR_ONLY = frozenset({str})


def _list(limit: int, item: Checker, of_str: bool) -> Checker:
    def check(value: Any) -> None:
        if not isinstance(value, list):
            raise _Invalid(f"expected list, got {type(value).__name__}")
        if len(value) > limit:
            raise _too_many(len(value), limit)
        if of_str and set(map(type, value)) <= _STR_ONLY:
            return  # the common case, at C speed
        _each(value, item)

    return check


def _dict(key: Checker, item: Checker) -> Checker:
    def check(value: Any) -> None:
        if not isinstance(value, dict):
            raise _Invalid(f"expected map, got {type(value).__name__}")
        for k, v in value.items():
            try:
                key(k)
            except _Invalid as bad:
                bad.detail = f"key {_short(k)}: {bad.detail}"
                raise
            try:
                item(v)
            except _Invalid as bad:
                bad.path.insert(0, f"[{_short(k)}]")
                raise

    return check


_INT_ONLY = frozenset({int})


def _int_list(limit: int) -> Any:
    def check(value: Any) -> None:
        # The hot case (bucket arrays of every step message): checked at C speed.
        if type(value) is not list:
            raise _Invalid(f"expected list, got {type(value).__name__}")
        if value:
            if len(value) > limit:
                raise _too_many(len(value), limit)
            if not set(map(type, value)) <= _INT_ONLY:
                _each(value, _check_int)  # names the first item that is not an int
            if min(value) < _I64_MIN or max(value) > _U64:
                raise _Invalid("integer out of range")

    return check


def _each(value: list[Any], check: Checker) -> None:
    """``check`` every item; a failure names the item's index."""
    for i, v in enumerate(value):
        try:
            check(v)
        except _Invalid as bad:
            bad.path.insert(0, f"[{i}]")
            raise


def _tensor_list(width: int) -> Any:
    """run_info.params ([name, shape, dtype, requires_grad]) or .buffers ([name, shape, dtype])."""
    entry = functools.partial(_check_tensor, width=width)

    def check(value: Any) -> None:
        if type(value) is not list:
            raise _Invalid(f"expected list, got {type(value).__name__}")
        if len(value) > MAX_TENSORS:
            raise _too_many(len(value), MAX_TENSORS)
        _each(value, entry)

    return check


def _check_tensor(entry: Any, width: int) -> None:
    # Readers index these entries and multiply the shapes (parameter counts),
    # so the layout is checked here once instead of guarded everywhere.
    if type(entry) is not list or len(entry) < width:
        what = "[name, shape, dtype, requires_grad]" if width == 4 else "[name, shape, dtype]"
        raise _Invalid(f"expected {what}")
    name, shape, dtype = entry[0], entry[1], entry[2]
    if type(name) is not str or type(dtype) is not str:
        raise _Invalid("name and dtype must be strings")
    if type(shape) is not list or len(shape) > MAX_DIMS:
        raise _Invalid(f"shape must be a list of at most {MAX_DIMS} sizes")
    for d in shape:
        if type(d) is not int or not 0 <= d <= _U64:
            raise _Invalid("shape sizes must be non-negative integers")
    if width == 4 and type(entry[3]) is not bool:
        raise _Invalid("requires_grad must be a bool")
    for extra in entry[width:]:
        _check_plain(extra, 1)


_FRAME_TYPES = (str, int, str)


def _check_threads(value: Any) -> None:
    """stacks.threads: [{"name", "ident", "main", "frames": [[file, line, func], ...]}]."""
    if type(value) is not list:
        raise _Invalid(f"expected list, got {type(value).__name__}")
    if len(value) > MAX_ITEMS:
        raise _too_many(len(value), MAX_ITEMS)
    _each(value, _check_thread)


def _check_thread(thread: Any) -> None:
    # Viewers turn frames into (str, int, str) tuples; a frame of another shape
    # would make drawing the stack raise in the watcher.
    if type(thread) is not dict:
        raise _Invalid(f"expected map, got {type(thread).__name__}")
    for key, want in (("name", str), ("ident", int), ("main", bool)):
        if key in thread and type(thread[key]) is not want:
            raise _Invalid(f"{key} must be {want.__name__}")
    frames = thread.get("frames", [])
    if type(frames) is not list or len(frames) > MAX_ITEMS:
        raise _Invalid(f"frames must be a list of at most {MAX_ITEMS}")
    for frame in frames:
        if (
            type(frame) is not list
            or len(frame) != 3
            or tuple(map(type, frame)) != _FRAME_TYPES
            or not _I64_MIN <= frame[1] <= _U64
        ):
            raise _Invalid("frames must be [file, line, function]")
    for key, v in thread.items():
        if key not in ("name", "ident", "main", "frames"):
            _check_plain(v, 1)


#: Checkers for fields whose annotation alone says too little or too much.
_FIELD_CHECKS: dict[tuple[str, str], Any] = {
    **{
        ("step", f): _int_list(MAX_BUCKETS)
        for f in ("b_index", "b_nbytes", "b_offset_ns", "b_dur_ns")
    },
    **{
        ("step", f): _int_list(MAX_STEP_COLLECTIVES)
        for f in ("c_nbytes", "c_offset_ns", "c_dur_ns")
    },
    **{
        ("step", f): (lambda v: _check(v, list[str], MAX_STEP_COLLECTIVES))
        for f in ("c_op", "c_class", "c_group", "c_site")
    },
    # Step fields added after 78bf5a1 with bounds of their own, as the schema bounds them.
    ("step", "unused_names"): lambda v: _check(v, list[str], MAX_UNUSED_NAMES),
    ("step", "eval_layers"): lambda v: _check(v, list[str], MAX_EVAL_LAYERS),
    ("buckets", "index"): _int_list(MAX_BUCKETS),
    ("buckets", "nbytes"): _int_list(MAX_BUCKETS),
    ("buckets", "dtype"): lambda v: _check(v, list[str], MAX_BUCKETS),
    ("buckets", "params"): lambda v: _check(v, list[list[int]], MAX_BUCKETS),
    ("fingerprint", "params"): _int_list(MAX_TENSORS),
    ("fingerprint", "buffers"): _int_list(MAX_TENSORS),
    ("run_info", "params"): _tensor_list(4),
    ("run_info", "buffers"): _tensor_list(3),
    ("stacks", "threads"): _check_threads,
}

#: Parallel lists: readers zip them, so they must have one length.
#: Per kind, groups of list fields that must have equal lengths.
_PARALLEL: dict[str, tuple[tuple[str, ...], ...]] = {
    "step": (
        ("b_index", "b_nbytes", "b_offset_ns", "b_dur_ns"),
        ("c_op", "c_class", "c_group", "c_nbytes", "c_offset_ns", "c_dur_ns", "c_site"),
    ),
    "buckets": (("index", "nbytes", "dtype", "params"),),
    "collectives": (("ops", "groups", "sites", "counts"),),
}


def _compile(kind: str, name: str, hint: Any) -> Any:
    """A checker for one field: the generic walk, or a specific one for hot or loose shapes."""
    special = _FIELD_CHECKS.get((kind, name))
    if special is not None:
        return special
    if hint == list[int]:
        return _int_list(MAX_ITEMS)
    return _checker(hint)


class _Spec:
    __slots__ = ("cls", "fields", "parallel", "required")

    def __init__(self, cls: type[Message]) -> None:
        hints = typing.get_type_hints(cls)
        self.cls = cls
        self.fields = {
            f.name: _compile(cls.KIND, f.name, hints[f.name]) for f in dataclasses.fields(cls)
        }
        self.required = frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        self.parallel = _PARALLEL.get(cls.KIND, ())


_SPECS = {kind: _Spec(cls) for kind, cls in MESSAGE_TYPES.items()}


def _no_ext(code: int, data: bytes) -> Any:
    # ddpscope never sends extension types; a namedtuple where a list is
    # expected only confuses readers.
    raise SchemaError("not a msgpack message", f"extension type {code} is not used by ddpscope")


def _unpack(buf: bytes) -> Any:
    if len(buf) > MAX_MESSAGE_BYTES:
        raise SchemaError("message too large", f"{len(buf)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_no_ext,
            max_str_len=MAX_STRING_BYTES,
            max_bin_len=MAX_STRING_BYTES,
            max_array_len=MAX_TENSORS,
            max_map_len=MAX_ITEMS,
        )
    except SchemaError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types for malformed input
        raise SchemaError(
            "not a msgpack message", f"{exc.__class__.__name__}: {str(exc)[:200]}"
        ) from None


def decode(buf: bytes) -> Message:
    """Decode and validate one message. Raises SchemaError on anything odd."""
    body = _unpack(buf)
    if not isinstance(body, dict):
        raise SchemaError("not a map", f"message is a {type(body).__name__}, expected a map")
    version = body.get("v")
    if version != SCHEMA_VERSION:
        raise SchemaError(
            "schema version",
            f"message has version {_short(version)}; this ddpscope reads version {SCHEMA_VERSION}",
        )
    kind = body.pop("k", None)
    spec = _SPECS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise SchemaError("unknown message kind", _short(kind))
    missing = spec.required - body.keys()
    if missing:
        raise SchemaError(kind, f"missing field(s) {', '.join(sorted(missing))}")
    kwargs = {}
    fields = spec.fields
    for name, value in body.items():
        check = fields.get(name)
        if check is None:
            continue  # a newer sender's extra field: ignore, stay compatible
        try:
            check(value)
        except _Invalid as bad:
            raise SchemaError(f"{kind}.{name}", bad.text()) from None
        kwargs[name] = value
    rank = kwargs["rank"]
    if rank < 0:
        raise SchemaError(f"{kind}.rank", f"negative rank {rank}")
    if rank >= MAX_WORLD_SIZE:
        raise SchemaError(f"{kind}.rank", f"rank {rank} is beyond {MAX_WORLD_SIZE} ranks")
    for names in spec.parallel:
        _check_parallel(kind, names, kwargs)
    if kind == "run_info" and not 0 < kwargs["world_size"] <= MAX_WORLD_SIZE:
        raise SchemaError(
            "run_info.world_size", f"{kwargs['world_size']} is not in 1..{MAX_WORLD_SIZE}"
        )
    return spec.cls(**kwargs)


def _check_parallel(kind: str, names: tuple[str, ...], kwargs: dict[str, Any]) -> None:
    first = names[0]
    n = len(kwargs.get(first, ()))
    for name in names[1:]:
        m = len(kwargs.get(name, ()))
        if m != n:
            raise SchemaError(f"{kind}.{name}", f"{m} items where {first} has {n}")
