"""CURVE keys for a tcp:// client endpoint (docs/deployment.md).

    python -m zllm.launch.keys server --curve-dir /etc/zllm/curve
        make the server's key pair (the server also makes it at its first start); prints the
        path of the public key file to hand to clients
    python -m zllm.launch.keys new-client --curve-dir /etc/zllm/curve --name alice --out ./alice
        authorize a new client: its public key goes to <curve dir>/clients/alice.key, its key
        pair to ./alice/alice.key_secret (hand that file, and server.key, to the client)

Removing <curve dir>/clients/NAME.key revokes that client at its next connection.
"""

from __future__ import annotations

import argparse
import os
import sys

from zllm.ipc.curve import SERVER_NAME, create_client_keys, load_or_create_server_keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zllm.launch.keys", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    server = commands.add_parser("server", help="make (or show) the server's key pair")
    server.add_argument("--curve-dir", required=True)
    client = commands.add_parser("new-client", help="authorize a new client and write its key pair")
    client.add_argument("--curve-dir", required=True)
    client.add_argument("--name", required=True)
    client.add_argument("--out", default=".", help="directory for the client's key pair (made 0700)")
    args = parser.parse_args(argv)
    try:
        if args.command == "server":
            load_or_create_server_keys(args.curve_dir)
            print(os.path.join(args.curve_dir, f"{SERVER_NAME}.key"))
        else:
            authorized, key_pair = create_client_keys(args.curve_dir, args.name, args.out)
            print(f"authorized: {authorized}\nclient key pair (give to the client, keep private): {key_pair}")
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
