"""The wire schema: every message a rank sends, encoded with msgpack.

The same bytes travel over ZeroMQ and sit in record files, so one decoder
serves the live watcher, replay and reports. The decoder never trusts its
input: sizes are bounded, every field is type-checked, and anything odd
raises :class:`SchemaError` with a message naming the field.

This module imports neither torch nor textual. docs/wire-schema.md documents
every field with its unit and when it is sent; keep the two in step.

Decoding takes two paths: for each kind a decoder generated at import
(ddpscope/schema_codec.py, from the plans this module makes of each field)
takes a valid message at C speed, and whatever it is not sure of goes to the
field-by-field checks here, which accept it or name what is wrong. Both are
made from the same annotations and tables (the bounds of rank and world size
are written twice: _ENVELOPE_BOUNDS and _BOUNDS, and the tail of
_decode_checked); tests/unit/test_decode_equivalence.py holds the pair to the
decoder before it.

Long module: the message classes and the decoder are one contract: the decoder
compiles each kind's checks from its dataclass's annotations, so a field and its check
change together here (240 of the lines are field comments and blanks).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union, get_args, get_origin

import msgpack

from ddpscope.schema_codec import MISSING, FieldPlan, compile_decoder

#: Bumped on any change that an older reader would misread. Readers reject
#: other versions with a clear message instead of guessing.
SCHEMA_VERSION = 1

#: Largest message a reader accepts (run_info of a model with many tensors is
#: the biggest; 64 MiB is far above any real one and bounds hostile input).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# What one message may hold. Each bound is far above what a real rank sends and
# exists so that a hostile or corrupt message cannot make a reader allocate
# without limit: a watcher keeps hundreds of steps per rank, so the size of one
# decoded message multiplies. docs/wire-schema.md lists them with their reasons.

#: Ranks in one run: ``rank`` must be below it, ``run_info.world_size`` at most it.
MAX_WORLD_SIZE = 1 << 16
#: Buckets in one layout or step (DDP's 25 MB default gives ~1,100 for a 7B fp32 model).
MAX_BUCKETS = 1 << 14
#: Entries of per-tensor lists (run_info.params/buffers, fingerprint digests).
MAX_TENSORS = 1 << 20
#: Entries of any other list and of any map.
MAX_ITEMS = 1 << 16
#: Bytes of one string (a path, a traceback tail) or bytes value.
MAX_STRING_BYTES = 1 << 16
#: Nesting of free-form values (the ``any`` parts: run_info.ddp/options, hparams).
MAX_DEPTH = 8
#: Dimensions of one tensor shape in run_info.params/buffers.
MAX_DIMS = 64

#: Phases a rank can be in, as reported by heartbeats and stack dumps.
PHASES = (
    "idle",
    "data",
    "forward",
    "backward",
    "allreduce",
    "collective",
    "optimizer",
    "eval",
    #: Inside torch.save on the training thread (a checkpoint being written).
    "save",
    "join",
    "exited",
)
#: Phases in which a rank's training thread is blocked on the other ranks.
WAITING_PHASES = frozenset({"allreduce", "collective", "join"})

#: Classes of the collectives a Step lists (``c_class``): DDP's own syncs outside
#: backward (the buffer broadcast at the start of forward, Join's per-forward
#: agreement), and those the script or its framework called.
COLLECTIVE_CLASSES = ("ddp", "user")
#: Collectives listed per step at most; the rest are only in the sums (``c_more``).
MAX_STEP_COLLECTIVES = 32


class SchemaError(ValueError):
    """A message that is not valid ddpscope telemetry.

    ``reason`` names what was wrong from a small fixed set ("step.b_dur_ns",
    "schema version", "not a msgpack message", ...) and is also the text before
    the first colon: counters of rejects key on it, and content chosen by the
    sender (a kind name, a map key, a list index) must never become a key, or
    a flood of distinct bad messages would grow the counter without bound.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


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


#: ``RunInfo.ddp["api"]`` of a module under ``torch.distributed._composable.replicate``
#: (absent for a ``DistributedDataParallel`` model).
DDP_API_REPLICATE = "replicate"


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
    #: DDP constructor settings: bucket_cap_bytes, find_unused_parameters, ...;
    #: "api": DDP_API_REPLICATE for a module under torch's composable replicate().
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
    #: How the DDP model is compiled: "" (eager, or DDP around a compiled module),
    #: "torch.compile(ddp_model)", "ddp_model.compile()".
    compiled: str = ""


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
    #: The arrays above were measured in this step. Bucket detail is sampled
    #: (every ``b_every``-th step, a power of two, and the first steps); a step
    #: between samples has ``b_detail`` false and empty arrays. Its phases,
    #: ``comm_wait_ns`` included, are measured as always.
    b_detail: bool = True
    #: Steps between two detailed ones when this step began (1: every step).
    b_every: int = 1
    #: Clock that timed the step: "cpu" or "cuda".
    clock: str = "cpu"
    #: Time the training thread was blocked in DDP's own collectives outside backward
    #: (the buffer broadcast at the start of each forward, Join's per-forward syncs).
    sync_wait_ns: int = 0
    #: Time it was blocked in collectives the script or its framework called
    #: (``dist.all_reduce`` of a loss, ``barrier``, ``*_object``; async ones at ``wait()``).
    #: The phases above exclude both, so data + forward + backward + comm_wait +
    #: sync_wait + coll_wait + optimizer + other = t_end - t_start.
    coll_wait_ns: int = 0
    #: The step's forwards ran inside a ``Join`` context manager.
    join: bool = False
    #: Per blocking collective of the step, in call order (at most
    #: MAX_STEP_COLLECTIVES): op ("broadcast", "all_reduce", "barrier", ...), class
    #: ("ddp" or "user"), group ("" default, else "0,2,..."), bytes (-1 unknown),
    #: start (ns from t_start) and time blocked, call site ("file:line in func",
    #: "" for DDP's own).
    c_op: list[str] = field(default_factory=list)
    c_class: list[str] = field(default_factory=list)
    c_group: list[str] = field(default_factory=list)
    c_nbytes: list[int] = field(default_factory=list)
    c_offset_ns: list[int] = field(default_factory=list)
    c_dur_ns: list[int] = field(default_factory=list)
    c_site: list[str] = field(default_factory=list)
    #: Collectives of the step beyond the list (their time is in the sums).
    c_more: int = 0
    #: The training thread's run-queue wait (runnable, waiting for a CPU) since it
    #: started, at the step's end, ns; -1 where not known (no /proc: macOS).
    rq_wait_ns: int = -1
    #: The training thread's time on a CPU since it started, at the step's end, ns
    #: (read and interpolated with ``rq_wait_ns``); -1 where not known.
    cpu_ns: int = -1
    #: optimizer.step() ran on gradients no backward of this step all-reduced
    #: (every one under ``no_sync()``): the rank's update is its own.
    unsynced: bool = False
    #: The step's backward reached the model with no forward through DDP in the
    #: step (the loop called ``model.module``): DDP all-reduced nothing.
    bypassed: bool = False
    #: Content digest (63 bits) of the latest of a DataLoader pass's first batches
    #: the step drew; 0 past them or with none. Equal on every rank: the same data.
    batch_digest: int = 0
    #: ``loader_pass`` and ``epoch`` are those of the pass the training thread last drew
    #: a batch from (with gradients on): the pass the step trained on. False: of the pass
    #: whose sampler last yielded (no draw seen on that thread, or an older rank).
    drawn: bool = False
    #: DataLoader workers of an IterableDataset pass the step drew from that were seen
    #: yielding the same batches, each the whole stream (0: none seen).
    worker_copies: int = 0
    #: Only for a model DDP searches for unused parameters every step
    #: (``find_unused_parameters=True``, no static graph): host ns in DDP's
    #: post-forward over the step's forwards, and how many parameters some rank
    #: left unused in the step's synced backward (-1: not known, as under no_sync).
    search_ns: int = -1
    unused_params: int = -1
    #: With ``unused_params`` > 0: a 63-bit digest of which parameters went unused (the
    #: same set gives the same digest on every rank and step), and their names (at most
    #: MAX_UNUSED_NAMES, in DDP's order) on the first step of each new set.
    unused_set: int = 0
    unused_names: list[str] = field(default_factory=list)
    #: Steps in a row, this one included, that drew fewer batches from DataLoaders than
    #: the steps before a pass ran out (``StopIteration``), that pass's loader not drawn
    #: from since: they train on batches kept from it (``itertools.cycle``, alone or
    #: zipped beside a loader drawn anew). ``replay_of``: the steps that drew up to that
    #: pass's end. 0 and 0 on other steps.
    replayed: int = 0
    replay_of: int = 0
    #: With ``replayed``: the process-wide id of the pass that ran out (as
    #: ``loader_pass``; -1: a loader not followed, an IterableDataset's).
    replay_pass: int = -1
    #: Every training forward of the step (gradients on) ran with the model in eval
    #: mode; on the first such step, ``eval_layers`` names the kinds of layer that mode
    #: changes (dropout, running statistics; at most 8, ``[]`` when none).
    eval_mode: bool = False
    eval_layers: list[str] = field(default_factory=list)
    #: The step drew the last of a DataLoader pass's first batches, and they were the
    #: previous pass's of that loader in the same order (a loader whose sampler does not
    #: shuffle, whose dataset has ``set_epoch``): the qualified type of the innermost
    #: dataset layer with ``set_epoch``; "" on other steps. ``pass_epochs``: that
    #: layer's epoch at the previous pass and at this one, as the training process
    #: reads it (-1: not readable); ``epoch_shared``: the epoch is kept in shared
    #: memory, where DataLoader workers see it change; ``persistent_workers``: the
    #: loader's workers kept across passes (0: none).
    pass_repeat: str = ""
    pass_epochs: list[int] = field(default_factory=list)
    epoch_shared: bool = False
    persistent_workers: int = 0


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
    #: While ``phase`` is "collective": its op, class ("ddp" or "user") and call site.
    coll_op: str = ""
    coll_class: str = ""
    coll_site: str = ""
    #: The training thread's time on a CPU plus time waiting for one, ns since it
    #: started (schedstat); -1 where not known. It grows while the thread computes
    #: and stays flat while it is blocked (asleep, in I/O, on a lock).
    runnable_ns: int = -1
    #: While the training thread is blocked in a system call on a regular file: the
    #: call ("read", "write", "sync", "close", "copy") and the file's path. A checkpoint
    #: written outside torch.save (fsspec, safetensors, DCP) shows here.
    io_op: str = ""
    io_path: str = ""
    #: Bytes/s the whole process moved over the last interval (read/write calls on
    #: any descriptor, TCP bytes sent and acknowledged or received), measured while
    #: the training thread has been in one phase outside the collectives for a
    #: second or more; -1 otherwise. A rank waiting on its own transfer threads (a
    #: checkpoint upload) moves megabytes a second; a stuck one next to nothing.
    moved_bps: int = -1


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
    #: blake2b-64 of the real dataset indices the Subset chain keeps, in order (0: no
    #: Subset, or not computed). Equal on every rank when the split is shared.
    subset_digest: int = 0
    #: How many ranks a sampler of its own deals each sample to on purpose
    #: (repeated augmentation: torchvision's RASampler, timm's RepeatAugSampler);
    #: 1 for every other sampler.
    repeats: int = 1
    #: Batches the loader says this pass yields on this rank (len(batch_sampler)),
    #: -1 if unknown. Steps follow batches whatever shards them (accelerate's
    #: BatchSamplerShard, a bucketing batch sampler), where samples do not.
    batches: int = -1
    #: The sampler draws with replacement (RandomSampler or WeightedRandomSampler with
    #: ``replacement=True``): ranks drawing apart still share samples by chance.
    replacement: bool = False
    #: The loader's layers that each keep one rank's share (hooks/ranksplits.py),
    #: outermost first: qualified type names and the ways each splits. Two or more:
    #: the data is split by rank twice over (``double_sharded``).
    split_types: list[str] = field(default_factory=list)
    split_ways: list[int] = field(default_factory=list)
    #: Length of the innermost dataset under the Subset chain (-1: no Subset): a
    #: per-rank Subset of ``1/num_replicas`` of it is a shard of its own.
    base_len: int = -1


#: Step.unused_names holds at most this many names.
MAX_UNUSED_NAMES = 16
#: Step.eval_layers holds at most this many kinds of layer.
MAX_EVAL_LAYERS = 8
#: Steps in a row a rank trains without drawing, once its pass ran out, before
#: ``replayed_batches`` can name it (and at least ``Step.replay_of``).
REPLAY_MIN_STEPS = 8

#: SamplerPassEnd.head holds at most this many of a pass's first indices.
HEAD_LEN = 16


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
    #: First indices drawn (at most HEAD_LEN), for a quick look.
    head: list[int]
    #: Indices i with mix(i) % sketch_mod == 0: the same rule on every rank, so two
    #: ranks' sketches intersect exactly where their shards do.
    sketch: list[int]
    sketch_mod: int
    #: Draws the sketch covers, when fewer than ``count`` (-1: all of them): a pass of
    #: unknown length is sketched over its first ``dataset // world`` draws only.
    sketch_count: int = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class Fingerprint(Message):
    KIND: ClassVar[str] = "fingerprint"
    #: Steps of the job, counted alike on every rank: a rank's own steps plus
    #: those it shadowed under Join after running out of data.
    step: int
    #: "initial", "interval", "request", "final".
    reason: str
    #: 64-bit digests of each parameter / buffer, in RunInfo order.
    params: list[int]
    buffers: list[int]
    cost_ns: int
    #: Indices into RunInfo.params of the parameters holding a NaN or an inf.
    nonfinite: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class HParams(Message):
    KIND: ClassVar[str] = "hparams"
    step: int
    #: One entry per optimizer: {"type": str, "groups": [{name: float, ...}, ...]}.
    optimizers: list[dict[str, Any]]
    #: Read as the rank closed (after its last step), not as a step closed.
    final: bool = False


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
#: Op name for a DDP forward that broadcasts the module's buffers (counted like a collective).
DDP_BUFFERS = "ddp_buffers"


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


#: Most items of list[int] and list[str] fields whose bound is not MAX_ITEMS.
_LIMITS: dict[tuple[str, str], int] = {
    **{("step", f): MAX_BUCKETS for f in ("b_index", "b_nbytes", "b_offset_ns", "b_dur_ns")},
    **{
        ("step", f): MAX_STEP_COLLECTIVES
        for f in ("c_op", "c_class", "c_group", "c_site", "c_nbytes", "c_offset_ns", "c_dur_ns")
    },
    ("step", "unused_names"): MAX_UNUSED_NAMES,
    ("step", "eval_layers"): MAX_EVAL_LAYERS,
    ("buckets", "index"): MAX_BUCKETS,
    ("buckets", "nbytes"): MAX_BUCKETS,
    ("buckets", "dtype"): MAX_BUCKETS,
    ("fingerprint", "params"): MAX_TENSORS,
    ("fingerprint", "buffers"): MAX_TENSORS,
}

#: Checkers for fields whose annotation alone says too little or too much.
_FIELD_CHECKS: dict[tuple[str, str], Any] = {
    ("buckets", "params"): lambda v: _check(v, list[list[int]], MAX_BUCKETS),
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
    limit = _LIMITS.get((kind, name), MAX_ITEMS)
    if hint == list[int]:
        return _int_list(limit)
    return _checker(hint, limit)


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

#: What msgpack builds: a field typed ``Any`` may hold any of them.
_MSGPACK_TYPES = (type(None), bool, int, float, str, bytes, list, dict, msgpack.Timestamp)
_EXACT: dict[Any, tuple[type, ...]] = {
    int: (int,),
    bool: (bool,),
    float: (float, int),  # _check_float takes an int where a float is due
    str: (str,),
}
#: Inclusive bounds of ints the checking decoder enforces besides their types: the
#: version and rank of every kind, and these.
_BOUNDS: dict[tuple[str, str], tuple[int | None, int | None]] = {
    ("run_info", "world_size"): (1, MAX_WORLD_SIZE),
}
_ENVELOPE_BOUNDS: dict[str, tuple[int | None, int | None]] = {
    "v": (SCHEMA_VERSION, SCHEMA_VERSION),
    "rank": (0, MAX_WORLD_SIZE - 1),
}


def _passes(check: Checker) -> Callable[[Any], bool]:
    def ok(value: Any) -> bool:
        try:
            check(value)
        except _Invalid:
            return False
        return True

    return ok


def _plan(spec: _Spec, f: dataclasses.Field[Any], hint: Any) -> FieldPlan:
    """``f``'s checks as the fast decoder takes them: the same as ``spec`` makes."""
    kind = spec.cls.KIND
    factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
    # The version has a default for the dataclass, but a message must carry it.
    default = MISSING if f.default is dataclasses.MISSING or f.name == "v" else f.default
    low, high = _ENVELOPE_BOUNDS.get(f.name) or _BOUNDS.get((kind, f.name), (None, None))
    exact = _EXACT.get(hint)
    if exact is not None:
        return FieldPlan(f.name, exact, low=low, high=high, default=default, factory=factory)
    if (kind, f.name) not in _FIELD_CHECKS and hint in (list[int], list[str]):
        limit = _LIMITS.get((kind, f.name), MAX_ITEMS)
        (item,) = get_args(hint)
        return FieldPlan(f.name, (list,), item, limit, default=default, factory=factory)
    origin = get_origin(hint)
    shape = (origin,) if origin in (list, dict) else _MSGPACK_TYPES
    ok = _passes(spec.fields[f.name])
    return FieldPlan(f.name, shape, ok=ok, default=default, factory=factory)


def _fast(spec: _Spec) -> Callable[[dict[Any, Any]], Any]:
    hints = typing.get_type_hints(spec.cls)
    plans = [_plan(spec, f, hints[f.name]) for f in dataclasses.fields(spec.cls)]
    return compile_decoder(spec.cls, plans, spec.parallel)


#: Per kind, the generated decoder that takes the common case (see schema_codec).
_FAST = {kind: _fast(spec) for kind, spec in _SPECS.items()}


#: msgpack.unpackb for bytes from the network: every size bounded, maps keyed
#: by strings. Callers add ``ext_hook`` (extension types are refused, each
#: caller with its own reason) and ``max_bin_len``.
unpack_untrusted = functools.partial(
    msgpack.unpackb,
    raw=False,
    strict_map_key=True,
    use_list=True,
    max_str_len=MAX_STRING_BYTES,
    max_array_len=MAX_TENSORS,
    max_map_len=MAX_ITEMS,
)


def _no_ext(code: int, data: bytes) -> Any:
    # ddpscope never sends extension types; a namedtuple where a list is
    # expected only confuses readers.
    raise SchemaError("not a msgpack message", f"extension type {code} is not used by ddpscope")


def decode(buf: bytes) -> Message:
    """Decode and validate one message. Raises SchemaError on anything odd."""
    if len(buf) > MAX_MESSAGE_BYTES:
        raise SchemaError("message too large", f"{len(buf)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        body = unpack_untrusted(buf, ext_hook=_no_ext, max_bin_len=MAX_STRING_BYTES)
    except SchemaError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types for malformed input
        raise SchemaError(
            "not a msgpack message", f"{exc.__class__.__name__}: {str(exc)[:200]}"
        ) from None
    if type(body) is dict:
        kind = body.get("k")
        fast = _FAST.get(kind) if type(kind) is str else None
        if fast is not None:
            msg = fast(body)  # checks the version too
            if msg is not None:
                return msg
    return _decode_checked(body)


def _decode_checked(body: Any) -> Message:
    """Check every field of an unpacked message and say what is wrong, if anything.

    Every message the generated decoders take is valid here too; this path
    decides the rest, and words every error."""
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


# --- for checkers of other encodings (transport/batch.py) ---------------------


def field_plans(kind: str) -> list[FieldPlan]:
    """``kind``'s fields in order, with the checks the generated decoder makes on
    each: what a relay's batch (values by position, not by name) must pass too."""
    spec = _SPECS[kind]
    hints = typing.get_type_hints(spec.cls)
    return [_plan(spec, f, hints[f.name]) for f in dataclasses.fields(spec.cls)]


def parallel_fields(kind: str) -> tuple[tuple[str, ...], ...]:
    """``kind``'s groups of list fields that must have equal lengths."""
    return _PARALLEL.get(kind, ())
