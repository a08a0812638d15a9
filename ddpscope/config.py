"""Options of the rank side, from keyword arguments and DDPSCOPE_* variables.

Precedence: a keyword passed to ``attach`` beats the environment, which beats
the default. Every option has one environment variable; docs/configuration.md
lists them, and a test checks that every entry of ``OPTIONS`` is there.
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
            raise ConfigError(f"DDPSCOPE_SERVER_KEY / DDPSCOPE_CLIENT_KEY: {exc}") from None


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
    "endpoint": ("DDPSCOPE_ENDPOINT", "ZeroMQ address ranks publish to"),
    "control_endpoint": (
        "DDPSCOPE_CONTROL_ENDPOINT",
        "ZeroMQ address ranks take requests from (default: endpoint port + 1)",
    ),
    "record": ("DDPSCOPE_RECORD", "record the run into this directory"),
    "disable": ("DDPSCOPE_DISABLE", "1 turns ddpscope off; attach() returns an inert handle"),
    "checksum_every": (
        "DDPSCOPE_CHECKSUM_EVERY",
        "fingerprint weights every N steps (0: automatic, -1: off)",
    ),
    "checksum_budget": (
        "DDPSCOPE_CHECKSUM_BUDGET",
        "share of step time automatic fingerprints may cost (default 0.005)",
    ),
    "heartbeat_s": ("DDPSCOPE_HEARTBEAT_S", "seconds between heartbeats"),
    "resend_s": ("DDPSCOPE_RESEND_S", "seconds between re-sends of run info"),
    "stacks_after_s": (
        "DDPSCOPE_STACKS_AFTER_S",
        "send Python stacks once a rank is stuck this long in one phase",
    ),
    "queue_size": ("DDPSCOPE_QUEUE_SIZE", "messages buffered before dropping"),
    "sndhwm": ("DDPSCOPE_SNDHWM", "ZeroMQ send high-water mark"),
    "run_id": ("DDPSCOPE_RUN_ID", "run id (default: agreed by all ranks of the launch)"),
    "server_key": (
        "DDPSCOPE_SERVER_KEY",
        "the watcher's or relay's public key (Z85, key file or keys directory): use CURVE",
    ),
    "client_key": (
        "DDPSCOPE_CLIENT_KEY",
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
    if not 0 < opts.checksum_budget < 1:
        raise ConfigError("checksum_budget must be between 0 and 1")
    opts.resolved_control_endpoint()  # raises on a malformed endpoint
    if opts.client_key and not opts.server_key:
        raise ConfigError(
            "DDPSCOPE_CLIENT_KEY is set but DDPSCOPE_SERVER_KEY is not: a client keypair is "
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
