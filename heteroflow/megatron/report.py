"""The import report: what happened to every argument, as text for people and JSON for tools.

Every argument the source gives gets exactly one entry with a disposition:
- `mapped`: carried into the job exactly (the detail names the job field);
- `approximated`: heteroflow cannot reproduce it exactly; the job does the nearest thing (the detail
  says what differs);
- `ignored`: it does not change the model, the training or the plan (the detail says why);
- `unsupported`: a model feature heteroflow cannot represent; no job is produced while any remain;
- `unknown`: not in heteroflow's table of Megatron arguments (a newer flag, or a fork's); check it.
Megatron defaults that matter to the job are listed too (origin `default`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DISPOSITIONS = ("mapped", "approximated", "ignored", "unsupported", "unknown")


@dataclass(frozen=True, slots=True)
class Entry:
    """What became of one argument (or of one Megatron default the source relies on)."""

    key: str
    """As written: `--num-layers`, `torchrun --nnodes`, `model.encoder_seq_length`."""
    value: str
    """The value as given ('' for a switch)."""
    disposition: str
    """One of `DISPOSITIONS`."""
    detail: str
    """The job field it became, or why it was left out."""
    line: int | None = None
    """Line in the script (None for YAML keys and defaults)."""
    origin: str = "script"
    """script, launcher, yaml or default."""

    def __post_init__(self) -> None:
        assert self.disposition in DISPOSITIONS, self.disposition


@dataclass(frozen=True, slots=True)
class LayoutSummary:
    """The Megatron layout in Megatron's own terms."""

    world_size: int
    nnodes: int
    nproc_per_node: int
    tp: int
    pp: int
    cp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    stage_layers: tuple[int, ...]
    virtual_stages: int | None = None
    ep: int = 1
    """Expert-parallel degree (MoE layers)."""
    etp: int | None = None
    """Expert tensor-parallel degree when it differs from tp."""


@dataclass(frozen=True, slots=True)
class ImportReport:
    """Everything the import decided, in the order a person wants to read it."""

    source: str
    kind: str
    """shell, megatron-yaml or nemo-yaml."""
    entries: tuple[Entry, ...]
    layout: LayoutSummary | None = None
    launcher: str = ""
    """e.g. `torchrun (line 78): 16 nodes x 8 processes`."""
    blockers: tuple[str, ...] = ()
    """Model features heteroflow cannot represent (one line each); non-empty means no job."""
    script_notes: tuple[str, ...] = ()
    """Undecided conditions, unknown values, commands not followed."""
    cluster_note: str = ""
    """How the cluster was chosen (given, device type, or a placeholder to fill in)."""

    def by_disposition(self, disposition: str) -> list[Entry]:
        """Entries with one disposition."""
        return [e for e in self.entries if e.disposition == disposition]

    def counts(self) -> dict[str, int]:
        """How many entries each disposition has."""
        return {d: len(self.by_disposition(d)) for d in DISPOSITIONS}

    def to_json(self) -> dict:
        """Plain data (one JSON document)."""
        data = asdict(self)
        data["counts"] = self.counts()
        return data

    def format(self) -> str:
        """The report as text: summary, blockers, approximations, then every argument."""
        lines = [f"Megatron import of {self.source} ({self.kind})"]
        if self.launcher:
            lines.append(f"  launch:  {self.launcher}")
        if self.layout is not None:
            lay = self.layout
            vp = f", {lay.virtual_stages} virtual stages per rank" if lay.virtual_stages else ""
            lines.append(f"  layout:  tp {lay.tp} x pp {lay.pp} x cp {lay.cp} x dp {lay.dp} = {lay.world_size} ranks "
                         f"({_count(lay.nnodes, 'node')} x {lay.nproc_per_node}){vp}")
            if lay.ep != 1 or lay.etp is not None:
                etp = lay.tp if lay.etp is None else lay.etp
                lines.append(f"  experts: etp {etp} x ep {lay.ep} x expert-dp {lay.world_size // (lay.pp * etp * lay.ep)} "
                             "per pipeline stage (folded over the stage's tp x cp x dp ranks)")
            lines.append(f"  batch:   micro-batch {lay.micro_batch_size} per dp rank, global {lay.global_batch_size}; "
                         f"heteroflow plan micro_batch_size {lay.micro_batch_size * lay.dp}")
            lines.append(f"  stages:  layers per pipeline stage {list(lay.stage_layers)}")
        if self.cluster_note:
            lines.append(f"  cluster: {self.cluster_note}")
        counts = self.counts()
        lines.append("  arguments: " + ", ".join(f"{n} {d}" for d, n in counts.items()))
        if self.blockers:
            lines.append("")
            lines.append("NOT IMPORTED: the model uses features heteroflow cannot represent yet:")
            lines += [f"  - {b}" for b in self.blockers]
        approx = self.by_disposition("approximated")
        if approx:
            lines.append("")
            lines.append("Differences from the Megatron run (approximated):")
            lines += [f"  - {_where(e)}{e.key}{_value(e)}: {e.detail}" for e in approx]
        unknown = self.by_disposition("unknown")
        if unknown:
            lines.append("")
            lines.append("Unknown arguments (not in heteroflow's Megatron table; check them by hand):")
            lines += [f"  - {_where(e)}{e.key}{_value(e)}: {e.detail}" for e in unknown]
        if self.script_notes:
            lines.append("")
            lines.append("Script notes:")
            lines += [f"  - {n}" for n in self.script_notes]
        lines.append("")
        lines.append("Every argument:")
        width = min(max((len(e.key) + len(_value(e)) for e in self.entries), default=10), 48)
        for e in self.entries:
            shown = (e.key + _value(e)).ljust(width)
            lines.append(f"  {e.disposition:<12} {shown}  {e.detail}{_line(e)}")
        return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _value(e: Entry) -> str:
    return f" {e.value}" if e.value != "" else ""


def _where(e: Entry) -> str:
    return f"line {e.line}: " if e.line else ""


def _line(e: Entry) -> str:
    if e.origin == "default":
        return "  (Megatron default)"
    return f"  (line {e.line})" if e.line else ""
