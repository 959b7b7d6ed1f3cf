"""A tiny byte-pair-encoding tokenizer, trained deterministically on the built-in corpus.

Ids: 0 `<unk>`, 1 `<bos>`, 2 `<eos>`, then one id per character of the corpus alphabet (sorted), then
one id per merge in the order learned. Merges are learned greedily (most frequent adjacent pair, ties
broken by the pair's text), so a prefix of the merge list is itself a valid, smaller tokenizer:
`truncated(vocab_size)` gives one that fits any model vocabulary at least as large as the alphabet
(tiny-llama's 512 uses all merges, micro-llama's 256 a prefix). Text is first split into words with a
leading space, runs of other symbols, single digits and whitespace, as GPT-2 does, so merges never
cross words and arithmetic stays digit by digit.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from importlib import resources
from pathlib import Path

SPECIALS = ("<unk>", "<bos>", "<eos>")
UNK, BOS, EOS = 0, 1, 2
TOKENIZER_FILE = "tokenizer.json"
_PRETOKEN = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")


class Tokenizer:
    """Encode text to ids and back, with the merges given in priority order."""

    def __init__(self, alphabet: list[str], merges: list[tuple[str, str]]):
        self.alphabet, self.merges = list(alphabet), [tuple(m) for m in merges]
        self.tokens = list(SPECIALS) + self.alphabet + [a + b for a, b in self.merges]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self._rank = {m: r for r, m in enumerate(self.merges)}
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        """Number of ids (specials + alphabet + merges)."""
        return len(self.tokens)

    def truncated(self, vocab_size: int) -> "Tokenizer":
        """The same tokenizer with only as many merges as fit in `vocab_size` ids."""
        base = len(SPECIALS) + len(self.alphabet)
        if vocab_size < base:
            raise ValueError(f"vocab_size {vocab_size} is below the built-in tokenizer's {base} base tokens")
        return Tokenizer(self.alphabet, self.merges[:vocab_size - base])

    def _encode_word(self, word: str) -> list[int]:
        if word not in self._cache:
            parts = list(word)
            while len(parts) > 1:
                never = len(self._rank)
                best, i = min((self._rank.get(pair, never), i) for i, pair in enumerate(zip(parts, parts[1:])))
                if best == never:
                    break
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
            self._cache[word] = [self.ids.get(p, UNK) for p in parts]
        return self._cache[word]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (characters outside the alphabet become `<unk>`)."""
        return [i for word in _PRETOKEN.findall(text) for i in self._encode_word(word)]

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens left out."""
        return "".join(self.tokens[i] for i in ids if i >= len(SPECIALS))

    def save(self, path: str | Path) -> None:
        """Write the alphabet and merges as JSON."""
        Path(path).write_text(json.dumps({"alphabet": self.alphabet, "merges": self.merges}, indent=0) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """Read a tokenizer written by `save`."""
        data = json.loads(Path(path).read_text())
        return cls(data["alphabet"], data["merges"])


def train_bpe(text: str, vocab_size: int) -> Tokenizer:
    """Learn merges on `text` until the vocabulary has `vocab_size` ids (or no pair repeats)."""
    alphabet = sorted(set(text))
    words = Counter(_PRETOKEN.findall(text))
    split = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(SPECIALS) + len(alphabet) + len(merges) < vocab_size:
        pairs: Counter = Counter()
        for w, parts in split.items():
            for pair in zip(parts, parts[1:]):
                pairs[pair] += words[w]
        if not pairs:
            break
        pair, count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merges.append(pair)
        joined = pair[0] + pair[1]
        for w, parts in split.items():
            i = 0
            while i < len(parts) - 1:
                if parts[i] == pair[0] and parts[i + 1] == pair[1]:
                    parts[i:i + 2] = [joined]
                i += 1
    return Tokenizer(alphabet, merges)


def builtin_tokenizer(vocab_size: int | None = None) -> Tokenizer:
    """The committed tokenizer, truncated to `vocab_size` ids when given."""
    path = resources.files("heteroflow.data").joinpath(TOKENIZER_FILE)
    data = json.loads(path.read_text(encoding="utf-8"))
    tok = Tokenizer(data["alphabet"], data["merges"])
    return tok if vocab_size is None or vocab_size >= tok.vocab_size else tok.truncated(vocab_size)
