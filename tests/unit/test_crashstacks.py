"""The traceback a rank's end message carries: bounded, and still naming the error."""

from __future__ import annotations

from collections.abc import Callable

from ddpscope.hooks.crashstacks import LINE_CHARS, TRACEBACK_CHARS, bounded_traceback


def _raised(fail: Callable[[], None]) -> str:
    try:
        fail()
    except Exception as e:
        return bounded_traceback(type(e), e, e.__traceback__)
    raise AssertionError("nothing raised")


def _deep(n: int) -> None:
    if n:
        _deep(n - 1)
    raise ValueError("batch 17 has NaN labels")


def _key_lists() -> None:
    keys = ", ".join(f'"module.layer{i}.weight"' for i in range(400))
    plain = ", ".join(f'"layer{i}.weight"' for i in range(400))
    raise RuntimeError(
        "Error(s) in loading state_dict for Net:\n"
        f"\tMissing key(s) in state_dict: {plain}.\n"
        f"\tUnexpected key(s) in state_dict: {keys}."
    )


def test_a_short_traceback_is_kept_whole() -> None:
    text = _raised(lambda: _deep(3))
    assert text.startswith("Traceback (most recent call last):")
    assert text.endswith("ValueError: batch 17 has NaN labels\n")
    assert text.count("in _deep") == 4


def test_a_deep_traceback_keeps_the_innermost_frames_and_the_error() -> None:
    text = _raised(lambda: _deep(300))
    assert len(text) <= TRACEBACK_CHARS
    assert text.endswith("ValueError: batch 17 has NaN labels\n")
    assert 'raise ValueError("batch 17 has NaN labels")' in text


def test_a_message_longer_than_the_budget_keeps_the_start_of_each_line() -> None:
    text = _raised(_key_lists)
    assert len(text) <= TRACEBACK_CHARS
    assert "RuntimeError: Error(s) in loading state_dict for Net:\n" in text
    assert '\tMissing key(s) in state_dict: "layer0.weight", ' in text
    assert '\tUnexpected key(s) in state_dict: "module.layer0.weight", ' in text
    assert all(len(line) <= LINE_CHARS for line in text.splitlines())
    assert "in _key_lists" in text  # and the frame that raised it
