"""Find the files a launch script names (`source FILE`, `. FILE`, `sbatch FILE`) the way its user runs it.

Megatron's example scripts are run from the repository root (`bash examples/gpt3/train.sh`) or from
their own directory, so a relative name is looked up next to the script, then in the directories above
it (the nearest match wins). Only regular text files are read; nothing is run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

MAX_PARENT_LEVELS = 6
"""How far above the script a relative name is looked up (examples/<area>/<model>/x.sh and deeper)."""
MAX_FILE_BYTES = 1 << 20


def file_finder(script: Path) -> Callable[[str], tuple[str, str] | None]:
    """`find(name) -> (path, text)` for the files `script` names, or None when no such file is readable."""
    base = script.resolve().parent

    def find(name: str) -> tuple[str, str] | None:
        candidate = Path(name)
        if candidate.is_absolute():
            places = [candidate]
        else:
            places = [base / candidate] + [parent / candidate for parent in list(base.parents)[:MAX_PARENT_LEVELS]]
        for place in places:
            try:
                if place.is_file() and place.stat().st_size <= MAX_FILE_BYTES:
                    return str(place), place.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
        return None

    return find
