"""Socket set-up in one place, so every peer gets the same safety options.

Keys are applied here too: a socket given ``ServerKeys`` is a CURVE server
(it binds), one given ``ClientKeys`` a CURVE client (it connects). Security
options must be set before ``bind``/``connect``, which is why they are
arguments rather than something the caller does afterwards.
"""

from __future__ import annotations

import os
import stat

import zmq

from ddpscope.schema import MAX_MESSAGE_BYTES
from ddpscope.transport.security import ClientKeys, ServerKeys, apply_client, apply_server

#: Requests are tiny; anything bigger on a control socket is hostile.
MAX_REQUEST_BYTES = 4096


def _secure(sock: zmq.Socket, server: ServerKeys | None, client: ClientKeys | None) -> None:
    if server is not None:
        apply_server(sock, server)
    if client is not None:
        apply_client(sock, client)


def rank_publisher(
    ctx: zmq.Context,
    endpoint: str,
    sndhwm: int,
    keys: ClientKeys | None = None,
    connect: bool = True,
) -> zmq.Socket:
    """PUB that connects to the watcher: never blocks, never holds exit open.

    An XPUB, which sends like a PUB and also hands the subscriptions it gets to
    the application: the publisher holds its first messages until the watcher's
    (or relay's) subscription has arrived, instead of losing them to the
    moment between connecting and being subscribed. ``connect=False``: the
    caller connects it to ``endpoint`` (after attaching a monitor, which sees
    only the events after it).
    """
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    # With NODROP a full pipe makes a DONTWAIT send raise Again instead of
    # dropping silently, so every drop is counted.
    sock.setsockopt(zmq.XPUB_NODROP, 1)
    _secure(sock, None, keys)
    if connect:
        sock.connect(endpoint)
    return sock


def rank_control(ctx: zmq.Context, endpoint: str, keys: ClientKeys | None = None) -> zmq.Socket:
    """SUB through which the watcher's requests reach a rank."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
    sock.setsockopt(zmq.RCVHWM, 64)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    _secure(sock, None, keys)
    sock.connect(endpoint)
    return sock


def watcher_subscriber(
    ctx: zmq.Context, endpoint: str, rcvhwm: int = 100_000, keys: ServerKeys | None = None
) -> zmq.Socket:
    """SUB that binds where ranks publish; bounded message size."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    _secure(sock, keys, None)
    sock.bind(endpoint)
    return sock


def watcher_control(ctx: zmq.Context, endpoint: str, keys: ServerKeys | None = None) -> zmq.Socket:
    """PUB the watcher sends requests on."""
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    _secure(sock, keys, None)
    sock.bind(endpoint)
    return sock


# --- a relay: two proxies, ranks on one side and the watcher on the other --------


def relay_ranks_in(
    ctx: zmq.Context, endpoint: str, rcvhwm: int, keys: ServerKeys | None = None
) -> zmq.Socket:
    """XSUB the node's ranks publish to (bound, like a watcher's SUB).

    It subscribes to everything itself, so ranks send from the start whether
    or not a watcher is connected upstream.
    """
    sock = ctx.socket(zmq.XSUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    _secure(sock, keys, None)
    sock.bind(endpoint)
    sock.send(b"\x01")  # subscribe to every topic, kept for ranks that connect later
    return sock


def relay_watcher_out(
    ctx: zmq.Context, endpoint: str, sndhwm: int, keys: ClientKeys | None = None
) -> zmq.Socket:
    """XPUB that connects to the watcher's bound SUB and forwards the node's stream.

    Without a subscribed watcher it discards (the ranks' stream still reaches
    the relay and its recording). With one that falls behind, it drops at the
    high-water mark rather than blocking the relay; the watcher sees the
    drops as gaps in the ranks' sequence numbers.
    """
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    _secure(sock, None, keys)
    sock.connect(endpoint)
    return sock


def relay_requests_in(
    ctx: zmq.Context, endpoint: str, keys: ClientKeys | None = None
) -> zmq.Socket:
    """XSUB that connects to the watcher's control PUB (requests come down it)."""
    sock = ctx.socket(zmq.XSUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
    sock.setsockopt(zmq.RCVHWM, 64)
    _secure(sock, None, keys)
    sock.connect(endpoint)
    return sock


def relay_requests_out(
    ctx: zmq.Context, endpoint: str, keys: ServerKeys | None = None
) -> zmq.Socket:
    """XPUB the node's ranks take requests from (bound, like a watcher's control PUB)."""
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    _secure(sock, keys, None)
    sock.bind(endpoint)
    return sock


class IpcFiles:
    """The socket files of the ``ipc://`` endpoints a process bound, to remove at close.

    libzmq leaves them behind (it removes only those of ``ipc://*``). Only a
    file that is still the one this process bound is removed: another
    process may have bound the same path since, and it keeps its socket.
    """

    def __init__(self) -> None:
        self._bound: list[tuple[str, int]] = []

    def bound(self, *endpoints: str) -> None:
        for endpoint in endpoints:
            if not endpoint.startswith("ipc://") or endpoint == "ipc://*":
                continue
            path = endpoint[len("ipc://") :]
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                self._bound.append((path, st.st_ino))

    def remove(self) -> None:
        bound, self._bound = self._bound, []
        for path, ino in bound:
            try:
                if os.stat(path).st_ino == ino:
                    os.unlink(path)
            except OSError:
                pass
