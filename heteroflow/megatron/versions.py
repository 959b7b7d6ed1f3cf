"""Which Megatron-LM release's rules the importer applies: the current one by default, an older one
with `--megatron-version` where a rule changed between releases.

Each rule that changed names the first Megatron-Core release with the new behaviour (checked with
`git tag --contains <commit>` on NVIDIA/Megatron-LM).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from heteroflow.errors import UserError

CURRENT_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
"""The Megatron-LM main commit (2026-08-22, Megatron-Core 0.20.0 in development) the flag table is checked against."""


@dataclass(frozen=True, order=True, slots=True)
class MegatronVersion:
    """A Megatron-Core release number."""

    major: int
    minor: int
    patch: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


CURRENT = MegatronVersion(0, 20, 0)
NULL_TOKENIZER_EXACT = MegatronVersion(0, 18, 0)
"""From this release (#4057, commit c9dfe34) NullTokenizer's vocabulary is exactly --vocab-size (eod =
vocab_size - 1); before it, --vocab-size + 1 (the end-of-document token was appended)."""


def parse_version(text: str) -> MegatronVersion:
    """`0.14`, `0.14.1`, `core_v0.14.0`, `core_r0.13.0`, `v0.12.0rc3` -> the release; `UserError` otherwise."""
    match = re.fullmatch(r"(?:core_[vr]|v)?(\d+)\.(\d+)(?:\.(\d+))?(?:rc\d+)?", text.strip())
    if match is None:
        raise UserError(f"--megatron-version: {text!r} is not a Megatron-Core release such as 0.14 or core_v0.14.0")
    return MegatronVersion(int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))


def null_tokenizer_vocab(vocab_size: int, version: MegatronVersion) -> tuple[int, str]:
    """NullTokenizer's vocabulary for `--vocab-size` under `version`, and why."""
    if version >= NULL_TOKENIZER_EXACT:
        return vocab_size, (f"NullTokenizer: exactly --vocab-size {vocab_size} (Megatron-Core >= "
                            f"{NULL_TOKENIZER_EXACT}; eod = vocab_size - 1)")
    return vocab_size + 1, (f"NullTokenizer: --vocab-size {vocab_size} + 1 end-of-document token (Megatron-Core "
                            f"{version} < {NULL_TOKENIZER_EXACT})")
