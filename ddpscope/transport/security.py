"""CURVE keys and the bind policy: who may listen where, and with which keys.

The policy (docs/security.md explains the threat model behind it):

- The watcher and relays listen on loopback (or an ``ipc://`` path) by default,
  and may do so without keys. Listening on any other address needs a server
  keypair (``ddpscope keys DIR``; ``--keys DIR`` or ``DDPSCOPE_KEYS``): with
  keys every connection is encrypted and the server is authenticated, without
  them :func:`check_bind` refuses, so there is never a silently open port.
- A client (a rank, or a relay forwarding upstream) that is given the
  server's public key (``DDPSCOPE_SERVER_KEY``: Z85 text, a key file or a keys
  directory) speaks CURVE. CURVE needs a client keypair too; unless one is
  configured (``DDPSCOPE_CLIENT_KEY``), each socket gets an ephemeral one.
- A server whose keys directory has a ``clients/`` subdirectory with public
  key files accepts only those clients (ZAP allow-list); without it, any
  client that knows the server's public key is accepted.

Key files are ZeroMQ's certificate format (what ``zmq.auth.create_certificates``
writes, so ``zmq.auth.load_certificate`` reads them), created with mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import stat
import time
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("ddpscope")

#: Base name of the server keypair in a keys directory.
SERVER_NAME = "server"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
#: Subdirectory of a keys directory holding the allowed clients' public keys.
CLIENTS_DIR = "clients"
#: ZAP domain of the listening sockets (the allow-list is kept under it).
ZAP_DOMAIN = "ddpscope"
#: Length of a CURVE key in Z85 text.
Z85_LEN = 40

KEYS_HINT = (
    "create a keypair with `ddpscope keys DIR`, start the watcher (or relay) with "
    "--keys DIR (or DDPSCOPE_KEYS=DIR), and give ranks and relays "
    "DDPSCOPE_SERVER_KEY=DIR/server.key"
)


class SecurityError(Exception):
    """A key that cannot be used, or a bind that the policy refuses. Says what to do."""


def require_curve() -> None:
    """Raise unless this libzmq can do CURVE (it needs libsodium or its tweetnacl)."""
    if not zmq.has("curve"):
        raise SecurityError(
            f"this libzmq ({zmq.zmq_version()}, pyzmq {zmq.__version__}) was built without "
            "CURVE support (libsodium), so ddpscope cannot use keys. Install a pyzmq wheel "
            "from PyPI (they bundle it) or rebuild libzmq with --with-libsodium."
        )


# --- where one may listen ------------------------------------------------------


def endpoint_host(endpoint: str) -> str | None:
    """The host part of a ``tcp://HOST:PORT`` endpoint (None for ipc/inproc)."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    if ";" in host:  # tcp://SOURCE;HOST:PORT (a connect-side source address)
        host = host.rpartition(";")[2]
    return host.strip("[]")


def is_local(endpoint: str) -> bool:
    """True when only this host can reach ``endpoint``: ipc://, inproc:// or tcp loopback."""
    host = endpoint_host(endpoint)
    if host is None:
        return endpoint.startswith(("ipc://", "inproc://"))
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, an interface name or a wildcard: reachable from outside


def check_bind(endpoint: str, keys: ServerKeys | None, who: str = "watcher") -> None:
    """Refuse to listen beyond this host without keys."""
    if keys is None and not is_local(endpoint):
        raise SecurityError(
            f"the {who} refuses to listen on {endpoint} without keys: anyone who can reach "
            "that port could read every rank's telemetry, inject fake telemetry and ask the "
            f"ranks for their stack dumps. To listen there, {KEYS_HINT}. To stay on this "
            "host, use tcp://127.0.0.1:PORT or ipc://PATH (see docs/security.md)."
        )


# --- key files -----------------------------------------------------------------


@dataclass(frozen=True)
class ServerKeys:
    """A listening side's keypair, and its client allow-list (None: any client)."""

    public: bytes
    secret: bytes
    #: Directory of allowed clients' public key files; None accepts any client
    #: that knows the server's public key.
    clients_dir: str | None = None
    source: str = ""


@dataclass(frozen=True)
class ClientKeys:
    """What a connecting side needs: the server's public key and its own keypair."""

    server_public: bytes
    public: bytes = b""
    secret: bytes = b""
    #: A configured keypair (for an allow-list) rather than a fresh one per socket.
    source: str = ""

    def keypair(self) -> tuple[bytes, bytes]:
        if self.secret:
            return self.public, self.secret
        return zmq.curve_keypair()  # ephemeral: one per socket


_BANNER = "#   ****  Generated on {} by ddpscope keys  ****\n#   ZeroMQ CURVE {} Certificate\n{}\n"


def _write_private(path: str, text: str, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise SecurityError(
            f"{path} exists; not overwriting a key (use --force to replace it)"
        ) from None
    try:
        os.fchmod(fd, 0o600)  # also when an existing file is replaced
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _cert_text(public: bytes, secret: bytes | None) -> str:
    now = datetime.datetime.now().isoformat(timespec="seconds")
    if secret:
        kind, note = "**Secret**", "#   Keep this file private (mode 0600); never copy it to ranks."
    else:
        kind, note = "Public", "#   Give this file (or its key) to ranks and relays."
    lines = [_BANNER.format(now, kind, note), "metadata", "curve"]
    lines.append(f'    public-key = "{public.decode()}"')
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def create_keypair(directory: str, name: str = SERVER_NAME, force: bool = False) -> tuple[str, str]:
    """Write ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret``, both mode 0600.

    The directory is created with mode 0700 if it does not exist. Returns the
    two paths. Refuses to overwrite existing keys unless ``force``.
    """
    require_curve()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = zmq.curve_keypair()
    pub_path = os.path.join(directory, name + PUBLIC_SUFFIX)
    sec_path = os.path.join(directory, name + SECRET_SUFFIX)
    if not force:
        for path in (pub_path, sec_path):
            if os.path.exists(path):
                raise SecurityError(
                    f"{path} exists; not overwriting a key (use --force to replace it)"
                )
    _write_private(sec_path, _cert_text(public, secret), force)
    _write_private(pub_path, _cert_text(public, None), force)
    return pub_path, sec_path


def _read_cert(path: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"cannot read key file {path}: {exc}") from None
    _check_z85(public, path)
    if secret is not None:
        _check_z85(secret, path)
    return public, secret


def _check_z85(key: bytes, where: str) -> None:
    if len(key) != Z85_LEN:
        raise SecurityError(f"{where}: not a CURVE key ({len(key)} characters, expected 40)")
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError, IndexError):
        raise SecurityError(f"{where}: not a CURVE key (invalid Z85 text)") from None


def _check_private(path: str) -> None:
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecurityError(
            f"{path}: secret key file is readable by other users (mode "
            f"{stat.S_IMODE(mode):o}); run chmod 600 {path}"
        )


def load_server_keys(directory: str) -> ServerKeys:
    """The keypair in ``DIR/server.key_secret``, and ``DIR/clients/`` if it has keys."""
    require_curve()
    path = os.path.join(directory, SERVER_NAME + SECRET_SUFFIX)
    if not os.path.isfile(path):
        raise SecurityError(f"no server key in {directory} ({path} is missing); {KEYS_HINT}")
    _check_private(path)
    public, secret = _read_cert(path)
    if secret is None:
        raise SecurityError(f"{path} holds no secret key")
    clients = os.path.join(directory, CLIENTS_DIR)
    allow: str | None = None
    if os.path.isdir(clients):
        found = [n for n in os.listdir(clients) if n.endswith(PUBLIC_SUFFIX)]
        if not found:
            raise SecurityError(
                f"{clients} exists but holds no client keys (*.key): no client could connect. "
                "Add keys (`ddpscope keys DIR --client NAME`) or remove the directory to "
                "accept any client that has the server key."
            )
        for name in found:
            _read_cert(os.path.join(clients, name))  # every file must be a valid key
        allow = clients
    return ServerKeys(public=public, secret=secret, clients_dir=allow, source=path)


def parse_server_key(value: str) -> bytes:
    """The server's public key from Z85 text, a key file, or a keys directory."""
    text = value.strip()
    if len(text) == Z85_LEN and not os.path.exists(text):
        key = text.encode()
        _check_z85(key, "server key")
        return key
    path = os.path.expanduser(text)
    if os.path.isdir(path):
        path = os.path.join(path, SERVER_NAME + PUBLIC_SUFFIX)
    if not os.path.isfile(path):
        raise SecurityError(
            f"server key {value!r}: neither a 40-character Z85 key nor a readable key file "
            f"({path} not found)"
        )
    public, _ = _read_cert(path)
    return public


def load_client_keys(server_key: str, client_key: str = "") -> ClientKeys:
    """Keys of a connecting side; ``client_key`` is a ``NAME.key_secret`` file or ""."""
    require_curve()
    server_public = parse_server_key(server_key)
    if not client_key:
        return ClientKeys(server_public=server_public)
    path = os.path.expanduser(client_key)
    if not os.path.isfile(path):
        raise SecurityError(f"client key file {path} not found")
    _check_private(path)
    public, secret = _read_cert(path)
    if secret is None:
        raise SecurityError(
            f"{path} holds only a public key; the client needs its NAME{SECRET_SUFFIX} file"
        )
    return ClientKeys(server_public=server_public, public=public, secret=secret, source=path)


# --- applying keys to sockets --------------------------------------------------


def apply_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Make ``sock`` a CURVE server (before it binds)."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    if keys.clients_dir is not None:
        # CURVE consults the ZAP handler (the allow-list) whenever one runs; it
        # looks the client's key up under this domain.
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def apply_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``sock`` a CURVE client of the server whose public key ``keys`` holds."""
    public, secret = keys.keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def start_authenticator(ctx: zmq.Context, keys: ServerKeys | None) -> object | None:
    """A ZAP handler enforcing the allow-list, when the keys have one (else None).

    Without a ZAP handler libzmq accepts any client that completes the CURVE
    handshake, i.e. any client that knows the server's public key.
    """
    if keys is None or keys.clients_dir is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("ddpscope.auth"))
    auth.start()
    auth.configure_curve(domain=ZAP_DOMAIN, location=keys.clients_dir)
    return auth


# --- seeing failed handshakes --------------------------------------------------

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
#: Events a handshake watch listens to.
WATCHED_EVENTS = HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED

_MISMATCH = getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", 0x11000002)
_CRYPTO = getattr(zmq, "PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC", 0x11000001)


def explain_failure(event: int, value: int, curve: bool, server: bool) -> str:
    """One line on why a handshake failed, from a monitor event."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if server:
            return f"a client's key is not in the allow-list (ZAP status {value})"
        return (
            f"the server refused this client's key (ZAP status {value}): its allow-list "
            "does not hold the public key of DDPSCOPE_CLIENT_KEY"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MISMATCH:
        if curve:
            other = "client" if server else "server"
            return f"security mismatch: this side uses keys and the {other} does not"
        if server:
            return "security mismatch: a client uses keys and this side does not"
        return (
            "security mismatch: the server requires keys; set DDPSCOPE_SERVER_KEY to its public key"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _CRYPTO:
        if server:
            return "a client used the wrong server key (its handshake could not be decrypted)"
        return "the handshake could not be decrypted: wrong key"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        if server:
            return "a client dropped its handshake (it has no key, or the wrong one)"
        if curve:
            return (
                "the server dropped the handshake: DDPSCOPE_SERVER_KEY is most likely not the "
                "public key of the server at this address (or that server has no keys)"
            )
        return (
            "the server dropped the handshake: if it listens with keys, set "
            "DDPSCOPE_SERVER_KEY to its public key"
        )
    try:
        name = zmq.Event(event).name
    except ValueError:
        name = str(event)
    return f"handshake failed ({name}, {value:#x})"


@dataclass
class HandshakeWatch:
    """Counts failed handshakes on some sockets through their monitor sockets.

    ``poll()`` reads pending events without blocking; the owning thread calls it
    from its loop (monitor sockets, like all sockets, belong to one thread).
    Warnings are logged at most every ``log_every_s`` seconds.
    """

    who: str
    curve: bool
    server: bool
    log_every_s: float = 30.0
    failures: int = 0
    succeeded: int = 0
    last_error: str = ""
    monitors: list[tuple[zmq.Socket, zmq.Socket, str]] = field(default_factory=list)
    #: Watched sockets (watch(..., disconnects=True)) whose connection dropped
    #: since the owner last cleared this.
    disconnected: set[zmq.Socket] = field(default_factory=set)
    #: Watched sockets (watch(..., connects=True)) with a connection up whose
    #: handshake has not failed.
    connected: set[zmq.Socket] = field(default_factory=set)
    _logged_at: float = -1e9
    _logged_reason: str = ""
    _precise: bool = False

    def watch(
        self, sock: zmq.Socket, endpoint: str, disconnects: bool = False, connects: bool = False
    ) -> zmq.Socket:
        """Watch ``sock``'s handshakes (and, if asked, its disconnections and
        connections); returns the monitor socket to poll."""
        events = WATCHED_EVENTS | (zmq.EVENT_DISCONNECTED if disconnects else 0)
        events |= zmq.EVENT_CONNECTED if connects else 0
        mon = sock.get_monitor_socket(events)
        self.monitors.append((sock, mon, endpoint))
        return mon

    def unwatch(self, sock: zmq.Socket) -> None:
        for entry in [m for m in self.monitors if m[0] is sock]:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            entry[1].close(linger=0)
            self.monitors.remove(entry)
        self.disconnected.discard(sock)
        self.connected.discard(sock)

    def poll(self) -> int:
        """Read pending events; returns how many handshakes failed among them."""
        failed = 0
        for sock, mon, endpoint in self.monitors:
            while True:
                try:
                    frames = mon.recv_multipart(zmq.DONTWAIT)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    break
                try:
                    evt = parse_monitor_message(frames)
                except Exception:
                    continue
                if evt["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.succeeded += 1
                    continue
                if evt["event"] == zmq.EVENT_DISCONNECTED:
                    self.disconnected.add(sock)
                    self.connected.discard(sock)
                    continue
                if evt["event"] == zmq.EVENT_CONNECTED:
                    self.connected.add(sock)
                    continue
                self.connected.discard(sock)
                failed += 1
                self.failures += 1
                reason = explain_failure(evt["event"], evt["value"], self.curve, self.server)
                vague = evt["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                self._note(reason, endpoint, vague)
        return failed

    def _note(self, reason: str, endpoint: str, vague: bool) -> None:
        # Both ends close a refused connection: which side notices first varies,
        # so a vague report does not replace a precise one already known.
        if not (vague and self._precise):
            self.last_error = f"{endpoint}: {reason}"
            self._precise = not vague
        now = time.monotonic()
        if reason != self._logged_reason or now - self._logged_at >= self.log_every_s:
            self._logged_at, self._logged_reason = now, reason
            log.warning(
                "ddpscope %s: handshake on %s failed (%d so far): %s",
                self.who,
                endpoint,
                self.failures,
                reason,
            )

    def close(self) -> None:
        for sock, mon, _ in self.monitors:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(linger=0)
        self.monitors.clear()
