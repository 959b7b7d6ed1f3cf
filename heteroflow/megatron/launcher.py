"""Find the training launch among the commands a script would run, and read the launcher's options.

The launch is the command that starts a Megatron training entry point (`pretrain_gpt.py` and the
like), directly or through torchrun / `python -m torch.distributed.run|launch` / deepspeed / srun /
mpirun and wrappers such as `env`, `nohup` or `numactl`. Words after the entry point are Megatron's
arguments; the launcher's options give the number of nodes and processes per node.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from heteroflow.errors import UserError
from heteroflow.megatron.programs import program_family
from heteroflow.megatron.report import Entry
from heteroflow.megatron.shell import Command, Field

_TRAINING_NAME = re.compile(r"^(pretrain|train|finetune|run_pretrain|main)[\w.-]*\.py$|^.*(pretrain|finetune).*\.py$")
_DISTRIBUTED = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "deepspeed", "srun", "mpirun",
                "mpiexec", "sbatch")
_SCHEDULERS = ("srun", "mpirun", "mpiexec", "sbatch")
"""Launchers whose sizes count tasks: torchrun inside them is the launcher that sets processes per node."""
# Launcher options: (names, role, takes a value). Roles: nproc, nnodes, nodes-and-nproc (srun -n), ignored.
_OPTIONS = (
    (("--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus", "--ntasks-per-node", "--npernode",
      "--gpus-per-node"), "nproc", True),
    (("--nnodes", "--num_nodes", "--num-nodes", "-N", "--nodes"), "nnodes", True),
    (("--standalone",), "standalone", False),
    (("--node_rank", "--node-rank"), "rank of this node: every node runs the same script", True),
    (("--master_addr", "--master-addr", "--master_port", "--master-port", "--rdzv_endpoint", "--rdzv-endpoint",
      "--rdzv_backend", "--rdzv-backend", "--rdzv_id", "--rdzv-id", "--rdzv_conf", "--rdzv-conf"),
     "rendezvous endpoint of the Megatron run; heteroflow's launcher sets its own", True),
    (("--max_restarts", "--max-restarts", "--monitor_interval", "--monitor-interval", "--log_dir", "--log-dir",
      "--redirects", "--tee", "--role", "--local_addr", "--local-addr", "--start_method", "--start-method",
      "--local-ranks-filter", "--local_ranks_filter"), "launcher housekeeping (restarts, logs)", True),
    (("--no_python", "--no-python", "--module", "-m", "--use_env", "--use-env", "--run_path", "--run-path",
      "-u", "-l", "--label", "--verbose", "-v", "--exclusive", "--overcommit", "-O", "--parsable", "--requeue",
      "--no-container-mount-home", "--container-remap-root", "--frozen", "--locked", "--no-sync", "--isolated"),
     "launcher housekeeping", False),
    (("--extra", "--with", "--group", "--project", "--directory", "--python", "--env-file", "--package",
      "--dependency", "-d", "--signal", "--comment", "--reservation", "--qos", "-q", "--constraint", "-C",
      "--mail-type", "--mail-user", "--chdir", "-D", "--open-mode", "--gpus", "-G", "--container-workdir",
      "--container-env", "--distribution"),
     "launcher housekeeping (environment, scheduling)", True),
    (("--hostfile", "--include", "--exclude", "--master_port", "--launcher", "-H", "--host", "--hosts",
      "-x", "--map-by", "--bind-to", "--mca", "-p", "--partition", "-J", "--job-name", "-o", "--output",
      "-e", "--error", "-A", "--account", "-t", "--time", "--container-image", "--container-mounts",
      "--container-name", "--mpi", "--export", "--cpu-bind", "--gres", "-w", "--nodelist", "-c",
      "--cpus-per-task", "--ntasks", "-n", "-np", "--mem"),
     "scheduler / host placement option; the heteroflow cluster says where devices are", True),
)


@dataclass(frozen=True, slots=True)
class Launch:
    """The training command of a script."""

    line: int
    launcher: str
    """torchrun, torch.distributed.launch, deepspeed, srun, mpirun or python."""
    program: str
    """The entry point, e.g. `pretrain_gpt.py`."""
    nproc_per_node: int | None
    """Processes (devices) per node, None when the script leaves it to the machine or the environment."""
    nnodes: int | None
    argv: tuple[Field, ...]
    """Megatron's arguments."""
    entries: tuple[Entry, ...]
    """Report entries for the launcher's own options."""
    notes: tuple[str, ...] = ()
    program_path: str = ""
    """The entry point as the script writes it, e.g. `${DIR}/examples/mimo/train.py`."""

    def describe(self) -> str:
        """One line for the report."""
        nodes = "?" if self.nnodes is None else str(self.nnodes)
        procs = "?" if self.nproc_per_node is None else str(self.nproc_per_node)
        return (f"{self.launcher} {self.program} (line {self.line}): {nodes} node{'s' * (nodes != '1')} x {procs} "
                f"process{'es' * (procs != '1')} per node")


def _basename(text: str) -> str:
    return os.path.basename(text.rstrip("/"))


_WRAPPERS = ("srun", "mpirun", "mpiexec", "env", "nohup", "time", "exec", "numactl", "taskset", "nice", "timeout",
             "stdbuf", "sudo", "nsys", "ncu", "sbatch", "uv")
_PYTHON = re.compile(r"^python[\d.]*$")


def _entry_index(fields: tuple[Field, ...]) -> int | None:
    """Index of the training entry point among a command's words, if the command runs one.

    The command itself must be a launcher, a wrapper, Python or the script: `echo torchrun ... pretrain_gpt.py`
    only prints the launch line.
    """
    first = _basename(fields[0].text) if fields and fields[0].known else ""
    if not (first in _DISTRIBUTED or first in _WRAPPERS or _PYTHON.match(first) or first.endswith(".py")):
        return None
    has_launcher = False
    for k, f in enumerate(fields):
        if not f.known and not _known_py_name(f):
            continue
        base = _basename(f.text)
        if base in _DISTRIBUTED or f.text in _DISTRIBUTED:
            has_launcher = True
        elif _module_program(fields, k) and (has_launcher or _PYTHON.match(_basename(fields[k - 2].text))):
            return k
        if base.endswith(".py") and (has_launcher or _TRAINING_NAME.match(base)):
            return k
    return None


def _module_program(fields: tuple[Field, ...], k: int) -> bool:
    """Whether word k is the module of `python -m MODULE` / `torchrun -m MODULE` (not torch.distributed.*)."""
    return (k >= 2 and fields[k - 1].text in ("-m", "--module") and fields[k].known
            and not fields[k].text.startswith(("-", "torch.distributed")))


def program_path(field: Field, fields: tuple[Field, ...], k: int) -> str:
    """The entry point as a path: `examples.inference.offline` run with -m reads examples/inference/offline.py."""
    if _module_program(fields, k):
        return field.text.replace(".", "/") + ".py"
    return field.text


def _known_py_name(field: Field) -> bool:
    """Whether a word such as `${CODE_DIR}/pretrain_gpt.py` names a known Python file in an unknown directory."""
    tail = field.raw.rsplit("/", 1)[-1]
    return "/" in field.raw and tail.endswith(".py") and Field(tail).known


def _int(field: Field | None) -> tuple[int | None, str]:
    if field is None:
        return None, "missing value"
    if not field.known:
        return None, f"{field.text} is not set in the script (pass --env or use --nnodes / --nproc-per-node)"
    text = field.text.strip()
    if ":" in text and all(p.isdigit() for p in text.split(":")):
        return int(text.split(":")[1]), f"elastic range {text}: the largest, {text.split(':')[1]}, is used"
    if text.isdigit():
        return int(text), ""
    return None, f"{text!r} depends on the machine the script runs on"


def _read_launcher(words: tuple[Field, ...], line: int) -> tuple[str, int | None, int | None, list[Entry], list[str]]:
    """Launcher name, processes per node, nodes, report entries and notes from the words before the program."""
    launcher = "python"
    nproc = nnodes = None
    srun_nodes = srun_nproc = None
    entries: list[Entry] = []
    notes: list[str] = []
    current = ""
    k = 0
    while k < len(words):
        word = words[k]
        text = word.text
        base = _basename(text)
        if word.known and (base in _DISTRIBUTED or text in _DISTRIBUTED):
            current = base if base in _DISTRIBUTED else text
            if launcher in ("python",) + _SCHEDULERS:  # torchrun inside srun is the launcher
                launcher = current
            k += 1
            continue
        if not text.startswith("-") or not word.known:
            k += 1  # the launcher or a wrapper (env, nohup, numactl, python): nothing for the job
            continue
        name, _, inline = text.partition("=")
        option = next((o for o in _OPTIONS if name in o[0]), None)
        if option is None:
            entries.append(Entry(f"{current or 'launcher'} {name}", inline, "unknown",
                                 "launcher option heteroflow does not know", line, "launcher"))
            k += 1
            continue
        names, role, takes_value = option
        value_field = None
        if takes_value:
            if inline:
                value_field = Field(inline)
            elif k + 1 < len(words):
                value_field = words[k + 1]
                k += 1
        k += 1
        shown = value_field.text if value_field is not None else ""
        key = f"{current or 'launcher'} {name}"
        if role in ("nproc", "nnodes"):
            value, why = _int(value_field)
            if value is None:
                entries.append(Entry(key, shown, "ignored", f"cannot be read: {why}", line, "launcher"))
                notes.append(f"line {line}: {key} {shown}: {why}")
                continue
            is_srun = current in _SCHEDULERS
            if role == "nproc":
                if is_srun:
                    srun_nproc = value
                else:
                    nproc = value
                detail = f"cluster: {value} devices per node" + (f" ({why})" if why else "")
            else:
                if is_srun:
                    srun_nodes = value
                else:
                    nnodes = value
                detail = f"cluster: {value} node{'s' * (value != 1)}" + (f" ({why})" if why else "")
            entries.append(Entry(key, shown, "approximated" if why else "mapped", detail, line, "launcher"))
        elif role == "standalone":
            nnodes = 1
            entries.append(Entry(key, "", "mapped", "cluster: a single node", line, "launcher"))
        else:
            entries.append(Entry(key, shown, "ignored", role, line, "launcher"))
    if nproc is None and srun_nproc is not None and launcher in ("python",) + _SCHEDULERS:
        nproc = srun_nproc
    if nnodes is None and srun_nodes is not None:
        nnodes = srun_nodes
    return launcher, nproc, nnodes, entries, notes


def find_launch(commands: tuple[Command, ...]) -> Launch:
    """The script's training launch; a `UserError` when it has none, or when it is unreadable."""
    found: list[tuple[Command, int]] = []
    for command in commands:
        k = _entry_index(command.fields)
        if k is not None:
            found.append((command, k))
    if not found:
        programs = [(c, f.text) for c in commands for f in c.fields if f.text.endswith(".py")]
        for c, program in programs:
            family = program_family(program)
            if family is not None:
                raise UserError(f"line {c.line}: {family}")
        unknown = [c for c in commands if c.fields and any(_basename(f.text) in _DISTRIBUTED for f in c.fields)]
        if unknown:
            c = unknown[0]
            raise UserError(f"line {c.line}: the launcher runs {' '.join(f.text for f in c.fields)[:120]!r}, "
                            "but the training script's path is not known; pass the variables it uses with --env")
        if not programs:
            raise UserError("no training launch found: the script runs no Python program (a file of settings that "
                            "a launch script `source`s? import the launch script instead)")
        raise UserError("no training launch found: expected a command such as `torchrun ... pretrain_gpt.py ...` "
                        "(heteroflow reads the script without running it)")
    command, k = found[0]
    notes = [f"line {c.line}: another launch of {c.fields[j].text} is not used (the first launch, line "
             f"{command.line}, is imported)" for c, j in found[1:]]
    launcher, nproc, nnodes, entries, launcher_notes = _read_launcher(command.fields[:k], command.line)
    if launcher == "python":
        # A plain `python pretrain_gpt.py` is one process unless a scheduler wrapper said otherwise.
        nproc = 1 if nproc is None else nproc
        nnodes = 1 if nnodes is None else nnodes
    elif launcher == "deepspeed" and nnodes is None and not any(
            e.key.split()[-1] in ("--num_nodes", "--num-nodes", "--hostfile") for e in entries):
        # Without a hostfile or --num_nodes the deepspeed launcher runs on the local machine only.
        launcher_notes.append(f"line {command.line}: deepspeed without --num_nodes or --hostfile: one node")
        nnodes = 1
    elif launcher in ("torchrun", "torch.distributed.run", "torch.distributed.launch"):
        # torchrun's own defaults (--nnodes 1:1, --nproc-per-node 1) when the option is absent, not unknown.
        given = {e.key.split()[-1] for e in entries}
        for names, what in ((("--nnodes",), "nnodes"), (("--nproc_per_node", "--nproc-per-node"), "nproc")):
            if not given & set(names):
                launcher_notes.append(f"line {command.line}: {launcher} without {names[0]}: its default, 1, is used")
                nnodes, nproc = (1, nproc) if what == "nnodes" else (nnodes, 1)
    for name, value in command.prefix_assigns:
        entries.append(Entry(f"{name}=", value.text, "ignored", "environment of the launch (CUDA / NCCL tuning)",
                             command.line, "launcher"))
    path = program_path(command.fields[k], command.fields, k)
    return Launch(command.line, launcher, _basename(path), nproc, nnodes, tuple(command.fields[k + 1:]),
                  tuple(entries), tuple(notes + launcher_notes), path)
