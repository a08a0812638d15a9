"""The wire schema: every message a rank sends, encoded with msgpack.

The same bytes travel over ZeroMQ and sit in record files, so one decoder
serves the live watcher, replay and reports. The decoder never trusts its
input: sizes are bounded, every field is type-checked, and anything odd
raises :class:`SchemaError` with a message naming the field.

This module imports neither torch nor textual. docs/wire-schema.md documents
every field with its unit and when it is sent; keep the two in step.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union, get_args, get_origin

import msgpack

#: Bumped on any change that an older reader would misread. Readers reject
#: other versions with a clear message instead of guessing.
SCHEMA_VERSION = 1

#: Largest message a reader accepts (run_info of a model with many tensors is
#: the biggest; 64 MiB is far above any real one and bounds hostile input).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: Phases a rank can be in, as reported by heartbeats and stack dumps.
PHASES = ("idle", "data", "forward", "backward", "allreduce", "optimizer", "eval", "join", "exited")


class SchemaError(ValueError):
    """A message that is not valid ddpscope telemetry."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Fields every message carries (the envelope)."""

    KIND: ClassVar[str] = ""
    #: Schema version the sender wrote.
    v: int = SCHEMA_VERSION
    #: Run id, the same on every rank of one launch.
    run: str
    #: Global rank of the sender.
    rank: int
    #: Index of the DDP model in the sender process (0 for the first attached).
    model: int = 0
    #: Per-process sequence number assigned by the publisher; gaps mean drops.
    seq: int = 0
    #: Sender's monotonic clock (ns) when the message was created.
    t: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo(Message):
    KIND: ClassVar[str] = "run_info"
    local_rank: int
    world_size: int
    local_world_size: int
    host: str
    pid: int
    restart_count: int = 0
    backend: str
    device: str
    versions: dict[str, str]
    #: DDP constructor settings: bucket_cap_bytes, find_unused_parameters, ...
    ddp: dict[str, Any]
    #: [name, shape, dtype, requires_grad] for each parameter, in module order.
    params: list[list[Any]]
    #: [name, shape, dtype] for each buffer, in module order.
    buffers: list[list[Any]]
    #: A (wall ns, monotonic ns) pair sampled together on the sender.
    wall_ns: int
    mono_ns: int
    started_wall_ns: int
    #: Effective ddpscope options on this rank.
    options: dict[str, Any] = field(default_factory=dict)
    #: Absolute path of the script the rank runs (sys.argv[0]); "" if unknown.
    script: str = ""
    #: CUDA devices visible to the rank (-1: not checked, 0: no CUDA).
    cuda_visible: int = -1
    #: The GPU the rank should use given LOCAL_RANK ("" when it cannot be told).
    device_expected: str = ""
    #: UUID of the model's GPU ("" on CPU or when unknown).
    device_uuid: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketLayout(Message):
    KIND: ClassVar[str] = "buckets"
    #: Increments each time DDP builds or rebuilds its buckets.
    generation: int
    #: First step that used this layout.
    step: int
    index: list[int]
    nbytes: list[int]
    dtype: list[str]
    #: For each bucket, indices into RunInfo.params.
    params: list[list[int]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Step(Message):
    KIND: ClassVar[str] = "step"
    step: int
    #: Start (end of the previous step) and end of the step, sender's monotonic ns.
    t_start: int
    t_end: int
    data_ns: int
    forward_ns: int
    backward_ns: int
    optimizer_ns: int
    other_ns: int
    #: Time the training thread was blocked waiting for gradient all-reduce.
    comm_wait_ns: int
    #: Backward passes in this step (>1 under no_sync accumulation).
    micro_batches: int
    #: optimizer.step() calls observed; 0 when GradScaler skipped the step.
    optimizer_steps: int
    #: DistributedSampler epoch and loader pass the step's batches came from (-1: none).
    epoch: int = -1
    loader_pass: int = -1
    #: Bucket layout generation the arrays below refer to.
    layout: int = 0
    #: Per all-reduced bucket, in the order the buckets were launched.
    b_index: list[int] = field(default_factory=list)
    b_nbytes: list[int] = field(default_factory=list)
    b_offset_ns: list[int] = field(default_factory=list)
    b_dur_ns: list[int] = field(default_factory=list)
    #: Clock that timed the step: "cpu" or "cuda".
    clock: str = "cpu"


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    KIND: ClassVar[str] = "heartbeat"
    phase: str
    step: int
    #: Last bucket handed to all-reduce in the current step, -1 when none yet.
    bucket: int
    in_phase_s: float
    cpu_pct: float
    rss_bytes: int
    threads: int
    cuda_allocated: int = -1
    cuda_reserved: int = -1
    #: Publisher counters since start.
    sent: int = 0
    dropped_queue: int = 0
    dropped_send: int = 0
    #: All-reduces this rank shadowed under Join after running out of data.
    join_shadow: int = 0
    #: Control messages from the watcher that were malformed or not allowed.
    rejected_requests: int = 0
    wall_ns: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Stacks(Message):
    KIND: ClassVar[str] = "stacks"
    #: "request" (watcher asked) or "stuck" (rank stuck in one phase).
    reason: str
    phase: str
    step: int
    #: [{"name", "ident", "main", "frames": [[file, line, func], ...]}], innermost frame last.
    threads: list[dict[str, Any]]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerPass(Message):
    """A DataLoader started a pass over its sampler (``iter(loader)``)."""

    KIND: ClassVar[str] = "sampler_pass"
    loader: int
    pass_id: int
    #: Process-wide pass counter across loaders; Step.loader_pass refers to it.
    global_pass: int = -1
    step: int
    #: Whether the model was in training mode with grad enabled at the time.
    training: bool
    sampler_type: str
    batch_sampler_type: str
    dataset_type: str
    dataset_len: int
    #: Number of indices the sampler says it will yield (len(sampler)), -1 if unknown.
    expected: int
    distributed: bool
    #: DistributedSampler settings; -1/False when the sampler is not distributed.
    epoch: int = -1
    seed: int = -1
    num_replicas: int = -1
    sampler_rank: int = -1
    shuffle: bool = False
    drop_last: bool = False
    #: Indices this rank gets twice because DistributedSampler padded the dataset.
    padded: int = 0
    #: How many Subset-like wrappers were seen through to reach real dataset indices.
    subset_depth: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerPassEnd(Message):
    """The pass ended: exhausted, or abandoned when the loader was iterated again."""

    KIND: ClassVar[str] = "sampler_pass_end"
    loader: int
    pass_id: int
    global_pass: int = -1
    step: int
    #: Indices actually drawn from the sampler during the pass.
    count: int
    complete: bool
    #: 64-bit digest of the order of (real dataset) indices drawn.
    digest: int
    #: First indices drawn (at most 16), for a quick look.
    head: list[int]
    #: Indices i with mix(i) % sketch_mod == 0: the same rule on every rank, so two
    #: ranks' sketches intersect exactly where their shards do.
    sketch: list[int]
    sketch_mod: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Fingerprint(Message):
    KIND: ClassVar[str] = "fingerprint"
    step: int
    #: "initial", "interval", "request", "final".
    reason: str
    #: 64-bit digests of each parameter / buffer, in RunInfo order.
    params: list[int]
    buffers: list[int]
    cost_ns: int


@dataclass(frozen=True, slots=True, kw_only=True)
class HParams(Message):
    KIND: ClassVar[str] = "hparams"
    step: int
    #: One entry per optimizer: {"type": str, "groups": [{name: float, ...}, ...]}.
    optimizers: list[dict[str, Any]]


@dataclass(frozen=True, slots=True, kw_only=True)
class End(Message):
    KIND: ClassVar[str] = "end"
    #: "exit" (interpreter exit), "exception" (uncaught exception, traceback in
    #: ``error``), "signal" (SIGTERM, e.g. torchrun stopping the job), "close"
    #: (handle closed), "disabled" (internal error).
    reason: str
    step: int
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchInfo(Message):
    """What the model's training forwards look like: per-rank batch, BatchNorm layers."""

    KIND: ClassVar[str] = "batch"
    #: Steps the model had closed when this was seen.
    step: int
    #: Largest first dimension of a training forward's input so far (-1: unknown).
    size: int
    #: Where the size was read: "args[0]", "kwargs['input_ids']", ... ("" if unknown).
    source: str = ""
    #: BatchNorm layers (not SyncBatchNorm) in training mode, at most 64 names.
    batchnorm: list[str] = field(default_factory=list)
    batchnorm_count: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveCall(Message):
    """``torch.save`` to a file path (the first save to each path)."""

    KIND: ClassVar[str] = "save"
    step: int
    #: Absolute path written.
    path: str
    #: First caller frame outside torch and ddpscope: "file:line in function".
    site: str
    #: What was saved: "ddp_state_dict" (the DDP wrapper's state_dict, keys "module."...),
    #: "ddp_module" (the DDP wrapper itself), or "other".
    what: str
    #: Key of the checkpoint dict that held it ("" when saved at the top level).
    key: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Collectives(Message):
    """Collectives this process issued since it attached, counted by call site."""

    KIND: ClassVar[str] = "collectives"
    #: Steps closed when the counts were taken.
    step: int
    #: True for the snapshot taken at shutdown.
    final: bool = False
    #: Parallel lists: operation, group ("" for the default group, else "0,2,..."),
    #: call site and cumulative count.
    ops: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataParallelSeen(Message):
    """An ``nn.DataParallel`` in a process that runs DistributedDataParallel."""

    KIND: ClassVar[str] = "dataparallel"
    step: int
    #: Where it was constructed ("" when found inside an attached DDP model).
    site: str
    #: Qualified type of the module it wraps.
    module: str
    device_ids: list[int] = field(default_factory=list)
    #: Found inside an attached DDP model (DDP wrapping DataParallel).
    inside_ddp: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown(Message):
    """The process group's state when ddpscope shut down on this rank."""

    KIND: ClassVar[str] = "shutdown"
    step: int
    #: A default process group was still initialised (destroy_process_group not called).
    pg_initialized: bool
    #: Where destroy_process_group() was called ("" if it was not seen).
    destroy_site: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Request(Message):
    """Watcher to rank: the only thing a watcher can ask for."""

    KIND: ClassVar[str] = "request"
    #: "stacks" or "fingerprint".
    what: str
    #: Rank asked, -1 for all.
    target: int = -1


REQUESTS = ("stacks", "fingerprint")

#: Collectives counted when called from the script (point-to-point ops are left out:
#: send/recv are asymmetric by design).
COLLECTIVE_OPS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        RunInfo,
        BucketLayout,
        Step,
        Heartbeat,
        Stacks,
        SamplerPass,
        SamplerPassEnd,
        Fingerprint,
        HParams,
        End,
        Request,
        BatchInfo,
        SaveCall,
        Collectives,
        DataParallelSeen,
        Shutdown,
    )
}


def encode(msg: Message) -> bytes:
    """Encode a message for the wire or a record file."""
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    body["k"] = msg.KIND
    return msgpack.packb(body, use_bin_type=True)


def encode_fields(kind: str, fields: dict[str, Any]) -> bytes:
    """Encode from a plain dict, for the publisher's fast path (no dataclass).

    Adds the "k" and "v" keys to ``fields`` itself, to save a copy.
    """
    fields["k"] = kind
    fields.setdefault("v", SCHEMA_VERSION)
    return msgpack.packb(fields, use_bin_type=True)


# --- decoding ---------------------------------------------------------------

_U64 = (1 << 64) - 1
_I64_MIN = -(1 << 63)


def _check(value: Any, hint: Any, where: str) -> None:
    origin = get_origin(hint)
    if hint is Any:
        return
    if origin in (Union, types.UnionType):
        for alt in get_args(hint):
            try:
                _check(value, alt, where)
                return
            except SchemaError:
                pass
        raise SchemaError(f"{where}: {type(value).__name__} is not {hint}")
    if hint is bool:
        if not isinstance(value, bool):
            raise SchemaError(f"{where}: expected bool, got {type(value).__name__}")
        return
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise SchemaError(f"{where}: expected int, got {type(value).__name__}")
        if not _I64_MIN <= value <= _U64:
            raise SchemaError(f"{where}: integer out of range")
        return
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SchemaError(f"{where}: expected number, got {type(value).__name__}")
        return
    if hint is str:
        if not isinstance(value, str):
            raise SchemaError(f"{where}: expected str, got {type(value).__name__}")
        return
    if origin is list:
        if not isinstance(value, list):
            raise SchemaError(f"{where}: expected list, got {type(value).__name__}")
        (item,) = get_args(hint)
        if item is not Any:
            for i, v in enumerate(value):
                _check(v, item, f"{where}[{i}]")
        return
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected map, got {type(value).__name__}")
        key, item = get_args(hint)
        for k, v in value.items():
            _check(k, key, f"{where} key")
            _check(v, item, f"{where}[{k!r}]")
        return
    raise SchemaError(f"{where}: unsupported type {hint}")  # pragma: no cover


_INT_ONLY = frozenset({int})


def _check_int_list(value: Any, where: str) -> None:
    # The hot case (bucket arrays of every step message): checked at C speed.
    if type(value) is not list:
        raise SchemaError(f"{where}: expected list, got {type(value).__name__}")
    if value:
        if not set(map(type, value)) <= _INT_ONLY:
            for i, v in enumerate(value):
                _check(v, int, f"{where}[{i}]")
        if min(value) < _I64_MIN or max(value) > _U64:
            raise SchemaError(f"{where}: integer out of range")


def _compile(hint: Any) -> Any:
    """A checker for one field: the generic walk, or a fast path for hot shapes."""
    if hint == list[int]:
        return _check_int_list
    return lambda value, where: _check(value, hint, where)


class _Spec:
    __slots__ = ("cls", "fields", "required")

    def __init__(self, cls: type[Message]) -> None:
        hints = typing.get_type_hints(cls)
        self.cls = cls
        self.fields = {f.name: _compile(hints[f.name]) for f in dataclasses.fields(cls)}
        self.required = frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )


_SPECS = {kind: _Spec(cls) for kind, cls in MESSAGE_TYPES.items()}


def _unpack(buf: bytes) -> Any:
    if len(buf) > MAX_MESSAGE_BYTES:
        raise SchemaError(f"message of {len(buf)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            use_list=True,
        )
    except SchemaError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types for malformed input
        raise SchemaError(f"not a msgpack message: {exc.__class__.__name__}: {exc}") from None


def decode(buf: bytes) -> Message:
    """Decode and validate one message. Raises SchemaError on anything odd."""
    body = _unpack(buf)
    if not isinstance(body, dict):
        raise SchemaError(f"message is a {type(body).__name__}, expected a map")
    version = body.get("v")
    if version != SCHEMA_VERSION:
        raise SchemaError(
            f"schema version {version!r}; this ddpscope reads version {SCHEMA_VERSION}"
        )
    kind = body.pop("k", None)
    spec = _SPECS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise SchemaError(f"unknown message kind {kind!r}")
    missing = spec.required - body.keys()
    if missing:
        raise SchemaError(f"{kind}: missing field(s) {', '.join(sorted(missing))}")
    kwargs = {}
    for name, value in body.items():
        check = spec.fields.get(name)
        if check is None:
            continue  # a newer sender's extra field: ignore, stay compatible
        check(value, f"{kind}.{name}")
        kwargs[name] = value
    if kwargs["rank"] < 0:
        raise SchemaError(f"{kind}.rank: negative rank {kwargs['rank']}")
    return spec.cls(**kwargs)
