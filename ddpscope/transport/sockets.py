"""Socket set-up in one place, so every peer gets the same safety options."""

from __future__ import annotations

import zmq

from ddpscope.schema import MAX_MESSAGE_BYTES


def rank_publisher(ctx: zmq.Context, endpoint: str, sndhwm: int) -> zmq.Socket:
    """PUB that connects to the watcher: never blocks, never holds exit open."""
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    # With NODROP a full pipe makes a DONTWAIT send raise Again instead of
    # dropping silently, so every drop is counted.
    sock.setsockopt(zmq.XPUB_NODROP, 1)
    sock.connect(endpoint)
    return sock


def rank_control(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """SUB through which the watcher's requests reach a rank."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 4096)  # requests are tiny; anything big is hostile
    sock.setsockopt(zmq.RCVHWM, 64)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def watcher_subscriber(ctx: zmq.Context, endpoint: str, rcvhwm: int = 100_000) -> zmq.Socket:
    """SUB that binds where ranks publish; bounded message size."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.bind(endpoint)
    return sock


def watcher_control(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """PUB the watcher sends requests on."""
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock
