"""Findings that explain each other: which finding is the consequence of which.

One fault often trips several detectors. A rank with more batches than the
others (``uneven_inputs``) runs an extra forward at the end, whose buffer
broadcast nobody answers, which is exactly what ``rank0_only_collective``
looks for; the rank with fewer batches exits first, which ``rank_exit``
reports. Shown side by side as errors, they send the user to fix code they do
not have. Each rule here recognises one such pattern from the findings alone
and links the consequence to its cause (:meth:`FindingBook.explain`): the
consequence stays in the book, updated by its own detector, but is shown as
info with a note naming the cause, and the cause's fix.

The rules:

- ``uneven_inputs`` explains a ``rank0_only_collective`` of the ranks with more
  batches when the unanswered collective is a DDP forward's buffer broadcast
  (the extra forward), or when every rank that did not issue it is a rank that
  ran out of batches; and a ``rank_exit`` whose ranks all exited normally and
  are the ones that ran out (confirmed uneven inputs); and, without Join, the
  mismatch at the end of the short ranks' data: a ``rank0_only_collective``
  or a ``hang`` where the short ranks wait in a collective after their loop
  while the others wait in their next training step (the buffer broadcast or
  the gradient all-reduce), and the ``rank_exit`` of ranks that then raised
  (the collective timeout); and a ``hyperparam_mismatch`` whose ranks split
  exactly as their batches (or samples) per epoch do: a learning-rate
  schedule sized from ``len(loader)`` runs at another pace on each.
- ``rank_exit`` of a rank that raised or was killed explains a
  ``rank0_only_collective`` of ranks blocked in a collective whose missing
  partners had all stopped so already when it was raised: they wait for a
  rank that is gone. (Partners that were waiting elsewhere and died later of
  the collective timeout are the mismatch's consequence, not its cause.)
- ``straggler`` explains a ``hang`` episode that resumed by itself, when the
  rank behind in it is that straggler: the others waited for it, once longer.
- ``forward_bypasses_ddp`` explains the parameters' ``desync`` that followed
  steps trained with no forward through DDP: no gradient was all-reduced.
- ``hyperparam_mismatch`` explains the same model's parameters' ``desync``
  when it was found no later and names every rank the desync does: the
  ranks applied different updates to the same averaged gradients.

Rules run when the book changed (its version moved), after the detectors,
from :class:`ddpscope.analysis.engine.Analysis`. A link whose rule no longer
holds is undone, and the finding stands on its own again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import ranks_phrase
from ddpscope.schema import DDP_BUFFERS


class Want(NamedTuple):
    """A link a rule asks for."""

    cause: tuple[str, str]
    note: str
    severity: str = "info"
    fix: str = ""


Key = tuple[str, str]
Rule = Callable[[RunState, FindingBook], dict[Key, Want]]


def _ranks_of(evidence_map: object) -> set[int]:
    """Ranks named by the keys of an evidence map ({"0": ..., "2": ...})."""
    if not isinstance(evidence_map, dict):
        return set()
    out = set()
    for k in evidence_map:
        try:
            out.add(int(k))
        except (TypeError, ValueError):
            continue
    return out


def uneven_inputs_rule(run: RunState, book: FindingBook) -> dict[Key, Want]:
    out: dict[Key, Want] = {}
    for u in book.of_kind("uneven_inputs"):
        short = set(u.ranks)
        if not short:
            continue
        cause = (u.kind, u.key)
        loader = u.evidence.get("loader", "?")
        fix = f"Fix the cause, the uneven inputs: {u.fix}"
        for c in book.of_kind("rank0_only_collective"):
            named = set(c.ranks)
            if not named or named & short or (c.kind, c.key) in out:
                continue
            extra_forward = c.evidence.get("op") == DDP_BUFFERS
            missing = _ranks_of(c.evidence.get("others"))
            if not extra_forward and not (missing and missing <= short):
                continue
            what = (
                "extra forward broadcasts DDP's buffers"
                if extra_forward
                else "collective comes in a step"
            )
            out[(c.kind, c.key)] = Want(
                cause,
                f"Caused by uneven_inputs (loader {loader}): {ranks_phrase(short)} ran out of "
                f"batches first, so {ranks_phrase(named)}'s {what} that the others never run; it "
                "is not a collective issued on some ranks by the script.",
                fix=fix,
            )
        _ran_out_mismatch(book, u, short, cause, loader, fix, out)
        _paced_by_loader(book, u, cause, loader, fix, out)
        r = book.get("rank_exit", "run")
        if r is None or not u.evidence.get("confirmed") or not r.ranks:
            continue
        stopped = r.evidence.get("stopped")
        if _raised_on_running_out(u, r, short):
            out.setdefault(
                (r.kind, r.key),
                Want(
                    cause,
                    f"Caused by uneven_inputs (loader {loader}): {ranks_phrase(set(r.ranks))} "
                    "raised in the first step after running out of batches: its next collective "
                    "met the others' training all-reduce, a collective of another size, so it "
                    "received the wrong data or failed.",
                    fix=fix,
                ),
            )
            continue
        if (
            set(r.ranks) <= short
            and isinstance(stopped, dict)
            and stopped
            and all(isinstance(s, dict) and s.get("how") == "exit" for s in stopped.values())
        ):
            out.setdefault(
                (r.kind, r.key),
                Want(
                    cause,
                    f"Caused by uneven_inputs (loader {loader}): {ranks_phrase(set(r.ranks))} "
                    "ran out of batches and finished while the others still had data.",
                    fix=fix,
                ),
            )
    return out


def _paced_by_loader(
    book: FindingBook, u: Finding, cause: Key, loader: object, fix: str, out: dict[Key, Want]
) -> None:
    """A schedule sized from ``len(loader)`` (total steps, warm-up, cosine length) runs at
    another pace on ranks with other loader lengths: a ``hyperparam_mismatch`` whose ranks
    split exactly as their batches (or samples) per epoch do is that, not a rank's own
    setting."""
    per_rank = u.evidence.get("batches_per_epoch") or u.evidence.get("samples_per_epoch")
    if not isinstance(per_rank, dict) or len(set(per_rank.values())) < 2:
        return
    length = {int(q): n for q, n in per_rank.items() if str(q).isdigit()}
    for h in book.of_kind("hyperparam_mismatch"):
        if (h.kind, h.key) in out or not _split_alike(h.evidence.get("values"), length):
            continue
        what = "batches" if u.evidence.get("batches_per_epoch") else "samples"
        sizes = "; ".join(
            f"{n} on {ranks_phrase(sorted(q for q, m in length.items() if m == n))}"
            for n in sorted(set(length.values()))
        )
        out[(h.kind, h.key)] = Want(
            cause,
            f"Caused by uneven_inputs (loader {loader}): {h.key} differs across ranks just as "
            f"their {what} per epoch do ({sizes}): a schedule sized from len(loader) (its total "
            "steps, its warm-up) runs at another pace on each.",
            fix=fix,
        )


def _split_alike(groups: object, length: dict[int, object]) -> bool:
    """Whether the value groups of a ``hyperparam_mismatch`` (two or more, each listed
    whole) split the ranks exactly as ``length`` does: one length per group, a length
    for no other group."""
    if not isinstance(groups, list) or len(groups) < 2:
        return False
    seen: set[object] = set()
    for g in groups:
        ranks = g.get("ranks") if isinstance(g, dict) else None
        if not isinstance(ranks, list) or not ranks or g.get("count") != len(ranks):
            return False  # a group listed in part (a large world): not judged
        lengths = {length.get(q) for q in ranks}
        if len(lengths) != 1 or None in lengths or lengths <= seen:
            return False
        seen |= lengths
    return True


def _raised_on_running_out(u: Finding, r: Finding, short: set[int]) -> bool:
    """Every rank named raised within a step of running out of batches (not under Join).

    Its next collective (the next epoch's, an evaluation's) is paired with
    the others' gradient all-reduce: gloo hands it another collective's bytes
    ("Invalid mt19937 state" from accelerate's RNG broadcast) or a size error.
    """
    ran_out = u.evidence.get("ran_out_at_step")
    stopped = r.evidence.get("stopped")
    if u.evidence.get("join") or not isinstance(ran_out, dict) or not isinstance(stopped, dict):
        return False
    if not stopped or not set(r.ranks) <= short:
        return False
    for q, s in stopped.items():
        limit = ran_out.get(q)
        if not isinstance(s, dict) or s.get("how") != "exception" or not isinstance(limit, int):
            return False
        step = s.get("step")
        if not isinstance(step, int) or not limit <= step <= limit + 1:
            return False
    return True


def _in_training(op: object) -> bool:
    """A collective every step of the training loop runs (as the blocked maps name them)."""
    return op in (DDP_BUFFERS, "allreduce", "all-reduce", "broadcast (DDP buffers)")


def _training_wait(w: object) -> bool:
    """A hang's ``where`` entry waiting in a training step's collective."""
    if not isinstance(w, dict):
        return False
    coll = w.get("collective")
    return w.get("phase") == "allreduce" or (isinstance(coll, dict) and coll.get("class") == "ddp")


def _after_loop_wait(w: object) -> bool:
    """A hang's ``where`` entry waiting in a collective of the script's own."""
    return isinstance(w, dict) and w.get("phase") == "collective" and not _training_wait(w)


def _ran_out_mismatch(
    book: FindingBook,
    u: Finding,
    short: set[int],
    cause: Key,
    loader: object,
    fix: str,
    out: dict[Key, Want],
) -> None:
    """Without Join, the ranks that ran out wait in their own next collective (the end of
    the job's barrier, the next epoch's first step) while the others wait in their next
    training step: one mismatch, reported as a stuck collective, a hang and the timeout
    errors it ends in. Each is the uneven inputs' consequence."""
    if u.evidence.get("join"):
        return
    mismatch = False
    for c in book.of_kind("rank0_only_collective"):
        blocked = c.evidence.get("blocked")
        if not isinstance(blocked, dict) or (c.kind, c.key) in out:
            continue
        ranks = _ranks_of(blocked)
        ops = {int(q): v.get("op") for q, v in blocked.items() if isinstance(v, dict)}
        ran_out, long_ = ranks & short, ranks - short
        if ranks and not long_ and not any(_in_training(ops.get(q)) for q in ranks):
            # Only the ranks that ran out are blocked in it; the ranks that never
            # issued it (named in "others") are the ones still training.
            long_ = _ranks_of(c.evidence.get("others"))
            if not long_ or long_ & short:
                continue
        elif not (
            ran_out
            and long_
            and all(_in_training(ops.get(q)) for q in long_)
            and not any(_in_training(ops.get(q)) for q in ran_out)
        ):
            continue
        mismatch = True
        out[(c.kind, c.key)] = Want(
            cause,
            f"Caused by uneven_inputs (loader {loader}): {ranks_phrase(ran_out)} ran out "
            f"of batches and went on to the code after the loop, while {ranks_phrase(long_)} "
            f"still train{'s' if len(long_) == 1 else ''}: their collectives no longer "
            "match.",
            fix=fix,
        )
    h = book.get("hang", "run")
    where = h.evidence.get("where") if h is not None else None
    if h is not None and isinstance(where, dict) and (h.kind, h.key) not in out:
        ranks = _ranks_of(where)
        long_ = ranks - short

        ran_out = ranks & short
        if (
            long_
            and ran_out
            and all(_training_wait(where.get(str(q))) for q in long_)
            and all(_after_loop_wait(where.get(str(q))) for q in ran_out)
        ):
            mismatch = True
            out[(h.kind, h.key)] = Want(
                cause,
                f"Caused by uneven_inputs (loader {loader}): {ranks_phrase(ran_out)} ran out of "
                f"batches and wait{'s' if len(ran_out) == 1 else ''} in a collective after "
                f"the loop that {ranks_phrase(long_)}, still training, never "
                f"issue{'s' if len(long_) == 1 else ''}.",
                fix=fix,
            )
    r = book.get("rank_exit", "run")
    if not mismatch or r is None or (r.kind, r.key) in out or h is None:
        return
    stopped = r.evidence.get("stopped")
    if (
        isinstance(stopped, dict)
        and stopped
        and all(isinstance(v, dict) and v.get("how") == "exception" for v in stopped.values())
        and 0 <= h.raised_ns <= r.raised_ns
    ):
        out[(r.kind, r.key)] = Want(
            cause,
            f"Caused by uneven_inputs (loader {loader}): {ranks_phrase(set(r.ranks))} failed after "
            "the mismatch the uneven inputs caused (see hang): the collective timed out.",
            fix=fix,
        )


def crash_rule(run: RunState, book: FindingBook) -> dict[Key, Want]:
    r = book.get("rank_exit", "run")
    if r is None or not r.active:
        return {}
    stopped = r.evidence.get("stopped")
    if not isinstance(stopped, dict):
        return {}
    gone = {
        int(q)
        for q, s in stopped.items()
        if isinstance(s, dict) and s.get("how") in ("exception", "vanished") and q.isdigit()
    }
    if not gone:
        return {}
    out: dict[Key, Want] = {}
    for c in book.of_kind("rank0_only_collective"):
        others = c.evidence.get("others")
        missing = _ranks_of(others)
        named = set(c.ranks)
        # The partners must have been gone already when the ranks were found blocked: a
        # rank that was waiting elsewhere and only then died of the collective timeout is
        # a consequence of the mismatch, not its cause.
        already = isinstance(others, dict) and all(
            str(v).startswith("ended (") for v in others.values()
        )
        if already and missing and missing <= gone and named and not named & gone:
            out[(c.kind, c.key)] = Want(
                (r.kind, r.key),
                f"Caused by rank_exit: {ranks_phrase(missing)} stopped (see rank_exit), so "
                f"{ranks_phrase(named)} wait{'s' if len(named) == 1 else ''} in a collective for a "
                "rank that is gone.",
                fix=f"Fix the first failure: {r.fix}",
            )
    return out


def straggler_rule(run: RunState, book: FindingBook) -> dict[Key, Want]:
    h = book.get("hang", "run")
    if h is None or h.active or h.evidence.get("resolved") != "progress resumed":
        return {}
    if len(h.ranks) != 1:
        return {}
    s: Finding | None = book.get("straggler", str(h.ranks[0]))
    if s is None:
        return {}
    return {
        (h.kind, h.key): Want(
            (s.kind, s.key),
            f"Caused by the straggler: rank {h.ranks[0]}, behind in this stall, is the "
            "persistently slow rank (see straggler); the others waited for it, once longer.",
        )
    }


def bypass_rule(run: RunState, book: FindingBook) -> dict[Key, Want]:
    d = book.get("desync", "params")
    b = book.get("forward_bypasses_ddp", "model:0")
    if d is None or b is None or b.step > d.step or b.evidence.get("averaged_by_hand"):
        return {}
    return {
        (d.kind, d.key): Want(
            (b.kind, b.key),
            "Caused by forward_bypasses_ddp: the loop trains without a forward through the "
            "DDP model, so no gradient was all-reduced and each rank's replica went its own way.",
            fix=f"Fix the cause: {b.fix}",
        )
    }


def hparams_rule(run: RunState, book: FindingBook) -> dict[Key, Want]:
    want: dict[Key, Want] = {}
    for d in book.of_kind("desync"):
        what, _, model = d.key.partition(":")
        if what != "params":
            continue
        prefix = f"model {model} " if model else ""
        minority = set(d.evidence.get("minority_ranks") or d.ranks)
        for h in sorted(book.of_kind("hyperparam_mismatch"), key=lambda f: f.step):
            mine = h.key.startswith(prefix) if prefix else not h.key.startswith("model ")
            if mine and h.step <= d.step and minority <= set(h.ranks):
                want[(d.kind, d.key)] = Want(
                    (h.kind, h.key),
                    f"Caused by hyperparam_mismatch ({h.key}): the ranks apply different "
                    "updates to the same averaged gradients, so their replicas drift apart.",
                    fix=f"Fix the cause: {h.fix}",
                )
                break
    return want


#: In order: the first rule that explains a finding gives its cause.
RULES: tuple[Rule, ...] = (
    uneven_inputs_rule,
    crash_rule,
    straggler_rule,
    bypass_rule,
    hparams_rule,
)


def link_causes(run: RunState, book: FindingBook, rules: tuple[Rule, ...] = RULES) -> None:
    """Bring the book's consequence links in line with what the rules find now."""
    want: dict[Key, Want] = {}
    for rule in rules:
        for found, w in rule(run, book).items():
            want.setdefault(found, w)
    for gone in set(book.links()) - set(want):
        book.unexplain(*gone)
    for (kind, key), w in want.items():
        book.explain(kind, key, w.cause, w.note, severity=w.severity, fix=w.fix)
    book.linked_version = book.version
