"""The training setup of a run: effective global batch and learning rate.

Not a detector: what report and UI headers show, and what the
``global_batch`` check compares between runs of a script.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ddpscope.analysis.dpgroups import dp_group, dp_size
from ddpscope.analysis.state import RankView, RunState, first_optimizer, group_rates

#: Steps whose micro-batch counts decide the accumulation factor.
ACCUM_STEPS = 32


@dataclass(frozen=True)
class TrainingSetup:
    """Effective global batch and learning rate of a run, for headers and comparisons."""

    world_size: int
    #: Per-rank batch (first dimension of a training forward's input), by rank.
    batch_by_rank: dict[int, int]
    #: Micro-batches per optimizer step (gradient accumulation), by rank.
    accumulation_by_rank: dict[int, int]
    #: Samples per optimizer step over all ranks; None when no batch is known.
    global_batch: int | None
    #: Whether every rank's batch and accumulation were known (else an estimate).
    exact: bool
    #: Learning rate of optimizer 0, group 0, at the rank's first hyperparameters (lowest
    #: rank that reported one): what the run was started with, before any schedule moved it.
    lr: float | None
    #: The same group's learning rate in its newest hyperparameters (a scheduler's last).
    lr_last: float | None
    #: The highest rate that group had in the hyperparameters seen (a warm-up's peak,
    #: sampled every 8 steps, so it can read a little under the true peak).
    lr_peak: float | None
    #: Distinct learning rates across optimizer 0's parameter groups.
    lr_groups: int
    optimizer: str
    script: str
    #: Ranks of one DDP group: the world size unless DDP runs over subgroups, where
    #: the global batch is one group's (a model-parallel pair shares its batch).
    dp_size: int = 0

    @property
    def per_rank_batch(self) -> int | None:
        values = list(self.batch_by_rank.values())
        return int(statistics.median_low(values)) if values else None

    @property
    def accumulation(self) -> int | None:
        values = list(self.accumulation_by_rank.values())
        return int(statistics.median_low(values)) if values else None

    def text(self) -> str:
        """``global batch 64 = 32 per rank x 2 ranks · lr 0.05`` (empty when nothing is known)."""
        parts = []
        if self.global_batch is not None:
            accum = self.accumulation or 1
            ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
            if 0 < self.dp_size < self.world_size:
                ranks = f"{self.dp_size} ranks of one DDP group ({self.world_size} in all)"
            how = f"{self.per_rank_batch} per rank x {ranks}"
            if accum > 1:
                how += f" x {accum} accumulation steps"
            approx = "" if self.exact else "~"
            parts.append(f"global batch {approx}{self.global_batch} = {how}")
        if self.lr is not None:
            groups = f" (group 0 of {self.lr_groups} rates)" if self.lr_groups > 1 else ""
            moved = self.lr_last is not None and self.lr_last != self.lr
            now = f" → {self.lr_last:g}" if moved else ""
            top, ends = self.lr_peak, max(self.lr, self.lr_last or 0.0)
            # A warm-up: the rate rose above both ends, and the top is the setting.
            peak = f", peak {top:g}" if top is not None and top > ends else ""
            parts.append(f"lr {self.lr:g}{now}{peak}{groups}")
        return " · ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "dp_size": self.dp_size or self.world_size,
            "per_rank_batch": self.per_rank_batch,
            "accumulation": self.accumulation,
            "global_batch": self.global_batch,
            "exact": self.exact,
            "lr": self.lr,
            "lr_last": self.lr_last,
            "lr_peak": self.lr_peak,
            "lr_groups": self.lr_groups,
            "optimizer": self.optimizer,
            "summary": self.text(),
        }


def one_model(view: RankView) -> bool:
    """Whether the rank attached a single DDP model (a GAN attaches two)."""
    return len(view.infos) <= 1 and view.other_model_steps == 0


def _accumulation(view: RankView) -> int | None:
    """Micro-batches per optimizer step: the most common over the recent ones.

    Counted per optimizer step, not per step message: a script that accumulates
    without ``no_sync()`` closes a step at every synced backward, one micro-batch
    each, and only the last of a cycle has its ``optimizer.step()``
    (``accumulation.py``). A rank with more than one attached model (a GAN),
    or none whose optimizer ddpscope sees, is counted per step message.
    """
    # From the newest end of the deque: copying a 2,048-step history per rank per redraw
    # would cost more than the rest of a header.
    recent = list(itertools.islice(reversed(view.steps), ACCUM_STEPS))
    recent.reverse()
    per_opt: Counter[int] = Counter()
    if one_model(view):
        # A cycle cut short at the window's old end is not counted.
        whole = bool(recent) and recent[0].step == 0
        pending = 0
        for s in recent:
            pending += max(0, s.micro_batches)
            if s.optimizer_steps > 0:
                if whole and pending > 0:
                    per_opt[pending] += 1
                whole = True
                pending = 0
    if per_opt:
        return per_opt.most_common(1)[0][0]
    counts = Counter(s.micro_batches for s in recent if s.micro_batches > 0)
    return counts.most_common(1)[0][0] if counts else None


def _learning_rate(run: RunState) -> tuple[float | None, float | None, float | None, int, str]:
    """(first, newest, highest) lr of optimizer 0's group 0, its distinct group rates, its class.

    The first is what comparisons between runs use: a run read to its end has
    its scheduler's last rate, one read live its first, and both started alike.
    """
    for r in sorted(run.ranks):
        view = run.ranks[r]
        last = group_rates(view.hparams)
        if last:
            first = group_rates(view.first_hparams) or last
            name = str(first_optimizer(view.hparams).get("type", "")).rsplit(".", 1)[-1]
            return first[0], last[0], view.lr_peak, len(set(first)), name
    return None, None, None, 0, ""


def training_setup(run: RunState) -> TrainingSetup:
    """Global batch and learning rate as far as the messages tell; cheap enough per redraw."""
    world = run.world_size or len(run.ranks)
    batches: dict[int, int] = {}
    accums: dict[int, int] = {}
    script = ""
    for r, view in run.ranks.items():
        if view.batch is not None and view.batch.size > 0:
            batches[r] = view.batch.size
        a = _accumulation(view)
        if a is not None:
            accums[r] = a
        if not script and view.info is not None:
            script = view.info.script
    global_batch: int | None = None
    exact = False
    dp = dp_size(run) or world
    if batches:
        ranks = run.expected_ranks()
        complete = all(r in batches and r in accums for r in ranks) and len(ranks) == world
        if dp < world and ranks:
            ranks = list(dp_group(run, ranks[0])) or ranks
        if complete:
            global_batch = sum(batches[r] * accums[r] for r in ranks if r in batches)
            exact = True
        else:
            per = statistics.median_low(list(batches.values()))
            accum = statistics.median_low(list(accums.values())) if accums else 1
            global_batch = int(per * accum * max(1, dp))
    lr, lr_last, lr_peak, groups, optimizer = _learning_rate(run)
    return TrainingSetup(
        world_size=world,
        batch_by_rank=batches,
        accumulation_by_rank=accums,
        global_batch=global_batch,
        exact=exact,
        lr=lr,
        lr_last=lr_last,
        lr_peak=lr_peak,
        lr_groups=groups,
        optimizer=optimizer,
        script=script,
        dp_size=dp,
    )
