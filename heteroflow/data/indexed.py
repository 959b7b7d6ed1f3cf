"""Megatron's indexed dataset format (`PREFIX.bin` + `PREFIX.idx`, "MMIDIDX"), read and written.

`.bin` holds the token ids of every sequence back to back. `.idx` is little-endian:
the 9-byte magic `MMIDIDX\\0\\0`, a u64 version (1), a u8 dtype code (Megatron's `DType`: 4 int32,
8 uint16, ...), u64 sequence count N, u64 document count D, then int32[N] sequence lengths, int64[N]
byte offsets of each sequence in `.bin`, int64[D] document indices (sequence index where each document
starts, beginning with 0 and ending with N). A GPT dataset samples sequences; `prepare-data` writes one
sequence per document, as Megatron's `preprocess_data.py` does without sentence splitting.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from heteroflow.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
"""Megatron's integer dtype codes (6 and 7 are floats: never token ids)."""
CODE_OF = {np.dtype(t).name: code for code, t in DTYPE_CODES.items()}
UINT16_VOCAB_LIMIT = 65500
"""Megatron stores vocabularies below this size as uint16, larger ones as int32 (`DType.optimal_dtype`)."""


def token_dtype(vocab_size: int) -> str:
    """The token dtype Megatron chooses for a vocabulary: uint16 below 65500 ids, else int32."""
    return "uint16" if vocab_size < UINT16_VOCAB_LIMIT else "int32"


def index_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def data_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


class IndexedDataset:
    """One `.bin`/`.idx` pair, memory-mapped; `where` names the config path in error messages."""

    def __init__(self, prefix: str | Path, *, where: str = "train.data.prefixes"):
        self.prefix = str(prefix)
        idx, bin_ = index_path(prefix), data_path(prefix)
        for path in (idx, bin_):
            if not path.is_file():
                raise UserError(f"{where}: {path} not found (a Megatron dataset prefix names PREFIX.bin and "
                                "PREFIX.idx)")
        raw = idx.read_bytes()
        if len(raw) < HEADER_BYTES or raw[:len(MAGIC)] != MAGIC:
            raise UserError(f"{where}: {idx} is not a Megatron index file (no MMIDIDX header)")
        version, code, count, docs = struct.unpack_from("<QBQQ", raw, len(MAGIC))
        if version != VERSION:
            raise UserError(f"{where}: {idx} has index version {version}; only version {VERSION} exists")
        if code not in DTYPE_CODES:
            raise UserError(f"{where}: {idx} has dtype code {code}, not an integer token type")
        expected = HEADER_BYTES + 12 * count + 8 * docs
        if len(raw) not in (expected, expected + count):  # + one mode byte per sequence in multimodal sets
            raise UserError(f"{where}: {idx} has {len(raw)} bytes; its header ({count} sequences, {docs} document "
                            f"indices) needs {expected}: the file is truncated or not an index")
        self.dtype = np.dtype(DTYPE_CODES[code])
        offset = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(raw, np.int32, count, offset)
        self.sequence_pointers = np.frombuffer(raw, np.int64, count, offset + 4 * count)
        self.document_indices = np.frombuffer(raw, np.int64, docs, offset + 12 * count)
        num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        size = bin_.stat().st_size
        if size != num_tokens * self.dtype.itemsize:
            other = [n for n, t in DTYPE_CODES.items() if size == num_tokens * np.dtype(t).itemsize]
            hint = f" (it fits {np.dtype(DTYPE_CODES[other[0]]).name}: the index's dtype is wrong)" if other else ""
            raise UserError(f"{where}: {bin_} has {size} bytes, but {idx} describes {num_tokens} {self.dtype.name} "
                            f"tokens ({num_tokens * self.dtype.itemsize} bytes){hint}; write both with one tool")
        if count and (self.sequence_lengths.min() < 0 or self.sequence_pointers[0] != 0 or np.any(
                np.diff(self.sequence_pointers) != self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize)):
            raise UserError(f"{where}: {idx} has sequence offsets that do not follow its lengths; the index is corrupt")
        # A plain ndarray view of the map: slicing a np.memmap subclass costs more than the read itself.
        self.tokens = np.asarray(np.memmap(bin_, dtype=self.dtype, mode="r")) if size else np.zeros(0, self.dtype)
        self.num_tokens = num_tokens

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `i` (to its end when `length` is None)."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        end = start - offset + int(self.sequence_lengths[i]) if length is None else start + length
        return self.tokens[start:end]

    def check_tokens(self, vocab_size: int, *, where: str, chunk: int = 1 << 24) -> None:
        """Raise a `UserError` if a token id is negative or not below `vocab_size` (scans the `.bin`)."""
        low, high = 0, 0
        for a in range(0, len(self.tokens), chunk):
            part = self.tokens[a:a + chunk]
            low, high = min(low, int(part.min())), max(high, int(part.max()))
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise UserError(f"{where}: {data_path(self.prefix)} contains token id {bad}, but model.vocab_size is "
                            f"{vocab_size}; tokenize with a vocabulary that fits the model")


class IndexedWriter:
    """Writes `PREFIX.bin` while documents come, `PREFIX.idx` on `close()`; one sequence per document."""

    def __init__(self, prefix: str | Path, dtype: str):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        assert self.dtype.name in CODE_OF, f"no Megatron dtype code for {dtype}"
        self._bin = open(data_path(prefix), "wb")
        self.lengths: list[int] = []

    def add_document(self, tokens) -> None:
        """Append one document's token ids."""
        array = np.asarray(tokens, dtype=np.int64)
        info = np.iinfo(self.dtype)
        assert array.size == 0 or (array.min() >= info.min and array.max() <= info.max), "token id outside dtype"
        self._bin.write(array.astype(self.dtype).tobytes())
        self.lengths.append(int(array.size))

    def abort(self) -> None:
        """Close `.bin` without writing an index (no-op after `close`)."""
        self._bin.close()

    def close(self) -> Path:
        """Finish `.bin` and write `.idx`; returns the index path."""
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        path = index_path(self.prefix)
        with open(path, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODE_OF[self.dtype.name], len(lengths), len(documents)))
            f.write(lengths.tobytes() + pointers.tobytes() + documents.tobytes())
        return path
