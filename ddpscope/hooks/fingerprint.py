"""Bit-exact fingerprints of a model's parameters and buffers, and its hyperparameters.

DDP keeps replicas identical only if every rank applies the same update; a
rank that drifted (a missed all-reduce, a non-deterministic kernel, a buffer
updated locally) is found by comparing one 64-bit digest per tensor across
ranks. The digests must therefore be exact functions of the raw bits, cheap
enough to take often, and must never perturb training.

The hash
--------
A tensor's bytes are read as integer *words* ``v_j`` in row-major order: 1-,
2- and 4-byte elements are one uint8 / int16 / int32 word, 8- and 16-byte
elements two or four int32 words; each word is widened to int64 (sign-extended,
uint8 zero-extended). With ``B = BLOCK`` words per block::

    w_i  = splitmix64((i + 1) * 0x9E3779B97F4A7C15) | 1      for i < B
    K_b  = splitmix64(b * 0xD1B54A32D192ED03) | 1            (K_0 = 1)
    raw  = sum_b K_b * sum_i v_{bB+i} * w_i                  (mod 2**64)
    hash = splitmix64(raw ^ blake2b64(f"{dtype}|{shape}"))

Why this shape:

* Every weight ``w_i * K_b`` is odd, so invertible mod 2**64: changing any
  one word by ``d != 0`` moves ``raw`` by ``d * w_i * K_b != 0``. A single
  changed element (one flipped bit, -0.0 vs 0.0, another NaN payload) changes
  the digest with certainty; the finaliser and the xor are bijections and
  cannot undo that.
* The weights look random instead of ``2j + 1``: with arithmetic weights, small
  structured differences (the +-1 ulp noise of a non-deterministic reduction
  on 1, 3, 5, 7 -> +1 -1 -1 +1) cancel exactly. Pseudo-random weights make
  multi-word collisions rare, and they are not powers of one base, which the
  Thue-Morse sequence breaks for any base mod 2**64.
* Words are at most 32 bits. A product mod 2**64 only carries bits upwards, so
  a difference confined to bits >= k of every word it touches keeps only
  64 - k bits of hash. With int64 words, negating two float64 values (bit 63)
  always collides and doubling a float64 tensor (bit 52) collides 1 in 4096;
  with int32 words the worst case (sign-only changes) is ~2**-33 and ordinary
  drift (low mantissa bits) ~2**-64. int16 words would bound it at 2**-49 but
  cost ~1.6x on float32 weights.
* Blocks make the digest independent of how the work is chunked (chunks are
  whole blocks), so temporary memory is bounded and the same tensor has the
  same digest on CPU and CUDA, with any chunk size.
* dtype and shape are mixed in, so an empty tensor, a reshaped one or the same
  bits under another dtype all differ.
* On the device only int64 multiplies, sums, prefix sums and differences do
  arithmetic; their wrap-around is what CPU and CUDA integer kernels do. Everything needing
  logical shifts runs on the host in Python ints (the finaliser) or once, with
  masks, when the weight tables are built. Nothing draws from an RNG and the
  tensors are only read (under ``no_grad``), so training is bit-identical with
  or without it.

Cost
----
Per large tensor: per chunk a multiply into a scratch buffer and a row sum,
then one combine into a slot of a per-device result vector. Small tensors
(one block) of a device and word type are hashed together in five launches,
whatever their number. Then ONE device-to-host copy per device per check. On
CUDA that copy goes into pinned memory behind a recorded event that the
caller polls from another thread: no synchronisation of the training stream.
:class:`Fingerprinter` measures the host-side cost (and on CUDA the device
time between two timing events) and, in automatic mode, picks the interval
so the cost stays under a share of the step time.

Limits: a non-contiguous tensor is copied first (a transient second copy
of it); a sparse tensor is hashed as its dense values; meta tensors are
refused. The first check on a device builds small weight tables (one blocking
host-to-device copy); later checks reuse them.

Finite weights
--------------
The same check also says which parameters hold a NaN or an inf (a diverged
run trains on, all ranks equally NaN, and equal digests say nothing). It
sums each trained floating parameter, in float32 at least so that a large
fp16 tensor of finite values cannot overflow: a NaN or an inf anywhere makes
the sum non-finite, and the finite weights of any real model sum far below
float32's range. On a GPU the same test is one multi-tensor L1-norm launch
per dtype (``_foreach_norm``) instead of a launch per parameter. The flags
ride in the digests' own device-to-host copy. A sum, not ``isfinite().all()``
or a max-abs norm: on a CPU core the sum adds 16-20% to a check
(benchmarks/fingerprint_cost.py), the others 1/2 to 3/4 of the hash; the
automatic interval, paced on the measured cost, absorbs it. Buffers and
frozen parameters are not tested: an attention mask of -inf is one of those
on purpose.

Long module: the hash, its device-to-host transfer and the Fingerprinter that paces
it are one design, and its derivation (this docstring) stays beside the code it
justifies.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "DeviceTransfer",
    "EventTransfer",
    "Fingerprinter",
    "PendingDigests",
    "default_transfer",
    "digest_tensors",
    "hparams",
    "hparams_key",
]

#: Words per block: part of the hash definition (changing it changes every
#: digest). Small enough that a tail block is cheap, large enough that the
#: per-block combine is a rounding error.
BLOCK = 4096

#: Default words per chunk (a multiple of BLOCK): bounds scratch memory. On
#: CPU a chunk that stays in L2 is fastest; on GPUs fewer, bigger launches win.
CHUNK_CPU = 1 << 18
CHUNK_DEVICE = 1 << 22

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_BLOCK_STEP = 0xD1B54A32D192ED03
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32, 16: torch.int32}


def _fmix64(z: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints that scrambles well."""
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK
    return z ^ (z >> 31)


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 torch accepts (same bits)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _fmix64_tensor(z: Tensor) -> Tensor:
    """:func:`_fmix64` on an int64 tensor, in place.

    torch's ``>>`` on int64 is arithmetic, so the copied-in sign bits are
    masked off to get the logical shift the finaliser needs.
    """
    for shift, mul in ((30, _MUL1), (27, _MUL2), (31, 0)):
        z ^= (z >> shift) & ((1 << (64 - shift)) - 1)
        if mul:
            z *= _signed(mul)
    return z


def _odd_mixed(start: Tensor, step: int) -> Tensor:
    z = start.mul_(_signed(step))
    return _fmix64_tensor(z).bitwise_or_(1)


# --- per-device weight tables --------------------------------------------------

_TABLE_LOCK = threading.Lock()
#: device -> (w[BLOCK], K[>= blocks seen]); read-only once published.
_TABLES: dict[torch.device, tuple[Tensor, Tensor]] = {}
#: Outgrown K tables stay alive: a check still queued on another stream may read
#: them, and the caching allocator only orders reuse within one stream.
_RETIRED: list[Tensor] = []


def _tables(device: torch.device, blocks: int) -> tuple[Tensor, Tensor]:
    got = _TABLES.get(device)
    if got is not None and got[1].numel() >= blocks:
        return got
    with _TABLE_LOCK, torch.no_grad():
        got = _TABLES.get(device)
        if got is not None and got[1].numel() >= blocks:
            return got
        if got is None:
            w = _odd_mixed(torch.arange(1, BLOCK + 1, dtype=torch.int64), _GOLDEN)
        else:
            w = got[0]
            _RETIRED.append(got[1])
        size = max(blocks, 64, 2 * got[1].numel() if got is not None else 0)
        k = _odd_mixed(torch.arange(size, dtype=torch.int64), _BLOCK_STEP)
        # A blocking host-to-device copy returns only once the data is on the
        # device, so any stream may read the tables afterwards.
        published = (w.to(device), k.to(device))
        _TABLES[device] = published
        return published


# --- per-tensor metadata ---------------------------------------------------------

_META: dict[tuple[torch.dtype, torch.Size], int] = {}


def _meta(t: Tensor) -> int:
    key = (t.dtype, t.shape)
    m = _META.get(key)
    if m is None:
        # Python's hash() of str is salted per process; ranks need the same bits.
        text = f"{t.dtype}|{tuple(t.shape)}".encode()
        m = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
        if len(_META) > 1 << 16:  # shapes of real models are few; bound odd callers
            _META.clear()
        _META[key] = m
    return m


def _words(t: Tensor) -> Tensor:
    """The raw bits of ``t`` as a 1-D integer tensor, in row-major order."""
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    word = _WORD.get(t.element_size())
    if word is None:
        raise TypeError(f"cannot fingerprint {t.dtype}: {t.element_size()}-byte elements")
    if not t.is_contiguous():
        t = t.contiguous()
    # flatten() of a 1-D tensor is the tensor itself: the cheap order for the
    # many 1-D parameters; wider elements must be flat before they split.
    return t.view(word).flatten() if word.itemsize == t.element_size() else t.flatten().view(word)


# --- host transfer ---------------------------------------------------------------


class DeviceTransfer(Protocol):
    """Brings one device's digest vector to the host, and says when it has arrived."""

    def finish(self, digests: Tensor) -> None:
        """Enqueue the copy of ``digests`` (int64, on the device) to the host."""

    def ready(self) -> bool:
        """True once :meth:`host` may be read; never blocks."""

    def wait(self) -> None:
        """Block this thread (only) until :meth:`ready`."""

    def host(self) -> Tensor:
        """The digests on the host; valid once ready."""

    def device_ns(self) -> int | None:
        """Device time the work took, when the device measures it; valid once ready."""


class _Event(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: Any) -> float: ...


class _HostTransfer:
    """Work on the host is done when it returns; a non-CPU device without events
    (MPS, XPU, ...) pays one blocking copy per check instead."""

    __slots__ = ("_host",)

    def __init__(self) -> None:
        self._host: Tensor | None = None

    def finish(self, digests: Tensor) -> None:
        self._host = digests.cpu()

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def host(self) -> Tensor:
        assert self._host is not None, "finish() was not called"
        return self._host

    def device_ns(self) -> int | None:
        return None


class EventTransfer:
    """The CUDA path: an async copy into (pinned) host memory behind an event.

    Events come from ``new_event`` so that tests can drive this exact logic on
    CPU with a fake event. The start event brackets the hashing kernels, which
    gives their device time for the interval policy.
    """

    __slots__ = ("_end", "_host", "_pin", "_src", "_start", "_stream")

    def __init__(self, new_event: Callable[[], _Event], stream: Any = None, pin: bool = True):
        self._stream = stream
        self._pin = pin
        self._start = new_event()
        self._end = new_event()
        self._start.record(stream)
        self._host: Tensor | None = None
        self._src: Tensor | None = None

    def finish(self, digests: Tensor) -> None:
        host = torch.empty(digests.shape, dtype=digests.dtype, pin_memory=self._pin)
        host.copy_(digests, non_blocking=True)
        self._end.record(self._stream)
        self._host = host
        # Held until the copy is known done; costs nothing and spares relying on
        # the caching allocator's stream ordering.
        self._src = digests

    def ready(self) -> bool:
        if self._src is None:
            return self._host is not None
        if not self._end.query():
            return False
        self._src = None
        return True

    def wait(self) -> None:
        if self._src is not None:
            self._end.synchronize()  # this event only: the training stream runs on
            self._src = None

    def host(self) -> Tensor:
        assert self._host is not None and self._src is None, "read before ready()"
        return self._host

    def device_ns(self) -> int | None:
        return int(self._start.elapsed_time(self._end) * 1e6)


#: Makes the transfer object of one device for one check.
TransferFactory = Callable[[torch.device], DeviceTransfer]


def default_transfer(device: torch.device) -> DeviceTransfer:
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        return EventTransfer(lambda: torch.cuda.Event(enable_timing=True), stream)
    return _HostTransfer()


# --- digests ---------------------------------------------------------------------


#: A device's share of one check: its transfer, the input index of each digest
#: slot, then the input index of each finiteness flag after them.
_Group = tuple[DeviceTransfer, list[int], list[int]]


class PendingDigests:
    """Digests of one check, possibly still travelling to the host."""

    __slots__ = ("_groups", "_metas", "_nonfinite", "_values")

    def __init__(self, metas: list[int], groups: list[_Group]):
        self._metas = metas
        self._groups = groups
        self._values: list[int] | None = None
        self._nonfinite: list[int] = []

    def __len__(self) -> int:
        return len(self._metas)

    def ready(self) -> bool:
        return all(tr.ready() for tr, _, _ in self._groups)

    def wait(self) -> None:
        for tr, _, _ in self._groups:
            tr.wait()

    def device_ns(self) -> int | None:
        """Longest device time of the devices involved (None on CPU); waits."""
        self.wait()
        times = [t for t in (tr.device_ns() for tr, _, _ in self._groups) if t is not None]
        return max(times) if times else None

    def values(self) -> list[int]:
        """One unsigned 64-bit digest per input tensor, in input order; waits if needed."""
        if self._values is None:
            self.wait()
            raw = [0] * len(self._metas)  # empty tensors never reach a device
            bad: list[int] = []
            for tr, idx, checked in self._groups:
                host = tr.host().tolist()
                for i, v in zip(idx, host[: len(idx)], strict=True):
                    raw[i] = v & _MASK
                bad.extend(i for i, v in zip(checked, host[len(idx) :], strict=True) if v)
            self._values = [_fmix64(r ^ m) for r, m in zip(raw, self._metas, strict=True)]
            self._nonfinite = sorted(bad)
        return self._values

    def nonfinite(self) -> list[int]:
        """Input indices of the checked tensors holding a NaN or an inf; waits if needed."""
        self.values()
        return self._nonfinite


#: A device's tensors of one word dtype and at most BLOCK words are hashed in
#: one batch from this many on: a handful of launches instead of two per tensor
#: (models have hundreds of biases, norms and BN statistics).
BATCH_MIN = 4

_BATCHES: dict[
    tuple[torch.device, torch.dtype, tuple[int, ...]], tuple[Tensor, Tensor, Tensor]
] = {}


def _batch_tables(
    device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """(a zero word, the weights of each tensor laid end to end after a 0, segment ends).

    Cached per layout: a model checks the same tensors every time.
    """
    key = (device, dtype, sizes)
    got = _BATCHES.get(key)
    if got is None:
        w = _tables(torch.device("cpu"), 1)[0]
        ends = [0]
        for n in sizes:
            ends.append(ends[-1] + n)
        with torch.no_grad():
            cpu = (
                torch.zeros(1, dtype=dtype),
                torch.cat([torch.zeros(1, dtype=torch.int64), *(w[:n] for n in sizes)]),
                torch.tensor(ends, dtype=torch.int64),
            )
        # Blocking copies, as for _tables: safe to read from any stream after.
        got = (cpu[0].to(device), cpu[1].to(device), cpu[2].to(device))
        if len(_BATCHES) > 256:
            _BATCHES.clear()
        _BATCHES[key] = got
    return got


def _digest_batch(words: list[Tensor], device: torch.device, out: Tensor) -> None:
    """Raw hashes of single-block word vectors of one dtype, into ``out``.

    Products are laid end to end behind a zero and prefix-summed; each hash is
    the difference of two prefix sums. Wrap-around makes that exact mod 2**64,
    and integer sums are deterministic in any order.
    """
    zero, w, ends = _batch_tables(device, words[0].dtype, tuple(v.numel() for v in words))
    cat = torch.cat([zero, *words])
    prefix = torch.mul(cat, w).cumsum_(0)
    at = prefix.index_select(0, ends)
    torch.sub(at[1:], at[:-1], out=out)


def _digest_device(
    items: list[tuple[int, Tensor]], device: torch.device, chunk: int
) -> tuple[Tensor, list[int]]:
    """Enqueue the raw hash of each (index, words) on ``device``.

    Returns the hashes as one int64 vector and the input index of each slot.
    """
    small: dict[torch.dtype, list[tuple[int, Tensor]]] = {}
    single: list[tuple[int, Tensor]] = []
    for item in items:
        if item[1].numel() <= BLOCK:
            small.setdefault(item[1].dtype, []).append(item)
        else:
            single.append(item)
    out = torch.empty(len(items), dtype=torch.int64, device=device)
    order: list[int] = []
    for group in small.values():
        if len(group) < BATCH_MIN:
            single.extend(group)
            continue
        _digest_batch([v for _, v in group], device, out[len(order) : len(order) + len(group)])
        order.extend(i for i, _ in group)
    if not single:
        return out, order
    longest = max(v.numel() for _, v in single)
    blocks = -(-longest // BLOCK)
    w, keys = _tables(device, blocks)
    buf = torch.empty(min(chunk, blocks * BLOCK), dtype=torch.int64, device=device)
    parts = torch.empty(blocks if blocks > 1 else 0, dtype=torch.int64, device=device)
    for i, v in single:
        slot = out[len(order)]
        order.append(i)
        n = v.numel()
        if n <= BLOCK:  # K_0 == 1: no combine needed
            torch.mul(v, w[:n], out=buf[:n])
            torch.sum(buf[:n], 0, out=slot)
            continue
        full = n - n % BLOCK
        b = 0
        for o in range(0, full, chunk):
            m = min(chunk, full - o) // BLOCK
            prod = buf[: m * BLOCK].view(m, BLOCK)
            torch.mul(v[o : o + m * BLOCK].view(m, BLOCK), w, out=prod)
            torch.sum(prod, 1, out=parts[b : b + m])
            b += m
        if full < n:
            r = n - full
            torch.mul(v[full:], w[:r], out=buf[:r])
            torch.sum(buf[:r], 0, out=parts[b])
            b += 1
        torch.sum(parts[:b].mul_(keys[:b]), 0, out=slot)
    return out, order


#: Dtypes summed in float32 to test finiteness (their own range overflows).
_SUM_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
_SUMMABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _finite_checked(t: Tensor) -> Tensor | None:
    """``t`` as a real floating tensor whose sum tests finiteness, or None (not checked)."""
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.dtype not in _SUMMABLE or t.layout != torch.strided or not t.numel():
        return None
    return t


def _nonfinite_flags(tensors: list[Tensor], grouped: bool) -> Tensor:
    """1 for each tensor holding a NaN or an inf, else 0, as int64 (see the module docstring).

    ``grouped`` (devices other than the CPU): one multi-tensor launch per dtype, the
    L1 norms, instead of one sum launched per parameter (hundreds in a real model). On
    the CPU that kernel is a loop of its own, and a sum costs less than half of it.
    """
    if not grouped:
        sums = [t.sum(dtype=_SUM_WIDER.get(t.dtype, t.dtype)) for t in tensors]
    else:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        sums = list(tensors)  # each slot replaced below
        for dtype, idx in by_dtype.items():
            norms = torch._foreach_norm(
                [tensors[i] for i in idx], 1, dtype=_SUM_WIDER.get(dtype, dtype)
            )
            for i, n in zip(idx, norms, strict=True):
                sums[i] = n
    return torch.stack(sums).isfinite().logical_not().long()  # stack promotes the dtypes


def digest_tensors(
    tensors: Sequence[Tensor],
    *,
    chunk: int | None = None,
    transfer: TransferFactory = default_transfer,
    finite: Collection[int] = (),
) -> PendingDigests:
    """Start digesting ``tensors`` on their own devices; see the module docstring.

    ``chunk`` (words, rounded down to a multiple of BLOCK) bounds the scratch
    memory per device; it does not change the digests. The tensors at the
    indices in ``finite`` are also tested for NaN and inf
    (:meth:`PendingDigests.nonfinite`).
    """
    metas = [_meta(t) for t in tensors]
    by_device: dict[torch.device, list[tuple[int, Tensor]]] = {}
    groups: list[_Group] = []
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if t.numel():
                by_device.setdefault(t.device, []).append((i, _words(t)))
        for device, items in by_device.items():
            if device.type == "meta":
                raise TypeError("cannot fingerprint tensors on the meta device: they hold no data")
            size = (
                chunk if chunk is not None else CHUNK_CPU if device.type == "cpu" else CHUNK_DEVICE
            )
            tr = transfer(device)
            digests, order = _digest_device(items, device, max(BLOCK, size - size % BLOCK))
            checked: list[int] = []
            summed: list[Tensor] = []
            for i, _ in items:
                real = _finite_checked(tensors[i]) if i in finite else None
                if real is not None:
                    checked.append(i)
                    summed.append(real)
            if summed:
                # One vector, one copy to the host: the flags follow the digests.
                flags = _nonfinite_flags(summed, grouped=device.type != "cpu")
                digests = torch.cat((digests, flags))
            tr.finish(digests)
            groups.append((tr, order, checked))
    return PendingDigests(metas, groups)


# --- the periodic fingerprinter ------------------------------------------------------

#: Periodic checks are skipped while this many are still in flight (a stalled
#: poller must not grow the queue without bound); requests and direct start()
#: calls are never skipped.
MAX_IN_FLIGHT = 8
#: A check's cost is the least of the last few: a check the scheduler preempted
#: (or a GC pause inside it) only reads longer, and one such reading set the
#: interval alone (a 3-rank CPU job: one rank's first check read 6x the others',
#: so it checked at step 0 and 96 only, and a desync at step 5 waited for the end).
COST_SAMPLES = 3
#: The first check also builds the hash's weight tables: until a second one is
#: measured, checks come at least this often (a power of two: ranks stay aligned).
FIRST_INTERVAL_MAX = 16


class Fingerprinter:
    """Fingerprints one model's parameters and buffers on a schedule.

    ``start`` runs on the training thread right after ``optimizer.step``;
    ``poll`` runs on a background thread and returns the finished checks in the
    order they were started, one per call. ``every``: N > 0 fingerprints steps
    that are multiples of N, -1 never (requests only), 0 picks N from the
    measured cost (see :meth:`interval`).
    """

    def __init__(
        self,
        params: list[Tensor],
        buffers: list[Tensor],
        *,
        every: int = 0,
        budget: float = 0.005,
        chunk: int | None = None,
        transfer: TransferFactory = default_transfer,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        if every < -1:
            raise ValueError(f"every must be -1, 0 or a positive step count, not {every}")
        if not budget > 0:
            raise ValueError(f"budget must be a positive share of step time, not {budget}")
        # Lists held, not copied: a caller that swaps a buffer in place is seen.
        self.params = params
        self.buffers = buffers
        self.every = every
        self.budget = budget
        self.chunk = chunk
        self.transfer = transfer
        self.clock = clock
        #: Reason of the last ``due()`` that returned True.
        self.pending_reason = ""
        #: No interval check is due before this step (nothing requested meanwhile);
        #: read by the step's close to skip calling due() (hooks/attach.py).
        self.quiet_until = 0
        #: Host ns the last start() took, and device ns of the last polled check.
        self.host_ns = 0
        self.device_ns = 0
        self._host_costs: deque[int] = deque(maxlen=COST_SAMPLES)
        self._device_costs: deque[int] = deque(maxlen=COST_SAMPLES)
        self.started = 0
        # request() runs on another thread: a counter pair needs no lock and a
        # request arriving mid-due() is never lost. Unequal: a request is waiting.
        self.requested = 0
        self.served = 0
        self._in_flight: deque[tuple[int, str, int, int, PendingDigests]] = deque()
        self._poll_lock = threading.Lock()

    def request(self) -> None:
        """Make the next :meth:`due` true, with reason 'request'."""
        self.requested += 1

    def cost_ns(self) -> int:
        """What one check costs the training step: host time, or device time if longer."""
        return max(self.host_ns, self.device_ns)

    def interval(self, median_step_ns: int) -> int | None:
        """Steps between checks: the explicit ``every``, or chosen from the cost.

        Automatic N is the smallest power of two >= cost / (budget * step). A
        power of two keeps ranks aligned: ranks with different costs may pick
        different N, but the multiples of the larger N are checked by all of
        them, so there are always common steps to compare.
        """
        if self.every != 0:
            return self.every if self.every > 0 else None
        cost = self.cost_ns()
        if cost <= 0 or median_step_ns <= 0:
            return None
        n = max(1, math.ceil(cost / (self.budget * median_step_ns)))
        n = 1 << (n - 1).bit_length()
        return min(n, FIRST_INTERVAL_MAX) if self.started == 1 else n

    def next_reason(self, step: int, median_step_ns: int) -> str | None:
        """Why to fingerprint after ``step`` ('initial', 'interval', 'request') or None."""
        requested = self.requested
        if requested != self.served:
            self.served = requested
            return "request"
        if self.every == -1:
            return None
        if self.started == 0 and (self.every == 0 or step % self.every == 0):
            # Automatic mode needs one measurement before it can pick N.
            return "initial"
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            return None
        n = self.interval(median_step_ns)
        return "interval" if n is not None and step % n == 0 else None

    def due(self, step: int, median_step_ns: int) -> bool:
        """Whether to call ``start(step, self.pending_reason)`` now."""
        if step < self.quiet_until and self.requested == self.served:
            return False  # every step's fast path: two comparisons
        reason = self.next_reason(step, median_step_ns)
        if reason is None:
            if self.every == -1:
                self.quiet_until = 1 << 62  # only a request starts one
            elif len(self._in_flight) < MAX_IN_FLIGHT:
                n = self.interval(median_step_ns)
                if n is not None and n > 1:
                    # The next multiple of n, looked at again by the next multiple of
                    # 8: the step median (and so n) moves at most every 8th step, and
                    # the step's close looks in on multiples of 8 (hooks/attach.py).
                    self.quiet_until = min(step - step % n + n, step - step % 8 + 8)
            return False
        self.pending_reason = reason
        return True

    def start(self, step: int, reason: str) -> None:
        """Enqueue a check of the current weights (training thread, after the step)."""
        tensors = [*self.params, *self.buffers]
        t0 = self.clock()
        # Trained parameters only: a frozen one holding -inf (a mask kept as a
        # Parameter so that .to() moves it) is that way on purpose.
        trained = {i for i, p in enumerate(self.params) if p.requires_grad}
        pending = digest_tensors(tensors, chunk=self.chunk, transfer=self.transfer, finite=trained)
        cost = self.clock() - t0
        self._host_costs.append(cost)
        self.host_ns = min(self._host_costs)
        self.started += 1
        self._in_flight.append((step, reason, len(self.params), cost, pending))

    def in_flight(self) -> int:
        return len(self._in_flight)

    def discard_oldest(self) -> None:
        """Give up on the oldest check (it never completed), so later ones can go out."""
        with self._poll_lock:
            if self._in_flight:
                self._in_flight.popleft()

    def poll(self, force: bool = False) -> dict[str, Any] | None:
        """The oldest started check once its digests reached the host, else None.

        ``force`` waits for it (blocking this thread only). None when nothing
        is in flight.
        """
        with self._poll_lock:
            if not self._in_flight:
                return None
            step, reason, n_params, cost, pending = self._in_flight[0]
            if not pending.ready():
                if not force:
                    return None
                pending.wait()
            self._in_flight.popleft()
        values = pending.values()
        device_ns = pending.device_ns()
        if device_ns is not None:
            self._device_costs.append(device_ns)
            self.device_ns = min(self._device_costs)
        return {
            "step": step,
            "reason": reason,
            "params": values[:n_params],
            "buffers": values[n_params:],
            "cost_ns": cost,
            "nonfinite": pending.nonfinite(),
        }


# --- hyperparameters ---------------------------------------------------------------


def _number(v: Any) -> float | None:
    if isinstance(v, (int, float)):  # bool is an int
        return float(v)
    # Only CPU tensors: .item() on a device tensor would sync the stream.
    if isinstance(v, Tensor) and v.device.type == "cpu" and v.numel() == 1:
        return float(v.item())
    return None


def _numbers(v: tuple[Any, ...] | list[Any]) -> list[float] | None:
    nums = []
    for x in v:
        f = _number(x)
        if f is None:
            return None
        nums.append(f)
    return nums


def _group_numbers(group: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, v in group.items():
        if name == "params":
            continue
        if isinstance(v, (tuple, list)):
            nums = _numbers(v)
            if nums:
                # betas is the one tuple everyone knows as beta1/beta2.
                base, first = ("beta", 1) if name == "betas" else (name, 0)
                for j, x in enumerate(nums, first):
                    out[f"{base}{j}"] = x
            continue
        f = _number(v)
        if f is not None:
            out[name] = f
    return out


def hparams(optimizers: Iterable[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """Numeric hyperparameters of each optimizer's param groups, for the wire.

    Device-tensor values are left out: reading them would synchronise.
    """
    result = []
    for opt in optimizers:
        cls = type(opt)
        groups = [_group_numbers(g) for g in opt.param_groups]
        result.append({"type": f"{cls.__module__}.{cls.__qualname__}", "groups": groups})
    return result


_PLAIN = frozenset((int, float, bool))


def hparams_key(optimizers: Iterable[torch.optim.Optimizer]) -> tuple[Any, ...]:
    """A cheap value that changes whenever :func:`hparams` would (per-step check).

    Plain numbers go in as they are (no float() or names to build); CPU tensors
    are read, because a scheduler that updates a tensor lr in place leaves the
    object unchanged. Anything :func:`hparams` ignores is left out, so an
    odd object in a group can never make the comparison raise.
    """
    key: list[Any] = []
    for opt in optimizers:
        key.append(type(opt))
        for g in opt.param_groups:
            key.append(len(g))
            for name, v in g.items():
                if name == "params":
                    continue
                if type(v) in _PLAIN:
                    key.append(v)
                elif isinstance(v, (tuple, list)):
                    key.append(tuple(_number(x) for x in v))
                else:
                    key.append(_number(v))
    return tuple(key)
