"""Reading a recording raises the collector's young threshold, and puts back what it found."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from ddpscope.record.collect import YOUNG, reading_recording


@pytest.fixture(autouse=True)
def saved_threshold() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_the_threshold_is_raised_inside_and_restored_after_nested_blocks() -> None:
    gc.set_threshold(700, 10, 10)
    with reading_recording():
        assert gc.get_threshold() == (YOUNG, 10, 10)
        with reading_recording():
            assert gc.get_threshold()[0] == YOUNG
        assert gc.get_threshold()[0] == YOUNG  # the outer reader still reads
    assert gc.get_threshold() == (700, 10, 10)


def test_a_reader_on_another_thread_keeps_it_raised_until_the_last_one_ends() -> None:
    gc.set_threshold(700, 10, 10)
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with reading_recording():
            inside.set()
            release.wait(10)

    worker = threading.Thread(target=other)
    with reading_recording():
        worker.start()
        assert inside.wait(10)
    assert gc.get_threshold()[0] == YOUNG  # the other thread is still reading
    release.set()
    worker.join(10)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_collector_switched_off_or_set_higher_is_left_as_it_was() -> None:
    gc.set_threshold(0)
    with reading_recording():
        assert gc.get_threshold()[0] == 0
    gc.set_threshold(10 * YOUNG, 10, 10)
    with reading_recording():
        assert gc.get_threshold()[0] == 10 * YOUNG
    assert gc.get_threshold()[0] == 10 * YOUNG


def test_an_error_in_the_block_still_restores_it() -> None:
    gc.set_threshold(700, 10, 10)
    with pytest.raises(RuntimeError), reading_recording():
        raise RuntimeError("a damaged recording")
    assert gc.get_threshold() == (700, 10, 10)
