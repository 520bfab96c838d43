"""The command line: ``engine generate``, ``engine chat``, ``engine serve``, ``engine rpc``,
``engine worker``, ``engine router``, ``engine cluster``."""

# The docstring above is ``engine --help``'s description. One module per command family: generate
# and chat in generate.py; serve and rpc in serve.py; worker, router and cluster in cluster.py;
# pool in pool.py; keys (and every command's --curve-keys) in keys.py. The engine's options (and
# generate's and chat's sampling options) are in engine_options.py, one map of flags to fields.

from __future__ import annotations

import argparse
import sys

from engine.cli.cluster import add_cluster_commands
from engine.cli.engine_options import add_engine_options
from engine.cli.generate import add_generate_commands
from engine.cli.keys import add_curve_option, add_keys_commands, apply_curve_option
from engine.cli.pool import add_pool_commands
from engine.cli.serve import add_server_commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    add_generate_commands(sub)

    add_server_commands(sub, add_engine_options)
    add_cluster_commands(sub, add_engine_options)
    add_pool_commands(sub)
    for command in list(sub.choices.values()):
        add_curve_option(command)
    add_keys_commands(sub)

    args = parser.parse_args(argv)
    try:
        apply_curve_option(args)
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
