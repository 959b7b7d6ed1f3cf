"""`heteroflow` command line: parses arguments and dispatches; the work lives in the packages.

User errors (`UserError`, including every config problem) print a clear message and exit 2. Numeric flags
(`heteroflow.config.limits`) and output paths (`heteroflow.config.paths`) are checked before any work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence

from heteroflow import __version__
from heteroflow.config import limits
from heteroflow.config.paths import DIR, EXISTING_DIR, FILE_IN_NEW_DIR, Output, check_output_paths, job_outputs
from heteroflow.errors import ConfigError, Problem, UserError


def _print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def cmd_devices(args: argparse.Namespace) -> int:
    """List local devices, or the chip catalog."""
    from heteroflow.devices import report
    if args.catalog:
        from heteroflow.config.catalog import CATALOG
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


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise UserError(f"--env expects NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def run_import_megatron(args: argparse.Namespace):
    """Import the source named on the command line; returns the `ImportResult`."""
    from heteroflow.megatron import ImportOptions, import_megatron
    options = ImportOptions(cluster=args.cluster, device_type=args.device_type, script_args=tuple(args.script_args),
                            env=_env_pairs(args.env), nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                            vocab_size=args.vocab_size, **_megatron_version(args.megatron_version))
    return import_megatron(args.source, options)


def _megatron_version(text: str | None) -> dict:
    """`--megatron-version` as ImportOptions keywords (none: the current release's rules)."""
    if text is None:
        return {}
    from heteroflow.megatron.versions import parse_version
    return {"megatron_version": parse_version(text)}


def cmd_import_megatron(args: argparse.Namespace) -> int:
    """Import a Megatron-LM launch script / YAML as a job (see `heteroflow.megatron.output` for the streams)."""
    from heteroflow.megatron.output import emit
    if args.compare and args.json:
        raise UserError("--compare prints a table; drop --json (or run `heteroflow plan JOB --json` and "
                        "`heteroflow plan JOB --evaluate --json` on the imported job)")
    check_output_paths(Output("-o", args.output), Output("--plan-out", args.plan_out))
    result = run_import_megatron(args)
    status = emit(result, output=args.output, plan_out=args.plan_out, as_json=args.json)
    if args.compare:
        if result.job is None:
            raise UserError("--compare needs the cluster's device type: pass --device-type NAME or --cluster FILE")
        from heteroflow.megatron.compare import compare_with_planner
        print(compare_with_planner(result.job), file=sys.stdout if args.output else sys.stderr)
    return status


def cmd_train(args: argparse.Namespace) -> int:
    """Train a job under its plan (or `--plan`), on this machine's devices or emulated."""
    from heteroflow.config import load_job
    from heteroflow.launcher.launch import TrainingFailed
    from heteroflow.launcher.prepare import TrainOptions
    from heteroflow.launcher.signals import DEFAULT_STOP_GRACE_S, StoppedAtOnce
    from heteroflow.launcher.train import train_job
    if (args.node is None) != (args.rdzv is None):
        raise UserError("a multi-node run needs both --node NAME and --rdzv HOST:PORT (on every node)")
    if args.replan_on_failure and args.node is None:
        raise UserError("--replan-on-failure applies to multi-node runs (--node NAME --rdzv HOST:PORT)")
    job = load_job(args.job)
    if args.rank and not args.dry_run:
        raise UserError("--rank applies to dry runs: add --dry-run")
    if args.dry_run:
        from heteroflow.launcher.dry_run import dry_run_job
        dry_run_job(job, plan_path=args.plan, ranks=args.rank)
        return 0
    check_output_paths(Output("--metrics", args.metrics, FILE_IN_NEW_DIR), Output("--log-dir", args.log_dir, DIR),
                       Output("--tensorboard-dir", args.tensorboard_dir, DIR), *job_outputs(job))
    options = TrainOptions(plan_path=args.plan, emulate=args.emulate, steps=args.steps, metrics_path=args.metrics,
                           log_dir=args.log_dir, timeout_s=args.timeout, max_restarts=args.max_restarts,
                           node=args.node, rdzv=args.rdzv, join_timeout_s=args.join_timeout,
                           replan_on_failure=args.replan_on_failure, rejoin_timeout_s=args.rejoin_timeout,
                           resume=args.resume, tensorboard_dir=args.tensorboard_dir,
                           stop_grace_s=args.stop_grace if args.stop_grace is not None else DEFAULT_STOP_GRACE_S)
    try:
        results = train_job(job, options)
    except TrainingFailed as failure:
        print(f"heteroflow train: training failed\n{failure}", file=sys.stderr)
        return 1
    except StoppedAtOnce as stopped:
        print(f"heteroflow train: {stopped}; {_resume_advice(job)}", file=sys.stderr)
        return stopped.exit_status
    stopped_by = max((r.stopped_by for r in results.values()), default=0)
    if stopped_by:
        return _report_stop(job, results, stopped_by)
    if 0 not in results:  # a node without rank 0: rank 0's node prints the losses
        where = f"node {args.node} " if args.node else ""
        print(f"heteroflow train: {where}done (ranks {', '.join(map(str, sorted(results))) or 'none'})")
        return 0
    losses = results[0].losses
    if losses:
        resumed = f" (resumed at step {results[0].first_step})" if results[0].first_step else ""
        print(f"heteroflow train: done, {len(losses)} steps{resumed}, loss {losses[0]:.4f} -> {losses[-1]:.4f}"
              + (f"; metrics in {args.metrics}" if args.metrics else ""))
    return 0

def _resume_command() -> str:
    """This command line with `--resume` (added when missing)."""
    import shlex
    argv = ["heteroflow", *sys.argv[1:]]
    return shlex.join(argv if "--resume" in argv else [*argv, "--resume"])


def _resume_advice(job) -> str:
    """Where a killed run can continue from."""
    from heteroflow.runtime.checkpoint import checkpoint_root
    root = checkpoint_root(job)
    if root is None:
        return "the job sets no train.checkpoint, so nothing was saved"
    return f"the newest complete checkpoint in {root} is kept; continue from it with: {_resume_command()}"


def _report_stop(job, results: dict, signum: int) -> int:
    """One line for a run stopped by a signal after a step (`heteroflow.runtime.stop`); its exit status."""
    from heteroflow.runtime.stop import exit_status, signal_name
    result = results[min(results)]
    done = result.first_step + len(result.losses)
    what = f"heteroflow train: stopped by {signal_name(signum)} after step {done - 1}"
    if result.saved:
        print(f"{what}; checkpoint {result.saved} (step {done}); resume with: {_resume_command()}", flush=True)
    else:
        print(f"{what}; the job sets no train.checkpoint, so nothing was saved: set it to resume a stopped run "
              f"(it is written at a stop whatever its interval)", flush=True)
    return exit_status(signum)


def cmd_plan(args: argparse.Namespace) -> int:
    """Search the best plan for a job, or estimate a given one."""
    from heteroflow.stagemap.commands import plan_command
    check_output_paths(Output("-o", args.output), Output("--gantt", args.gantt))
    host = None
    if args.emulate and args.evaluate is not None and not args.profile:
        # priced as `train --emulate` prices it: the job's cluster.profile, else this host's cached quick profile
        from heteroflow.config import load_job
        from heteroflow.launcher.prepare import cache_dir
        from heteroflow.measure.host import emulation_profile
        host = emulation_profile(load_job(args.job), cache_dir())
    return plan_command(job_path=args.job, output=args.output, as_json=args.json, gantt=args.gantt,
                        evaluate=args.evaluate, profile_path=args.profile, emulate=args.emulate,
                        max_micro_batch_size=args.max_micro_batch_size,
                        calibration_path=args.calibration, profile=host)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the cost model's factors per device type to measured runs."""
    from heteroflow.calibrate.command import calibrate_command
    from heteroflow.stagemap.calibration import FACTORS
    check_output_paths(Output("-o", args.output))
    factors = tuple(f.strip() for f in args.factors.split(",") if f.strip()) if args.factors else FACTORS
    kwargs = {} if args.prior_weight is None else {"prior_weight": args.prior_weight}
    return calibrate_command(job_path=args.job, run_paths=args.runs, output=args.output, as_json=args.json,
                             factors=factors, stage_parts=args.stage_parts, **kwargs)


def cmd_tune(args: argparse.Namespace) -> int:
    """Run the best predicted plans briefly, calibrate from them, write the best measured plan."""
    from heteroflow.config import load_job
    from heteroflow.launcher.tune import TuneOptions, default_work_dir, tune_command
    if (args.node is None) != (args.rdzv is None):
        raise UserError("a multi-node tune needs both --node NAME and --rdzv HOST:PORT (on every node)")
    work_dir = args.work_dir or default_work_dir(args.output)
    check_output_paths(Output("-o", args.output), Output("--work-dir", work_dir, DIR))
    job = load_job(args.job)
    options = TuneOptions(output=args.output, top_k=args.top, steps=args.steps, emulate=args.emulate,
                          work_dir=work_dir, timeout_s=args.timeout, node=args.node, rdzv=args.rdzv,
                          join_timeout_s=args.join_timeout)
    return tune_command(job, options)


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure this machine's devices, links and disk for the cost model."""
    from heteroflow.measure.command import profile_command
    check_output_paths(Output("-o", args.output), Output("--disk-dir", args.disk_dir, EXISTING_DIR))
    return profile_command(output=args.output, quick=args.quick, device_type=args.device_type,
                           disk_dir=args.disk_dir, as_json=args.json, link=not args.no_link)


def cmd_prepare_data(args: argparse.Namespace) -> int:
    """Tokenize text / JSONL into a Megatron indexed dataset."""
    from heteroflow.data.prepare import prepare_data
    report = prepare_data(args.inputs, tokenizer_dir=args.tokenizer, prefix=args.output, json_key=args.json_key,
                          append_eod=args.append_eod, dtype=args.dtype, progress=sys.stderr.isatty())
    empty = f", {report.num_empty} empty documents left out" if report.num_empty else ""
    print(f"{report.prefix}.bin, {report.prefix}.idx: {report.num_documents} documents, {report.num_tokens} tokens "
          f"({report.dtype}, vocabulary {report.vocab_size}){empty}")
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

    p = add("train", cmd_train, "train a job: one process per device of its plan")
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument("--plan", metavar="PLAN.yaml", help="an explicit plan file (from `heteroflow plan -o`)")
    p.add_argument("--emulate", action="store_true",
                   help="run every rank as a local CPU process over gloo (vendor labels still pick the transport)")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON record per step to this file")
    p.add_argument("--log-dir", metavar="DIR",
                   help="keep every rank's output here (default: a temporary dir, removed after a success)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="step limit in seconds: a rank stuck in one step this long is reported with its stage and "
                        "step and the run stops instead of hanging; collectives time out a little later (default 600)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart every worker up to N times after a rank fails, resuming from the newest "
                        "checkpoint (default 0: fail at once)")
    p.add_argument("--node", metavar="NAME", help="multi-node: the cluster node this machine is (run the same "
                   "command with each node's name on each node)")
    p.add_argument("--rdzv", metavar="HOST:PORT", help="multi-node: where the nodes meet; the node on HOST hosts it")
    p.add_argument("--join-timeout", type=float, default=300.0, metavar="S",
                   help="multi-node: how long the nodes wait for each other (default 300)")
    p.add_argument("--replan-on-failure", action="store_true",
                   help="multi-node: when the run fails and a node does not come back, plan again on the nodes "
                        "that remain and resume from the newest checkpoint")
    p.add_argument("--rejoin-timeout", type=float, metavar="S",
                   help="multi-node: how long survivors wait for the missing nodes after a failure before "
                        "replanning (default: --timeout + --join-timeout)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in train.checkpoint.dir (any plan may resume "
                        "it; step 0 when there is none)")
    p.add_argument("--tensorboard-dir", metavar="DIR",
                   help="write TensorBoard scalars here from rank 0 (overrides train.tensorboard_dir; needs the "
                        "tensorboard extra)")
    p.add_argument("--stop-grace", type=float, metavar="S",
                   help="on SIGTERM or SIGINT every rank finishes its step and the run saves a checkpoint; the ranks "
                        "are killed if that takes longer than S seconds (default 25; set it below the scheduler's "
                        "window, e.g. SLURM --signal=TERM@T)")
    p.add_argument("--dry-run", action="store_true",
                   help="without the cluster: build each chosen rank's groups, stage, shard, optimizer and offload "
                        "tiers in a fake world of the plan's size (no storage, nothing computed) and report them "
                        "with the planner's memory figures")
    p.add_argument("--rank", type=int, action="append", metavar="R",
                   help="with --dry-run: a rank to dry-run (repeatable; default: the first, a middle and the last)")

    p = add("import-megatron", cmd_import_megatron,
            "turn a Megatron-LM launch script, --yaml-cfg file or NeMo model YAML into a job (never runs it)")
    p.add_argument("source", metavar="SCRIPT.sh|CONFIG.yaml")
    p.add_argument("script_args", nargs="*", metavar="ARG", help="positional parameters $1 $2 ... of the script")
    p.add_argument("-o", "--output", metavar="JOB.yaml", help="write the job here (default: stdout)")
    p.add_argument("--plan-out", metavar="PLAN.yaml", help="also write the Megatron layout as a plan file")
    p.add_argument("--compare", action="store_true",
                   help="also price the Megatron layout and heteroflow's best plan on the job's cluster, side by side")
    p.add_argument("--cluster", metavar="CLUSTER.yaml", help="place the layout on this cluster (top-level cluster:)")
    p.add_argument("--device-type", metavar="NAME", help="device type of the nodes the launcher describes")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="a variable the script reads from its environment (repeatable)")
    p.add_argument("--nnodes", type=int, metavar="N", help="number of nodes, when the source does not say")
    p.add_argument("--nproc-per-node", type=int, metavar="N", help="devices per node, when the source does not say")
    p.add_argument("--vocab-size", type=int, metavar="N",
                   help="tokenizer vocabulary size (before Megatron's padding), when it cannot be told")
    p.add_argument("--megatron-version", metavar="X.Y",
                   help="apply an older Megatron-Core release's rules where they changed (default: current main)")
    p.add_argument("--json", action="store_true", help="print one JSON document (job and report)")

    p = add("prepare-data", cmd_prepare_data,
            "tokenize text or JSONL files into Megatron's indexed format (PREFIX.bin + PREFIX.idx)")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="a .jsonl/.json file (one JSON object per line) or a text file (documents separated by "
                        "blank lines)")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="a local Hugging Face tokenizer directory")
    p.add_argument("-o", "--output", required=True, metavar="PREFIX", help="write PREFIX.bin and PREFIX.idx")
    p.add_argument("--json-key", default="text", metavar="KEY", help="the JSON field holding the text (default text)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's eos token")
    p.add_argument("--dtype", choices=("uint16", "int32"),
                   help="token dtype (default: uint16 below 65500 ids, else int32, as Megatron chooses)")

    p = add("plan", cmd_plan, "search the best plan for a job (or estimate one with --evaluate)")
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument("-o", "--output", metavar="PLAN.yaml", help="write the plan (with its predictions)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--gantt", metavar="FILE.png", help="draw the simulated schedule")
    p.add_argument("--evaluate", metavar="PLAN.yaml", nargs="?", const="",
                   help="estimate this plan file instead of searching (no file: the job's own plan)")
    p.add_argument("--profile", metavar="PROFILE.yaml", help="measured figures (default: the job's cluster.profile)")
    p.add_argument("--calibration", metavar="CALIBRATION.yaml",
                   help="factors fitted by `heteroflow calibrate` (default: the job's cluster.calibration)")
    p.add_argument("--emulate", action="store_true",
                   help="with --evaluate: price the run as `train --emulate` does it, every rank a local CPU process")
    p.add_argument("--max-micro-batch-size", type=int, metavar="N", help="largest micro-batch size searched")
    p.add_argument("--all-layouts", action="store_true",
                   help="accepted for old scripts: the search always covers every layout the cost model prices")

    p = add("calibrate", cmd_calibrate,
            "fit the cost model's factors per device type to measured runs (metrics files or a measurements file)")
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="a `train --metrics` file, or a YAML file with `measurements: [{plan: ..., tokens_per_s: ...}]`")
    p.add_argument("-o", "--output", metavar="CALIBRATION.yaml", help="write the calibration here")
    p.add_argument("--factors", metavar="F,F", help="fit only these factors (default: gemm,memory,overhead,tp_comm,"
                   "dp_comm)")
    p.add_argument("--prior-weight", type=float, metavar="W",
                   help="pull toward the uncalibrated model, in log step time per log factor (default 0.05)")
    p.add_argument("--stage-parts", action="store_true",
                   help="also fit each stage's measured compute, tp-collective, dp and optimizer times (metrics files "
                        "with per-stage figures)")
    p.add_argument("--json", action="store_true", help="print the calibration, sensitivities and residuals as JSON")

    p = add("tune", cmd_tune, "run the best predicted plans for a few steps, calibrate from them, keep the best "
            "measured plan")
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument("-o", "--output", metavar="PLAN.yaml", required=True, help="write the best measured plan here")
    p.add_argument("--top", type=int, default=3, metavar="K", help="plans to run, best predicted first (default 3)")
    p.add_argument("--steps", type=int, default=10, metavar="N",
                   help="steps per plan, the first 2 (or 20%%) not measured (default 10, at least 3)")
    p.add_argument("--emulate", action="store_true", help="run every rank as a local CPU process, as `train --emulate`")
    p.add_argument("--work-dir", metavar="DIR", help="trial plans, metrics, logs and the calibration (default: "
                   "PLAN.tune next to -o; must be empty); multi-node: the same shared directory on every node")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="step limit of each trial (as train)")
    p.add_argument("--node", metavar="NAME", help="multi-node: the cluster node this machine is")
    p.add_argument("--rdzv", metavar="HOST:PORT", help="multi-node: where the nodes meet for each trial")
    p.add_argument("--join-timeout", type=float, default=300.0, metavar="S",
                   help="multi-node: how long the nodes wait for each other (default 300)")

    p = add("profile", cmd_profile, "measure this machine's devices, links and disk for the cost model")
    p.add_argument("-o", "--output", metavar="PROFILE.yaml", help="write the profile here")
    p.add_argument("--quick", action="store_true", help="small sizes: seconds instead of minutes")
    p.add_argument("--device-type", metavar="NAME", help="the cluster device type these devices are")
    p.add_argument("--disk-dir", metavar="DIR", help="directory for the disk test (default: the temp dir)")
    p.add_argument("--no-link", action="store_true", help="skip the two-process link test")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    return parser


_FLAG_LIMITS = {  # argparse dest -> the flag as written, and its allowed range
    "steps": ("--steps", limits.STEPS), "timeout": ("--timeout", limits.TIMEOUT_S),
    "stop_grace": ("--stop-grace", limits.TIMEOUT_S),
    "join_timeout": ("--join-timeout", limits.TIMEOUT_S), "rejoin_timeout": ("--rejoin-timeout", limits.TIMEOUT_S),
    "max_restarts": ("--max-restarts", limits.MAX_RESTARTS), "nnodes": ("--nnodes", limits.NUM_NODES),
    "nproc_per_node": ("--nproc-per-node", limits.DEVICES_PER_NODE), "vocab_size": ("--vocab-size", limits.VOCAB_SIZE),
    "max_micro_batch_size": ("--max-micro-batch-size", limits.MICRO_BATCH_SIZE),
    "prior_weight": ("--prior-weight", limits.positive(100.0)), "top": ("--top", limits.integers(1, 64)),
}


def check_number_flags(args: argparse.Namespace) -> None:
    """Every numeric flag given is finite and in its range (`heteroflow.config.limits`), else one
    `--flag: message` line each, before any work."""
    problems = [Problem(flag, message) for dest, (flag, limit) in _FLAG_LIMITS.items()
                if getattr(args, dest, None) is not None and (message := limit.problem(getattr(args, dest)))]
    if problems:
        raise ConfigError(problems)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `heteroflow` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        check_number_flags(args)
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
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, and keep Python from reporting the closed
        # stdout again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
