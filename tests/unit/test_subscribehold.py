"""When a rank's held first sends go: the subscription, the grace, a connected peer."""

from __future__ import annotations

from ddpscope.hooks.subscribehold import (
    CLOSE_WAIT_S,
    CONNECTED_WAIT_S,
    GRACE_S,
    HOLD_MAX,
    SubscribeHold,
)

T0 = 100.0


def test_with_nobody_connected_the_sends_go_at_the_end_of_the_grace() -> None:
    hold = SubscribeHold(T0)
    assert hold.hold(b"a") and hold.holding
    assert not hold.over(T0 + GRACE_S - 0.01, subscribed=False)
    assert hold.over(T0 + GRACE_S, subscribed=False)
    assert hold.close_wait(T0 + 0.1) == 0.0  # nobody to wait for at close
    assert hold.release() == [b"a"]
    assert not hold.holding and not hold.hold(b"b")  # sent at once from here on


def test_a_subscription_ends_the_hold_at_once() -> None:
    hold = SubscribeHold(T0)
    hold.hold(b"a")
    assert hold.over(T0 + 0.01, subscribed=True)


def test_a_connected_peer_is_waited_for_longer_but_not_forever() -> None:
    hold = SubscribeHold(T0)
    hold.peer = True
    assert not hold.over(T0 + 3 * GRACE_S, subscribed=False)
    assert hold.over(T0 + CONNECTED_WAIT_S, subscribed=False)
    # Its handshake failed (a wrong key): back to the grace.
    hold.peer = False
    assert hold.over(T0 + 3 * GRACE_S, subscribed=False)


def test_at_close_a_connected_peer_is_waited_for_at_most_a_second() -> None:
    hold = SubscribeHold(T0)
    hold.peer = True
    assert hold.close_wait(T0 + 0.1) == CLOSE_WAIT_S
    assert 0.19 < hold.close_wait(T0 + CONNECTED_WAIT_S - 0.2) < 0.21
    assert hold.close_wait(T0 + CONNECTED_WAIT_S + 1) == 0.0
    hold.release()
    assert hold.close_wait(T0 + 0.1) == 0.0


def test_the_hold_keeps_at_most_hold_max_payloads_in_order() -> None:
    hold = SubscribeHold(T0)
    kept = [hold.hold(bytes([i % 256])) for i in range(HOLD_MAX + 3)]
    assert kept == [True] * HOLD_MAX + [False] * 3
    assert hold.release() == [bytes([i % 256]) for i in range(HOLD_MAX)]
