"""Tokenizer for the bash subset Megatron launch scripts are written in.

It turns text into words and operators without expanding anything: a word keeps its parts (literal
text, quoted or not, and `$` expansions) so the interpreter can expand and split them the way bash
does. Quotes, backslash escapes, line continuations, comments and here-documents are handled here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from heteroflow.megatron.shell.errors import ShellSyntaxError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPECIAL_PARAMS = "@*#?$!-0123456789"
_OPERATORS = ("&&", "||", ";;", "<<<", "<<-", "<<", ">>", ">&", "<&", "&>", ">|", ";", "&", "|", "(", ")",
              "<", ">")
_META = set(" \t\n;&|()<>")


@dataclass(frozen=True, slots=True)
class Lit:
    """Literal text; `quoted` text is never split or globbed."""

    text: str
    quoted: bool = False


@dataclass(frozen=True, slots=True)
class Param:
    """A parameter expansion: `$NAME`, `$1`, `${NAME[i]}`, `${NAME:-word}`, `${#NAME}` ..."""

    name: str
    quoted: bool
    source: str
    """The expansion as written, shown when its value cannot be known."""
    op: str = ""
    """One of `:-`, `-`, `:=`, `=`, `:+`, `+`, `:?`, `?`, `#`, `##`, `%`, `%%`, `/`, `//`, `^^`, `,,`, `:`."""
    arg: tuple = ()
    """The word after `op`, as parts."""
    index: str | None = None
    """`@`, `*` or an index expression for `${NAME[...]}`."""
    length: bool = False
    """`${#NAME}`."""
    indirect: bool = False
    """`${!NAME}`."""


@dataclass(frozen=True, slots=True)
class Arith:
    """`$((expr))`; `expr` is expanded like a double-quoted word before it is evaluated."""

    expr: tuple
    quoted: bool
    source: str


@dataclass(frozen=True, slots=True)
class CmdSub:
    """`$(...)` or a backquoted command: never run, so its value is unknown."""

    source: str
    quoted: bool


Part = Lit | Param | Arith | CmdSub


@dataclass(frozen=True, slots=True)
class Token:
    """A word, an operator, a newline, an arithmetic command `((...))`, or the end of input."""

    kind: str
    """word, op, newline, arith or eof."""
    text: str
    """Source text (for words: as written, quotes included)."""
    line: int
    parts: tuple = ()
    adjacent: bool = False
    """No blank before this token (tells `NAME=(` array assignments from `NAME= (...)`)."""
    heredoc: str | None = None
    """On a here-document's delimiter word: the document's text (`sbatch <<EOF` reads it as its script)."""

    @property
    def plain(self) -> str | None:
        """The word's text when it is one unquoted literal (keywords must be), else None."""
        if self.kind == "word" and len(self.parts) == 1 and isinstance(self.parts[0], Lit) \
                and not self.parts[0].quoted:
            return self.parts[0].text
        return None


class Lexer:
    """Splits a script into tokens; `tokens()` returns them all, ending with an `eof` token."""

    def __init__(self, text: str):
        self.text = text.replace("\r\n", "\n")
        self.i = 0
        self.line = 1
        self.out: list[Token] = []
        self.pending_heredocs: list[tuple[str, bool, int]] = []
        self.notes: list[str] = []

    # -- helpers ---------------------------------------------------------------------------------
    def _peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.text[j] if j < len(self.text) else ""

    def _error(self, message: str, line: int | None = None) -> ShellSyntaxError:
        return ShellSyntaxError(f"line {line or self.line}: {message}")

    def _advance(self, n: int = 1) -> str:
        chunk = self.text[self.i:self.i + n]
        self.line += chunk.count("\n")
        self.i += n
        return chunk

    def _command_start(self) -> bool:
        """Whether the next token starts a command (where `((` opens an arithmetic command)."""
        if not self.out:
            return True
        last = self.out[-1]
        if last.kind in ("newline", "op"):
            return last.text in ("\n", ";", "&&", "||", "|", "(", "&", ";;")
        return last.plain in ("if", "then", "elif", "else", "do", "while", "until", "!", "{", "for")

    # -- main loop -------------------------------------------------------------------------------
    def tokens(self) -> list[Token]:
        """Every token of the text."""
        adjacent = False
        while self.i < len(self.text):
            c = self._peek()
            if c in " \t":
                self._advance()
                adjacent = False
                continue
            if c == "\\" and self._peek(1) == "\n":
                self._advance(2)
                adjacent = False
                continue
            if c == "\\" and self._trailing_blank_continuation():
                continue
            if c == "#":
                while self.i < len(self.text) and self._peek() != "\n":
                    self._advance()
                continue
            if c == "\n":
                self.out.append(Token("newline", "\n", self.line))
                self._advance()
                self._read_heredoc_bodies()
                adjacent = False
                continue
            if c == "(" and self._peek(1) == "(" and self._command_start():
                self._read_arith_command()
            elif c in _META:
                self._read_operator(adjacent)
            else:
                self._read_word(adjacent)
            adjacent = True
        self.out.append(Token("eof", "", self.line))
        return self.out

    def _trailing_blank_continuation(self) -> bool:
        """`\\` followed by blanks then a newline: bash ends the command there; people mean a continuation."""
        m = re.compile(r"\\[ \t]+\n").match(self.text, self.i)
        if not m:
            return False
        self.notes.append(f"line {self.line}: backslash followed by spaces before the line end; bash would "
                          "end the command here, heteroflow reads it as a line continuation")
        self._advance(m.end() - self.i)
        return True

    def _read_operator(self, adjacent: bool) -> None:
        line = self.line
        for op in _OPERATORS:
            if self.text.startswith(op, self.i):
                self._advance(len(op))
                self.out.append(Token("op", op, line, adjacent=adjacent))
                if op in ("<<", "<<-"):
                    self._read_heredoc_delimiter(strip_tabs=op == "<<-")
                return
        raise self._error(f"unexpected character {self._peek()!r}")

    def _read_arith_command(self) -> None:
        line = self.line
        self._advance(2)
        start, depth = self.i, 0
        while self.i < len(self.text):
            c = self._peek()
            if c == "(":
                depth += 1
            elif c == ")":
                if depth == 0 and self._peek(1) == ")":
                    expr = self.text[start:self.i]
                    self._advance(2)
                    self.out.append(Token("arith", expr, line, parts=_parse_inner(expr, line)))
                    return
                depth -= 1
            self._advance()
        raise self._error("`((` without its closing `))`", line)

    # -- here-documents --------------------------------------------------------------------------
    def _read_heredoc_delimiter(self, strip_tabs: bool) -> None:
        while self._peek() in " \t":
            self._advance()
        start = self.i
        while self.i < len(self.text) and self._peek() not in _META:
            self._advance()
        delimiter = self.text[start:self.i].replace("'", "").replace('"', "").replace("\\", "")
        if not delimiter:
            raise self._error("here-document without a delimiter")
        self.pending_heredocs.append((delimiter, strip_tabs, len(self.out)))
        # Emitted as the redirection's target word, so the parser drops it with the operator.
        self.out.append(Token("word", delimiter, self.line, parts=(Lit(delimiter, quoted=True),), adjacent=True))

    def _read_heredoc_bodies(self) -> None:
        """Read the bodies of here-documents opened on the line that just ended onto their delimiter tokens."""
        for delimiter, strip_tabs, index in self.pending_heredocs:
            body: list[str] = []
            while self.i < len(self.text):
                end = self.text.find("\n", self.i)
                end = len(self.text) if end < 0 else end
                body_line = self.text[self.i:end]
                self._advance(end - self.i + (1 if end < len(self.text) else 0))
                if (body_line.lstrip("\t") if strip_tabs else body_line) == delimiter:
                    break
                body.append(body_line.lstrip("\t") if strip_tabs else body_line)
            self.out[index] = replace(self.out[index], heredoc="\n".join(body) + "\n")
        self.pending_heredocs = []

    # -- words -----------------------------------------------------------------------------------
    def _read_word(self, adjacent: bool) -> None:
        line, start = self.line, self.i
        parts = self._scan_parts(stop=_META)
        self.out.append(Token("word", self.text[start:self.i], line, parts=tuple(parts), adjacent=adjacent))

    def _scan_parts(self, stop: set[str], in_brace: bool = False) -> list[Part]:
        """Parts of a word up to an unquoted character in `stop` (or `}` closing a `${...}`)."""
        parts: list[Part] = []
        buf: list[str] = []

        def flush() -> None:
            if buf:
                parts.append(Lit("".join(buf)))
                buf.clear()

        while self.i < len(self.text):
            c = self._peek()
            if in_brace and c == "}":
                break
            if not in_brace and c in stop:
                break
            if c == "\\":
                nxt = self._peek(1)
                self._advance(2)
                if nxt == "\n" or not nxt:
                    continue
                flush()
                parts.append(Lit(nxt, quoted=True))
            elif c == "'":
                flush()
                parts.append(Lit(self._read_single_quoted(), quoted=True))
            elif c == '"':
                flush()
                self._advance()
                parts.extend(self._read_double_quoted())
            elif c == "$" or c == "`":
                part = self._read_dollar(quoted=False)
                if isinstance(part, Lit) and not part.quoted:
                    buf.append(part.text)
                else:
                    flush()
                    parts.append(part)
            else:
                buf.append(self._advance())
        flush()
        return parts

    def _read_single_quoted(self) -> str:
        line = self.line
        self._advance()
        end = self.text.find("'", self.i)
        if end < 0:
            raise self._error("unterminated single quote", line)
        text = self.text[self.i:end]
        self._advance(end - self.i + 1)
        return text

    def _read_double_quoted(self) -> list[Part]:
        """Parts of a double-quoted string; the opening quote is already consumed."""
        line = self.line
        parts: list[Part] = []
        buf: list[str] = []
        while True:
            if self.i >= len(self.text):
                raise self._error("unterminated double quote", line)
            c = self._peek()
            if c == '"':
                self._advance()
                break
            if c == "\\" and self._peek(1) in '$`"\\\n':
                nxt = self._peek(1)
                self._advance(2)
                if nxt != "\n":
                    buf.append(nxt)
            elif c in "$`":
                part = self._read_dollar(quoted=True)
                if isinstance(part, Lit):
                    buf.append(part.text)
                else:
                    if buf:
                        parts.append(Lit("".join(buf), quoted=True))
                        buf = []
                    parts.append(part)
            else:
                buf.append(self._advance())
        # An empty "" still counts: it makes an (empty) word; "${A[@]}" of an empty array makes none.
        if buf or not parts:
            parts.append(Lit("".join(buf), quoted=True))
        return parts

    def _read_dollar(self, quoted: bool) -> Part:
        """A `$...` or backquote expansion starting at the current character."""
        line, start = self.line, self.i
        if self._peek() == "`":
            self._advance()
            end = self.text.find("`", self.i)
            if end < 0:
                raise self._error("unterminated backquote", line)
            self._advance(end - self.i + 1)
            return CmdSub(self.text[start:self.i], quoted)
        nxt = self._peek(1)
        if nxt == "(" and self._peek(2) == "(":
            self._advance(3)
            expr_start = self.i
            self._skip_balanced(")", line)
            if self._peek() != ")":
                raise self._error("`$((` without its closing `))`", line)
            expr = self.text[expr_start:self.i - 1]
            self._advance()
            return Arith(_parse_inner(expr, line), quoted, self.text[start:self.i])
        if nxt == "(":
            self._advance(2)
            self._skip_balanced(")", line)
            return CmdSub(self.text[start:self.i], quoted)
        if nxt == "{":
            self._advance(2)
            return self._read_braced(start, quoted, line)
        if nxt == "'" and not quoted:
            self._advance()
            return Lit(_ansi_c(self._read_single_quoted()), quoted=True)
        m = _NAME.match(self.text, self.i + 1)
        if m:
            self._advance(1 + len(m.group()))
            return Param(m.group(), quoted, self.text[start:self.i])
        if nxt and nxt in _SPECIAL_PARAMS:
            self._advance(2)
            return Param(nxt, quoted, self.text[start:self.i])
        self._advance()
        return Lit("$", quoted)

    def _skip_balanced(self, close: str, line: int) -> None:
        """Advance past the `)` that closes an already opened `(`, minding quotes and nesting."""
        depth = 0
        while self.i < len(self.text):
            c = self._peek()
            if c == "\\":
                self._advance(2)
                continue
            if c == "'":
                self._read_single_quoted()
                continue
            if c == '"':
                self._advance()
                self._read_double_quoted()
                continue
            self._advance()
            if c == "(":
                depth += 1
            elif c == close:
                if depth == 0:
                    return
                depth -= 1
        raise self._error("unbalanced parentheses in `$(`", line)

    def _read_braced(self, start: int, quoted: bool, line: int) -> Param:
        """`${...}`; the `${` is already consumed."""
        length = indirect = False
        if self._peek() == "#" and self._peek(1) not in "}":
            length = True
            self._advance()
        elif self._peek() == "!":
            indirect = True
            self._advance()
        m = _NAME.match(self.text, self.i)
        if m:
            name = m.group()
        elif self._peek() and self._peek() in _SPECIAL_PARAMS:
            name = self._peek()
            # Multi-digit positional parameters: ${10}.
            digits = re.compile(r"\d+").match(self.text, self.i)
            name = digits.group() if digits else name
        else:
            raise self._error(f"bad substitution {self.text[start:self.i + 1]!r}", line)
        self._advance(len(name))
        index = None
        if self._peek() == "[":
            end = self.text.find("]", self.i)
            if end < 0:
                raise self._error("unterminated `[` in `${...}`", line)
            index = self.text[self.i + 1:end]
            self._advance(end - self.i + 1)
        op = ""
        for candidate in (":-", ":=", ":+", ":?", "##", "%%", "//", "^^", ",,", "-", "=", "+", "?", "#", "%",
                          "/", "^", ",", ":"):
            if self.text.startswith(candidate, self.i):
                op = candidate
                self._advance(len(op))
                break
        arg: list[Part] = []
        if op:
            arg = self._scan_parts(stop=set(), in_brace=True)
        if self._peek() != "}":
            raise self._error(f"bad substitution {self.text[start:self.i + 1]!r}: missing `}}`", line)
        self._advance()
        return Param(name, quoted, self.text[start:self.i], op=op, arg=tuple(arg), index=index,
                     length=length, indirect=indirect)


def _parse_inner(text: str, line: int) -> tuple:
    """Parts of the text inside `$((...))`: expanded like a double-quoted string."""
    sub = Lexer(text)
    sub.line = line
    parts: list[Part] = []
    buf: list[str] = []
    while sub.i < len(sub.text):
        c = sub._peek()
        if c in "$`":
            if buf:
                parts.append(Lit("".join(buf), quoted=True))
                buf = []
            parts.append(sub._read_dollar(quoted=True))
        elif c == '"':
            sub._advance()
        elif c == "\\" and sub._peek(1) == "\n":
            sub._advance(2)
        else:
            buf.append(sub._advance())
    if buf:
        parts.append(Lit("".join(buf), quoted=True))
    return tuple(parts)


_ANSI_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', "r": "\r", "a": "\a", "0": "\0"}


def _ansi_c(text: str) -> str:
    """The value of `$'...'` for the common escapes."""
    return re.sub(r"\\(.)", lambda m: _ANSI_ESCAPES.get(m.group(1), "\\" + m.group(1)), text)


def tokenize(text: str) -> tuple[list[Token], list[str]]:
    """Tokens of `text` and notes about constructs read leniently."""
    lexer = Lexer(text)
    return lexer.tokens(), lexer.notes
