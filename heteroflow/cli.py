"""`heteroflow` command line: parses arguments and dispatches; the work lives in the packages.

User errors (`UserError`, including every config problem) print a clear message and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from heteroflow import __version__
from heteroflow.errors import ConfigError, UserError


def _print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def cmd_devices(args: argparse.Namespace) -> int:
    """List local devices, or the chip catalog."""
    from heteroflow.devices import report
    if args.catalog:
        from heteroflow.devices.catalog import CATALOG
        if args.json:
            _print_json(report.catalog_json(CATALOG))
        else:
            print(report.format_catalog(CATALOG))
        return 0
    from heteroflow.devices.probe import probe_local_devices
    found = probe_local_devices()
    if args.json:
        _print_json(report.devices_json(found))
    else:
        print(report.format_devices(found))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Check a job file; print a summary, or every problem as `path: message`."""
    from heteroflow.config import load_job
    from heteroflow.config.summary import summarize_job
    job = load_job(args.job)
    print(f"{args.job}: valid")
    print(summarize_job(job))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="heteroflow", description="Train Transformers on mixed-vendor clusters.")
    parser.add_argument("--version", action="version", version=f"heteroflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, run: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(run=run)
        return p

    p = add("devices", cmd_devices, "show the devices found on this machine, or the chip catalog")
    p.add_argument("--catalog", action="store_true", help="list the chip catalog instead of local devices")
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = add("validate", cmd_validate, "check a job YAML file")
    p.add_argument("job", metavar="JOB.yaml")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `heteroflow` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as error:
        from heteroflow.config.job import format_config_error
        print(format_config_error(error), file=sys.stderr)
        return 2
    except UserError as error:
        print(f"heteroflow {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
