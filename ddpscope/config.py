"""Options of the rank side, from keyword arguments and DDPSCOPE_* variables.

Precedence: a keyword passed to ``attach`` beats the environment, which beats
the default. Every option has one environment variable; docs/configuration.md
lists them, and a test checks that every entry of ``OPTIONS`` is there.

Every DDPSCOPE_* name is spelled here and nowhere else in the package (the
``*_VAR`` constants; tests/unit/test_config.py checks). The one exception is
``ddpscope/_bootstrap/sitecustomize.py``, which runs at the start of every
Python process of a launched job and imports nothing of ddpscope; the test
pins its spelling of :data:`AUTOATTACH_VAR` to this one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpscope.transport.security import ClientKeys

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"

# The rank options' variables, one per field of Options.
ENDPOINT_VAR = "DDPSCOPE_ENDPOINT"
CONTROL_ENDPOINT_VAR = "DDPSCOPE_CONTROL_ENDPOINT"
RECORD_VAR = "DDPSCOPE_RECORD"
DISABLE_VAR = "DDPSCOPE_DISABLE"
CHECKSUM_EVERY_VAR = "DDPSCOPE_CHECKSUM_EVERY"
CHECKSUM_BUDGET_VAR = "DDPSCOPE_CHECKSUM_BUDGET"
BUCKET_EVERY_VAR = "DDPSCOPE_BUCKET_EVERY"
HEARTBEAT_S_VAR = "DDPSCOPE_HEARTBEAT_S"
RESEND_S_VAR = "DDPSCOPE_RESEND_S"
STACKS_AFTER_S_VAR = "DDPSCOPE_STACKS_AFTER_S"
QUEUE_SIZE_VAR = "DDPSCOPE_QUEUE_SIZE"
SNDHWM_VAR = "DDPSCOPE_SNDHWM"
RUN_ID_VAR = "DDPSCOPE_RUN_ID"
SERVER_KEY_VAR = "DDPSCOPE_SERVER_KEY"
CLIENT_KEY_VAR = "DDPSCOPE_CLIENT_KEY"
#: The rank's CURVE options, i.e. how a rank reaches the watcher: a watcher
#: started with the job's environment ignores them, a relay takes them over.
RANK_KEY_VARS = (SERVER_KEY_VAR, CLIENT_KEY_VAR)

# Variables of the launcher and the watcher, not rank options.
#: "1": the bootstrap attaches ddpscope to every DDP model (set by ``ddpscope run``).
AUTOATTACH_VAR = "DDPSCOPE_AUTOATTACH"
#: Directory where ranks of a ``ddpscope run`` job leave notes for it (hooks/unwatched.py).
NOTES_VAR = "DDPSCOPE_NOTES_DIR"
#: 1: ``ddpscope run`` starts a relay on this node; 0: never; unset: on multi-node launches.
RELAY_VAR = "DDPSCOPE_RELAY"
#: The watcher's (or relay's) server keys directory; ranks do not read it.
KEYS_VAR = "DDPSCOPE_KEYS"
#: Set by ``ddpscope run`` in the job's environment: how it knows the processes
#: the job left running once it ended (ddpscope.cli.leftovers).
JOB_VAR = "DDPSCOPE_JOB"


class ConfigError(ValueError):
    """An option has a value ddpscope cannot use."""


@dataclass(frozen=True)
class Options:
    #: Where ranks publish telemetry (the watcher or a relay binds here).
    endpoint: str = DEFAULT_ENDPOINT
    #: Where ranks listen for requests (stacks, fingerprints); "" derives it
    #: from ``endpoint`` (port + 1).
    control_endpoint: str = ""
    #: Directory to record the run into; "" records nothing.
    record: str = ""
    #: Turn ddpscope off entirely on this rank.
    disable: bool = False
    #: Fingerprint weights every N steps; 0 picks N so the cost stays under
    #: ``checksum_budget`` of step time; -1 turns periodic fingerprints off.
    checksum_every: int = 0
    #: Share of step time periodic fingerprints may cost when N is automatic.
    checksum_budget: float = 0.005
    #: Time every gradient bucket's all-reduce every N steps (after the first
    #: three). 0: register the comm hook only if its floor fits the step
    #: (hooks/bucket_cost.py), then pick N (1..32) so the bookkeeping stays
    #: under 0.25% of step time. -1: never (DDP's C++ path throughout).
    bucket_every: int = 0
    #: Seconds between heartbeats (the publisher thread's pace).
    heartbeat_s: float = 1.0
    #: Seconds between re-sends of run info and bucket layout, for late watchers.
    resend_s: float = 5.0
    #: A rank stuck this many seconds in one phase sends its Python stacks once.
    stacks_after_s: float = 5.0
    #: Messages the bounded hot-path buffer holds before dropping (and counting).
    queue_size: int = 4096
    #: ZeroMQ send high-water mark, in messages.
    sndhwm: int = 10000
    #: Run id; "" derives one shared by all ranks of the launch.
    run_id: str = ""
    #: The watcher's (or relay's) CURVE public key: Z85 text, a key file or a
    #: keys directory. Set, every connection of the rank is encrypted and the
    #: server authenticated; "" connects in the clear (loopback, ipc).
    server_key: str = ""
    #: This rank's own keypair (a NAME.key_secret file), for a server that keeps
    #: an allow-list of clients; "" uses a fresh keypair per connection.
    client_key: str = ""

    def resolved_control_endpoint(self) -> str:
        if self.control_endpoint:
            return self.control_endpoint
        return derive_control_endpoint(self.endpoint)

    def client_keys(self) -> ClientKeys | None:
        """The CURVE keys of the rank's connections, or None when it connects in the clear.

        Raises ConfigError naming the variable when a key cannot be used.
        """
        if not self.server_key:
            return None
        from ddpscope.transport.security import SecurityError, load_client_keys

        try:
            return load_client_keys(self.server_key, self.client_key)
        except SecurityError as exc:
            raise ConfigError(f"{SERVER_KEY_VAR} / {CLIENT_KEY_VAR}: {exc}") from None


def derive_control_endpoint(endpoint: str) -> str:
    """tcp://host:port -> tcp://host:port+1; ipc://path -> ipc://path.control."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if not port.isdigit() or not host:
            raise ConfigError(f"endpoint {endpoint!r} must look like tcp://HOST:PORT")
        return f"tcp://{host}:{int(port) + 1}"
    if endpoint.startswith("ipc://"):
        return endpoint + ".control"
    raise ConfigError(f"endpoint {endpoint!r}: only tcp:// and ipc:// are supported")


#: Option name -> (environment variable, one-line help).
OPTIONS: dict[str, tuple[str, str]] = {
    "endpoint": (ENDPOINT_VAR, "ZeroMQ address ranks publish to"),
    "control_endpoint": (
        CONTROL_ENDPOINT_VAR,
        "ZeroMQ address ranks take requests from (default: endpoint port + 1)",
    ),
    "record": (RECORD_VAR, "record the run into this directory"),
    "disable": (DISABLE_VAR, "1 turns ddpscope off; attach() returns an inert handle"),
    "checksum_every": (
        CHECKSUM_EVERY_VAR,
        "fingerprint weights every N steps (0: automatic, -1: off)",
    ),
    "checksum_budget": (
        CHECKSUM_BUDGET_VAR,
        "share of step time automatic fingerprints may cost (default 0.005)",
    ),
    "bucket_every": (
        BUCKET_EVERY_VAR,
        "time every bucket's all-reduce every N steps (0: automatic, where the comm hook "
        "fits the step; 1: every step; -1: never)",
    ),
    "heartbeat_s": (HEARTBEAT_S_VAR, "seconds between heartbeats"),
    "resend_s": (RESEND_S_VAR, "seconds between re-sends of run info"),
    "stacks_after_s": (
        STACKS_AFTER_S_VAR,
        "send Python stacks once a rank is stuck this long in one phase",
    ),
    "queue_size": (QUEUE_SIZE_VAR, "messages buffered before dropping"),
    "sndhwm": (SNDHWM_VAR, "ZeroMQ send high-water mark"),
    "run_id": (RUN_ID_VAR, "run id (default: agreed by all ranks of the launch)"),
    "server_key": (
        SERVER_KEY_VAR,
        "the watcher's or relay's public key (Z85, key file or keys directory): use CURVE",
    ),
    "client_key": (
        CLIENT_KEY_VAR,
        "this rank's keypair file (NAME.key_secret) for servers with an allow-list",
    ),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _convert(name: str, raw: Any, kind: type, source: str) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(f"{source}: {raw!r} is not a boolean (use 1 or 0)")
    try:
        if kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if kind is float:
            return float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {raw!r} is not a valid {kind.__name__}") from None
    return str(raw)


def _validate(opts: Options) -> Options:
    if opts.heartbeat_s <= 0 or opts.resend_s <= 0:
        raise ConfigError("heartbeat_s and resend_s must be positive")
    if opts.queue_size < 16:
        raise ConfigError("queue_size must be at least 16")
    if opts.checksum_every < -1:
        raise ConfigError("checksum_every must be -1 (off), 0 (automatic) or a step count")
    if opts.bucket_every < -1:
        raise ConfigError("bucket_every must be -1 (off), 0 (automatic) or a step count")
    if not 0 < opts.checksum_budget < 1:
        raise ConfigError("checksum_budget must be between 0 and 1")
    opts.resolved_control_endpoint()  # raises on a malformed endpoint
    if opts.client_key and not opts.server_key:
        raise ConfigError(
            f"{CLIENT_KEY_VAR} is set but {SERVER_KEY_VAR} is not: a client keypair is "
            "only used together with the server's public key"
        )
    if opts.server_key:
        opts.client_keys()  # raises on a key that cannot be read
    return opts


def load(
    overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> Options:
    """Build Options from defaults, then the environment, then ``overrides``."""
    env = os.environ if env is None else env
    types = {f.name: f.type for f in dataclasses.fields(Options)}
    kind_of = {"str": str, "int": int, "float": float, "bool": bool}
    values: dict[str, Any] = {}
    for name, (var, _) in OPTIONS.items():
        if var in env:
            values[name] = _convert(name, env[var], kind_of[str(types[name])], var)
    for name, raw in (overrides or {}).items():
        if name not in OPTIONS:
            known = ", ".join(sorted(OPTIONS))
            raise TypeError(f"attach() got an unknown option {name!r}; known options: {known}")
        values[name] = _convert(name, raw, kind_of[str(types[name])], f"option {name}")
    return _validate(Options(**values))
