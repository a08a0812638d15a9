"""Weight fingerprints: bit-exact digests, the check schedule, hyperparameters."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpscope.hooks import fingerprint as fpmod
from ddpscope.hooks.fingerprint import (
    BATCH_MIN,
    BLOCK,
    MAX_IN_FLIGHT,
    EventTransfer,
    Fingerprinter,
    digest_tensors,
    hparams,
    hparams_key,
)

U64 = 1 << 64
MASK = U64 - 1

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.complex64,
]
# Sizes around the block edge and past several chunks (tests use chunk=BLOCK).
SIZES = [1, 2, 3, 7, 255, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5]


def digest(t: torch.Tensor, **kw: Any) -> int:
    return digest_tensors([t], **kw).values()[0]


def random_tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Arbitrary bits of ``dtype`` (NaNs included), built from random bytes."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1  # a bool byte other than 0/1 is not a real bool
    return raw.view(dtype)


def flip_bit(t: torch.Tensor, element: int, bit: int) -> torch.Tensor:
    u = t.clone()
    size = t.element_size()
    u.view(torch.uint8)[element * size + bit // 8] ^= 1 << (bit % 8)
    return u


# --- the digest ----------------------------------------------------------------


def test_equal_values_in_different_storage_give_equal_digests() -> None:
    t = torch.linspace(-3, 3, 5000)
    big = torch.zeros(7000)
    big[1000:6000] = t  # same values at a storage offset inside another tensor
    same = [t.clone(), torch.tensor(t.tolist()), big[1000:6000], t.detach().requires_grad_()]
    want = digest(t)
    assert [digest(x) for x in same] == [want] * len(same)
    assert digest(t, chunk=BLOCK) == want  # chunking bounds memory, never the result


def test_batched_small_tensors_digest_as_they_do_alone() -> None:
    ts = [torch.arange(n, dtype=torch.float32) * 0.5 for n in (1, 5, BLOCK, 17, 3)]
    assert len(ts) >= BATCH_MIN
    assert digest_tensors(ts).values() == [digest(t) for t in ts]


def test_flipping_a_bit_changes_only_that_tensors_digest_in_a_batch() -> None:
    ts = [torch.full((n,), 1.5) for n in (3, 4, 5, 6, 7)]
    before = digest_tensors(ts).values()
    ts[2] = flip_bit(ts[2], 4, 0)
    after = digest_tensors(ts).values()
    assert [a != b for a, b in zip(before, after, strict=True)] == [
        False,
        False,
        True,
        False,
        False,
    ]


@settings(max_examples=120, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.sampled_from(SIZES),
    seed=st.integers(0, 2**31),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 127),
)
def test_any_single_bit_flip_changes_the_digest(
    dtype: torch.dtype, n: int, seed: int, where: float, bit: int
) -> None:
    t = random_tensor(dtype, n, seed)
    bits = 1 if dtype == torch.bool else 8 * t.element_size()
    flipped = flip_bit(t, int(where * n), bit % bits)
    # Alone (single or chunked path) and among small neighbours (batched path).
    assert digest(flipped, chunk=BLOCK) != digest(t, chunk=BLOCK)
    pad = [torch.zeros(2, dtype=dtype)] * BATCH_MIN
    assert digest_tensors([*pad, flipped]).values()[-1] == digest(flipped)


def test_negative_zero_and_zero_differ() -> None:
    assert torch.equal(torch.tensor([-0.0]), torch.tensor([0.0]))  # why == is not enough
    assert digest(torch.tensor([-0.0])) != digest(torch.tensor([0.0]))


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(DTYPES[:4]), n=st.sampled_from([2, 3, 64, BLOCK + 1]))
def test_sign_and_exponent_only_changes_of_many_elements_change_the_digest(
    dtype: torch.dtype, n: int
) -> None:
    # Differences confined to high bits are the weak spot of any product hash
    # mod 2**64; int64 words made these collide (always, or 1 in 4096).
    t = torch.linspace(1, 2, n, dtype=dtype)
    assert len({digest(t), digest(-t), digest(2 * t), digest(0.5 * t)}) == 4


def test_nan_payloads_differ() -> None:
    a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert a.isnan().item() and b.isnan().item()
    assert digest(a) != digest(b)
    assert digest(a) == digest(a.clone())


def test_shape_and_dtype_are_part_of_the_digest() -> None:
    t = torch.arange(12, dtype=torch.float32)
    assert len({digest(t), digest(t.view(3, 4)), digest(t.view(4, 3))}) == 3
    assert digest(t) != digest(t.view(torch.int32))  # same bits, other dtype
    assert digest(torch.empty(0)) != digest(torch.empty(0, 3))
    assert digest(torch.tensor(1.0)) != digest(torch.tensor([1.0]))


def test_transposed_view_digests_like_its_contiguous_copy() -> None:
    a = torch.arange(6 * BLOCK, dtype=torch.float32).view(6, BLOCK)
    for view in (a.t(), a[:, ::3], torch.tensor(2.5).expand(3, 5)):
        assert not view.is_contiguous()
        assert digest(view) == digest(view.contiguous())
        assert digest(view, chunk=BLOCK) == digest(view.contiguous())


def test_conjugate_view_digests_its_values() -> None:
    z = torch.tensor([1 + 2j, -3 - 0.5j], dtype=torch.complex64)
    assert digest(z.conj()) == digest(z.conj().resolve_conj())
    assert digest(z.conj()) != digest(z)


def test_digests_are_unsigned_64_bit() -> None:
    ts = [torch.full((3,), float(i)) for i in range(64)] + [torch.empty(0)]
    values = digest_tensors(ts).values()
    assert all(type(v) is int and 0 <= v < U64 for v in values)
    assert any(v >= 1 << 63 for v in values)  # not squeezed into int64's range
    assert len(set(values)) == len(values)


def _reference(t: torch.Tensor) -> int:
    """The hash exactly as the module docstring defines it, in plain Python."""

    def fmix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    size = t.element_size()
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[min(size, 4)]
    words = t.contiguous().flatten().view(word).tolist()
    raw = 0
    for j, v in enumerate(words):
        b, i = divmod(j, BLOCK)
        w = fmix(((i + 1) * 0x9E3779B97F4A7C15) & MASK) | 1
        k = fmix((b * 0xD1B54A32D192ED03) & MASK) | 1
        raw = (raw + v * w * k) & MASK
    text = f"{t.dtype}|{tuple(t.shape)}".encode()
    meta = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return fmix(raw ^ meta)


def test_digest_matches_its_definition() -> None:
    ts = [
        torch.linspace(-1, 1, 2 * BLOCK + 3).view(-1, 1),
        torch.tensor([-1, 127], dtype=torch.int8),
        torch.tensor([[True, False]]),
        torch.tensor([1 + 1j, -2j], dtype=torch.complex128),
        torch.arange(9, dtype=torch.int64) - 4,
        torch.empty(0, 2, dtype=torch.float16),
    ]
    assert digest_tensors(ts).values() == [_reference(t) for t in ts]


def test_digesting_modifies_no_tensor_grad_or_rng_state() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, BLOCK + 1), torch.nn.BatchNorm1d(BLOCK + 1))
    model(torch.ones(4, 8)).sum().backward()
    tensors = [*model.parameters(), *model.buffers()]
    grads = [(p.grad, p.grad.clone()) for p in model.parameters() if p.grad is not None]
    versions = [t._version for t in tensors]
    copies = [t.detach().clone() for t in tensors]
    rng = torch.get_rng_state()

    digest_tensors(tensors).values()

    assert [t._version for t in tensors] == versions
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies, strict=True))
    assert all(p.requires_grad for p in model.parameters())
    assert [p.grad for p in model.parameters()] == [g for g, _ in grads]  # same objects
    assert all(torch.equal(g, c) for g, c in grads)
    assert torch.equal(torch.get_rng_state(), rng)


# --- finiteness of the parameters ------------------------------------------------


def test_parameters_holding_nan_or_inf_are_listed_in_input_order() -> None:
    ts = [torch.randn(5), torch.tensor([1.0, -math.inf]), torch.randn(BLOCK * 3 + 7)]
    ts[2][BLOCK + 9] = math.nan
    ts.append(torch.tensor([math.nan], dtype=torch.float64))
    assert digest_tensors(ts, finite=range(len(ts))).nonfinite() == [1, 2, 3]


def test_only_the_tensors_named_are_tested() -> None:
    ts = [torch.zeros(3), torch.full((4, 4), -math.inf).triu(1)]
    assert digest_tensors(ts, finite={0}).nonfinite() == []
    assert digest_tensors(ts, finite={0, 1}).nonfinite() == [1]
    assert digest_tensors(ts).nonfinite() == []


def test_the_fingerprinter_tests_trained_parameters_not_frozen_ones_or_buffers() -> None:
    # A mask of -inf is a buffer, or a frozen Parameter, on purpose.
    mask = torch.full((4, 4), -math.inf).triu(1)
    params = [
        torch.nn.Parameter(torch.ones(3)),
        torch.nn.Parameter(mask.clone(), requires_grad=False),
    ]
    fp = Fingerprinter(params, [mask])
    fp.start(0, "initial")
    got = fp.poll(force=True)
    assert got is not None and got["nonfinite"] == []
    with torch.no_grad():
        params[0][1] = math.nan
    fp.start(1, "interval")
    got = fp.poll(force=True)
    assert got is not None and got["nonfinite"] == [0]


def test_large_finite_half_precision_tensors_are_finite() -> None:
    # Their own sum overflows fp16 (65504) and bf16 is coarse: summed in float32.
    big = [torch.full((100_000,), 60_000.0, dtype=d) for d in (torch.float16, torch.bfloat16)]
    assert digest_tensors(big, finite={0, 1}).nonfinite() == []
    big[0][77] = math.inf
    big[1][5] = math.nan
    assert digest_tensors(big, finite={0, 1}).nonfinite() == [0, 1]


def test_complex_and_batched_small_parameters_are_tested() -> None:
    small = [torch.randn(3) for _ in range(BATCH_MIN + 2)]  # hashed as one batch
    small[2][1] = math.inf
    cplx = torch.randn(4, dtype=torch.complex64)
    cplx[3] = complex(0.0, math.nan)
    ts = [*small, cplx, torch.arange(3), torch.zeros(0)]  # integers and empties: not tested
    assert digest_tensors(ts, finite=range(len(ts))).nonfinite() == [2, len(small)]


@pytest.mark.parametrize("grouped", [False, True], ids=["sums-cpu", "foreach-norms-gpu"])
def test_both_ways_of_testing_agree_on_every_dtype(grouped: bool) -> None:
    # The grouped way is the one devices other than the CPU take; it runs on the CPU too.
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    ts = [torch.full((70_000,), 60_000.0, dtype=d) for d in dtypes for _ in range(2)]
    for i, bad in ((1, math.nan), (2, math.inf), (7, -math.inf)):
        ts[i][123] = bad
    flags = fpmod._nonfinite_flags(ts, grouped=grouped).tolist()
    assert flags == [0, 1, 1, 0, 0, 0, 0, 1]


def test_testing_finiteness_changes_no_digest() -> None:
    ts = [torch.randn(7), torch.tensor([math.nan]), torch.randn(BLOCK + 3).half()]
    assert digest_tensors(ts, finite={0, 1, 2}).values() == digest_tensors(ts).values()


def test_meta_tensors_are_refused() -> None:
    with pytest.raises(TypeError, match="meta"):
        digest_tensors([torch.empty(3, device="meta")])


# --- the device path, with a fake event -------------------------------------------


class FakeEvents:
    """Stands in for torch.cuda.Event: completes only when the test says so."""

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []

    def new(self) -> FakeEvent:
        ev = FakeEvent()
        self.events.append(ev)
        return ev

    def complete(self) -> None:
        for ev in self.events:
            ev.done = True

    def transfer(self, _device: torch.device) -> EventTransfer:
        return EventTransfer(self.new, stream=None, pin=False)


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.recorded = 0
        self.waited = 0

    def record(self, stream: Any = None) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True

    def elapsed_time(self, end_event: Any) -> float:
        return 2.5  # ms


@pytest.fixture
def events() -> Iterator[FakeEvents]:
    yield FakeEvents()


def test_event_transfer_is_not_ready_until_its_event_completes(events: FakeEvents) -> None:
    ts = [torch.arange(5.0), torch.arange(BLOCK * 2 + 1.0)]
    pending = digest_tensors(ts, transfer=events.transfer)
    start, end = events.events
    assert (start.recorded, end.recorded) == (1, 1)  # one copy and one event per device
    assert not pending.ready()
    assert not pending.ready()
    events.complete()
    assert pending.ready()
    assert pending.values() == digest_tensors(ts).values()
    assert end.waited == 0  # polling never blocked
    assert pending.device_ns() == 2_500_000


def test_values_before_ready_waits_on_the_event_only(events: FakeEvents) -> None:
    pending = digest_tensors([torch.ones(3)], transfer=events.transfer)
    assert pending.values() == [digest(torch.ones(3))]
    assert events.events[1].waited == 1


def test_poll_returns_nothing_until_the_copy_lands(events: FakeEvents) -> None:
    params = [torch.ones(4), torch.arange(10.0)]
    buffers = [torch.zeros(2, dtype=torch.int64)]
    fp = Fingerprinter(params, buffers, transfer=events.transfer)
    fp.start(3, "interval")
    assert fp.poll() is None
    assert fp.poll() is None
    events.complete()
    got = fp.poll()
    assert got is not None
    assert set(got) == {"step", "reason", "params", "buffers", "cost_ns", "nonfinite"}
    assert (got["step"], got["reason"]) == (3, "interval")
    assert got["params"] == digest_tensors(params).values()
    assert got["buffers"] == digest_tensors(buffers).values()
    assert fp.device_ns == 2_500_000
    assert fp.poll() is None


def test_nonfinite_flags_travel_in_the_same_copy_as_the_digests(events: FakeEvents) -> None:
    values = [torch.ones(4), torch.tensor([1.0, math.nan]), torch.arange(BLOCK * 2 + 1.0)]
    params = [torch.nn.Parameter(v) for v in values]
    fp = Fingerprinter(params, [], transfer=events.transfer)
    fp.start(4, "interval")
    assert len(events.events) == 2  # still one copy and one event pair
    assert fp.poll() is None
    events.complete()
    got = fp.poll()
    assert got is not None and got["nonfinite"] == [1]
    assert got["params"] == digest_tensors(params).values()


def test_forced_poll_waits_for_the_event(events: FakeEvents) -> None:
    fp = Fingerprinter([torch.ones(2)], [], transfer=events.transfer)
    fp.start(9, "final")
    got = fp.poll(force=True)
    assert got is not None and got["step"] == 9
    assert events.events[1].waited == 1


# --- the Fingerprinter ----------------------------------------------------------


def fake_clock(cost_ns: int) -> Any:
    """A clock under which every start() costs exactly ``cost_ns``."""
    ticks = iter(range(0, 10**15, cost_ns))
    return lambda: next(ticks)


def due_steps(fp: Fingerprinter, steps: range, median_ns: int) -> list[tuple[int, str]]:
    out = []
    for s in steps:
        if fp.due(s, median_ns):
            out.append((s, fp.pending_reason))
            fp.start(s, fp.pending_reason)
            fp.poll()
    return out


def test_poll_reports_params_and_buffers_separately_with_host_cost() -> None:
    params = [torch.ones(3), torch.arange(5000.0)]
    buffers = [torch.zeros(1), torch.tensor(7)]
    fp = Fingerprinter(params, buffers, clock=fake_clock(1234))
    fp.start(0, "initial")
    got = fp.poll()
    assert got == {
        "step": 0,
        "reason": "initial",
        "params": digest_tensors(params).values(),
        "buffers": digest_tensors(buffers).values(),
        "cost_ns": 1234,
        "nonfinite": [],
    }
    assert fp.poll() is None


def test_results_come_back_in_start_order() -> None:
    p = torch.zeros(3)
    fp = Fingerprinter([p], [])
    fp.start(1, "interval")
    p += 1  # the next check sees the new weights
    fp.start(2, "final")
    first, second = fp.poll(), fp.poll()
    assert first is not None and second is not None
    assert (first["step"], second["step"]) == (1, 2)
    assert first["params"] != second["params"]


def test_explicit_every_checks_multiples_of_n() -> None:
    fp = Fingerprinter([torch.ones(2)], [], every=3)
    got = due_steps(fp, range(10), median_ns=1)
    assert got == [(0, "initial"), (3, "interval"), (6, "interval"), (9, "interval")]


def test_every_minus_one_checks_only_on_request() -> None:
    fp = Fingerprinter([torch.ones(2)], [], every=-1)
    assert due_steps(fp, range(5), median_ns=1_000_000) == []
    fp.request()
    assert due_steps(fp, range(5, 9), median_ns=1_000_000) == [(5, "request")]


def test_request_makes_only_the_next_due_true() -> None:
    fp = Fingerprinter([torch.ones(2)], [], every=100)
    fp.start(0, "initial")
    fp.poll()
    fp.request()
    fp.request()  # two requests before a step are one check
    assert fp.due(41, 1) and fp.pending_reason == "request"
    assert not fp.due(42, 1)


def test_automatic_mode_checks_first_to_measure_the_cost() -> None:
    fp = Fingerprinter([torch.ones(2)], [], clock=fake_clock(1000))
    assert fp.interval(1_000_000) is None  # nothing measured yet
    assert fp.due(5, 0) and fp.pending_reason == "initial"


def test_automatic_interval_keeps_the_cost_under_budget() -> None:
    # 2 ms per check, 100 ms steps, 0.5 % budget: at most one check in 4 steps.
    fp = Fingerprinter([torch.ones(2)], [], clock=fake_clock(2_000_000))
    got = due_steps(fp, range(13), median_ns=100_000_000)
    assert got == [(0, "initial"), (4, "interval"), (8, "interval"), (12, "interval")]
    assert fp.interval(100_000_000) == 4
    assert fp.interval(0) is None  # no step time yet: no periodic checks


@settings(max_examples=200, deadline=None)
@given(
    cost=st.integers(1, 10**10),
    median=st.integers(1, 10**10),
    budget=st.floats(1e-4, 0.5),
)
def test_automatic_interval_is_the_smallest_power_of_two_within_budget(
    cost: int, median: int, budget: float
) -> None:
    fp = Fingerprinter([], [], budget=budget)
    fp.host_ns = cost
    n = fp.interval(median)
    assert n is not None and n & (n - 1) == 0  # ranks that differ still share steps
    allowed = budget * median
    assert n >= math.ceil(cost / allowed)
    assert n == 1 or n // 2 < math.ceil(cost / allowed)


@settings(max_examples=100, deadline=None)
@given(cost=st.integers(1, 10**8), median=st.integers(10**5, 10**9), steps=st.integers(1, 300))
def test_between_checks_due_answers_as_asking_at_every_step_would(
    cost: int, median: int, steps: int
) -> None:
    # The reference asks next_reason() at every step, as due() did before it
    # learnt to skip the steps between two interval checks.
    quick = Fingerprinter([torch.ones(2)], [], clock=fake_clock(cost))
    asked = Fingerprinter([torch.ones(2)], [], clock=fake_clock(cost))
    want = []
    for s in range(steps):
        reason = asked.next_reason(s, median)
        if reason is not None:
            want.append((s, reason))
            asked.start(s, reason)
            asked.poll()
    assert due_steps(quick, range(steps), median) == want


def test_a_shorter_interval_takes_effect_within_eight_steps() -> None:
    # 2 ms per check: 0.5% of 25 ms steps is one check in 16, of 100 ms one in 4.
    fp = Fingerprinter([torch.ones(2)], [], clock=fake_clock(2_000_000))
    early = due_steps(fp, range(0, 20), median_ns=25_000_000)
    assert early == [(0, "initial"), (16, "interval")]
    later = due_steps(fp, range(20, 40), median_ns=100_000_000)
    # The quiet stretch after 17 ends at the next multiple of 8: 24 is checked.
    assert [s for s, _ in later] == [24, 28, 32, 36]
    fp.request()
    assert fp.due(41, 100_000_000) and fp.pending_reason == "request"


def costs_clock(costs_ns: list[int]) -> Any:
    """A clock under which the k-th start() costs ``costs_ns[k]`` (the last one after)."""
    stamps = []
    t = 0
    for c in costs_ns:
        stamps += [t, t + c]
        t += c
    ticks = itertools.chain(stamps, itertools.count(t, costs_ns[-1]))
    return lambda: next(ticks)


def test_a_slow_first_check_does_not_set_the_interval_alone() -> None:
    # The first check builds the hash's tables: 40 ms once, 2 ms after. At 25 ms
    # steps 40 ms alone meant one check in 512; a second comes by step 16.
    fp = Fingerprinter([torch.ones(2)], [], clock=costs_clock([40_000_000, 2_000_000]))
    assert due_steps(fp, range(0, 40), median_ns=25_000_000) == [
        (0, "initial"),
        (16, "interval"),
        (32, "interval"),
    ]


def test_one_check_that_reads_long_does_not_push_the_next_ones_out() -> None:
    # Preempted once (30 ms instead of 2): the interval stays that of 2 ms.
    costs = [2_000_000, 2_000_000, 30_000_000, 2_000_000]
    fp = Fingerprinter([torch.ones(2)], [], clock=costs_clock(costs))
    steps = [s for s, _ in due_steps(fp, range(0, 70), median_ns=25_000_000)]
    assert steps == [0, 16, 32, 48, 64]


def test_device_time_counts_when_longer_than_host_time() -> None:
    fp = Fingerprinter([], [])
    fp.host_ns, fp.device_ns = 1_000, 4_000_000
    assert fp.interval(100_000_000) == 8  # from 4 ms, not 1 us


def test_periodic_checks_pause_while_too_many_are_in_flight(events: FakeEvents) -> None:
    fp = Fingerprinter([torch.ones(2)], [], every=1, transfer=events.transfer)
    for s in range(MAX_IN_FLIGHT):
        assert fp.due(s, 1)
        fp.start(s, fp.pending_reason)
    assert not fp.due(MAX_IN_FLIGHT, 1)
    fp.request()
    assert fp.due(MAX_IN_FLIGHT, 1)  # an explicit ask is never dropped
    events.complete()
    assert fp.poll() is not None
    assert fp.due(MAX_IN_FLIGHT + 1, 1)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError):
        Fingerprinter([], [], every=-2)
    with pytest.raises(ValueError):
        Fingerprinter([], [], budget=0)


# --- hyperparameters --------------------------------------------------------------


def _param() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2))]


def test_hparams_of_sgd_with_momentum() -> None:
    opt = torch.optim.SGD(_param(), lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True)
    (entry,) = hparams([opt])
    assert entry["type"] == "torch.optim.sgd.SGD"
    (group,) = entry["groups"]
    assert group["lr"] == 0.1 and group["momentum"] == 0.9
    assert group["weight_decay"] == 1e-4 and group["dampening"] == 0.0
    assert group["nesterov"] == 1.0
    assert "params" not in group and "foreach" not in group  # None is not a number
    assert all(type(v) is float for v in group.values())


def test_hparams_of_adam_flatten_betas_per_group() -> None:
    opt = torch.optim.Adam(_param(), lr=1e-3, betas=(0.8, 0.99), eps=1e-6)
    opt.add_param_group({"params": _param(), "lr": 5e-4})
    (entry,) = hparams([opt])
    assert entry["type"] == "torch.optim.adam.Adam"
    first, second = entry["groups"]
    assert (first["beta1"], first["beta2"], first["eps"]) == (0.8, 0.99, 1e-6)
    assert "betas" not in first
    assert (first["lr"], second["lr"]) == (1e-3, 5e-4)


def test_hparams_read_a_tensor_lr_as_a_float() -> None:
    opt = torch.optim.Adam(_param(), lr=torch.tensor(0.01), foreach=False)
    assert hparams([opt])[0]["groups"][0]["lr"] == pytest.approx(0.01)


def test_other_tuples_flatten_with_indices() -> None:
    opt = torch.optim.Rprop(_param(), etas=(0.4, 1.3), step_sizes=(1e-6, 50))
    group = hparams([opt])[0]["groups"][0]
    assert (group["etas0"], group["etas1"]) == (0.4, 1.3)
    assert (group["step_sizes0"], group["step_sizes1"]) == (1e-6, 50.0)


def test_hparams_key_changes_exactly_when_hparams_change() -> None:
    lr = torch.tensor(0.01)
    adam = torch.optim.Adam(_param(), lr=lr, foreach=False)
    sgd = torch.optim.SGD(_param(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    key = hparams_key([adam, sgd])
    assert hparams_key([adam, sgd]) == key
    sgd.step()
    sched.step()  # float lr replaced
    assert hparams_key([adam, sgd]) != key
    key = hparams_key([adam, sgd])
    lr.fill_(0.02)  # tensor lr changed in place: same object, new value
    assert hparams_key([adam, sgd]) != key


def test_hparams_key_ignores_the_parameters_themselves() -> None:
    scalar = torch.nn.Parameter(torch.tensor(1.0))  # one element: reads like a tensor lr
    opt = torch.optim.SGD([scalar], lr=0.1)
    key = hparams_key([opt])
    with torch.no_grad():
        scalar.add_(1)
    assert hparams_key([opt]) == key


def test_module_does_not_depend_on_python_hash_seed() -> None:
    # The per-(dtype, shape) salt must come from a fixed hash, not hash().
    assert fpmod._meta(torch.ones(2)) == int.from_bytes(
        hashlib.blake2b(b"torch.float32|(2,)", digest_size=8).digest(), "little"
    )
