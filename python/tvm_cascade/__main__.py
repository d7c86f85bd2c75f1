"""Command line: ``python -m tvm_cascade demo``."""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_cascade", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "demo",
        help="fuse plain attention with rolling_update, show the proven repairs and the "
        "fused TIR, and check it against numpy on the CPU (and on a CUDA GPU if present)",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run()
    return 2


if __name__ == "__main__":
    sys.exit(main())
