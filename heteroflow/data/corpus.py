"""The built-in training corpus: procedurally generated English-like text with learnable structure.

Generated once by `python -m heteroflow.data.corpus` and committed as `corpus.txt` (package data),
so the demo needs no download. Everything is deterministic (a seeded `random.Random`), and the text
is original: a small invented world whose facts stay consistent (each person always lives in the same
town and keeps the same animals), plus arithmetic, counting and calendar patterns. A small model
learns the frequent patterns within a few hundred steps, so falling loss is visible in a demo.
Paragraphs are separated by blank lines; each paragraph becomes one document.
"""

from __future__ import annotations

import random
from importlib import resources
from pathlib import Path

CORPUS_FILE = "corpus.txt"
_SEED = 20240601
_TARGET_CHARS = 320_000

_NAMES = ["Mira", "Tomas", "Ilse", "Anouk", "Bram", "Cato", "Dilan", "Esme", "Femke", "Gerrit", "Hanna", "Joris",
          "Kaia", "Lotte", "Milo", "Noor", "Otto", "Pim", "Roos", "Sven", "Tess", "Ulla", "Vera", "Wout"]
_TOWNS = {"Valen": "by the river", "Orlen": "in the hills", "Brisk": "on the coast", "Tarn": "near the lake",
          "Hollow": "in the valley", "Marrow": "at the edge of the forest"}
_JOBS = ["baker", "smith", "weaver", "farmer", "fisher", "potter", "carpenter", "teacher"]
_ANIMALS = ["goats", "hens", "sheep", "ducks", "bees", "cats", "dogs", "geese"]
_GOODS = ["bread", "apples", "cheese", "rope", "nails", "wool", "fish", "honey", "pears", "salt"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve"]


def _world(rng: random.Random) -> dict[str, dict]:
    """Fixed facts per person: the corpus never contradicts them."""
    towns = list(_TOWNS)
    return {name: {"town": rng.choice(towns), "job": rng.choice(_JOBS), "animal": rng.choice(_ANIMALS),
                   "count": rng.randint(2, 9), "friend": rng.choice([n for n in _NAMES if n != name])}
            for name in _NAMES}


def _story(rng: random.Random, world: dict[str, dict]) -> str:
    name = rng.choice(_NAMES)
    p = world[name]
    day = rng.choice(_DAYS)
    goods = rng.sample(_GOODS, 2)
    friend = p["friend"]
    lines = [
        f"{name} lives in {p['town']}. {p['town']} is a town {_TOWNS[p['town']]}.",
        f"{name} is a {p['job']} and keeps {_NUMBER_WORDS[p['count']]} {p['animal']}.",
        f"On {day} morning, {name} walks to the market in {p['town']} and buys {goods[0]} and {goods[1]}.",
        f"There {name} meets {friend}, who lives in {world[friend]['town']} and works as a {world[friend]['job']}.",
        f"In the evening {name} feeds the {p['animal']} and counts them: " +
        ", ".join(_NUMBER_WORDS[1:p['count'] + 1]) + ".",
    ]
    return " ".join(lines[:rng.randint(3, 5)])


def _arithmetic(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(4, 8)):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        op = rng.choice(["plus", "times", "minus"])
        if op == "minus" and b > a:
            a, b = b, a
        value = {"plus": a + b, "times": a * b, "minus": a - b}[op]
        facts.append(f"{a} {op} {b} is {value}.")
    return " ".join(facts)


def _calendar(rng: random.Random) -> str:
    start = rng.randrange(7)
    days = [_DAYS[(start + i) % 7] for i in range(rng.randint(3, 7))]
    month = rng.randrange(12)
    return (f"After {days[0]} comes {days[1]}. The days go " + ", ".join(days) + ". "
            f"The month after {_MONTHS[month]} is {_MONTHS[(month + 1) % 12]}, and the month before it is "
            f"{_MONTHS[month - 1]}.")


def _counting(rng: random.Random) -> str:
    start, step = rng.randint(1, 50), rng.randint(1, 5)
    numbers = [str(start + step * i) for i in range(rng.randint(5, 10))]
    return f"Counting by {step} from {start}: " + ", ".join(numbers) + "."


def make_corpus(seed: int = _SEED, target_chars: int = _TARGET_CHARS) -> str:
    """The corpus text: paragraphs separated by blank lines, about `target_chars` long."""
    rng = random.Random(seed)
    world = _world(rng)
    makers = [lambda: _story(rng, world)] * 5 + [lambda: _arithmetic(rng)] * 2 + [lambda: _calendar(rng),
                                                                                 lambda: _counting(rng)]
    paragraphs: list[str] = []
    size = 0
    while size < target_chars:
        text = rng.choice(makers)()
        paragraphs.append(text)
        size += len(text) + 2
    return "\n\n".join(paragraphs) + "\n"


def builtin_corpus_text() -> str:
    """The committed corpus shipped with the package."""
    return resources.files("heteroflow.data").joinpath(CORPUS_FILE).read_text(encoding="utf-8")


def builtin_documents() -> list[str]:
    """The corpus split into documents (paragraphs)."""
    return [p for p in builtin_corpus_text().split("\n\n") if p.strip()]


if __name__ == "__main__":  # regenerate the committed files: corpus.txt, then the tokenizer trained on it
    from heteroflow.data.tokenizer import TOKENIZER_FILE, train_bpe

    here = Path(__file__).parent
    text = make_corpus()
    (here / CORPUS_FILE).write_text(text, encoding="utf-8")
    train_bpe(text, vocab_size=512).save(here / TOKENIZER_FILE)
    print(f"wrote {len(text)} characters to {here / CORPUS_FILE} and {here / TOKENIZER_FILE}")
