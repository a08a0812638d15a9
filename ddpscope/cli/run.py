"""``ddpscope run -- COMMAND``: watch a DDP job without editing its script.

The launcher changes nothing but the child's environment: ``ddpscope/_bootstrap``
goes first on PYTHONPATH so that its ``sitecustomize`` runs in every Python
process the command starts (torchrun's agent, each rank, spawned DataLoader
workers), and ``DDPSCOPE_AUTOATTACH=1`` tells it to attach ddpscope to every
DistributedDataParallel model those processes build. The options travel as the
DDPSCOPE_* variables of :mod:`ddpscope.config`, with one run id generated here
so that all ranks of the launch record into one run directory.

This module must not import torch: only the rank processes need it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ddpscope import config
from ddpscope.analysis.wording import ranks_phrase
from ddpscope.cli.launch import launch
from ddpscope.record.reader import attempts

#: Directory whose sitecustomize.py hooks DDP construction in the child processes.
BOOTSTRAP_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_bootstrap"
)

#: Where recordings go when neither --record nor DDPSCOPE_RECORD says.
DEFAULT_RECORD_DIR = "runs"

# Run ids become directory names; keep them to characters every filesystem takes.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

EPILOG = """\
examples:
  ddpscope run -- torchrun --standalone --nproc_per_node=4 train.py --epochs 2
  ddpscope run --record /data/runs -- python -m torch.distributed.run --nproc_per_node=2 train.py
  ddpscope run --headless --endpoint tcp://127.0.0.1:6000 -- python train.py
  ddpscope run --endpoint tcp://HEAD:5557 -- torchrun --nnodes=2 --nproc_per_node=8 ...

Every DistributedDataParallel model the launched Python processes build gets
ddpscope.attach(model) right after its constructor returns; the script is not
edited. Processes started with python -I, -E or -S ignore PYTHONPATH and are not
watched. Other DDPSCOPE_* variables in the environment (see
docs/configuration.md) reach the ranks unchanged.

On a multi-node launch (torchrun --nnodes with more than one node, or
--relay / DDPSCOPE_RELAY=1) a relay runs inside this launcher: the node's
ranks publish to it on a private ipc:// socket and it forwards to --endpoint
(the watcher's address, with DDPSCOPE_SERVER_KEY if the watcher has keys).
No UI opens beside such a job: run `ddpscope watch` where --endpoint points.
See docs/relay.md.
"""


class UsageError(Exception):
    """A bad option value: reported before anything is launched."""


def new_run_id() -> str:
    """A fresh run id, sortable by start time (same shape the ranks would pick)."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def build_env(
    base: Mapping[str, str],
    record: str | None = None,
    endpoint: str | None = None,
    run_id: str | None = None,
    command: Sequence[str] = (),
) -> dict[str, str]:
    """The child's environment. ``None`` keeps what ``base`` says (or the default).

    The run id: ``run_id``, else DDPSCOPE_RUN_ID, else for a multi-node
    torchrun ``command`` the one all nodes share (:func:`shared_run_id`; left
    to the ranks when there is none), else a new one.

    Raises UsageError when an option (from the arguments or from ``base``)
    has a value the ranks could not use, so that nothing is launched.
    """
    env = dict(base)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *(p for p in entries if p)])
    env[config.AUTOATTACH_VAR] = "1"

    if record is None:
        record = env.get(config.RECORD_VAR) or DEFAULT_RECORD_DIR
    # Absolute: the ranks may run in another directory than this launcher.
    env[config.RECORD_VAR] = os.path.abspath(record) if record else ""
    if endpoint is not None:
        env[config.ENDPOINT_VAR] = endpoint
    if run_id is None:
        run_id = env.get(config.RUN_ID_VAR) or None
    if run_id is None and torchrun_nnodes(command) > 1:
        run_id = shared_run_id(command) or ""
    if run_id is None:
        run_id = new_run_id()
    if run_id and not _RUN_ID.fullmatch(run_id):
        raise UsageError(
            f"run id {run_id!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it names the run's directory)"
        )
    if run_id:
        env[config.RUN_ID_VAR] = run_id
    else:
        env.pop(config.RUN_ID_VAR, None)  # the ranks agree on one through their store
    keys = env.get(config.KEYS_VAR, "")
    if keys and not env.get(config.SERVER_KEY_VAR):
        # The watcher listens with these keys: the ranks need their public half.
        from ddpscope.transport.security import PUBLIC_SUFFIX, SERVER_NAME

        env[config.SERVER_KEY_VAR] = os.path.join(
            os.path.abspath(os.path.expanduser(keys)), SERVER_NAME + PUBLIC_SUFFIX
        )
    try:
        config.load(env=env)
    except config.ConfigError as exc:
        raise UsageError(str(exc)) from None
    return env


def check_record_dir(env: Mapping[str, str]) -> None:
    """Raise UsageError when the ranks could not record where ``env`` says.

    Each rank would otherwise find out alone, after the job started, and
    train unrecorded with a warning in its output.
    """
    record = env.get(config.RECORD_VAR, "")
    if not record:
        return
    try:
        os.makedirs(record, exist_ok=True)
        # Writing is the only test that holds for root and read-only mounts alike.
        with tempfile.TemporaryFile(dir=record):
            pass
    except OSError as exc:
        raise UsageError(
            f"cannot record into {record}: {exc.strerror or exc}; choose another --record DIR, "
            "or --record '' to record nothing"
        ) from None


def torchrun_options(command: Sequence[str]) -> dict[str, str] | None:
    """torchrun's own options in ``command`` (``--nnodes=2`` and ``--nnodes 2`` alike,
    names with ``-`` for ``_``), or None when it is not a torchrun launch.

    Recognises ``torchrun`` and ``python -m torch.distributed.run`` (or
    ``.launch``); only options before the training script are looked at.
    """
    if not command:
        return None
    args = list(command)
    if os.path.basename(args[0]) == "torchrun":
        rest = args[1:]
    else:
        try:
            i = args.index("-m")
        except ValueError:
            return None
        if args[i + 1 : i + 2] not in (["torch.distributed.run"], ["torch.distributed.launch"]):
            return None
        rest = args[i + 2 :]
    found: dict[str, str] = {}
    for j, arg in enumerate(rest):
        if arg.endswith(".py") or arg in ("-m", "--module"):
            break  # the training script: its own arguments are not torchrun's
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        if not eq:
            following = rest[j + 1] if j + 1 < len(rest) else ""
            value = "" if following.startswith("-") else following
        found[name.replace("_", "-")] = value
    return found


def torchrun_nnodes(command: Sequence[str]) -> int:
    """The most nodes a torchrun command may use (``--nnodes=N`` or ``MIN:MAX``); 1 if not said."""
    value = (torchrun_options(command) or {}).get("--nnodes", "")
    try:
        return max(int(part) for part in value.split(":")) if value else 1
    except ValueError:
        return 1


def shared_run_id(command: Sequence[str]) -> str | None:
    """The run id every node's launcher can agree on for a multi-node launch.

    Each node runs its own ``ddpscope run``; a fresh id per launcher would
    split one job into one run per node. torchrun's rendezvous id is the same
    on every node (SLURM scripts pass the job id), so it names the run; without
    one, None: the ranks agree on an id through the process group's store.
    """
    options = torchrun_options(command) or {}
    rdzv = options.get("--rdzv-id", "")
    if not rdzv or rdzv == "none":
        return None
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in rdzv)[:120]
    return f"rdzv-{cleaned}"


def wants_relay(command: Sequence[str], env: Mapping[str, str], flag: bool | None = None) -> bool:
    """Whether ``ddpscope run`` starts a relay on this node (see docs/relay.md).

    ``--relay`` / ``--no-relay`` decide; else DDPSCOPE_RELAY (1/0); else a
    relay runs when the command is a torchrun launch of more than one node.
    """
    if flag is not None:
        return flag
    value = env.get(config.RELAY_VAR, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    if value:
        var = config.RELAY_VAR
        raise UsageError(f"{var}={env[var]!r}: use 1 (relay) or 0 (no relay)")
    return torchrun_nnodes(command) > 1


#: A Unix socket path holds at most 107 bytes (sun_path); "/ranks.sock" takes 11.
_MAX_SOCKET_DIR = 107 - len("/ranks.sock")


def _socket_dir() -> str:
    """A private (0700) directory for the relay's socket, short enough for a socket path.

    A long TMPDIR (a cluster's per-job scratch path) makes the default one too
    long; /tmp is then used instead.
    """
    path = tempfile.mkdtemp(prefix="ddpscope-relay-")
    if len(path) <= _MAX_SOCKET_DIR:
        return path
    os.rmdir(path)
    return tempfile.mkdtemp(prefix="ddpscope-", dir="/tmp")


class NodeRelay:
    """A relay inside this launcher: the ranks of this node publish to it over ipc://."""

    def __init__(self, env: Mapping[str, str], metrics: str | None = None) -> None:
        from ddpscope.metrics import open_metrics
        from ddpscope.transport.relay import Relay

        opts = config.load(env=env)
        self.upstream = opts.endpoint
        self._dir = _socket_dir()
        self.listen = f"ipc://{self._dir}/ranks.sock"
        server = None
        try:
            server = open_metrics(metrics, "relay")
            self.relay = Relay(
                self.listen,
                opts.endpoint,
                upstream_control=opts.resolved_control_endpoint(),
                upstream_keys=opts.client_keys(),
                metrics=server,
            )
        except BaseException:
            if server is not None:
                server.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    def rank_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The ranks' environment: publish to the relay, which holds the upstream keys."""
        out = {k: v for k, v in env.items() if k not in config.RANK_KEY_VARS}
        out[config.ENDPOINT_VAR] = self.listen
        out[config.CONTROL_ENDPOINT_VAR] = config.derive_control_endpoint(self.listen)
        return out

    def start(self) -> None:
        self.relay.start()

    def close(self) -> None:
        self.relay.settle()  # the ranks' last messages (end) out before stopping
        self.relay.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def describe_attempts(env: Mapping[str, str]) -> str:
    """The line naming each attempt's recording, when torchrun restarted the job; else ''."""
    opts = config.load(env=env)
    if not (opts.record and opts.run_id):
        return ""
    found = attempts(os.path.join(opts.record, opts.run_id))
    if not found:
        return ""
    dirs = ", ".join(f"{path}{os.sep} (attempt {n})" for n, path in found)
    return (
        f"ddpscope: the job restarted {len(found) - 1} time(s); each attempt is a run of its "
        f"own: {dirs}. `ddpscope report {opts.record}` reads the newest."
    )


def describe_unrecorded(env: Mapping[str, str]) -> str:
    """The line saying no process of the job attached a model, when none did; else ''."""
    opts = config.load(env=env)
    if not (opts.record and opts.run_id):
        return ""
    try:
        names = os.listdir(opts.record)
    except OSError:
        names = []
    attempt = re.compile(re.escape(opts.run_id) + r"(-r\d+)?")
    if any(attempt.fullmatch(n) for n in names):
        return ""  # some attempt of the job attached (torchrun's restarts are ID-rN)
    head = f"ddpscope: run {opts.run_id} recorded nothing: no process of the job attached a model. "
    notes_dir = env.get(config.NOTES_VAR, "")
    failed = failed_constructions(read_failures(notes_dir))
    if failed:
        return head + failed
    unsynced = unwatched_training(read_notes(notes_dir))
    if unsynced:
        return head + unsynced
    return head + (
        "ddpscope watches DistributedDataParallel models and modules under "
        "torch.distributed._composable.replicate; the job built none before it ended "
        "(FSDP and other sharded wrappers are not watched)."
    )


def _json_notes(directory: str, prefix: str = "") -> list[dict[str, Any]]:
    """The JSON objects the job's ranks left in ``directory`` (names starting with
    ``prefix``); unreadable ones skipped."""
    out = []
    try:
        names = sorted(os.listdir(directory)) if directory else []
    except OSError:
        return []
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                note = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(note, dict):
            out.append(note)
    return out


def read_failures(directory: str) -> list[dict[str, Any]]:
    """The notes of DDP constructions that raised (hooks/unwatched.py), well-formed ones only."""
    return [
        n
        for n in _json_notes(directory, "failed-")
        if isinstance(n.get("rank"), int)
        and all(isinstance(n.get(k), str) for k in ("error", "site"))
    ]


def failed_constructions(notes: list[dict[str, Any]]) -> str:
    """What the job's DistributedDataParallel constructors raised, when they did."""
    if not notes:
        return ""
    notes = sorted(notes, key=lambda n: n["rank"])
    first = notes[0]
    ranks = [n["rank"] for n in notes if n["rank"] >= 0]
    who = ranks_phrase(ranks) if ranks else "a process"
    same = all(n["error"] == first["error"] for n in notes)
    also = "" if same or len(notes) == 1 else " (the others' errors differ: see the job's output)"
    return (
        f"DistributedDataParallel(...) raised on {who} at {first['site']}: {first['error']}"
        f"{also}. There was no model to watch; the job's traceback says more."
    )


def read_notes(directory: str) -> list[dict[str, int]]:
    """The notes the job's ranks left (hooks/unwatched.py), well-formed ones only."""
    keys = ("rank", "world", "steps", "collectives")
    return [n for n in _json_notes(directory) if all(isinstance(n.get(k), int) for k in keys)]


def unwatched_training(notes: list[dict[str, int]]) -> str:
    """What ranks that stepped optimizers with no DDP model and no collectives did."""
    if not notes:
        return ""
    notes = sorted(notes, key=lambda n: n["rank"])
    ranks = ranks_phrase([n["rank"] for n in notes])
    first = notes[0]
    collectives = max(n["collectives"] for n in notes)
    return (
        f"Yet {ranks} stepped an optimizer ({ranks_phrase([first['rank']])}: "
        f"{first['steps']} steps) in a process group of {first['world']} ranks with "
        f"{collectives} collective{'s' if collectives != 1 else ''} between the first "
        "and the last step: no DistributedDataParallel model, and nothing averaged the "
        "gradients, so each rank trained its own copy of the model, on its own data if "
        "a DistributedSampler split it. Wrap the model in "
        "torch.nn.parallel.DistributedDataParallel before training (pytorch/examples' "
        "imagenet main.py wraps it only on CUDA), or average the gradients every step."
    )


def describe(env: Mapping[str, str]) -> str:
    """The one line saying where the recording goes."""
    opts = config.load(env=env)
    live = f"live telemetry to {opts.endpoint}"
    run = opts.run_id or "(id agreed by the ranks)"
    if not opts.record:
        return f"ddpscope: run {run} is not recorded (--record ''); {live}"
    where = os.path.join(opts.record, opts.run_id or "RUN_ID")
    return f"ddpscope: recording run {run} to {where}{os.sep} ({live})"


class RunCommand:
    name = "run"
    help = "launch a training command with ddpscope attached to every DDP model"
    description = (
        "Launch COMMAND (torchrun ..., python -m torch.distributed.run ..., or any python "
        "command) with ddpscope attached to every DistributedDataParallel model its "
        "processes build, recording the run. No change to the training script is needed."
    )
    epilog = EPILOG

    def __init__(self) -> None:
        self._parser: argparse.ArgumentParser | None = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self._parser = parser
        parser.usage = (
            "%(prog)s [--record DIR] [--endpoint ADDR] [--run-id ID] [--headless] "
            "[--relay | --no-relay] -- COMMAND..."
        )
        parser.add_argument(
            "--record",
            metavar="DIR",
            help="record the run into DIR/RUN_ID/ (default: $DDPSCOPE_RECORD, else ./"
            f"{DEFAULT_RECORD_DIR}); '' records nothing",
        )
        parser.add_argument(
            "--endpoint",
            metavar="ADDR",
            help="ZeroMQ address the ranks publish to (default: $DDPSCOPE_ENDPOINT, else "
            f"{config.DEFAULT_ENDPOINT})",
        )
        parser.add_argument(
            "--run-id",
            metavar="ID",
            help="run id shared by all ranks (default: $DDPSCOPE_RUN_ID, else a new one)",
        )
        parser.add_argument(
            "--headless",
            action="store_true",
            help="do not open the live watcher beside the job (it opens only when stdin, "
            "stdout and stderr are a terminal; the job's output then goes to a log file)",
        )
        relay = parser.add_mutually_exclusive_group()
        relay.add_argument(
            "--relay",
            dest="relay",
            action="store_true",
            default=None,
            help="run a relay for this node's ranks, forwarding to --endpoint (default: on "
            "for torchrun --nnodes>1, or when DDPSCOPE_RELAY=1)",
        )
        relay.add_argument(
            "--no-relay",
            dest="relay",
            action="store_false",
            help="never run a relay: ranks publish to --endpoint directly",
        )
        from ddpscope.cli.watch import add_metrics_argument

        add_metrics_argument(parser)
        parser.add_argument(
            "command",
            nargs=argparse.REMAINDER,
            metavar="-- COMMAND",
            help="the command to launch, after --",
        )

    def run(self, args: argparse.Namespace) -> int:
        command = list(args.command)
        if command[:1] == ["--"]:
            command = command[1:]
        if not command:
            return self._usage_error("missing COMMAND (e.g. ddpscope run -- torchrun train.py)")
        try:
            env = build_env(os.environ, args.record, args.endpoint, args.run_id, command)
            relay = wants_relay(command, env, getattr(args, "relay", None))
            check_record_dir(env)
        except UsageError as exc:
            return self._usage_error(str(exc))
        metrics = getattr(args, "metrics", None)
        with_ui = not args.headless and all(s.isatty() for s in (sys.stdin, sys.stdout, sys.stderr))
        if metrics:
            from ddpscope.metrics import MetricsAddressError, parse_address

            try:
                parse_address(metrics)
            except MetricsAddressError as exc:
                return self._usage_error(str(exc))
            if not (relay or with_ui):
                return self._usage_error(
                    "--metrics is served by the watcher or the relay this command runs; "
                    "with neither (--headless, no relay) serve it from `ddpscope watch --metrics`"
                )
        print(describe(env), file=sys.stderr, flush=True)
        notes = tempfile.mkdtemp(prefix="ddpscope-notes-")
        env[config.NOTES_VAR] = notes
        try:
            if relay:
                rc = self._run_relayed(command, env, metrics)
            elif with_ui:
                from ddpscope.cli.watch import launch_with_watcher

                rc = launch_with_watcher(command, env, metrics)
            else:
                rc = launch(command, env)
            ending = describe_attempts(env) or describe_unrecorded(env)
        finally:
            shutil.rmtree(notes, ignore_errors=True)
        if ending:
            print(ending, file=sys.stderr, flush=True)
        return rc

    def _run_relayed(
        self, command: list[str], env: dict[str, str], metrics: str | None = None
    ) -> int:
        from ddpscope.transport.security import SecurityError

        try:
            node = NodeRelay(env, metrics)
        except (SecurityError, config.ConfigError) as exc:
            return self._usage_error(str(exc))
        except OSError as exc:
            print(f"ddpscope run: cannot start the relay: {exc}", file=sys.stderr)
            return 3
        secure = "with keys" if node.relay.upstream_watch.curve else "in the clear"
        print(
            f"ddpscope: relaying this node's ranks to {node.upstream} ({secure}); watch "
            f"with `ddpscope watch --endpoint ...` where that address points",
            file=sys.stderr,
            flush=True,
        )
        node.start()
        try:
            return launch(command, node.rank_env(env))
        finally:
            node.close()

    def _usage_error(self, message: str) -> int:
        # Like argparse's own errors (same format, same status), without SystemExit.
        if self._parser is not None:
            self._parser.print_usage(sys.stderr)
        print(f"ddpscope run: error: {message}", file=sys.stderr)
        return 2
