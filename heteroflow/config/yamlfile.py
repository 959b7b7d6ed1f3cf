"""Reading YAML (and other text) files a user names, within bounds.

A job, cluster, plan, profile or Megatron file is read only when it is a regular file of at most
`MAX_FILE_BYTES` (a FIFO, a device such as /dev/zero or a directory is refused before it is opened). The
YAML itself may nest at most `MAX_DEPTH` levels and expand to at most `MAX_NODES` nodes once aliases are
counted at every use (this refuses "billion laughs" alias bombs), and its mapping keys must be plain
scalars. Merge keys (`<<: *base`) work, later keys overriding merged ones; a key written twice in one
mapping is an error. Every failure is a `UserError` naming the file (and the line and column where known).

Numbers in exponent form read as YAML 1.2 (and OmegaConf, NeMo's loader) read them: `lr: 3e-4` and
`tokens_per_s: 1.2e5` are floats, where PyYAML's YAML 1.1 rules (a dot and a signed exponent) would leave them
strings (`add_exponent_floats`). heteroflow writes YAML with `dump_yaml`, which quotes a string of that form
(a node named `1e3`) so that it reads back as the same string.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import yaml
from yaml.composer import ComposerError
from yaml.nodes import MappingNode, ScalarNode

from heteroflow.errors import UserError

MAX_FILE_BYTES = 1 << 20
"""Largest file read (1 MiB): job files are a few KB, plans, profiles and Megatron configs tens of KB, and
PyYAML's pure-Python parser (needed for the checks below) takes seconds per MB."""
MAX_DEPTH = 100
"""Deepest nesting of mappings and sequences (a job nests about 6 levels)."""
MAX_NODES = 100_000
"""Most values (scalars, lists, mappings) in one document, counting an alias's whole subtree at each use;
a job has about a hundred."""

_MERGE_TAG = "tag:yaml.org,2002:merge"
_FLOAT_TAG = "tag:yaml.org,2002:float"
EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
"""A number with an exponent, with or without a dot or the exponent's sign (YAML 1.2's core schema)."""


def add_exponent_floats(loader: type[yaml.SafeLoader]) -> type[yaml.SafeLoader]:
    """`loader`, resolving exponent-form numbers (`3e-4`, `1E5`, `.5e3`) as floats; PyYAML's own float and int
    rules keep their forms. Modifies the class (a subclass of SafeLoader gets its own resolver table)."""
    loader.add_implicit_resolver(_FLOAT_TAG, EXPONENT_FLOAT, list("-+0123456789."))
    return loader


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_text_file(path: str | os.PathLike, *, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of regular file `path` (newlines as `\\n`), refusing anything else or anything larger
    than `max_bytes` without blocking and without reading more than `max_bytes + 1` bytes."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{path}: is {_kind(mode)}, not a regular file; name a file")
    try:
        # O_NONBLOCK: should the path have become a FIFO since the check, opening it still returns at once.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise UserError(f"{path}: is {_kind(mode)}, not a regular file; name a file")
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise UserError(f"{path}: larger than {max_bytes} bytes ({max_bytes / 2**20:g} MiB), more than any "
                        "file heteroflow reads; check the path")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: cannot read: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


class StrictLoader(yaml.SafeLoader):
    """SafeLoader with bounded depth and alias expansion, scalar keys only, and no duplicate keys."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0
        self._expanded = 0
        self._sizes: dict[int, int] = {}  # id(node) -> nodes in its subtree with aliases expanded

    def compose_document(self):
        node = super().compose_document()
        self._sizes = {}
        return node

    def _count(self, nodes: int, mark) -> None:
        self._expanded += nodes
        if self._expanded > MAX_NODES:
            raise ComposerError(None, None, f"more than {MAX_NODES} values (an alias counts its whole value at "
                                "each use); heteroflow's files hold far fewer: check the file, or use fewer aliases",
                                mark)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None and id(target) not in self._sizes:
                raise ComposerError(None, None, f"alias *{event.anchor} is used inside its own anchor (a recursive "
                                    "structure)", event.start_mark)
            node = super().compose_node(parent, index)  # reports an undefined alias
            self._count(self._sizes[id(node)], event.start_mark)
            return node
        mark = self.peek_event().start_mark
        if self._depth >= MAX_DEPTH:
            raise ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep", mark)
        before = self._expanded
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._count(1, mark)
        self._sizes[id(node)] = self._expanded - before
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        _check_keys(self, node)
        return node


add_exponent_floats(StrictLoader)


class Dumper(yaml.SafeDumper):
    """SafeDumper that quotes the strings `StrictLoader` would read as exponent-form floats."""


add_exponent_floats(Dumper)


def dump_yaml(data, **options) -> str:
    """`data` as YAML text that `read_yaml` reads back unchanged (`yaml.dump` options pass through)."""
    return yaml.dump(data, Dumper=Dumper, **options)


def _check_keys(loader: StrictLoader, node: MappingNode) -> None:
    """Keys are scalars, each written once (one merge key `<<` at most); merged keys may be overridden."""
    seen: set = set()
    for key_node, _ in node.value:
        if not isinstance(key_node, ScalarNode):
            kind = "mapping" if isinstance(key_node, MappingNode) else "list"
            raise ComposerError("while reading a mapping", node.start_mark,
                                f"a {kind} cannot be a mapping key; keys are plain names or numbers",
                                key_node.start_mark)
        key = "<<" if key_node.tag == _MERGE_TAG else loader.construct_object(key_node)
        if key in seen:
            raise ComposerError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)


def read_yaml(path: str | os.PathLike) -> object:
    """Parse a YAML file within the bounds above; every problem becomes a `UserError` naming the file,
    with line and column where YAML tells them."""
    path = Path(path)
    text = read_text_file(path)
    try:
        return yaml.load(text, Loader=StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise UserError(f"{where}: YAML error: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: YAML error: {exc}") from None
    except RecursionError:
        raise UserError(f"{path}: YAML error: nested too deeply") from None
    except (ValueError, OverflowError, TypeError) as exc:  # a scalar PyYAML cannot convert (2021-13-45, 10**5000)
        what = "a number with thousands of digits" if "integer string conversion" in str(exc) else str(exc)
        raise UserError(f"{path}: YAML error: a value cannot be read: {what}") from None
