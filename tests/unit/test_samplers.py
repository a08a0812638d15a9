"""SamplerProbe on real DataLoaders and real samplers: what it records, and that
training sees exactly what it would without it."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    Subset,
    TensorDataset,
)
from torch.utils.data import dataloader as torch_dataloader

from ddpscope.hooks.samplers import (
    SamplerProbe,
    _kept_in_range,
    mix64,
    padded_count,
    sketch_mod_for,
)
from ddpscope.schema import Message, SamplerPass, SamplerPassEnd, decode, encode_fields

ENVELOPE = {f.name for f in dataclasses.fields(Message)}
PASS_FIELDS = {f.name for f in dataclasses.fields(SamplerPass)} - ENVELOPE
END_FIELDS = {f.name for f in dataclasses.fields(SamplerPassEnd)} - ENVELOPE
#: Fields sent only when not their default.
OPTIONAL = {"sketch_count", "split_types", "split_ways", "base_len"}


class Recorder:
    """The ``post`` callable: keeps what the probe queued, checking field sets."""

    def __init__(self) -> None:
        self.msgs: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        want = {"sampler_pass": PASS_FIELDS, "sampler_pass_end": END_FIELDS}[kind]
        extra, missing = set(fields) - want, want - set(fields)
        assert not extra and missing <= OPTIONAL, (kind, extra, missing)
        # The schema's decoder type-checks every field (the digest is a uint64).
        decoded = decode(encode_fields(kind, {**fields, "run": "r", "rank": 0}))
        assert isinstance(decoded, SamplerPass if kind == "sampler_pass" else SamplerPassEnd)
        self.msgs.append((kind, dict(fields)))

    def passes(self) -> list[dict[str, Any]]:
        return [f for k, f in self.msgs if k == "sampler_pass"]

    def ends(self) -> list[dict[str, Any]]:
        return [f for k, f in self.msgs if k == "sampler_pass_end"]


Probe = Callable[..., tuple[SamplerProbe, Recorder]]


@pytest.fixture
def make_probe() -> Iterator[Probe]:
    """Install a probe (one at a time, as on a rank); always uninstalled afterwards."""
    made: list[SamplerProbe] = []

    def make(sketch_target: int = 1024, step: int = 0) -> tuple[SamplerProbe, Recorder]:
        for p in made:
            p.uninstall()
        rec = Recorder()
        probe = SamplerProbe(rec, lambda: step, lambda: True, sketch_target=sketch_target)
        probe.install()
        made.append(probe)
        return probe, rec

    yield make
    for p in made:
        p.uninstall()


def digest_of(indices: list[int]) -> int:
    return int.from_bytes(
        hashlib.blake2b(array("q", indices).tobytes(), digest_size=8).digest(), "little"
    )


def sketch_of(indices: list[int], mod: int) -> list[int]:
    return sorted({i for i in indices if mix64(i) % mod == 0})


def drain(loader: DataLoader[Any]) -> list[Any]:
    return list(loader)


def dist_sampler(n: int, replicas: int, rank: int, **kw: Any) -> DistributedSampler[int]:
    return DistributedSampler(range(n), num_replicas=replicas, rank=rank, **kw)


# --- what the tap records ------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "replicas", "rank", "epoch", "shuffle", "drop_last"),
    [
        (103, 4, 1, 0, True, False),
        (103, 4, 3, 5, True, False),
        (103, 4, 2, 1, True, True),
        (64, 2, 0, 2, False, False),
    ],
)
def test_tap_records_exactly_the_indices_distributed_sampler_yields(
    make_probe: Probe,
    n: int,
    replicas: int,
    rank: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
) -> None:
    _, rec = make_probe(sketch_target=8)
    kw = {"shuffle": shuffle, "seed": 11, "drop_last": drop_last}
    sampler = dist_sampler(n, replicas, rank, **kw)
    sampler.set_epoch(epoch)
    twin = dist_sampler(n, replicas, rank, **kw)
    twin.set_epoch(epoch)
    want = list(twin)

    batches = drain(DataLoader(range(n), batch_size=7, sampler=sampler))

    assert [int(x) for b in batches for x in b] == want
    (p,) = rec.passes()
    assert p["distributed"] and p["expected"] == len(want)
    assert (p["epoch"], p["seed"], p["num_replicas"], p["sampler_rank"]) == (
        epoch,
        11,
        replicas,
        rank,
    )
    assert p["sampler_type"] == "torch.utils.data.distributed.DistributedSampler"
    assert p["batch_sampler_type"] == "torch.utils.data.sampler.BatchSampler"
    assert (p["shuffle"], p["drop_last"]) == (shuffle, drop_last)
    (e,) = rec.ends()
    assert e["complete"] and e["count"] == len(want)
    assert e["head"] == want[:16]
    assert e["digest"] == digest_of(want)
    assert e["sketch_mod"] == sketch_mod_for(len(want), 8)
    assert e["sketch"] == sketch_of(want, e["sketch_mod"])


def test_probe_changes_neither_items_nor_global_rng(make_probe: Probe) -> None:
    # shuffle=True gives a RandomSampler without a generator: its seed comes from
    # the global RNG, so any extra iteration would show in the items or the state.
    def run() -> tuple[list[list[int]], torch.Tensor]:
        torch.manual_seed(1234)
        loader = DataLoader(list(range(50)), batch_size=4, shuffle=True)
        items = [b.tolist() for _ in range(3) for b in loader]
        items.append(next(iter(loader)).tolist())  # an abandoned peek as well
        return items, torch.get_rng_state()

    plain_items, plain_state = run()
    probe, rec = make_probe(sketch_target=4)
    probed_items, probed_state = run()
    probe.flush()

    assert probed_items == plain_items
    assert torch.equal(probed_state, plain_state)
    assert [e["count"] for e in rec.ends()] == [50, 50, 50, 4]


def test_digest_repeats_without_set_epoch_changes_with_it_and_matches_across_probes(
    make_probe: Probe,
) -> None:
    def rank0_digests(set_epoch: bool) -> list[int]:
        _, rec = make_probe()
        sampler = dist_sampler(40, 2, 0, seed=3)
        loader = DataLoader(range(40), batch_size=5, sampler=sampler)
        for epoch in range(3):
            if set_epoch:
                sampler.set_epoch(epoch)
            drain(loader)
        return [e["digest"] for e in rec.ends()]

    forgot = rank0_digests(set_epoch=False)
    assert len(set(forgot)) == 1
    first = rank0_digests(set_epoch=True)
    assert len(set(first)) == 3
    assert rank0_digests(set_epoch=True) == first  # a fresh probe, as on another process
    assert first[0] == forgot[0]


def test_sketches_of_distributed_ranks_meet_only_in_padding(make_probe: Probe) -> None:
    n, replicas = 1003, 4  # 1003 = 4 * 251 - 1: one padded position
    sketches, fulls, pads = [], [], []
    for rank in range(replicas):
        sampler = dist_sampler(n, replicas, rank, seed=7)
        _, rec = make_probe(sketch_target=8)
        drain(DataLoader(range(n), batch_size=16, sampler=sampler))
        _, full = make_probe(sketch_target=10**6)  # sketch_mod 1: the whole shard
        drain(DataLoader(range(n), batch_size=16, sampler=sampler))
        assert rec.ends()[0]["sketch_mod"] == 16
        sketches.append(set(rec.ends()[0]["sketch"]))
        fulls.append(set(full.ends()[0]["sketch"]))
        pads.append(rec.passes()[0]["padded"])

    g = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    padding = set(g[: replicas * 251 - n])
    assert pads == [0, 0, 0, 1]
    assert set().union(*fulls) == set(range(n))
    for a in range(replicas):
        for b in range(a + 1, replicas):
            assert fulls[a] & fulls[b] <= padding
            assert sketches[a] & sketches[b] <= padding
    assert set().union(*(fulls[a] & fulls[b] for a in range(4) for b in range(a + 1, 4))) == (
        padding
    )


def test_plain_random_sampler_on_two_ranks_overlaps_fully(make_probe: Probe) -> None:
    sketches = []
    for seed in (0, 1):  # two "ranks", each with its own global seed
        torch.manual_seed(seed)
        _, rec = make_probe(sketch_target=16)
        drain(DataLoader(list(range(500)), batch_size=8, shuffle=True))
        (p,) = rec.passes()
        assert not p["distributed"] and p["shuffle"] and p["expected"] == 500
        assert p["sampler_type"] == "torch.utils.data.sampler.RandomSampler"
        sketches.append(rec.ends()[0]["sketch"])
    assert sketches[0] == sketches[1] == sketch_of(list(range(500)), 16)
    assert len(sketches[0]) > 10


def test_disjoint_subsets_give_disjoint_sketches_and_the_same_subset_full_overlap(
    make_probe: Probe,
) -> None:
    base = list(range(1000))
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(5)).tolist()
    shards = [Subset(base, perm[:500]), Subset(base, perm[500:])]
    ends = []
    for shard in [*shards, shards[0]]:
        _, rec = make_probe(sketch_target=8)
        drain(DataLoader(shard, batch_size=10, shuffle=True))
        (p,) = rec.passes()
        assert p["subset_depth"] == 1 and p["dataset_len"] == 500
        assert p["dataset_type"] == "torch.utils.data.dataset.Subset"
        ends.append(rec.ends()[0])
    s0, s1, again = (set(e["sketch"]) for e in ends)
    assert s0 and s1 and not s0 & s1
    assert s0 == again  # real dataset indices: the same shard overlaps fully
    assert s0 <= set(perm[:500]) and s1 <= set(perm[500:])
    assert sorted(s0 | s1) == sketch_of(base, 32)


def test_nested_and_tensor_indexed_subsets_map_to_real_indices(make_probe: Probe) -> None:
    base = list(range(100, 200))  # values differ from positions, so mapping shows
    inner = Subset(base, torch.arange(99, -1, -1))  # tensor indices, reversed
    outer = Subset(inner, [0, 2, 4, 6, 8])
    _, rec = make_probe(sketch_target=10**6)
    items = [int(x) for b in DataLoader(outer, batch_size=2) for x in b]
    assert items == [199, 197, 195, 193, 191]
    assert rec.passes()[0]["subset_depth"] == 2
    assert rec.ends()[0]["head"] == [99, 97, 95, 93, 91]  # positions in ``base``


@given(
    n=st.integers(1, 40),
    replicas=st.integers(1, 6),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_padded_count_matches_the_padding_distributed_sampler_adds(
    n: int, replicas: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, replicas - 1))
    drop_last = data.draw(st.booleans())
    # Rebuild the global list from every rank's output (rank r holds positions
    # r, r+R, ...); a position is padding when its value already occurred.
    lists = [
        list(dist_sampler(n, replicas, r, seed=2, drop_last=drop_last)) for r in range(replicas)
    ]
    glob = [lists[p % replicas][p // replicas] for p in range(replicas * len(lists[0]))]
    seen: set[int] = set()
    repeats = set()
    for p, v in enumerate(glob):
        if v in seen:
            repeats.add(p)
        seen.add(v)
    real = sum(1 for p in repeats if p % replicas == rank)
    assert padded_count(n, replicas, rank, drop_last) == real


def test_padded_field_reports_the_rank_that_gets_an_index_twice(make_probe: Probe) -> None:
    _, rec = make_probe()
    for rank in range(3):
        drain(DataLoader(range(10), sampler=dist_sampler(10, 3, rank)))
    # 12 slots for 10 indices: padding sits at global positions 10 and 11, which
    # belong to ranks 10 % 3 == 1 and 11 % 3 == 2.
    assert [p["padded"] for p in rec.passes()] == [0, 1, 1]


# --- pass boundaries ---------------------------------------------------------


def test_peek_then_full_pass_gives_an_abandoned_then_a_complete_pass(make_probe: Probe) -> None:
    probe, rec = make_probe(step=3)
    sampler = dist_sampler(30, 2, 1, seed=1)
    loader = DataLoader(range(30), batch_size=4, sampler=sampler)
    first = next(iter(loader))
    drain(loader)
    assert [(k, f["loader"], f["pass_id"]) for k, f in rec.msgs] == [
        ("sampler_pass", 0, 0),
        ("sampler_pass_end", 0, 0),
        ("sampler_pass", 0, 1),
        ("sampler_pass_end", 0, 1),
    ]
    peek, full = rec.ends()
    assert not peek["complete"] and peek["count"] == 4 and peek["head"] == first.tolist()
    assert full["complete"] and full["count"] == 15 and full["step"] == 3
    assert (probe.last_pass, probe.last_epoch) == (1, 0)


def test_flush_ends_open_passes_as_incomplete(make_probe: Probe) -> None:
    probe, rec = make_probe()
    it = iter(DataLoader(range(20), batch_size=5))
    next(it)
    assert rec.ends() == []
    probe.flush()
    probe.flush()
    (e,) = rec.ends()
    assert not e["complete"] and e["count"] == 5
    assert [b.tolist() for b in it][-1] == [15, 16, 17, 18, 19]  # the loop is unaffected
    assert len(rec.ends()) == 1


def test_loaders_get_their_own_ids_and_last_state_follows_distributed_passes(
    make_probe: Probe,
) -> None:
    probe, rec = make_probe()
    assert (probe.last_epoch, probe.last_pass) == (-1, -1)
    train_sampler = dist_sampler(20, 2, 0)
    train = DataLoader(range(20), batch_size=5, sampler=train_sampler)
    val = DataLoader(range(8), batch_size=4)
    train_sampler.set_epoch(4)
    drain(train)
    assert (probe.last_epoch, probe.last_pass) == (4, 0)
    drain(val)
    assert (probe.last_epoch, probe.last_pass) == (4, 1)  # val keeps the training epoch
    train_sampler.set_epoch(5)
    drain(train)
    assert (probe.last_epoch, probe.last_pass) == (5, 2)
    assert [(p["loader"], p["pass_id"]) for p in rec.passes()] == [(0, 0), (1, 0), (0, 1)]


# --- loader shapes -----------------------------------------------------------


def test_batch_size_none_tracks_single_indices(make_probe: Probe) -> None:
    _, rec = make_probe()
    sampler = dist_sampler(21, 2, 0, seed=4)
    items = [int(x) for x in DataLoader(range(21), batch_size=None, sampler=sampler)]
    (p,) = rec.passes()
    assert p["batch_sampler_type"] == "" and p["padded"] == 0
    (e,) = rec.ends()
    assert e["count"] == 11 and e["digest"] == digest_of(items) and e["head"] == items[:16]


class PairBatches(Sampler[list[int]]):
    """A custom batch sampler without a ``.sampler``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        return iter([[i, i + 1] for i in range(0, self.n, 2)])

    def __len__(self) -> int:
        return self.n // 2


def test_custom_batch_samplers_are_followed(make_probe: Probe) -> None:
    _, rec = make_probe()
    drain(DataLoader(range(10), batch_sampler=PairBatches(10)))
    sampler = dist_sampler(10, 2, 1, shuffle=False)
    drain(DataLoader(range(10), batch_sampler=BatchSampler(sampler, 3, drop_last=True)))
    own, wrapped = rec.passes()
    assert own["sampler_type"] == own["batch_sampler_type"] == f"{__name__}.PairBatches"
    assert own["expected"] == -1 and not own["distributed"]
    assert wrapped["sampler_type"] == "torch.utils.data.distributed.DistributedSampler"
    assert wrapped["distributed"] and wrapped["expected"] == 5 and wrapped["drop_last"] is False
    e_own, e_wrapped = rec.ends()
    assert e_own["count"] == 10 and e_own["head"] == list(range(10))
    assert e_wrapped["count"] == 3 and e_wrapped["head"] == [1, 3, 5]


class NumpyOrder(Sampler[Any]):
    """Yields numpy integers and 0-d tensors, as hand-written samplers do."""

    def __iter__(self) -> Iterator[Any]:
        import numpy as np

        yield from np.arange(5)
        yield from torch.arange(5, 8)

    def __len__(self) -> int:
        return 8


def test_numpy_and_tensor_indices_are_tolerated(make_probe: Probe) -> None:
    pytest.importorskip("numpy")
    _, rec = make_probe()
    out = torch.cat(list(DataLoader(range(8), batch_size=3, sampler=NumpyOrder())))
    assert out.tolist() == list(range(8))
    (e,) = rec.ends()
    assert e["count"] == 8 and e["head"] == list(range(8)) and e["sketch"] == list(range(8))
    assert all(type(i) is int for i in e["head"] + e["sketch"])


class Keys(Sampler[str]):
    def __iter__(self) -> Iterator[str]:
        return iter(["a", "b", "c"])

    def __len__(self) -> int:
        return 3


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(6))


def test_passes_without_indices_are_reported_untracked(make_probe: Probe) -> None:
    _, rec = make_probe()
    keyed = {"a": 1, "b": 2, "c": 3}
    assert [b.tolist() for b in DataLoader(keyed, batch_size=2, sampler=Keys())] == [[1, 2], [3]]
    assert [b.tolist() for b in DataLoader(Stream(), batch_size=4)] == [[0, 1, 2, 3], [4, 5]]
    keys, stream = rec.ends()
    assert keys["complete"] and keys["count"] == -1 and keys["digest"] == 0
    assert keys["head"] == keys["sketch"] == []
    assert stream["count"] == -1 and not stream["complete"]
    assert rec.passes()[1]["dataset_type"] == f"{__name__}.Stream"


class Liar(Sampler[int]):
    """Says it yields 10 indices; yields 5000."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(5000))

    def __len__(self) -> int:
        return 10


def test_sketch_coarsens_but_keeps_its_rule_when_len_is_wrong(make_probe: Probe) -> None:
    _, rec = make_probe(sketch_target=8)
    drain(DataLoader(range(5000), batch_size=50, sampler=Liar()))
    (e,) = rec.ends()
    assert e["count"] == 5000
    mod = e["sketch_mod"]
    assert mod > 1 and mod & (mod - 1) == 0 and len(e["sketch"]) <= 32
    assert e["sketch"] == sketch_of(list(range(5000)), mod)


class Sparse(Sampler[int]):
    """Indices beyond len(dataset): a dict-backed dataset with large keys."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(0, 4000, 4))

    def __len__(self) -> int:
        return 1000


def test_indices_outside_the_dataset_range_follow_the_same_sketch_rule(
    make_probe: Probe,
) -> None:
    _, rec = make_probe(sketch_target=8)
    data = {i: i for i in range(0, 4000, 4)}  # len 1000; keys up to 3996
    drain(DataLoader(data, batch_size=25, sampler=Sparse()))
    (e,) = rec.ends()
    assert e["sketch"] == sketch_of(list(range(0, 4000, 4)), e["sketch_mod"])


@given(st.integers(1, 3000), st.sampled_from([2, 4, 64, 1024]))
@settings(max_examples=30, deadline=None)
def test_vectorised_sketch_rule_equals_mix64(n: int, mod: int) -> None:
    assert _kept_in_range(n, mod) == {i for i in range(n) if mix64(i) % mod == 0}


class OwnIter:
    """An iterator class not derived from torch's, as a future torch might have."""

    def __init__(self, loader: DataLoader[Any], with_sampler_iter: bool) -> None:
        self._source = iter(loader.batch_sampler)  # type: ignore[arg-type]
        if with_sampler_iter:
            self._sampler_iter = self._source

    def __iter__(self) -> OwnIter:
        return self

    def __next__(self) -> list[int]:
        return next(getattr(self, "_sampler_iter", self._source))


class OwnLoader(DataLoader[Any]):
    with_sampler_iter = True

    def _get_iterator(self) -> Any:
        return OwnIter(self, self.with_sampler_iter)


@pytest.mark.parametrize("with_sampler_iter", [True, False])
def test_iterators_of_other_classes_are_tapped_late_or_reported_untracked(
    make_probe: Probe, with_sampler_iter: bool
) -> None:
    _, rec = make_probe()
    loader = OwnLoader(range(9), batch_size=4)
    loader.with_sampler_iter = with_sampler_iter
    assert drain(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    (e,) = rec.ends()
    if with_sampler_iter:
        assert e["complete"] and e["count"] == 9 and e["head"] == list(range(9))
    else:
        assert not e["complete"] and e["count"] == -1


# --- failure and uninstall -----------------------------------------------------


class Remap(Dataset[int]):
    """Has ``.dataset`` and ``.indices`` but is not a Subset: ``indices`` is a dict."""

    def __init__(self) -> None:
        self.dataset = list(range(10))
        self.indices = {"train": list(range(10))}

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return self.dataset[i]


def test_an_internal_error_disables_the_probe_once_and_the_loop_continues(
    make_probe: Probe, caplog: pytest.LogCaptureFixture
) -> None:
    probe, rec = make_probe()
    loader = DataLoader(Remap(), batch_size=3)
    with caplog.at_level(logging.WARNING, logger="ddpscope"):
        epochs = [[b.tolist() for b in loader] for _ in range(2)]
    assert epochs == [[[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]] * 2
    assert not probe.enabled
    assert len([r for r in caplog.records if r.name == "ddpscope"]) == 1
    assert len(rec.passes()) == 1 and rec.ends() == []


def test_a_failing_post_disables_the_probe_and_the_loop_continues(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def post(kind: str, fields: dict[str, Any]) -> None:
        raise OSError("queue gone")

    probe = SamplerProbe(post, lambda: 0, lambda: True)
    probe.install()
    try:
        with caplog.at_level(logging.WARNING, logger="ddpscope"):
            out = [[b.tolist() for b in DataLoader(range(5), batch_size=2)] for _ in range(2)]
    finally:
        probe.uninstall()
    assert out == [[[0, 1], [2, 3], [4]]] * 2
    assert not probe.enabled
    assert len(caplog.records) == 1 and "queue gone" in caplog.records[0].getMessage()


def test_uninstall_restores_dataloader_iter_and_stops_observing() -> None:
    base_iter = torch_dataloader._BaseDataLoaderIter
    original = DataLoader.__dict__["__iter__"]
    rec = Recorder()
    probe = SamplerProbe(rec, lambda: 0, lambda: False)
    probe.install()
    probe.install()
    assert DataLoader.__dict__["__iter__"] is not original
    other = SamplerProbe(Recorder(), lambda: 0, lambda: False)
    with pytest.raises(RuntimeError):
        other.install()
    live = iter(DataLoader(range(6), batch_size=2))
    next(live)
    probe.uninstall()
    probe.uninstall()
    assert DataLoader.__dict__["__iter__"] is original
    assert "_sampler_iter" not in base_iter.__dict__
    assert [b.tolist() for b in live] == [[2, 3], [4, 5]]  # a live iterator still works
    drain(DataLoader(range(6), batch_size=2))
    assert len(rec.passes()) == 1
    assert rec.passes()[0]["training"] is False
    other.install()  # the slot is free again
    other.uninstall()


# --- cost ----------------------------------------------------------------------


class Echo(Dataset[int]):
    """A dataset that costs nothing, so the probe's own overhead shows."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def __getitems__(self, idx: list[int]) -> list[int]:
        return idx


def test_overhead_on_a_one_million_index_pass(
    make_probe: Probe, capsys: pytest.CaptureFixture[str]
) -> None:
    n, replicas, batch = 2_000_000, 2, 256  # this rank's pass: 1M indices

    def one_pass() -> float:
        sampler = dist_sampler(n, replicas, 0, seed=1)
        loader = DataLoader(Echo(n), batch_size=batch, sampler=sampler, collate_fn=lambda b: b)
        # Thread CPU time: the loader runs in this thread, and other processes on
        # a shared machine distort wall time more.
        t0 = time.thread_time()
        for _ in loader:
            pass
        return time.thread_time() - t0

    probe, rec = make_probe()
    first = one_pass()  # includes computing the qualifying set once
    plain, probed = [], []
    for _ in range(3):  # interleaved, so drifting machine load hits both alike
        probe.uninstall()
        plain.append(one_pass())
        probe.install()
        probed.append(one_pass())
    count = n // replicas
    assert [e["count"] for e in rec.ends()] == [count] * 4
    best, best_probed = min(plain), min(probed)
    with capsys.disabled():
        print(
            f"\n[sampler probe] 1M-index pass, batch {batch}: plain {best * 1e3:.0f} ms, "
            f"probed {best_probed * 1e3:.0f} ms (first {first * 1e3:.0f} ms); overhead "
            f"{(best_probed - best) / count * 1e9:.1f} ns/index, ratio {best_probed / best:.2f}"
        )


class _TorchvisionRA:  # torchvision's references: the count is `repetitions`
    def __init__(self, repetitions: int) -> None:
        self.num_replicas, self.rank, self.repetitions = 4, 0, repetitions
        self.epoch, self.seed, self.shuffle = 0, 0, True

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class _TimmRA:  # timm and DeiT since 2021: `num_repeats`
    def __init__(self) -> None:
        self.num_replicas, self.rank, self.num_repeats, self.epoch = 4, 1, 2, 3

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class RASampler:  # DeiT's first one, copied widely: 3 repeats hard-coded, no seed
    def __init__(self) -> None:
        self.num_replicas, self.rank, self.epoch, self.shuffle = 4, 2, 0, True

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_repeated_augmentation_samplers_say_how_many_ranks_get_each_sample() -> None:
    from torch.utils.data import DistributedSampler, RandomSampler

    from ddpscope.hooks.samplers import _epoch_aware, repeats_of

    assert repeats_of(_TorchvisionRA(3)) == 3 and repeats_of(_TorchvisionRA(1)) == 1
    assert repeats_of(_TimmRA()) == 2 and repeats_of(RASampler()) == 3
    data = list(range(8))
    assert repeats_of(DistributedSampler(data, num_replicas=2, rank=0)) == 1
    assert repeats_of(RandomSampler(data)) == repeats_of(None) == 1
    # Built like DistributedSampler: shards by rank and reshuffles by set_epoch.
    assert _epoch_aware(_TorchvisionRA(3)) and _epoch_aware(RASampler())
    assert not _epoch_aware(RandomSampler(data))


class EndlessPermutations(Sampler[int]):
    """detectron2's TrainingSampler: a stream of permutations, no length, one pass a run."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(0)
        while True:
            yield from torch.randperm(self.n, generator=g).tolist()


def test_a_pass_without_a_length_is_sketched_over_its_first_share_of_the_dataset(
    make_probe: Probe,
) -> None:
    """Over a whole run an infinite sampler draws every sample many times; its first
    len(dataset) // world draws are what a sharded stream keeps disjoint."""
    probe, rec = make_probe(sketch_target=8)
    loader = DataLoader(
        TensorDataset(torch.arange(64)), batch_size=10, sampler=EndlessPermutations(64)
    )
    it = iter(loader)
    drawn = [int(i) for _ in range(20) for i in next(it)[0]]  # 200 draws, 3 permutations and more
    probe.flush()
    (p,) = rec.passes()
    (e,) = rec.ends()
    assert p["expected"] == -1 and e["count"] == 200 and not e["complete"]
    assert e["sketch_count"] == 64  # world size 1: the whole dataset is its share
    assert e["sketch"] == sketch_of(drawn[:64], e["sketch_mod"])
    assert e["head"] == drawn[:16]


def test_a_pass_with_a_length_is_sketched_whole_and_says_nothing_of_it(make_probe: Probe) -> None:
    _, rec = make_probe()
    drain(DataLoader(TensorDataset(torch.arange(64)), batch_size=10, shuffle=True))
    (e,) = rec.ends()
    assert "sketch_count" not in e and e["count"] == 64
