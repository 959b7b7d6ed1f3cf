"""Import every file of a Megatron-LM / NeMo-Framework-Launcher tree and sort the outcomes (imported,
refused with the reason, crashed): the corpus test and `python tests/megatron/megatron_corpus.py ROOT...`."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from heteroflow.errors import UserError
from heteroflow.megatron import ImportOptions, import_megatron

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MEGATRON_MIRROR = Path(os.environ.get("HETEROFLOW_MEGATRON_MIRROR", "/work/.mirror/NVIDIA+Megatron-LM/repo"))
NEMO_MIRROR = Path(os.environ.get("HETEROFLOW_NEMO_LAUNCHER_MIRROR",
                                  "/work/.mirror/NVIDIA+NeMo-Framework-Launcher/repo"))


@dataclass(frozen=True)
class Outcome:
    """What importing one file gave."""

    path: Path
    kind: str
    """example, functional or nemo."""
    status: str
    """imported, refused or crashed."""
    message: str = ""
    vocab_size: int | None = None


def corpus_files(root: Path) -> list[tuple[Path, str]]:
    """The example scripts, functional-test configurations and NeMo training YAMLs under `root`."""
    files = [(p, "example") for p in sorted(root.glob("**/examples/**/*.sh"))]
    files += [(p, "functional") for p in sorted(root.glob("**/tests/functional_tests/test_cases/**/model_config.yaml"))]
    files += [(p, "nemo") for p in sorted(root.glob("**/launcher_scripts/conf/training/**/*.yaml"))]
    return files


def options_for(path: Path, kind: str) -> ImportOptions:
    """Functional tests run on the node and GPU counts their harness is given: 1 node of 8 GPUs unless
    the configuration names its GPUs per node."""
    if kind == "functional":
        names_gpus = "GPUS_PER_NODE" in path.read_text(encoding="utf-8", errors="replace")
        return ImportOptions(nnodes=1, nproc_per_node=None if names_gpus else 8)
    return ImportOptions()


def import_one(path: Path, kind: str) -> Outcome:
    """Import `path` the way a user would, with no --env."""
    try:
        result = import_megatron(path, options_for(path, kind))
    except UserError as error:
        return Outcome(path, kind, "refused", str(error))
    except Exception:  # noqa: BLE001 -- a crash is what the corpus test counts
        return Outcome(path, kind, "crashed", traceback.format_exc())
    if result.blocked:
        return Outcome(path, kind, "refused", "not imported: " + "; ".join(result.report.blockers))
    return Outcome(path, kind, "imported", "", result.job_dict["model"]["vocab_size"])


def reason(message: str) -> str:
    """A refusal's reason without paths, line numbers and numbers, to count alike refusals together."""
    lines = message.splitlines()
    first = lines[1].strip() if len(lines) > 1 and "cannot import" in lines[0] else lines[0]
    first = re.sub(r"^\S+?: (?=\S)", "", first, count=1) if first.startswith("/") else first
    first = re.sub(r"line \d+: ", "", first)
    return re.sub(r"\d+", "N", first)[:100]


def extract(git_dir: Path, paths: list[str], into: Path) -> Path:
    """The files under `paths` of a mirrored repository's newest commit, written out under `into`."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", "HEAD", *paths], check=True,
                             capture_output=True, timeout=300).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=300)
    return into


def summary(outcomes: list[Outcome]) -> str:
    """Counts per kind and per refusal reason."""
    out = []
    for kind in ("example", "functional", "nemo"):
        mine = [o for o in outcomes if o.kind == kind]
        counts = collections.Counter(o.status for o in mine)
        out.append(f"{kind}: {len(mine)} files, {counts['imported']} imported, {counts['refused']} refused, "
                   f"{counts['crashed']} crashed")
        reasons = collections.Counter(reason(o.message) for o in mine if o.status == "refused")
        out += [f"  {n:4d}  {text}" for text, n in reasons.most_common()]
    return "\n".join(out)


if __name__ == "__main__":
    everything = [import_one(p, k) for root in sys.argv[1:] for p, k in corpus_files(Path(root))]
    print(summary(everything))
