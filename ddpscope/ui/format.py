"""Fixed-width text for numbers, so columns never jump as values change."""

from __future__ import annotations

from collections.abc import Sequence

#: A rank's status badge where the finding's kind is wider than the status
#: column (10): cut, "missing_se", "checkpoint" and "rank0_only" said less.
BADGES = {
    "cpu_contention": "contention",
    "hyperparam_mismatch": "hparams",
    "missing_set_epoch": "set_epoch",
    "unsharded_data": "unsharded",
    "shard_overlap": "overlap",
    "uneven_inputs": "uneven",
    "global_batch": "batch",
    "checkpoint_all_ranks": "checkpoint",
    "rank0_only_collective": "rank0 coll",
    "dataparallel": "nn.DP",
    "batchnorm_small_batch": "batchnorm",
    "no_destroy_process_group": "no destroy",
    "device_mismatch": "device",
    "accumulate_without_no_sync": "accumulate",
    "forward_bypasses_ddp": "bypass DDP",
    "gradients_reduced_twice": "grads x2",
    "padded_evaluation": "eval pad",
    "worker_duplicates": "worker dup",
    "replayed_batches": "replayed",
    "repeated_epoch": "same epoch",
    "optimizer_not_stepping": "no update",
    "nonfinite_weights": "not finite",
    "double_sharded": "2x shard",
    "eval_mode_training": "eval mode",
    "unused_parameter_search": "search",
}
#: The status column's width, in the ranks and the hosts views.
BADGE_W = 10


def badge(status: str) -> str:
    """A rank's status as its column shows it: a finding's kind, or its short badge."""
    return BADGES.get(status, status)


def ms(value: float, width: int = 6) -> str:
    """Milliseconds in at most ``width`` characters; '-' for unknown (negative)."""
    if value < 0:
        return "-".rjust(width)
    if value < 10:
        text = f"{value:.2f}"
    elif value < 100:
        text = f"{value:.1f}"
    elif value < 100_000:
        text = f"{value:.0f}"
    else:
        text = f"{value / 1000:.0f}s"
    return text[:width].rjust(width)


def count(value: int) -> str:
    """12, 1.2k, 12k, 1.2M."""
    if value < 1000:
        return str(value)
    if value < 10_000:
        return f"{value / 1000:.1f}k"
    if value < 1_000_000:
        return f"{value // 1000}k"
    return f"{value / 1_000_000:.1f}M"


def nbytes(value: int) -> str:
    if value < 0:
        return "-"
    size = float(value)
    for unit in ("B", "K", "M", "G", "T"):
        if size < 1000 or unit == "T":
            return f"{size:.0f}{unit}" if size >= 10 or unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.0f}T"  # pragma: no cover


def age(seconds: float) -> str:
    """Seconds since something happened: 0.4s, 12s, 3m, 2h; '-' for never."""
    if seconds < 0:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def clock(seconds: float) -> str:
    """Elapsed time as H:MM:SS."""
    s = int(max(0.0, seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def pct(value: float) -> str:
    return "-" if value < 0 else f"{value:.0f}"


def ranks(values: Sequence[object], limit: int = 6) -> str:
    """The first ``limit`` items, then how many more: '0, 1, 2 +5'."""
    shown = ", ".join(str(r) for r in values[:limit])
    extra = len(values) - limit
    return shown + (f" +{extra}" if extra > 0 else "")
