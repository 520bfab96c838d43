"""``engine keys generate DIR`` and the ``--curve-keys DIR`` option every command takes
(added to the command line by cli.py)."""

from __future__ import annotations

import argparse
import os


def add_keys_commands(subparsers) -> None:
    k = subparsers.add_parser("keys", help="CURVE key pairs that authenticate ZeroMQ peers")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    g = ksub.add_parser("generate", help="make server and client key pairs in DIR")
    g.add_argument("directory", metavar="DIR")
    g.add_argument("--force", action="store_true", help="replace keys already in DIR")
    g.set_defaults(func=cmd_keys_generate)


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from engine.ipc.curve import generate_keys

    keys = generate_keys(args.directory, force=args.force)
    print(f"CURVE keys in {keys.directory}:")
    print("  server.key, server.key_secret  (every process that binds a socket)")
    print("  client.key, client.key_secret  (every process that connects)")
    print("Run every process with --curve-keys DIR (or ENGINE_CURVE_KEYS=DIR); drop another")
    print("client's public *.key file there to admit it. Keep the *_secret files private.")
    return 0


def add_curve_option(parser: argparse.ArgumentParser) -> None:
    """On ``parser`` and each of its subcommands (``engine pool serve --curve-keys DIR``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                add_curve_option(sub)
    parser.add_argument(
        "--curve-keys",
        default=argparse.SUPPRESS,
        metavar="DIR",
        help="authenticate every ZeroMQ peer with the CURVE keys in DIR (engine keys generate)",
    )


def apply_curve_option(args: argparse.Namespace) -> None:
    """Put --curve-keys in the environment, where this process's sockets and its children (the
    workers and pool service of ``engine cluster``) read it; checked at once (a clear error)."""
    directory = getattr(args, "curve_keys", None)
    if directory is None:
        return
    from engine.ipc.curve import load_keys

    load_keys(directory)
    os.environ["ENGINE_CURVE_KEYS"] = os.path.abspath(directory)
