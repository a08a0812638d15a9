"""Who this rank is: run id, topology, versions, DDP settings, model layout."""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from ddpscope._version import __version__
from ddpscope.config import Options
from ddpscope.hooks.target import Target, of_ddp

_RUN_ID_KEY = "ddpscope/run_id"


def _store_agreed_id(candidate: str) -> str | None:
    """First rank to ask wins; the others read its id. No collective, no wait."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        agreed = store.compare_set(_RUN_ID_KEY, "", candidate)
    except Exception:
        return None
    text = agreed.decode() if isinstance(agreed, bytes) else str(agreed)
    return text or None


def resolve_run_id(opts: Options, env: dict[str, str] | None = None) -> str:
    env = dict(os.environ) if env is None else env
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if opts.run_id:
        base = opts.run_id
    else:
        candidate = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
        base = ""
        if dist.is_available() and dist.is_initialized():
            base = _store_agreed_id(candidate) or ""
        if not base:
            elastic = env.get("TORCHELASTIC_RUN_ID", "")
            base = f"torchelastic-{elastic}" if elastic and elastic != "none" else candidate
    return base if restart in ("", "0") else f"{base}-r{restart}"


def topology() -> dict[str, int]:
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    }


def versions() -> dict[str, str]:
    return {
        "ddpscope": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def ddp_settings(model: Any) -> dict[str, Any]:
    return {
        "bucket_cap_bytes": int(getattr(model, "bucket_bytes_cap", -1)),
        "find_unused_parameters": bool(getattr(model, "find_unused_parameters", False)),
        "static_graph": bool(getattr(model, "static_graph", False)),
        "broadcast_buffers": bool(getattr(model, "broadcast_buffers", False)),
        "gradient_as_bucket_view": bool(getattr(model, "gradient_as_bucket_view", False)),
        **_dp_ranks(model),
    }


def _dp_ranks(model: Any) -> dict[str, list[int]]:
    """``dp_ranks``: the global ranks DDP averages over, when that is not the whole world.

    DDP over a subgroup (a data-parallel group beside tensor- or pipeline-
    parallel ones) keeps replicas equal within its group only, and shards
    data over that group: the analysis compares ranks within it.
    """
    group = getattr(model, "process_group", None)
    try:
        if group is None or not dist.is_initialized():
            return {}
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) >= dist.get_world_size():
            return {}
        return {"dp_ranks": sorted(int(r) for r in ranks)}
    except Exception:  # a group object torch does not know (a fake, a destroyed one)
        return {}


def backend_of(model: Any) -> str:
    try:
        return str(dist.get_backend(model.process_group))
    except Exception:
        return "unknown"


def device_of(model: Any) -> str:
    for p in model.parameters():
        return str(p.device)
    return "cpu"


def layout(model: Any) -> tuple[list[list[Any]], list[list[Any]]]:
    """A DDP model's parameters and buffers, named as in its module's state dict."""
    return layout_of(of_ddp(model))


def layout_of(target: Target) -> tuple[list[list[Any]], list[list[Any]]]:
    params = [
        [name, list(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad)]
        for name, p in target.named
    ]
    buffers = [
        [name, list(b.shape), str(b.dtype).replace("torch.", "")]
        for name, b in target.module.named_buffers()
    ]
    return params, buffers


def run_info_fields(target: Target, opts: Options, started_wall_ns: int) -> dict[str, Any]:
    topo = topology()
    model = target.ddp
    params, buffers = layout_of(target)
    ddp = ddp_settings(model)
    if target.api != "ddp":
        ddp["api"] = target.api
        ddp["broadcast_buffers"] = target.syncs_buffers
    return {
        "local_rank": topo["local_rank"],
        "world_size": topo["world_size"],
        "local_world_size": topo["local_world_size"],
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "backend": backend_of(model),
        "device": device_of(model),
        "versions": versions(),
        "ddp": ddp,
        "params": params,
        "buffers": buffers,
        "started_wall_ns": started_wall_ns,
        "options": public_options(opts),
    }


#: Options that may hold key material (a key can be given inline instead of
#: as a path): never sent or recorded, only whether they are set.
SECRET_OPTIONS = ("server_key", "client_key")


def public_options(opts: Any) -> dict[str, Any]:
    """The options as run info carries them: plain values, keys redacted."""
    out = {k: v for k, v in vars(opts).items() if isinstance(v, (int, float, str, bool))}
    for name in SECRET_OPTIONS:
        if out.get(name):
            out[name] = "(set)"
    return out


#: Tries at reading the wall clock between two monotonic reads; the tightest wins.
ANCHOR_TRIES = 16


def clock_anchor() -> dict[str, int]:
    """A wall/monotonic pair read as close together as this process can manage.

    Readers put hosts on one clock with it (record/clocks.py), so any gap
    between the two reads is alignment error: a thread switched out between
    them, on a busy machine, costs milliseconds. The wall read is bracketed
    by two monotonic reads, and the tightest of a few tries is kept (a few
    microseconds, once, at attach).
    """
    best: tuple[int, int, int] | None = None
    for _ in range(ANCHOR_TRIES):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best is None or after - before < best[0]:
            best = (after - before, wall, (before + after) // 2)
    assert best is not None
    return {"wall_ns": best[1], "mono_ns": best[2]}
