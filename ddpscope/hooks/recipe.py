"""Recipe probes: the DDP rules tutorials teach, observed from inside a rank.

PyTorch raises nothing when a script breaks the standard DDP recipe: every
rank writing the same checkpoint, a metric all-reduced on rank 0 only,
``nn.DataParallel`` inside a DDP job, BatchNorm with a tiny per-rank batch,
a process group never destroyed, two ranks on one GPU. The analysis side
judges; this module only reports what it sees:

- ``batch``: the largest first dimension of a training forward's input (the
  per-rank batch) and the BatchNorm layers in training mode, at the first
  training forward and whenever the batch grows;
- ``save``: the first ``torch.save`` to each file path, with the caller's
  site and whether the object is the DDP wrapper's state dict (``module.``
  keys) or the wrapper itself;
- ``collectives``: cumulative counts of the collectives the script issued
  (``torch.distributed.all_reduce`` and friends, called from outside torch)
  and of DDP forwards that broadcast buffers, by operation, group and call
  site; snapshots at steps 1, 2, 4, ..., 256 and every 256th after (the same
  steps on every rank, so ranks compare), and at shutdown;
- ``dataparallel``: an ``nn.DataParallel`` constructed in the process, or
  found inside an attached DDP model;
- ``shutdown``: whether the default process group was still alive when
  ddpscope shut down, and where ``destroy_process_group`` was called;
- run-info fields: the script, and which GPU the rank should use
  (:func:`expected_device`) against the GPU its model is on.

Costs on the training path: a forward pre-hook that reads one tensor's shape
(plus one attribute check when the model broadcasts buffers); a collective
costs a frame lookup and a dict increment; ``torch.save`` and DataParallel
construction are rare. Everything is guarded: an internal error turns this
probe off with one warning and training goes on.

Functions are patched process-wide, idempotently, while a probe is active
and restored by :meth:`RecipeProbe.uninstall` when nobody patched on top.

Long module: five probes sharing one process-wide set of patches (the collectives,
``torch.save``, ``destroy_process_group``, DataParallel) that :class:`RecipeProbe`
installs and restores together; split, the patch table would have several owners.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from ddpscope.hooks import compiled, pid
from ddpscope.hooks.typename import type_name
from ddpscope.schema import (
    COLLECTIVE_OPS,
    DDP_BUFFERS,
    BatchInfo,
    Collectives,
    DataParallelSeen,
    SaveCall,
    Shutdown,
)

log = logging.getLogger("ddpscope")

#: Site of DDP forwards run for training (the frame walk is spared on the hot path).
TRAINING_FORWARDS = "(training forwards)"
#: Distinct (op, group, site) keys counted; beyond, counts go to one overflow site.
MAX_SITES = 256
OVERFLOW_SITE = "(other sites)"
#: Distinct file paths reported by ``save`` messages.
MAX_PATHS = 256
#: BatchNorm layer names carried in a ``batch`` message.
MAX_BATCHNORM_NAMES = 64
#: Snapshot every this many steps once past the doubling phase.
SNAPSHOT_EVERY = 256

_INTERNAL_PREFIXES = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(__file__)) + os.sep,  # the ddpscope package
)
_internal_files: dict[str, bool] = {}
#: torch's model averaging (PeriodicModelAverager, post-local SGD's partner).
AVERAGING = os.path.join("torch", "distributed", "algorithms", "model_averaging") + os.sep


def _is_internal(filename: str) -> bool:
    known = _internal_files.get(filename)
    if known is None:
        known = filename.startswith(_INTERNAL_PREFIXES)
        if len(_internal_files) < 8192:
            _internal_files[filename] = known
    return known


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame at or above ``frame`` outside torch and ddpscope."""
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def site_text(filename: str, line: int, function: str) -> str:
    return f"{filename}:{line} in {function}"


def site_of(frame: FrameType | None) -> str:
    if frame is None:
        return ""
    return site_text(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def snapshot_due(steps: int) -> bool:
    """Steps after which the collective counts are sent: the same on every rank."""
    if steps <= 0:
        return False
    if steps <= SNAPSHOT_EVERY:
        return steps & (steps - 1) == 0
    return steps % SNAPSHOT_EVERY == 0


# --- devices -----------------------------------------------------------------------


@dataclass(frozen=True)
class CudaInventory:
    """What the rank's CUDA runtime shows: visible devices and their UUIDs."""

    visible: int
    uuid_of: Callable[[int], str]


def cuda_inventory() -> CudaInventory:
    """The one place that asks CUDA; called only for a model already on a GPU."""

    def uuid_of(index: int) -> str:
        try:
            return str(torch.cuda.get_device_properties(index).uuid)
        except Exception:
            return ""

    try:
        return CudaInventory(torch.cuda.device_count(), uuid_of)
    except Exception:
        return CudaInventory(0, lambda i: "")


def expected_device(local_rank: int, local_world_size: int, visible: int) -> str:
    """The GPU a rank should train on: ``cuda:LOCAL_RANK`` (torchrun's convention).

    With one visible device every rank sees ``cuda:0``: either the launcher gave
    each rank its own GPU through CUDA_VISIBLE_DEVICES, or they all share one,
    which only the device UUIDs across ranks tell apart. With fewer visible
    GPUs than LOCAL_RANK there is no GPU of the rank's own ("").
    """
    if visible <= 0 or local_rank < 0:
        return ""
    if visible == 1:
        return "cuda:0"
    if local_rank < visible:
        return f"cuda:{local_rank}"
    return ""


def device_fields(
    model_device: str,
    local_rank: int,
    local_world_size: int,
    inventory: Callable[[], CudaInventory] = cuda_inventory,
) -> dict[str, Any]:
    """RunInfo's ``cuda_visible``, ``device_expected`` and ``device_uuid`` for a model."""
    if not model_device.startswith("cuda"):
        return {"cuda_visible": -1, "device_expected": "", "device_uuid": ""}
    inv = inventory()
    _, _, index_text = model_device.partition(":")
    index = int(index_text) if index_text.isdigit() else 0
    return {
        "cuda_visible": inv.visible,
        "device_expected": expected_device(local_rank, local_world_size, inv.visible),
        "device_uuid": inv.uuid_of(index) if index < inv.visible else "",
    }


def run_info_fields(model: Any, local_rank: int, local_world_size: int) -> dict[str, Any]:
    """The recipe fields of a RunInfo: the script, and the device check."""
    device = "cpu"
    for p in model.parameters():
        device = str(p.device)
        break
    script = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return {
        "script": os.path.abspath(script) if script and script != "-c" else script,
        **device_fields(device, local_rank, local_world_size),
    }


# --- model facts ---------------------------------------------------------------------

_BATCHNORM: tuple[type[nn.Module], ...] = (
    (nn.modules.batchnorm._BatchNorm,)
    if hasattr(nn.modules.batchnorm, "_BatchNorm")
    else (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
)


def batchnorm_layers(module: nn.Module) -> list[str]:
    """BatchNorm layers (not SyncBatchNorm) in training mode: they use the local batch."""
    return [
        name or type(m).__name__
        for name, m in module.named_modules()
        if isinstance(m, _BATCHNORM) and not isinstance(m, nn.SyncBatchNorm) and m.training
    ]


#: Where a batch was found, made once: batch_of runs in every training forward.
_grad_enabled = torch.is_grad_enabled
_ARG_NAMES = tuple(f"args[{i}]" for i in range(8))


def batch_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, str]:
    """The first dimension of a forward's first tensor input, and where it was found."""
    if args and type(args[0]) is torch.Tensor and args[0].ndim:
        return args[0].shape[0], _ARG_NAMES[0]  # model(x): called on every forward
    for i, a in enumerate(args[:8]):
        if isinstance(a, torch.Tensor):
            if a.dim() > 0:
                return int(a.shape[0]), _ARG_NAMES[i]
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            if a[0].dim() > 0:
                return int(a[0].shape[0]), f"args[{i}][0]"
        elif isinstance(a, Mapping):
            for k, v in itertools.islice(a.items(), 16):
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    return int(v.shape[0]), f"args[{i}][{k!r}]"
    for k, v in itertools.islice(kwargs.items(), 16):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0]), f"kwargs[{k!r}]"
    return -1, ""


# --- the probe -----------------------------------------------------------------------

Post = Callable[[str, dict[str, Any]], None]


class PostModel(Protocol):
    """``Publisher.post``: queue (kind, model index, payload) with an optional finisher."""

    def __call__(self, kind: str, model: int, payload: Any, finisher: Any = None) -> None: ...


#: (op, group, file, line, function) -> calls.
CountKey = tuple[str, str, str, int, str]


def count_key(op: str, group: str, frame: FrameType | None) -> CountKey:
    if frame is None:
        return (op, group, "", 0, "")
    code = frame.f_code
    return (op, group, code.co_filename, frame.f_lineno, code.co_name)


class ModelWatch:
    """Per attached DDP model: the batch it trains on and the buffer broadcasts it makes."""

    def __init__(self, probe: RecipeProbe, model: Any, index: int, module: Any) -> None:
        self.probe = probe
        self.model = model
        #: The user's layers: the DDP model's ``.module``, or a module under replicate().
        self.module = module
        self.index = index
        self.size = -1
        # Only models that broadcast buffers in forward need the per-forward check.
        self._may_sync = False
        self._group = ""
        self._training_key: CountKey = (DDP_BUFFERS, "", "", 0, TRAINING_FORWARDS)
        try:
            self._may_sync = (
                callable(getattr(model, "will_sync_module_buffers", None))
                and hasattr(model, "require_forward_param_sync")
                and bool(getattr(model, "broadcast_buffers", True))
                and bool(getattr(model, "modules_buffers", None))
            )
            if self._may_sync:
                self._group = probe.group_key(getattr(model, "process_group", None))
                self._training_key = (DDP_BUFFERS, self._group, "", 0, TRAINING_FORWARDS)
        except Exception as exc:
            probe.disable(exc)

    def forward_pre(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        probe = self.probe
        if not probe.enabled or pid.current != probe.pid:
            return
        try:
            training = _grad_enabled() and module.training
            if training:
                first = args[0] if args else None
                if type(first) is torch.Tensor and first.ndim:
                    size, source = first.shape[0], _ARG_NAMES[0]  # model(x): every forward
                else:
                    size, source = batch_of(args, kwargs)
                if size > self.size:
                    self.size = size
                    self._post_batch(size, source)
            # require_forward_param_sync is what will_sync_module_buffers() reads
            # besides the two facts _may_sync holds: one attribute, not a call.
            if self._may_sync and module.require_forward_param_sync:
                # DDP broadcasts rank 0's buffers in this forward: a collective. An
                # evaluation forward on some ranks only is the classic mismatch.
                if training:
                    # Every rank's training loop makes these: no frame walk per step.
                    counts = probe._counts
                    key = self._training_key
                    n = counts.get(key)
                    if n is None:
                        probe.count(key)
                    else:
                        counts[key] = n + 1
                else:
                    probe.count(count_key(DDP_BUFFERS, self._group, user_frame(sys._getframe(1))))
        except Exception as exc:
            probe.disable(exc)

    def _post_batch(self, size: int, source: str) -> None:
        layers = batchnorm_layers(self.module)
        self.probe.post_model(
            BatchInfo.KIND,
            self.index,
            {
                "step": self.probe.current_step(),
                "size": size,
                "source": source,
                "batchnorm": layers[:MAX_BATCHNORM_NAMES],
                "batchnorm_count": len(layers),
            },
        )


class RecipeProbe:
    """Process-wide observer of torch.save, collectives, DataParallel and shutdown."""

    def __init__(self, post: Post, post_model: PostModel, current_step: Callable[[], int]) -> None:
        self._post = post
        self.post_model = post_model
        self.current_step = current_step
        self.enabled = True
        self.pid = os.getpid()
        self._counts: dict[CountKey, int] = {}
        self._groups: dict[int, tuple[Any, str]] = {}
        self._paths: set[str] = set()
        self._models: list[weakref.ref[Any]] = []
        self._ddp_keys: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
        self._destroy_site = ""
        self._finished = False

    # --- life cycle ----------------------------------------------------------------

    def install(self) -> None:
        global _active
        with _lock:
            _patch()
            _active = self

    def uninstall(self) -> None:
        global _active
        with _lock:
            if _active is self:
                _active = None
                _unpatch()

    def add_model(self, model: Any, index: int, module: Any = None) -> ModelWatch:
        """Watch one attached DDP model; reports a DataParallel found inside it.

        ``module``: the user's layers, when they are not ``model.module`` (replicate()).
        """
        module = model.module if module is None else module
        self._models.append(weakref.ref(model))
        watch = ModelWatch(self, model, index, module)
        self.guard(self._scan_dataparallel, module)
        return watch

    def on_step_end(self, steps: int) -> None:
        """After a step closed (``steps`` closed so far): counts on the agreed steps."""
        if self.enabled and snapshot_due(steps) and self._counts:
            self._post_counts(steps, final=False)

    def finish(self) -> None:
        """At shutdown: the last counts and the process group's state; then restore."""
        if self._finished:
            return
        self._finished = True
        try:
            if self.enabled and os.getpid() == self.pid:
                steps = self.current_step()
                if self._counts:
                    self._post_counts(steps, final=True)
                alive = dist.is_available() and dist.is_initialized()
                self._post(
                    Shutdown.KIND,
                    {"step": steps, "pg_initialized": alive, "destroy_site": self._destroy_site},
                )
        except Exception as exc:
            self.disable(exc)
        finally:
            self.uninstall()

    def disable(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            log.warning("ddpscope recipe checks disabled after an internal error: %r", exc)

    def guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self.disable(exc)
            return None

    def _live(self) -> bool:
        return self.enabled and pid.current == self.pid

    # --- collectives -----------------------------------------------------------------

    def group_key(self, group: Any) -> str:
        """The default group is "", any other group its global ranks ("0,2,4")."""
        if group is None:
            return ""
        known = self._groups.get(id(group))
        if known is not None:
            return known[1]
        if group is getattr(dist.GroupMember, "WORLD", None):
            key = ""
        else:
            key = ",".join(str(r) for r in dist.get_process_group_ranks(group))
        if len(self._groups) < 256:
            # Keep the group alive in the cache so that its id is never reused.
            self._groups[id(group)] = (group, key)
        return key

    def count(self, key: CountKey) -> None:
        counts = self._counts
        n = counts.get(key)
        if n is None and len(counts) >= MAX_SITES:
            key = (key[0], key[1], "", 0, OVERFLOW_SITE)
            n = counts.get(key)
        counts[key] = (n or 0) + 1

    def on_collective(
        self,
        op: str,
        frame: FrameType,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group_at: int | None,
    ) -> None:
        if not self._live():
            return
        try:
            code = frame.f_code
            if _is_internal(code.co_filename) and AVERAGING not in code.co_filename:
                # torch calling its own collectives (Join, object collectives). Model
                # averaging's are counted at its own site: the analysis needs to know
                # that replicas are averaged now and then instead of kept equal.
                return
            self.count(count_key(op, self.group_key(group_arg(args, kwargs, group_at)), frame))
        except Exception as exc:
            self.disable(exc)

    def _post_counts(self, steps: int, final: bool) -> None:
        # dict() copies atomically under the GIL, even while another thread counts.
        snapshot = dict(self._counts)
        payload = (steps, final, snapshot)
        self.post_model(Collectives.KIND, 0, payload, _counts_fields)

    # --- torch.save ------------------------------------------------------------------

    def on_save(self, obj: Any, f: Any, frame: FrameType | None) -> None:
        if not self._live():
            return
        try:
            path = _path_of(f)
            if not path or path in self._paths or len(self._paths) >= MAX_PATHS:
                return
            self._paths.add(path)
            what, key = self._classify(obj)
            fields = {
                "step": self.current_step(),
                "path": path,
                "site": site_of(user_frame(frame)),
                "what": what,
                "key": key,
            }
            self._post(SaveCall.KIND, fields)
        except Exception as exc:
            self.disable(exc)

    def _classify(self, obj: Any) -> tuple[str, str]:
        if isinstance(obj, DistributedDataParallel):
            return "ddp_module", ""
        if self._is_ddp_state(obj):
            return "ddp_state_dict", ""
        if isinstance(obj, Mapping):
            # A checkpoint dict: {"model": ..., "optimizer": ..., "epoch": ...}.
            for k, v in itertools.islice(obj.items(), 64):
                if isinstance(v, DistributedDataParallel):
                    return "ddp_module", str(k)
                if self._is_ddp_state(v):
                    return "ddp_state_dict", str(k)
        return "other", ""

    def _is_ddp_state(self, obj: Any) -> bool:
        """A mapping whose keys are those of an attached DDP wrapper's state dict."""
        if not isinstance(obj, Mapping) or not obj:
            return False
        keys = list(itertools.islice(obj.keys(), 8))
        if not all(isinstance(k, str) and k.startswith("module.") for k in keys):
            return False
        for ref in self._models:
            model = ref()
            if model is None:
                continue
            expected = self._ddp_keys.get(model)
            if expected is None:
                expected = self._ddp_keys[model] = frozenset(model.state_dict().keys())
            if any(k in expected for k in keys):
                return True
        return False

    # --- destroy_process_group, DataParallel -----------------------------------------

    def on_destroy(self, group: Any, frame: FrameType | None) -> None:
        if not self._live():
            return
        try:
            if group is None or group is getattr(dist.GroupMember, "WORLD", None):
                self._destroy_site = site_of(user_frame(frame))
        except Exception as exc:
            self.disable(exc)

    def on_dataparallel(self, dp: Any, frame: FrameType | None) -> None:
        if not self._live():
            return
        try:
            self._post_dataparallel(dp, site_of(user_frame(frame)), inside=False)
        except Exception as exc:
            self.disable(exc)

    def _scan_dataparallel(self, module: Any) -> None:
        for m in module.modules():
            if isinstance(m, DataParallel):
                self._post_dataparallel(m, "", inside=True)

    def _post_dataparallel(self, dp: Any, site: str, inside: bool) -> None:
        ids = [int(getattr(d, "index", d) or 0) for d in (getattr(dp, "device_ids", None) or [])]
        fields = {
            "step": self.current_step(),
            "site": site,
            "module": type_name(getattr(dp, "module", None)),
            "device_ids": ids,
            "inside_ddp": inside,
        }
        self._post(DataParallelSeen.KIND, fields)


def _counts_fields(payload: tuple[int, bool, dict[CountKey, int]], force: bool) -> dict[str, Any]:
    steps, final, snapshot = payload
    keys = sorted(snapshot)
    return {
        "step": steps,
        "final": final,
        "ops": [k[0] for k in keys],
        "groups": [k[1] for k in keys],
        "sites": [site_text(k[2], k[3], k[4]) if k[2] else k[4] for k in keys],
        "counts": [snapshot[k] for k in keys],
    }


def _path_of(f: Any) -> str:
    """The absolute path ``torch.save`` writes to; "" for buffers and unnamed streams."""
    if isinstance(f, (str, os.PathLike)):
        raw = os.fspath(f)
        return os.path.abspath(raw.decode() if isinstance(raw, bytes) else raw)
    name = getattr(f, "name", None)
    if isinstance(name, str) and name and not name.startswith("<"):
        return os.path.abspath(name)
    return ""


# --- process-wide patches ------------------------------------------------------------

_lock = threading.Lock()
_active: RecipeProbe | None = None
#: (owner, attribute, original, wrapper) for every patch in place.
_patches: list[tuple[Any, str, Any, Any]] = []


def group_arg(args: tuple[Any, ...], kwargs: dict[str, Any], group_at: int | None) -> Any:
    """The process group a collective was called with (None: the default group)."""
    if "group" in kwargs:
        return kwargs["group"]
    if group_at is not None and group_at < len(args):
        return args[group_at]
    return None


def _group_index(fn: Any) -> int | None:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("group") if "group" in names else None


class CollectiveTiming(Protocol):
    """:class:`ddpscope.hooks.collectives.CollectiveTimer`'s entry point."""

    def call(
        self,
        op: str,
        orig: Callable[..., Any],
        caller: FrameType,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group_at: int | None,
    ) -> Any: ...

    def save(self, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any: ...


#: Set by ddpscope.hooks.collectives while a rank times its collectives.
_timing: CollectiveTiming | None = None


def set_timing(timing: CollectiveTiming | None) -> None:
    global _timing
    _timing = timing


def _collective_wrapper(op: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    group_at = _group_index(orig)

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        probe = _active
        timing = _timing
        if (probe is None and timing is None) or torch.compiler.is_compiling():
            # Traced by dynamo: frame inspection would break the user's graph.
            return orig(*args, **kwargs)
        caller = sys._getframe(1)
        if probe is not None:
            probe.on_collective(op, caller, args, kwargs, group_at)
        if timing is not None:
            return timing.call(op, orig, caller, args, kwargs, group_at)
        return orig(*args, **kwargs)

    compiled.run_eagerly(wrapper)  # see hooks/compiled.py
    return wrapper


def _save_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        probe = _active
        if probe is not None:
            probe.on_save(obj, f, sys._getframe(1))
        timing = _timing
        if timing is not None:
            return timing.save(orig, (obj, f, *args), kwargs)
        return orig(obj, f, *args, **kwargs)

    return save


def _destroy_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        probe = _active
        if probe is not None:
            group = kwargs.get("group", args[0] if args else None)
            probe.on_destroy(group, sys._getframe(1))
        return orig(*args, **kwargs)

    return destroy_process_group


def _dataparallel_init(orig: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        probe = _active
        if probe is not None:
            probe.on_dataparallel(self, sys._getframe(1))

    return __init__


def _patch() -> None:
    if _patches:
        return
    from torch.distributed import distributed_c10d

    # Both namespaces: scripts call dist.all_reduce, some distributed_c10d.all_reduce.
    for owner in (dist, distributed_c10d):
        for op in COLLECTIVE_OPS:
            orig = getattr(owner, op, None)
            if callable(orig):
                _set(owner, op, orig, _collective_wrapper(op, orig))
        destroy = getattr(owner, "destroy_process_group", None)
        if callable(destroy):
            _set(owner, "destroy_process_group", destroy, _destroy_wrapper(destroy))
    _set(torch, "save", torch.save, _save_wrapper(torch.save))
    init = DataParallel.__dict__["__init__"]
    _set(DataParallel, "__init__", init, _dataparallel_init(init))


def _set(owner: Any, name: str, orig: Any, wrapper: Any) -> None:
    setattr(owner, name, wrapper)
    _patches.append((owner, name, orig, wrapper))


def _unpatch() -> None:
    for owner, name, orig, wrapper in reversed(_patches):
        # Someone patched on top of us: leave theirs (ours is inert without a probe).
        current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        if current is wrapper:
            setattr(owner, name, orig)
    _patches.clear()


def patched() -> bool:
    return bool(_patches)


__all__ = [
    "AVERAGING",
    "COLLECTIVE_OPS",
    "DDP_BUFFERS",
    "CudaInventory",
    "ModelWatch",
    "RecipeProbe",
    "batch_of",
    "batchnorm_layers",
    "cuda_inventory",
    "device_fields",
    "expected_device",
    "group_arg",
    "patched",
    "run_info_fields",
    "set_timing",
    "site_of",
    "snapshot_due",
    "user_frame",
]
