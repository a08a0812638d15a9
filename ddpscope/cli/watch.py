"""``ddpscope watch``: the live terminal UI; also the UI half of ``ddpscope run``.

Imports here stay light (argparse, config): textual and the analysis code
are imported inside ``run`` so that ``ddpscope --help`` stays fast. Nothing
here or below imports torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ddpscope import config
from ddpscope.cli.launch import Forwarder, exit_status, launch, start_job
from ddpscope.cli.lifeline import Lifeline, say

if TYPE_CHECKING:
    from ddpscope.analysis.live import LiveFeed
    from ddpscope.transport.subscriber import Subscriber
    from ddpscope.ui.app import WatchApp

EPILOG = """\
examples:
  ddpscope watch                                  # listen on tcp://127.0.0.1:5557
  ddpscope watch --endpoint tcp://127.0.0.1:6000  # where DDPSCOPE_ENDPOINT points the ranks
  ddpscope run -- torchrun --nproc_per_node=4 train.py   # launch a job with this UI beside it
  ddpscope watch --endpoint tcp://0.0.0.0:5557 --keys DIR # multi-node: relays connect with keys

Start it before, during or after the job: ranks re-send their run info every
few seconds, so a late watcher picks them up. Keys: q quits, space pauses,
? lists the rest. docs/watch.md describes every panel. Listening beyond
loopback needs CURVE keys (`ddpscope keys DIR`; docs/security.md).
"""

#: Exit status when the endpoint cannot be bound (another watcher holds it).
EXIT_CANNOT_LISTEN = 3

#: Seconds a busy thread may hold the GIL before a waiting one gets it (CPython's
#: default is 5 ms). The ingest thread is busy most of the time at hundreds of
#: ranks; every step of handling a key press waits this long for the GIL, so the
#: default made key presses take 100-400 ms at 256 ranks.
GIL_SWITCH_S = 0.001


def run_app(app: WatchApp, lifeline: Lifeline | None = None) -> None:
    """Run the UI in this thread with the GIL handed over quickly to it; it ends
    when ``lifeline`` says (a stop signal, the terminal gone) or the user quits."""
    from ddpscope.ui.terminal import use_tolerant_driver

    app.lifeline = lifeline
    use_tolerant_driver(app)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        app.run()
    finally:
        sys.setswitchinterval(previous)


class WatchCommand:
    name = "watch"
    help = "live view of every rank of a DDP job (terminal UI)"
    description = (
        "Listen where ranks publish (loopback by default) and show every rank at a glance: "
        "step times and their phases, all-reduce waits per bucket, findings with what to do, "
        "and any rank's stacks on demand. Needs no torch."
    )
    epilog = EPILOG

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--endpoint",
            metavar="ADDR",
            help="ZeroMQ address to listen on (default: $DDPSCOPE_ENDPOINT, else "
            f"{config.DEFAULT_ENDPOINT})",
        )
        parser.add_argument(
            "--control-endpoint",
            metavar="ADDR",
            help="address requests to ranks go out on (default: endpoint port + 1)",
        )
        parser.add_argument(
            "--keys",
            metavar="DIR",
            help="CURVE server keys from `ddpscope keys DIR` (default: $DDPSCOPE_KEYS); "
            "required to listen beyond loopback",
        )
        parser.add_argument("--log", metavar="FILE", help="show FILE in the job log view")
        parser.add_argument(
            "--catch-up",
            metavar="DIR",
            help="read the newest run recorded in DIR first, so a watcher started (or "
            "restarted) mid-run shows the run's history",
        )
        add_metrics_argument(parser)
        parser.add_argument(
            "--decoders",
            metavar="N",
            type=int,
            default=0,
            help="decode telemetry in N worker processes (default 0: in the ingest thread); "
            "for thousands of ranks, where decoding alone fills a core (docs/watch.md)",
        )

    def run(self, args: argparse.Namespace) -> int:
        env = dict(os.environ)
        if args.endpoint:
            env[config.ENDPOINT_VAR] = args.endpoint
        if args.control_endpoint:
            env[config.CONTROL_ENDPOINT_VAR] = args.control_endpoint
        if args.keys:
            env[config.KEYS_VAR] = args.keys
        # The watcher needs only where to listen; the rank-side key options
        # (DDPSCOPE_SERVER_KEY, ...) in its environment are not its business.
        watcher_env = {k: v for k, v in env.items() if k not in config.RANK_KEY_VARS}
        try:
            opts = config.load(env=watcher_env)
        except config.ConfigError as exc:
            print(f"ddpscope watch: error: {exc}", file=sys.stderr)
            return 2
        if args.decoders < 0:
            print(
                f"ddpscope watch: error: --decoders wants 0 or more, not {args.decoders}",
                file=sys.stderr,
            )
            return 2
        from ddpscope.metrics import MetricsAddressError, parse_address
        from ddpscope.transport.security import SecurityError
        from ddpscope.ui.app import build_app

        try:
            if args.metrics:
                parse_address(args.metrics)
            feed, sub = open_feed(
                opts, env.get(config.KEYS_VAR, ""), args.catch_up, args.metrics, args.decoders
            )
        except (SecurityError, MetricsAddressError) as exc:
            print(f"ddpscope watch: error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"ddpscope watch: {exc} (is another watcher running?)", file=sys.stderr)
            return EXIT_CANNOT_LISTEN
        with feed, Lifeline(terminal_fd=terminal_fd()) as lifeline:
            run_app(build_app(feed, log_path=args.log), lifeline)
        report_handshakes(sub, "ddpscope watch")
        return lifeline.exit_status() if lifeline.stopping else 0


def terminal_fd() -> int | None:
    """The UI's terminal (stdin, where Textual reads keys), if it is one."""
    try:
        fd = sys.__stdin__.fileno() if sys.__stdin__ is not None else -1
    except (OSError, ValueError):
        return None
    return fd if fd >= 0 and os.isatty(fd) else None


def add_metrics_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve OpenMetrics (Prometheus) at http://HOST:PORT/metrics: per-rank step "
        "time, waits, drops and active findings (default: off; docs/watch.md)",
    )


def open_feed(
    opts: config.Options,
    keys_dir: str = "",
    catch_up: str | None = None,
    metrics: str | None = None,
    decoders: int = 0,
) -> tuple[LiveFeed, Subscriber]:
    """Bind the watcher's sockets (with keys from ``keys_dir`` if given) and a feed on them
    (that first reads the newest run recorded in ``catch_up``, if given, and serves
    OpenMetrics at ``metrics``, HOST:PORT, if given).

    Raises SecurityError for unusable keys or a bind the policy refuses (beyond
    loopback without keys), MetricsAddressError for a ``metrics`` that is not
    HOST:PORT, OSError when an address cannot be bound. ``decoders``: worker
    processes that decode (0: the ingest thread does).
    """
    from ddpscope.analysis.live import LiveFeed
    from ddpscope.metrics import open_metrics
    from ddpscope.transport.security import load_server_keys
    from ddpscope.transport.subscriber import Subscriber

    keys = load_server_keys(os.path.expanduser(keys_dir)) if keys_dir else None
    control = opts.resolved_control_endpoint()
    sub = Subscriber(opts.endpoint, control, keys=keys)
    server = None
    try:
        server = open_metrics(metrics, "watcher")
        feed = LiveFeed(
            opts.endpoint,
            control,
            freeze_gc=True,
            subscriber=sub,
            catch_up=catch_up or None,
            metrics=server,
            decoders=decoders,
        )
    except BaseException:
        sub.close()
        if server is not None:
            server.close()
        raise
    return feed, sub


def report_handshakes(sub: Subscriber, who: str) -> None:
    """After the UI closes: say if peers failed to authenticate while it ran."""
    if sub.handshake_failures:
        print(
            f"{who}: {sub.handshake_failures} connection(s) failed the handshake: "
            f"{sub.handshakes.last_error}",
            file=sys.stderr,
        )


def job_log_path(env: Mapping[str, str]) -> str:
    """Where the launched job's output goes: beside its recording, else a temp file."""
    opts = config.load(env=env)
    if opts.record and opts.run_id:
        run_dir = os.path.join(opts.record, opts.run_id)
        os.makedirs(run_dir, exist_ok=True)
        return os.path.join(run_dir, "job.log")  # readers skip files that are not records
    return os.path.join(tempfile.gettempdir(), f"ddpscope-{opts.run_id or os.getpid()}.log")


def launch_with_watcher(
    command: list[str], env: Mapping[str, str], metrics: str | None = None
) -> int:
    """``ddpscope run`` with the UI: the job's output to a log file, the UI in this terminal.

    The UI stays on the job's final state until the user quits. Quitting
    while the job runs leaves it running: the launcher then waits for it as
    ``--headless`` would (signals are forwarded, its status is returned).
    A stop signal, or the terminal going away, ends the UI in any state; the
    job gets the signal (a lost terminal is a SIGHUP, as for a job run in it,
    unless SIGHUP was ignored: ``nohup``) and the launcher waits for it.
    """
    from ddpscope.transport.security import SecurityError
    from ddpscope.ui.app import build_app

    opts = config.load(env={k: v for k, v in env.items() if k not in config.RANK_KEY_VARS})
    try:
        feed, sub = open_feed(opts, env.get(config.KEYS_VAR, ""), metrics=metrics)
    except (OSError, SecurityError) as exc:
        print(f"ddpscope run: {exc}; running without the watcher", file=sys.stderr)
        return launch(command, env)
    log_path = job_log_path(env)
    forwarder = Forwarder()
    hangup = int(getattr(signal, "SIGHUP", 1))

    def terminal_lost() -> None:
        if hangup not in lifeline.ignored:
            forwarder.handle(hangup)

    lifeline = Lifeline(forwarder.handle, terminal_lost, terminal_fd())
    with lifeline:
        with feed, open(log_path, "ab") as log:
            child = start_job(
                command,
                env,
                forwarder,
                stdin=subprocess.DEVNULL,  # the terminal belongs to the UI
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            if isinstance(child, int):
                return child
            run_app(build_app(feed, log_path=log_path, job=child), lifeline)
        report_handshakes(sub, "ddpscope run")
        if child.poll() is None:
            if lifeline.signum is not None:
                name = _signal_name(lifeline.signum)
                say(f"ddpscope run: {name} passed on; waiting for job {child.pid} to stop")
            elif not lifeline.terminal_lost:  # (a lost terminal reads nothing)
                say(
                    f"ddpscope run: watcher closed; job {child.pid} keeps running (output: "
                    f"{log_path}). Waiting for it; Ctrl-C stops it."
                )
        rc = child.wait()
    say(f"ddpscope run: job output is in {log_path}")
    return exit_status(rc)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
