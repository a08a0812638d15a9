"""``ddpscope relay``: one per node, forwarding the node's ranks to the watcher.

Imports stay light here (argparse, config); zmq and the relay are imported in
``run``. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from ddpscope import config
from ddpscope.cli.lifeline import say

if TYPE_CHECKING:
    from ddpscope.transport.relay import RelayStats

EPILOG = f"""\
examples:
  ddpscope relay --upstream tcp://HEAD:5557             # ranks here keep the default endpoint
  ddpscope relay --upstream tcp://HEAD:5557 --record /scratch/runs
  DDPSCOPE_SERVER_KEY=/shared/keys/server.key ddpscope relay --upstream tcp://HEAD:5557

The ranks of this node publish to --listen (default {config.DEFAULT_ENDPOINT},
where ranks publish when nothing is configured), the relay forwards one stream
to the watcher at --upstream and passes the watcher's requests back down. It
takes everything the ranks send from the start, with or without a watcher.
`ddpscope run` starts one by itself on multi-node launches (docs/relay.md).
"""


class RelayCommand:
    name = "relay"
    help = "forward one node's ranks to a watcher on another host (one relay per node)"
    description = (
        "Run once per node of a multi-node job: the node's ranks publish to the relay "
        "locally, and it forwards their telemetry to the watcher as one stream and the "
        "watcher's requests back to them (two ZeroMQ proxies). It can record the node's "
        "ranks to disk. Runs until interrupted."
    )
    epilog = EPILOG

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--upstream",
            metavar="ADDR",
            required=True,
            help="the watcher's address (what it listens on, e.g. tcp://HEAD:5557)",
        )
        parser.add_argument(
            "--upstream-control",
            metavar="ADDR",
            help="the watcher's request address (default: upstream port + 1)",
        )
        parser.add_argument(
            "--listen",
            metavar="ADDR",
            default=config.DEFAULT_ENDPOINT,
            help=f"where this node's ranks publish (default {config.DEFAULT_ENDPOINT})",
        )
        parser.add_argument(
            "--listen-control",
            metavar="ADDR",
            help="where this node's ranks take requests (default: listen port + 1)",
        )
        parser.add_argument(
            "--record",
            metavar="DIR",
            default="",
            help="also record every rank of this node into DIR/RUN_ID/ (one file per rank)",
        )
        parser.add_argument(
            "--server-key",
            metavar="KEY",
            default=os.environ.get(config.SERVER_KEY_VAR, ""),
            help="the watcher's public key (Z85, key file or keys directory; default "
            "$DDPSCOPE_SERVER_KEY): connect upstream with CURVE",
        )
        parser.add_argument(
            "--client-key",
            metavar="FILE",
            default=os.environ.get(config.CLIENT_KEY_VAR, ""),
            help="this relay's keypair (NAME.key_secret) for a watcher with an allow-list "
            "(default $DDPSCOPE_CLIENT_KEY; else a fresh one)",
        )
        parser.add_argument(
            "--keys",
            metavar="DIR",
            default="",
            help="server keypair for --listen: required to listen beyond loopback",
        )
        parser.add_argument(
            "--metrics",
            metavar="HOST:PORT",
            help="serve this node's ranks' figures as OpenMetrics (Prometheus) at "
            "http://HOST:PORT/metrics (default: off; docs/relay.md)",
        )
        parser.add_argument(
            "--raw",
            action="store_true",
            help="forward the ranks' frames as they came, undecoded (default: check each "
            "here and send batches, so the watcher's core is not spent decoding)",
        )
        parser.add_argument(
            "--stats-every",
            metavar="S",
            type=float,
            default=30.0,
            help="print forwarding statistics every S seconds (0: only at exit)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from ddpscope.metrics import MetricsAddressError, open_metrics, parse_address
        from ddpscope.transport.relay import Relay
        from ddpscope.transport.security import (
            SecurityError,
            load_client_keys,
            load_server_keys,
        )

        metrics = None
        try:
            for addr in (args.upstream, args.listen):
                config.derive_control_endpoint(addr)  # validates the shape
            up_keys = (
                load_client_keys(args.server_key, args.client_key) if args.server_key else None
            )
            if args.client_key and not args.server_key:
                raise SecurityError("--client-key needs --server-key (the watcher's public key)")
            keys = load_server_keys(args.keys) if args.keys else None
            if args.metrics:
                parse_address(args.metrics)  # before binding anything
            metrics = open_metrics(args.metrics, "relay")
            relay = Relay(
                args.listen,
                args.upstream,
                listen_control=args.listen_control,
                upstream_control=args.upstream_control,
                record=os.path.abspath(args.record) if args.record else "",
                keys=keys,
                upstream_keys=up_keys,
                metrics=metrics,
                decode=not args.raw,
            )
        except (SecurityError, config.ConfigError, MetricsAddressError) as exc:
            if metrics is not None:
                metrics.close()
            print(f"ddpscope relay: error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            if metrics is not None:
                metrics.close()
            print(f"ddpscope relay: {exc} (is another relay or watcher there?)", file=sys.stderr)
            return 3
        stop = threading.Event()
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
        secure = "with keys" if up_keys else "in the clear"
        rec = f"; recording to {relay.record}" if relay.record else ""
        if metrics is not None:
            rec += f"; metrics at {metrics.url}"
        print(
            f"ddpscope relay: ranks publish to {relay.listen} (requests: "
            f"{relay.listen_control}); forwarding to {relay.upstream} {secure}{rec}",
            file=sys.stderr,
            flush=True,
        )
        relay.start()
        try:
            last = relay.stats()
            last_t = time.monotonic()
            every = args.stats_every if args.stats_every > 0 else None
            while not stop.wait(every if every else 3600):
                if every:
                    now = relay.stats()
                    t = time.monotonic()
                    say(describe(now, last, t - last_t))
                    last, last_t = now, t
        finally:
            relay.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        say(describe(relay.stats(), None, 0.0))  # the terminal may be gone: that is why we stop
        return 0


def describe(now: RelayStats, before: RelayStats | None, seconds: float) -> str:
    """One line of relay statistics (with a rate when ``before`` is given)."""
    parts = [f"ddpscope relay: {now.received} messages from ranks"]
    if before is not None and seconds > 0:
        parts[0] += f" ({(now.received - before.received) / seconds:.0f}/s)"
    parts.append(f"{now.requests} requests to ranks")
    parts.append("a watcher subscribed" if now.subscriptions else "no watcher has subscribed yet")
    if now.rejected:
        reasons = ", ".join(f"{reason} {n}" for reason, n in now.rejected_reasons)
        parts.append(f"{now.rejected} refused as not valid telemetry ({reasons})")
    if now.record_files:
        parts.append(
            f"recorded {now.recorded} into {now.record_files} file(s), "
            f"{now.record_gaps} lost before the relay"
        )
    failures = now.upstream_handshake_failures + now.downstream_handshake_failures
    if failures:
        parts.append(f"{failures} failed handshake(s): {now.last_error}")
    return "; ".join(parts)
