"""Where `heteroflow import-megatron` puts its results.

Without `-o` the job YAML goes to stdout and the report to stderr, so `> job.yaml` captures just the job;
with `-o` the job goes to the file and the report to stdout; `--json` prints one JSON document (job and
report) on stdout instead. A blocked import prints the report and fails with the blockers named.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from heteroflow.config.yamlfile import dump_yaml
from heteroflow.errors import UserError
from heteroflow.megatron.importer import ImportResult
from heteroflow.megatron.placement import PLACEHOLDER_DEVICE


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot write: {exc.strerror or exc}") from None


def emit(result: ImportResult, *, output: str | None = None, plan_out: str | None = None,
         as_json: bool = False) -> int:
    """Print / write an import result; raises `UserError` when the import was blocked. Returns 0."""
    if as_json:
        json.dump(result.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    if result.blocked:
        if not as_json:
            print(result.report.format(), file=sys.stderr)
        raise UserError(f"{result.source}: not imported: " + "; ".join(result.report.blockers))
    if output:
        _write(output, result.job_yaml())
    elif not as_json:
        sys.stdout.write(result.job_yaml())
    if plan_out:
        _write(plan_out, dump_yaml(result.plan_dict(), sort_keys=False))
    if not as_json:
        stream = sys.stdout if output else sys.stderr
        print(result.report.format(), file=stream)
        for path in (output, plan_out):
            if path:
                print(f"wrote {path}", file=stream)
    if result.needs_device_type:
        print(f"heteroflow import-megatron: note: the job's nodes have the placeholder device type "
              f"`{PLACEHOLDER_DEVICE}`; set it, or re-run with --device-type NAME or --cluster CLUSTER.yaml",
              file=sys.stderr)
    return 0
