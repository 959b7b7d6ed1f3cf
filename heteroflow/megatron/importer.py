"""`import_megatron`: a Megatron-LM launch script, `--yaml-cfg` file or NeMo model YAML -> a heteroflow job.

The job carries an explicit plan equal to the Megatron layout (one stage per pipeline rank, each with
Megatron's tp / cp / dp), so `heteroflow plan --evaluate` can price it; a comparison with the planner's
best plan takes `result.job` (the Megatron plan) and `result.job.with_plan(None)` (planner's choice).
Cluster: `--cluster FILE` places the layout on that cluster; `--device-type NAME` makes nodes node-0..
of that type from the launcher's sizes; with neither, the nodes get the device type `<set-me>`, which
`heteroflow validate` rejects until the user names their chip (the rest of the job is validated with a
stand-in device so every other problem shows now).
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from heteroflow.config import ClusterSpec, JobConfig, parse_cluster, parse_job, read_yaml
from heteroflow.config import limits
from heteroflow.config.catalog import lookup
from heteroflow.config.reader import Problems
from heteroflow.config.yamlfile import Dumper, read_text_file
from heteroflow.errors import ConfigError, UserError
from heteroflow.layout import ParallelLayout
from heteroflow.megatron.args import MegatronArgs, parse_argv
from heteroflow.megatron.context import Context
from heteroflow.megatron.features import check_features
from heteroflow.megatron.launcher import Launch, find_launch
from heteroflow.megatron.layout import MegatronLayout, map_layout
from heteroflow.megatron.mapping import map_model
from heteroflow.megatron.nemo import nemo_key, read_nemo_yaml
from heteroflow.megatron.placement import PLACEHOLDER_DEVICE, generated_cluster, plan_section
from heteroflow.megatron.report import Entry, ImportReport, LayoutSummary
from heteroflow.megatron.script_files import file_finder
from heteroflow.megatron.shell import run_script
from heteroflow.megatron.training import map_train
from heteroflow.megatron.programs import nemo_family, program_family
from heteroflow.megatron.model_config import is_model_config, read_model_config
from heteroflow.megatron.yaml_cfg import read_megatron_yaml, yaml_key
from heteroflow.megatron.yaml_files import read_megatron_yaml_file
from heteroflow.megatron.versions import CURRENT, MegatronVersion

_STAND_IN_DEVICE = "cpu"


@dataclass(frozen=True, kw_only=True, slots=True)
class ImportOptions:
    """What the user tells the importer besides the source file."""

    cluster: str | os.PathLike | None = None
    """A cluster YAML (top-level `cluster:`) to place the layout on."""
    device_type: str | None = None
    """Device type for generated nodes (ignored with `cluster`)."""
    script_args: tuple[str, ...] = ()
    """Positional parameters $1, $2, ... of the script."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables the script reads from its environment."""
    nnodes: int | None = None
    """Overrides the number of nodes the source implies."""
    nproc_per_node: int | None = None
    """Overrides the processes (devices) per node the source implies."""
    vocab_size: int | None = None
    """Tokenizer vocabulary size (before Megatron's padding) when the source does not tell it."""
    megatron_version: MegatronVersion = CURRENT
    """The Megatron-Core release whose rules apply where they changed (NullTokenizer's vocabulary)."""


@dataclass(frozen=True, slots=True)
class ImportResult:
    """The imported job, the Megatron layout and the report.

    `job_dict` is the job YAML data (None when a blocker stopped the import); `job` is the validated
    `JobConfig`, None also while the device type is the `<set-me>` placeholder.
    """

    source: str
    report: ImportReport
    layout: MegatronLayout | None
    job_dict: dict | None
    job: JobConfig | None

    @property
    def blocked(self) -> bool:
        """Whether model features stopped the import."""
        return bool(self.report.blockers)

    @property
    def needs_device_type(self) -> bool:
        """Whether the job still has the `<set-me>` placeholder device type."""
        return self.job_dict is not None and self.job is None

    def plan_dict(self) -> dict | None:
        """The Megatron layout as a plan file's data (`{"plan": ...}`)."""
        return None if self.job_dict is None else {"plan": self.job_dict["plan"]}

    def job_yaml(self) -> str:
        """The job as YAML text, with a header saying where it came from and what needs attention."""
        assert self.job_dict is not None, "no job: the import was blocked"
        head = [f"# Imported from Megatron-LM: {self.source}, by `heteroflow import-megatron`."]
        if self.layout is not None:
            lay, par = self.layout, self.layout.parallel
            experts = f" (experts: ep {par.ep}, etp {par.expert_tp})" if par.ep != 1 or par.etp is not None else ""
            head.append(f"# Megatron layout: tp {par.tp} x pp {lay.pp} x cp {par.cp} x dp {par.dp} on "
                        f"{lay.world_size} devices{experts}; plan.micro_batch_size = micro-batch "
                        f"{lay.micro_batch_size} x dp.")
        approx = self.report.by_disposition("approximated")
        if approx:
            head.append(f"# {len(approx)} setting(s) approximated; see the import report:")
            for e in approx:
                head += textwrap.wrap(f"{e.key}: {e.detail}", width=110, initial_indent="#   ",
                                      subsequent_indent="#       ")
        if self.needs_device_type:
            head.append(f"# ACTION NEEDED: replace `{PLACEHOLDER_DEVICE}` on node-0 with your device type (the other "
                        "nodes refer to it; see `heteroflow devices --catalog`),")
            head.append("# or re-run the import with --device-type NAME or --cluster CLUSTER.yaml.")
        body = dump_job_yaml(self.job_dict)
        if self.needs_device_type:
            # One anchor, so the user names the device type once for every node.
            first = f"device: {PLACEHOLDER_DEVICE}"
            body = body.replace(first, f"device: &device {PLACEHOLDER_DEVICE}", 1).replace(first, "device: *device")
        return "\n".join(head) + "\n" + body

    def to_json(self) -> dict:
        """One JSON document: the job (or null), the plan, and the report."""
        return {"source": self.source, "ready": self.job is not None, "blocked": self.blocked,
                "needs_device_type": self.needs_device_type, "job": self.job_dict, "report": self.report.to_json()}


class _FlowDict(dict):
    """A mapping written on one line (`- {name: node-0, device: ..., count: 8}`)."""


class _JobDumper(Dumper):
    """heteroflow's dumper, writing `_FlowDict`s on one line."""


_JobDumper.add_representer(_FlowDict, lambda dumper, data: dumper.represent_mapping(
    "tag:yaml.org,2002:map", data.items(), flow_style=True))


def dump_job_yaml(job: dict) -> str:
    """Job data as YAML in the style of the example jobs: sections in block style, nodes and stages one a line."""
    data = dict(job)
    if isinstance(data.get("cluster"), dict):
        data["cluster"] = dict(data["cluster"], nodes=[_FlowDict(n) for n in data["cluster"]["nodes"]])
    if isinstance(data.get("plan"), dict):
        data["plan"] = dict(data["plan"], stages=[_FlowDict(s) for s in data["plan"]["stages"]])
    return yaml.dump(data, Dumper=_JobDumper, sort_keys=False, default_flow_style=False, width=120)


def _source_kind(path: Path, data: object) -> str:
    if path.suffix.lower() not in (".yaml", ".yml"):
        return "shell"
    if isinstance(data, dict) and isinstance(data.get("model"), dict) and ("trainer" in data or "name" in data
                                                                            or "encoder_seq_length" in data["model"]):
        return "nemo-yaml"
    return "megatron-yaml"


@dataclass
class _Source:
    """What reading the source produced, before mapping."""

    kind: str
    args: MegatronArgs
    entries: list[Entry]
    notes: list[str]
    blockers: list[str]
    launch: Launch | None = None
    nnodes: int | None = None
    nproc_per_node: int | None = None
    program: str | None = None
    spelling: object = None
    """How the source names a missing argument (None: as a Megatron flag)."""


def _read_shell(path: Path, options: ImportOptions) -> _Source:
    text = read_text_file(path)
    try:
        run = run_script(text, args=options.script_args, env=options.env, script_name=str(path.resolve()),
                         cwd=str(path.resolve().parent), read_file=file_finder(path))
        launch = find_launch(run.commands)
    except UserError as exc:
        hint = _exit_hint(run) if "run" in locals() else ""
        if "no training launch" in str(exc):
            found = _family_in_text(text)
            if found is not None:
                raise UserError(f"{path}: {found}") from None
            if hint:
                raise UserError(f"{path}: no training launch reached{hint}") from None
        raise UserError(f"{path}: {exc}{hint}") from None
    args = parse_argv(launch.argv, launch.line)
    notes = list(run.notes) + list(launch.notes)
    for name, line in sorted(run.missing.items(), key=lambda kv: kv[1]):
        what = f"positional parameter ${name}" if name.isdigit() or name in "@*#" else f"${name}"
        hint = ("pass it after the script: heteroflow import-megatron SCRIPT ARG1 ARG2 ..." if name.isdigit()
                else f"pass --env {name}=VALUE if it matters")
        notes.append(f"line {line}: {what} is not set by the script (first used here); {hint}")
    for text, line, known in args.stray:
        if not known:
            notes.append(f"line {line}: word {text!r} on the launch line is not known; if it holds arguments, "
                         "pass it with --env")
    source = _Source("shell", args, list(launch.entries), notes, [], launch, launch.nnodes, launch.nproc_per_node,
                     launch.program_path)
    yaml_cfg = args.setting("yaml_cfg")
    if yaml_cfg is not None and yaml_cfg.value:
        cfg_path = Path(str(yaml_cfg.value))
        if not cfg_path.is_absolute():
            cfg_path = path.parent / cfg_path if (path.parent / cfg_path).exists() else cfg_path
        yaml_args, yaml_entries = read_megatron_yaml(read_megatron_yaml_file(cfg_path), origin="yaml")
        ignored = [Entry(s.key, s.shown, "ignored", "Megatron reads every argument from --yaml-cfg and ignores the "
                                                    "command line", s.line, s.origin)
                   for s in args.settings if s.dest != "yaml_cfg"]
        ignored.insert(0, Entry(yaml_cfg.key, yaml_cfg.shown, "mapped", f"arguments read from {cfg_path}",
                                yaml_cfg.line, "script"))
        source.args, source.kind, source.spelling = yaml_args, "shell + megatron-yaml", yaml_key
        source.entries += ignored + yaml_entries
    return source


_PROGRAM_WORD = re.compile(r"(?:^|[\s/=\"'])([\w.${}/-]+\.py)\b|(?:\s-m\s+)([\w.]+)", re.M)


def _family_in_text(text: str) -> str | None:
    """The family of a non-training program the script text names, for a script whose interpreted path
    launches nothing (it stops earlier, e.g. on a missing option): `line N: inference: ...`."""
    families = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        for match in _PROGRAM_WORD.finditer(line):
            program = match.group(1) or (match.group(2).replace(".", "/") + ".py")
            if program.startswith("torch/distributed"):
                continue
            family = program_family(program)
            if family is None:
                return None  # the script may also launch a training entry point: nothing to tell from the text
            families.append(f"line {number}: {family}")
    return families[0] if families else None


def _exit_hint(run) -> str:
    """Why the script stopped early, when an `exit` cut it short, with the variables to pass."""
    if run.exited_at is None or run.exit_status == 0:
        return ""
    positional = [n for n in run.exit_unset if n.isdigit() or n in "@*#"]
    if positional:
        return (f"; the script exits at line {run.exited_at} because it needs positional parameter "
                f"{', '.join('$' + n for n in positional)}: pass it after the script "
                "(heteroflow import-megatron SCRIPT ARG1 ARG2 ...)")
    if run.exit_unset:
        names = " ".join(f"--env {n}=VALUE" for n in run.exit_unset)
        return (f"; the script exits at line {run.exited_at} because {', '.join('$' + n for n in run.exit_unset)} "
                f"{'is' if len(run.exit_unset) == 1 else 'are'} not set: pass {names}")
    return f"; the script exits at line {run.exited_at} before it launches anything"


def _read_source(path: Path, options: ImportOptions) -> _Source:
    if path.suffix.lower() not in (".yaml", ".yml"):
        return _read_shell(path, options)
    data = read_megatron_yaml_file(path)
    family = nemo_family(str(path.resolve()))
    if family is not None:
        return _Source("nemo-yaml", parse_argv(()), [], [], [family], None, 1, 1, "pretrain_gpt.py", nemo_key)
    if is_model_config(path, data):
        config = read_model_config(path, data, options.env)
        args = parse_argv(config.argv)
        return _Source("model_config.yaml", args, [], [], list(config.blockers), None, None, config.nproc_per_node,
                       config.program)
    kind = _source_kind(path, data)
    if kind == "nemo-yaml":
        args, entries, blockers, nnodes, nproc = read_nemo_yaml(data)
        return _Source(kind, args, entries, [], blockers, None, nnodes, nproc, "pretrain_gpt.py", nemo_key)
    args, entries = read_megatron_yaml(data)
    return _Source(kind, args, entries, [], [], None, None, None, "pretrain_gpt.py", yaml_key)


def _load_cluster(path: str | os.PathLike) -> ClusterSpec:
    data = read_yaml(path)
    if not isinstance(data, dict) or set(data) != {"cluster"}:
        raise UserError(f"{path}: a cluster file must hold exactly one top-level key, `cluster:`")
    problems = Problems(str(path))
    cluster = parse_cluster(data["cluster"], problems)
    problems.raise_if_any()
    assert cluster is not None
    return cluster


def _world(source: _Source, options: ImportOptions, cluster: ClusterSpec | None, notes: list[str]) -> tuple[int, int, int]:
    """World size, nodes and processes per node of the Megatron run."""
    for value, limit, name in ((options.nnodes, limits.NUM_NODES, "--nnodes"),
                               (options.nproc_per_node, limits.DEVICES_PER_NODE, "--nproc-per-node"),
                               (source.nnodes, limits.NUM_NODES, "the source's number of nodes"),
                               (source.nproc_per_node, limits.DEVICES_PER_NODE, "the source's processes per node")):
        problem = None if value is None else limit.problem(value)
        if problem is not None:
            raise UserError(f"{name}: {problem}")
    if cluster is not None and not options.nnodes and not options.nproc_per_node:
        # The cluster file says where the job runs: its devices are the world, whatever the launcher said.
        counts = {n.count for n in cluster.nodes}
        if source.nnodes and source.nproc_per_node and source.nnodes * source.nproc_per_node != cluster.num_devices:
            notes.append(f"the source launches {source.nnodes} x {source.nproc_per_node} processes; the cluster has "
                         f"{cluster.num_devices} devices, which are the world size of the import")
        return cluster.num_devices, len(cluster.nodes), counts.pop() if len(counts) == 1 else 0
    nnodes = options.nnodes or source.nnodes
    nproc = options.nproc_per_node or source.nproc_per_node
    for given, found, what in ((options.nnodes, source.nnodes, "nodes"),
                               (options.nproc_per_node, source.nproc_per_node, "processes per node")):
        if given and found and given != found:
            notes.append(f"{what}: the source says {found}, the importer was told {given}; using {given}")
    if nnodes and nproc:
        return nnodes * nproc, nnodes, nproc
    if cluster is not None:
        counts = {n.count for n in cluster.nodes}
        per_node = nproc or (counts.pop() if len(counts) == 1 else 0)
        notes.append(f"the number of {'nodes' if nproc else 'ranks'} is not given by the source; the whole "
                     f"cluster ({cluster.num_devices} devices) is used")
        if nproc and cluster.num_devices % nproc == 0:
            return cluster.num_devices, cluster.num_devices // nproc, nproc
        return cluster.num_devices, len(cluster.nodes), per_node
    missing = " and ".join(w for w, v in (("nodes", nnodes), ("processes per node", nproc)) if not v)
    raise UserError(f"the number of {missing} is not known from the source; pass --nnodes N / --nproc-per-node M, "
                    "--env NAME=VALUE for the variables the launcher uses, or --cluster CLUSTER.yaml")


def import_megatron(path: str | os.PathLike, options: ImportOptions | None = None) -> ImportResult:
    """Import a Megatron-LM launch script, `--yaml-cfg` file or NeMo model YAML into a heteroflow job.

    Raises `UserError` when the source cannot be read or breaks Megatron's rules; returns a result
    with `blocked` set (and no job) when the model uses features heteroflow cannot represent.
    """
    options = options or ImportOptions()
    path = Path(path)
    source = _read_source(path, options)
    cluster = _load_cluster(options.cluster) if options.cluster is not None else None
    device_type = None
    if options.device_type is not None and cluster is None:
        device_type = lookup(options.device_type).name
    notes = list(source.notes)
    if options.device_type is not None and cluster is not None:
        notes.append(f"--device-type {options.device_type} is not used: the cluster file names the devices")
    ctx = Context(source.args, spelling=source.spelling, version=options.megatron_version)
    for problem in source.args.problems:
        ctx.error(f"{problem} (Megatron's argument parser rejects it)")
    for blocker in source.blockers:
        ctx.block(blocker)
    check_features(ctx, source.program)
    try:
        world, nnodes, nproc = _world(source, options, cluster, notes)
    except UserError:
        if not ctx.blockers:
            raise
        # A refused model needs no cluster size: say what it is rather than what is missing.
        report = ImportReport(str(path), source.kind, tuple(source.entries + ctx.entries()), None,
                              source.launch.describe() if source.launch is not None else "", tuple(ctx.blockers),
                              tuple(notes))
        return ImportResult(str(path), report, None, None, None)
    tp = ctx.get("tensor_model_parallel_size") if isinstance(ctx.get("tensor_model_parallel_size"), int) else 1
    model = map_model(ctx, max(tp, 1), options.vocab_size)
    layout = train = None
    if model:
        layout = map_layout(ctx, world, model["num_layers"], model["seq_length"],
                            model["moe"]["num_experts"] if "moe" in model else None)
    if layout is not None:
        layout = replace(layout, world_size=world)
        train = map_train(ctx, layout)
    elif model:
        # Still read the training arguments, so every problem is reported in one go.
        mbs, gbs = ctx.get("micro_batch_size") or 1, ctx.get("global_batch_size") or 1
        map_train(ctx, MegatronLayout(world, 1, ParallelLayout(), mbs if isinstance(mbs, int) else 1,
                                      gbs if isinstance(gbs, int) else 1, (model["num_layers"],)))
    summary = None
    if layout is not None:
        par = layout.parallel
        summary = LayoutSummary(world, nnodes, nproc, par.tp, layout.pp, par.cp, par.dp,
                                layout.micro_batch_size, layout.global_batch_size, layout.stage_layers,
                                layout.virtual_stages, par.ep, par.etp)
    launcher = source.launch.describe() if source.launch is not None else ""
    if ctx.blockers:
        notes += [f"also: {e}" for e in ctx.errors]
        report = ImportReport(str(path), source.kind, tuple(source.entries + ctx.entries()), summary, launcher,
                              tuple(ctx.blockers), tuple(notes))
        return ImportResult(str(path), report, layout, None, None)
    ctx.raise_errors(str(path))
    assert layout is not None and train is not None
    job_dict, job, cluster_note = _build_job(path, model, train, layout, cluster, nnodes, nproc, device_type, notes)
    report = ImportReport(str(path), source.kind, tuple(source.entries + ctx.entries()), summary, launcher, (),
                          tuple(notes), cluster_note)
    return ImportResult(str(path), report, layout, job_dict, job)


def _build_job(path: Path, model: dict, train: dict, layout: MegatronLayout, cluster: ClusterSpec | None,
               nnodes: int, nproc: int, device_type: str | None, notes: list[str]):
    """The job dict, the validated job (None with the placeholder device) and a note on the cluster."""
    if cluster is not None:
        cluster_dict = cluster.to_dict()
        note = f"given ({len(cluster.nodes)} nodes, {cluster.num_devices} devices)"
        if cluster.num_devices > layout.world_size:
            note += f"; the Megatron layout uses the first {layout.world_size} devices in node order"
        check_cluster = cluster
    else:
        cluster_dict = generated_cluster(nnodes, nproc, device_type)
        stand_in = generated_cluster(nnodes, nproc, device_type or _STAND_IN_DEVICE)
        problems = Problems()
        check_cluster = parse_cluster(stand_in, problems)
        problems.raise_if_any()
        nodes = f"{nnodes} node{'s' * (nnodes != 1)}"
        note = (f"{nodes} x {nproc} {device_type} devices (--device-type)" if device_type else
                f"{nodes} x {nproc} devices of type `{PLACEHOLDER_DEVICE}`: set the device type in the job "
                "(or re-run with --device-type NAME / --cluster CLUSTER.yaml); `heteroflow validate` rejects "
                "the placeholder")
    plan = plan_section(layout, check_cluster)
    job_dict = {"cluster": cluster_dict, "model": model, "train": train, "plan": plan}
    check_dict = dict(job_dict, cluster=check_cluster.to_dict())
    try:
        job = parse_job(check_dict, base_dir=str(path.resolve().parent), source="the imported job")
    except ConfigError as error:
        lines = "\n".join(f"  {p}" for p in error.problems)
        raise UserError(f"{path}: the imported job does not validate:\n{lines}") from None
    if cluster is None and device_type is None:
        return job_dict, None, note
    return job_dict, job, note
