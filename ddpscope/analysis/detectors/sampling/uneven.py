"""``uneven_inputs``: a rank that runs fewer steps than the others and leaves them waiting.

Predicted at the first step of a training loader from the ranks'
``len(loader)`` where they differ (exact, whatever batch sampler shards the
data: accelerate's ``even_batches=False``, a bucketing one), else from their
``len(sampler)``. The batch size is not in the telemetry, so the number
of samples one step consumes, U, is bracketed instead: after ``s`` steps of a
pass of ``e`` samples ``U <= (e-1) // (s-1)`` (the first s-1 batches were full),
and a finished pass of ``c`` samples in ``s`` steps gives ``U >= ceil(c / s)``
(not under gradient accumulation). Before any step, U is at most the smallest
rank's ``e`` (every rank gets at least one full batch). A rank surely runs fewer
steps when ``ceil(e / U)`` and ``floor(e / U)`` (drop_last either way) are below
the largest rank's for every U in the bracket; with a wide bracket the
sufficient test ``e_max - e >= U_max`` is used. Only for stock batch samplers:
bucketing ones make steps unrelated to samples. Confirmed (error) when a rank
moves on from a pass (its next trained pass, or its exit) after fewer steps
than another rank has already run in the corresponding pass, or exits while
another still has more than a step of data to go; only a normal exit counts
(a rank that raised or was stopped ends its pass early for another reason,
which ``rank_exit`` reports). Under ``Join`` (steps with ``Step.join``, or a
heartbeat with ``join_shadow`` > 0 or phase "join") the imbalance is handled:
the finding is info, saying that Join is handling it.

Passes and their step counts come from the pass ledger (sampling/ledger.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis.detectors.sampling.ledger import (
    KEEP_ORDINALS,
    PASS_MESSAGES,
    STOCK_BATCH_SAMPLERS,
    LedgerDetector,
    PassLedger,
    PassRec,
)
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import by_value, nth, ranks_phrase
from ddpscope.schema import End, Heartbeat, Message, SamplerPass, Step

#: Widest samples-per-step interval checked value by value when predicting steps.
MAX_EXACT_SPAN = 256
UNEVEN_FIX = (
    "Give every rank the same number of batches: shard with DistributedSampler (it pads every "
    "rank to the same length; drop_last=True trims instead), or cut every rank's shard to the "
    "shortest one; or run the loop under `torch.distributed.algorithms.join.Join([model])` so "
    "ranks that run out shadow the others' all-reduces."
)


@dataclass
class _Ordinal:
    """The k-th trained pass of one loader, on every rank."""

    #: rank -> its pass (steps so far), len(sampler), steps once it moved on.
    recs: dict[int, PassRec] = field(default_factory=dict)
    expected: dict[int, int] = field(default_factory=dict)
    #: rank -> len(batch_sampler), where the rank knows it.
    batches: dict[int, int] = field(default_factory=dict)
    finals: dict[int, int] = field(default_factory=dict)
    #: Running extremes, so that a step is checked in O(1).
    lo: int = -1
    hi: int = -1
    most_steps: int = 0
    fewest_final: int | None = None
    most_final: int = -1
    confirmed: bool = False

    def counts(self) -> dict[int, int]:
        return {r: rec.steps for r, rec in sorted(self.recs.items())}


@dataclass
class _UnevenIssue:
    loader: int
    step: int
    epoch: int
    short: list[int] = field(default_factory=list)
    predicted: str = ""
    predicted_at: int = -1
    confirmed: str = ""
    ordinal: int = -1
    expected: dict[int, int] = field(default_factory=dict)
    pass_steps: dict[int, int] = field(default_factory=dict)
    batches: dict[int, int] = field(default_factory=dict)
    #: Short rank -> the job's step count when it ran out of the confirmed pass.
    ran_out: dict[int, int] = field(default_factory=dict)
    bound: int = 0
    signature: Any = None


@dataclass
class _UnevenRun:
    ledger: PassLedger
    #: loader -> (lowest, highest) samples one step may consume, learnt from steps.
    bounds: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    ordinals: dict[int, dict[int, _Ordinal]] = field(default_factory=dict)
    issues: dict[int, _UnevenIssue] = field(default_factory=dict)
    #: rank -> all-reduces it shadowed under Join.
    joined: dict[int, int] = field(default_factory=dict)
    #: Ranks whose steps ran inside a Join context (Step.join).
    join_steps: set[int] = field(default_factory=set)


class UnevenInputsDetector(LedgerDetector[_UnevenRun]):
    kinds: tuple[str, ...] = ("uneven_inputs",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (Heartbeat, *PASS_MESSAGES)

    new_run = _UnevenRun

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if isinstance(msg, Heartbeat):
            self._heartbeat(run, msg, book)
            return
        if not isinstance(msg, PASS_MESSAGES):
            return
        st = self._state(run)
        if type(msg) is Step and msg.join and msg.rank not in st.join_steps:
            self._joined_step(st, msg.rank, book)
        ledger = st.ledger
        events = ledger.update(msg)
        if type(msg) is End and msg.reason != "exit":
            # A rank that crashed or was stopped ends its pass early for a reason that is
            # not its data: rank_exit reports it; counting it here would call it uneven.
            return
        for ev in events:
            rec = ev.rec
            if ev.kind == "rank_end":
                self._exited(st, ledger, ev.rank, book)
            elif rec is None or rec.begin is None:
                continue
            elif ev.kind == "first_step":
                self._trained(st, rec, book)
            elif ev.kind == "step":
                self._stepped(st, rec, book)
            elif ev.kind == "final":
                self._final(st, rec, book)
            elif ev.kind == "end":
                self._exhausted(st, rec, book)

    def _state(self, run: RunState) -> _UnevenRun:
        st = self._run(run.run_id)
        return st

    def _table(self, st: _UnevenRun, rec: PassRec) -> _Ordinal:
        tables = st.ordinals.setdefault(rec.loader, {})
        table = tables.get(rec.ordinal)
        if table is None:
            table = tables[rec.ordinal] = _Ordinal()
            for k in sorted(tables)[:-KEEP_ORDINALS]:
                del tables[k]
        return table

    def _trained(self, st: _UnevenRun, rec: PassRec, book: FindingBook) -> None:
        assert rec.begin is not None
        table = self._table(st, rec)
        e = rec.begin.expected
        table.recs[rec.rank] = rec
        if e >= 0:
            table.expected[rec.rank] = e
            table.lo = e if table.lo < 0 else min(table.lo, e)
            table.hi = max(table.hi, e)
        if rec.begin.batches >= 0:
            table.batches[rec.rank] = rec.begin.batches
        if not self._predict_batches(st, rec, table, book):
            self._predict(st, rec, table, book)

    def _learn(self, st: _UnevenRun, rec: PassRec, final: bool) -> bool:
        """Narrow the samples-per-step interval from this pass; True when it changed."""
        b = rec.begin
        if b is None or b.batch_sampler_type not in STOCK_BATCH_SAMPLERS or rec.steps < 1:
            return False
        lo, hi = st.bounds.get(rec.loader, (1, None))
        samples = rec.drawn if final else b.expected
        if rec.steps >= 2 and samples > 0:
            # The first s-1 steps took full batches and the s-th at least one more
            # sample: (s-1) * U < e (with drop_last too).
            bound = max(1, (samples - 1) // (rec.steps - 1))
            hi = bound if hi is None else min(hi, bound)
        end = rec.end
        if final and end is not None and end.complete and end.count > 0 and rec.micro == rec.steps:
            # s steps held all c drawn samples: s * U >= c. Not under gradient
            # accumulation, where a trailing micro-batch joins the next step.
            lo = max(lo, -(-end.count // rec.steps))
        if (lo, hi) == st.bounds.get(rec.loader, (1, None)):
            return False
        st.bounds[rec.loader] = (lo, hi)
        return True

    # prediction from len(sampler) --------------------------------------------------

    @staticmethod
    def _fewer_steps(e: int, big: int, lo: int, hi: int) -> bool:
        """Whether ``e`` samples surely make fewer steps than ``big`` for every U in
        [lo, hi], rounding up (drop_last=False) and down (drop_last=True) alike."""
        if e == 0:
            return big > 0
        if hi - lo > MAX_EXACT_SPAN:
            return big - e >= hi  # a multiple of any U <= hi lies in [e, big)
        return all(-(-big // u) > -(-e // u) and big // u > e // u for u in range(lo, hi + 1))

    def _predict_batches(
        self, st: _UnevenRun, rec: PassRec, table: _Ordinal, book: FindingBook
    ) -> bool:
        """Exact, for any batch sampler: the ranks' ``len(loader)`` differ. True when told."""
        b = rec.begin
        assert b is not None
        counts = table.batches
        if len(counts) < 2 or len(set(counts.values())) < 2:
            return False
        told = st.issues.get(rec.loader)
        if told is not None and told.predicted and told.predicted_at != rec.ordinal:
            return True  # predicted from an earlier pass: later epochs repeat it
        most = max(counts.values())
        short = sorted(r for r, n in counts.items() if n < most)
        gap = most - min(counts.values())
        issue = self._issue(st, rec.loader, b)
        if not issue.confirmed:
            issue.short = short
            issue.expected = dict(sorted(table.expected.items()))
        issue.batches = dict(sorted(counts.items()))
        issue.predicted_at = rec.ordinal
        issue.predicted = (
            f"ranks get different numbers of batches per epoch (len(loader): {by_value(counts)}); "
            f"{ranks_phrase(short)} will run out of batches up to {gap} step(s) before the others"
        )
        self._publish(st, issue, book)
        return True

    def _predict(self, st: _UnevenRun, rec: PassRec, table: _Ordinal, book: FindingBook) -> None:
        b = rec.begin
        assert b is not None
        if len(table.expected) < 2 or table.lo == table.hi:
            return
        if len(set(table.batches.values())) > 1:
            return  # told exactly, from the batch counts
        if table.batches and len(table.batches) == len(table.expected):
            return  # every rank gets the same number of batches: steps agree
        if b.batch_sampler_type not in STOCK_BATCH_SAMPLERS:
            return  # bucketing batch samplers: samples say nothing about steps
        told = st.issues.get(rec.loader)
        if told is not None and told.predicted and told.predicted_at != rec.ordinal:
            return  # predicted from an earlier pass: later epochs repeat it
        lo_u, learnt = st.bounds.get(rec.loader, (1, None))
        # Nothing learnt yet: assume the smallest rank gets at least one full batch.
        hi_u = learnt if learnt is not None else max(1, table.lo)
        if lo_u > hi_u:
            return  # batch sizes that vary: no prediction
        big = table.hi
        fewer = {e: self._fewer_steps(e, big, lo_u, hi_u) for e in set(table.expected.values())}
        short = sorted(r for r, e in table.expected.items() if fewer[e])
        if not short:
            return
        if table.lo == 0:
            why = f"{ranks_phrase(short)} will get no batch at all"
        elif learnt is not None:
            span = f"{lo_u}-{hi_u}" if lo_u < hi_u else f"{hi_u}"
            why = (
                f"each step consumes {span} samples (measured), so {ranks_phrase(short)} will run "
                f"out of batches at least one step before the others"
            )
        else:
            why = (
                f"unless one batch holds more than {table.lo} samples (the smallest rank's "
                f"whole epoch), {ranks_phrase(short)} will run out of batches at least one step "
                f"before the others"
            )
        issue = self._issue(st, rec.loader, b)
        if not issue.confirmed:
            issue.short = short
            issue.expected = dict(sorted(table.expected.items()))
        issue.bound = hi_u
        issue.predicted_at = rec.ordinal
        issue.predicted = (
            f"ranks draw different numbers of samples per epoch ({by_value(table.expected)}); {why}"
        )
        self._publish(st, issue, book)

    # confirmation from step counts -------------------------------------------------

    def _stepped(self, st: _UnevenRun, rec: PassRec, book: FindingBook) -> None:
        tables = st.ordinals.get(rec.loader)
        table = tables.get(rec.ordinal) if tables is not None else None
        if table is None:
            return
        table.most_steps = max(table.most_steps, rec.steps)
        # Steps only sharpen a prediction where the ranks' sample counts differ.
        if table.lo != table.hi and self._learn(st, rec, final=False):
            self._predict(st, rec, table, book)
        fewest = table.fewest_final
        if fewest is not None and rec.steps > fewest and not table.confirmed:
            self._confirm(st, rec, table, book)

    def _final(self, st: _UnevenRun, rec: PassRec, book: FindingBook) -> None:
        tables = st.ordinals.get(rec.loader)
        table = tables.get(rec.ordinal) if tables is not None else None
        if table is None:
            return
        n = table.finals[rec.rank] = rec.steps
        fewest = table.fewest_final
        table.fewest_final = n if fewest is None else min(fewest, n)
        table.most_final = max(table.most_final, n)
        if self._learn(st, rec, final=True):
            self._predict(st, rec, table, book)
        # A confirmed pass is refreshed as ranks finish it, so the final counts show.
        if table.most_steps > table.fewest_final or table.confirmed:
            self._confirm(st, rec, table, book)

    def _confirm(self, st: _UnevenRun, rec: PassRec, table: _Ordinal, book: FindingBook) -> None:
        assert rec.begin is not None
        counts = table.counts()
        low = min(table.finals.values())
        longer = {r: n for r, n in counts.items() if n > low}
        if not longer:
            return
        short = sorted(r for r, n in table.finals.items() if n == low)
        so_far = " so far" if any(r not in table.finals for r in longer) else ""
        text = (
            f"in the {nth(rec.ordinal)} training pass {ranks_phrase(short)} moved on after "
            f"{low} step(s) while the others ran more{so_far} ({by_value(longer)})"
        )
        self._confirmed(st, rec, table, short, text, book)

    def _confirmed(
        self,
        st: _UnevenRun,
        rec: PassRec,
        table: _Ordinal,
        short: list[int],
        text: str,
        book: FindingBook,
    ) -> None:
        """Tell the pass of ``rec`` uneven for certain, ``short`` the ranks that ran out."""
        assert rec.begin is not None
        table.confirmed = True
        issue = self._issue(st, rec.loader, rec.begin)
        if issue.confirmed and issue.ordinal != rec.ordinal:
            return  # the first uneven pass tells the story; later ones repeat it
        issue.ordinal = rec.ordinal
        issue.short = short
        issue.ran_out = _ran_out(table, short)
        issue.expected = dict(sorted(table.expected.items()))
        issue.pass_steps = table.counts()
        issue.confirmed = text
        self._publish(st, issue, book)

    def _exhausted(self, st: _UnevenRun, rec: PassRec, book: FindingBook) -> None:
        """A rank drew every batch of a trained pass while another has more batches to go.

        Certain from the batch counts alone: the rank is out of data for this
        pass, whatever it does next (its next epoch's first collective, an
        evaluation, its exit), while the other still has a batch to train on.
        """
        end = rec.end
        if end is None or not end.complete or rec.ordinal < 0 or rec.steps < 1:
            return
        table = st.ordinals.get(rec.loader, {}).get(rec.ordinal)
        mine = table.batches.get(rec.rank) if table is not None else None
        if table is None or mine is None or table.confirmed:
            return
        more = {}
        for r, n in table.batches.items():
            other = table.recs.get(r)
            if r == rec.rank or n <= mine or other is None:
                continue
            if other.end is None or (other.end.complete and other.steps > rec.steps):
                more[r] = n
        if not more:
            return
        short = sorted(r for r, n in table.batches.items() if n == mine)
        text = (
            f"in the {nth(rec.ordinal)} training pass {ranks_phrase(short)} drew all {mine} of "
            f"{'its' if len(short) == 1 else 'their'} batches while {ranks_phrase(more)} still "
            f"had more ({by_value(more)})"
        )
        self._confirmed(st, rec, table, short, text, book)

    def _exited(self, st: _UnevenRun, ledger: PassLedger, rank: int, book: FindingBook) -> None:
        """A rank exits while another still has more than a step of data in its pass."""
        mine = ledger.ranks.get(rank)
        if mine is None:
            return
        for loader, rec in mine.last_trained.items():
            if rec.begin is None or rec.steps < 2 or rec.drawn <= 0:
                continue
            learnt = st.bounds.get(loader, (1, None))[1]
            bound = (rec.drawn - 1) // (rec.steps - 1)
            bound = bound if learnt is None else min(learnt, bound)
            waiting: dict[int, int] = {}
            for r, rp in ledger.ranks.items():
                other = rp.last_trained.get(loader)
                if r == rank or rp.ended or other is None or other.ordinal != rec.ordinal:
                    continue
                left = other.begin.expected - rec.drawn if other.begin is not None else 0
                if other.end is None and left >= max(1, bound):
                    waiting[r] = rec.drawn + left
            issue = st.issues.get(loader)
            if not waiting or (issue is not None and issue.confirmed):
                continue
            issue = self._issue(st, loader, rec.begin)
            issue.ordinal = rec.ordinal
            issue.short = [rank]
            issue.confirmed = (
                f"{ranks_phrase([rank])} exited after {rec.steps} steps of the {nth(rec.ordinal)} "
                f"training pass ({rec.drawn} samples) while {ranks_phrase(waiting)} still had more "
                f"than a step of data in that pass ({by_value(waiting)} samples): they wait "
                f"in all-reduce for a rank that is gone"
            )
            self._publish(st, issue, book)

    def _joined_step(self, st: _UnevenRun, rank: int, book: FindingBook) -> None:
        st.join_steps.add(rank)
        for issue in st.issues.values():
            self._publish(st, issue, book)

    def _heartbeat(self, run: RunState, msg: Heartbeat, book: FindingBook) -> None:
        if msg.join_shadow <= 0 and msg.phase != "join":
            return
        st = self._state(run)
        if st.joined.get(msg.rank, -1) >= msg.join_shadow:
            return
        st.joined[msg.rank] = msg.join_shadow
        for issue in st.issues.values():
            self._publish(st, issue, book)

    # publishing ----------------------------------------------------------------------

    @staticmethod
    def _issue(st: _UnevenRun, loader: int, b: SamplerPass) -> _UnevenIssue:
        issue = st.issues.get(loader)
        if issue is None:
            issue = st.issues[loader] = _UnevenIssue(loader, b.step, b.epoch)
        return issue

    @staticmethod
    def _publish(st: _UnevenRun, issue: _UnevenIssue, book: FindingBook) -> None:
        joined = dict(sorted(st.joined.items()))
        under_join = bool(joined or st.join_steps)
        # Join is the documented way to train on uneven inputs: then the imbalance is
        # handled, worth knowing (the ranks that run out idle), not a fault.
        severity = "info" if under_join else ("error" if issue.confirmed else "warning")
        parts = [p for p in (issue.predicted, issue.confirmed) if p]
        message = f"Loader {issue.loader} has uneven inputs: " + "; ".join(parts) + "."
        if under_join:
            shadowed = sum(joined.values())
            if joined:
                how = f"{ranks_phrase(joined)}" + (
                    f" shadowed {shadowed} all-reduces" if shadowed else " joined"
                )
            else:
                how = f"the steps of {ranks_phrase(st.join_steps)} ran inside Join"
            message += (
                f" Join is handling them ({how}): the ranks that run out shadow the others' "
                "collectives, so the run does not hang."
            )
        else:
            message += (
                " Ranks that finish an epoch first move on (next epoch, evaluation, exit) while "
                "the others still wait in all-reduce: the job hangs, or pairs all-reduces of "
                "different steps."
            )
        evidence: dict[str, Any] = {
            "loader": issue.loader,
            "samples_per_epoch": {str(r): e for r, e in issue.expected.items()},
            "max_samples_per_step": issue.bound or None,
            "confirmed": bool(issue.confirmed),
        }
        if issue.ran_out:
            evidence["ran_out_at_step"] = {str(r): n for r, n in issue.ran_out.items()}
        if issue.batches:
            evidence["batches_per_epoch"] = {str(r): n for r, n in issue.batches.items()}
        if issue.pass_steps:
            evidence["pass"] = issue.ordinal
            evidence["steps_in_pass"] = {str(r): n for r, n in issue.pass_steps.items()}
        if joined:
            evidence["join_shadow"] = {str(r): n for r, n in joined.items()}
        if under_join:
            evidence["join"] = True
        signature = (severity, tuple(issue.short), message, tuple(issue.pass_steps.items()))
        if signature == issue.signature:
            return
        issue.signature = signature
        finding = book.raise_or_update(
            f"loader{issue.loader}",
            Finding(
                kind="uneven_inputs",
                severity=severity,
                ranks=list(issue.short),
                step=issue.step,
                epoch=issue.epoch,
                message=message,
                fix=UNEVEN_FIX,
                evidence=evidence,
            ),
        )
        # Join turns a would-be hang into handled imbalance. The book only ever raises a
        # severity, so lower it here.
        book.set_severity(finding, severity)


def _ran_out(table: _Ordinal, short: list[int]) -> dict[int, int]:
    """The job's step count at which each short rank ran out of the pass."""
    out = {}
    for r in short:
        rec = table.recs.get(r)
        if rec is not None and rec.first_step >= 0:
            out[r] = rec.first_step + rec.steps
    return out
