"""``ddpscope keys [DIR]``: create the CURVE keypair a watcher or relay needs off loopback."""

from __future__ import annotations

import argparse
import os
import sys

from ddpscope import config

#: Where keys go when neither DIR nor DDPSCOPE_KEYS says.
DEFAULT_KEYS_DIR = os.path.join("~", ".ddpscope", "keys")

EPILOG = """\
examples:
  ddpscope keys /shared/ddpscope-keys             # server.key, server.key_secret (mode 0600)
  ddpscope watch --endpoint tcp://0.0.0.0:5557 --keys /shared/ddpscope-keys
  DDPSCOPE_SERVER_KEY=/shared/ddpscope-keys/server.key ddpscope relay --upstream tcp://HEAD:5557

  ddpscope keys /shared/ddpscope-keys --client node07
      # node07.key_secret for the client (DDPSCOPE_CLIENT_KEY), and its public
      # key in clients/: once clients/ holds keys, the server accepts only them.

The secret key never leaves the watcher's host; ranks and relays need only the
public key (server.key). docs/security.md describes what keys protect.
"""


class KeysCommand:
    name = "keys"
    help = "create CURVE keys for a watcher or relay that listens beyond loopback"
    description = (
        "Create a CURVE keypair with ZeroMQ (files written with mode 0600 in a directory "
        "of mode 0700). The watcher or relay gets the directory (--keys DIR or "
        "DDPSCOPE_KEYS); ranks and relays get the public key (DDPSCOPE_SERVER_KEY)."
    )
    epilog = EPILOG

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "dir",
            nargs="?",
            metavar="DIR",
            help=f"directory for the keys (default: $DDPSCOPE_KEYS, else {DEFAULT_KEYS_DIR})",
        )
        parser.add_argument(
            "--client",
            metavar="NAME",
            help="create a client keypair NAME instead, and allow it: DIR/NAME.key_secret "
            "for the client, DIR/clients/NAME.key for the server's allow-list",
        )
        parser.add_argument("--force", action="store_true", help="replace existing keys")

    def run(self, args: argparse.Namespace) -> int:
        from ddpscope.transport.security import (
            CLIENTS_DIR,
            PUBLIC_SUFFIX,
            SecurityError,
            create_keypair,
        )

        directory = os.path.expanduser(
            args.dir or os.environ.get(config.KEYS_VAR) or DEFAULT_KEYS_DIR
        )
        try:
            if args.client:
                name = args.client
                if not name or os.sep in name or name.startswith(".") or name == "server":
                    raise SecurityError(
                        f"client name {name!r}: use a plain file name other than 'server'"
                    )
                pub, sec = create_keypair(directory, name, force=args.force)
                allowed = os.path.join(directory, CLIENTS_DIR)
                os.makedirs(allowed, mode=0o700, exist_ok=True)
                dest = os.path.join(allowed, name + PUBLIC_SUFFIX)
                if os.path.exists(dest) and not args.force:
                    raise SecurityError(f"{dest} exists (use --force to replace it)")
                os.replace(pub, dest)
                print(f"client secret key: {sec}  (give it to the client: DDPSCOPE_CLIENT_KEY)")
                print(f"allowed public key: {dest}")
                print(
                    "The server now accepts only the clients in "
                    f"{allowed}; restart it to pick up changes."
                )
                return 0
            pub, sec = create_keypair(directory, force=args.force)
        except SecurityError as exc:
            print(f"ddpscope keys: error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"ddpscope keys: error: {exc}", file=sys.stderr)
            return 2
        print(f"secret key: {sec}  (watcher/relay only: --keys {directory})")
        print(f"public key: {pub}  (ranks and relays: DDPSCOPE_SERVER_KEY={pub})")
        return 0
