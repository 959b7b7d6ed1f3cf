"""Parser for the bash subset: tokens -> the syntax tree of `nodes` (lists, if/case/for/while, functions).

Redirections are parsed and dropped (nothing is ever run, so where output goes does not matter).
"""

from __future__ import annotations

import re
from heteroflow.megatron.shell.errors import ShellSyntaxError
from heteroflow.megatron.shell.lexer import Lit, Token, tokenize
from heteroflow.megatron.shell.nodes import (AndOr, ArithCmd, Assign, Case, CondCmd, For, FuncDef, Group, If,
                                             Pipeline, Sequence, Simple, While, Word)

_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])?(\+?)=")
_DECLARATIONS = ("export", "declare", "local", "readonly", "typeset")
_REDIRECTIONS = ("<", ">", ">>", ">&", "<&", "&>", ">|", "<<<", "<<", "<<-")
_END_WORDS = ("then", "elif", "else", "fi", "do", "done", "esac", "}", ";;")


class Parser:
    """Recursive-descent parser over the lexer's tokens."""

    def __init__(self, tokens: list[Token], source_lines: list[str]):
        self.tokens = tokens
        self.pos = 0
        self.source_lines = source_lines

    # -- token helpers ---------------------------------------------------------------------------
    @property
    def tok(self) -> Token:
        return self.tokens[self.pos]

    def _next(self) -> Token:
        tok = self.tokens[self.pos]
        self.pos += 1
        return tok

    def _is_op(self, *ops: str) -> bool:
        return self.tok.kind == "op" and self.tok.text in ops

    def _is_word(self, *words: str) -> bool:
        return self.tok.plain in words

    def _expect_word(self, word: str, opened: Token) -> None:
        if not self._is_word(word):
            found = "end of file" if self.tok.kind == "eof" else repr(self.tok.text)
            raise ShellSyntaxError(f"line {self.tok.line}: expected `{word}` to close `{opened.plain or opened.text}` "
                                   f"from line {opened.line}, found {found}")
        self._next()

    def _skip_newlines(self) -> None:
        while self.tok.kind == "newline":
            self._next()

    def _line_text(self, line: int) -> str:
        return self.source_lines[line - 1].strip() if 0 < line <= len(self.source_lines) else ""

    # -- grammar ---------------------------------------------------------------------------------
    def parse(self) -> Sequence:
        """The whole script."""
        body = self._list(stop=())
        if self.tok.kind != "eof":
            raise ShellSyntaxError(f"line {self.tok.line}: unexpected {self.tok.text!r}")
        return body

    def _list(self, stop: tuple[str, ...]) -> Sequence:
        """And-or lists separated by `;`, `&` or newlines, up to a word in `stop` (or `)`)."""
        items = []
        while True:
            self._skip_newlines()
            while self._is_op(";", "&"):
                self._next()
                self._skip_newlines()
            if self.tok.kind == "eof" or self._is_op(")", ";;") or (self.tok.plain in stop and stop):
                break
            if self.tok.plain in _END_WORDS:
                raise ShellSyntaxError(f"line {self.tok.line}: unexpected `{self.tok.plain}`")
            items.append(self._and_or())
            if self._is_op(";", "&"):
                self._next()
            elif self.tok.kind not in ("newline", "eof") and not self._is_op(")", ";;") \
                    and self.tok.plain not in stop:
                raise ShellSyntaxError(f"line {self.tok.line}: unexpected {self.tok.text!r}")
        return Sequence(tuple(items))

    def _and_or(self) -> AndOr:
        first = self._pipeline()
        rest = []
        while self._is_op("&&", "||"):
            op = self._next().text
            self._skip_newlines()
            rest.append((op, self._pipeline()))
        return AndOr(first, tuple(rest))

    def _pipeline(self) -> Pipeline:
        negate = False
        if self._is_word("!"):
            self._next()
            negate = True
        commands = [self._command()]
        while self._is_op("|"):
            self._next()
            self._skip_newlines()
            commands.append(self._command())
        return Pipeline(tuple(commands), negate)

    def _command(self):
        tok = self.tok
        word = tok.plain
        if tok.kind == "arith":
            self._next()
            self._skip_redirections()
            return ArithCmd(tok.parts, tok.line, f"(({tok.text}))")
        if word == "if":
            node = self._if()
        elif word in ("for",):
            node = self._for()
        elif word in ("while", "until"):
            node = self._while()
        elif word == "case":
            node = self._case()
        elif word == "{":
            self._next()
            body = self._list(stop=("}",))
            self._expect_word("}", tok)
            node = Group(body, subshell=False)
        elif self._is_op("("):
            self._next()
            body = self._list(stop=())
            if not self._is_op(")"):
                raise ShellSyntaxError(f"line {tok.line}: `(` without its closing `)`")
            self._next()
            node = Group(body, subshell=True)
        elif word == "[[":
            node = self._cond()
        elif word == "function":
            self._next()
            name = self._next().plain or ""
            if self._is_op("("):
                self._next()
                self._next()
            self._skip_newlines()
            node = FuncDef(name, self._command())
        elif tok.kind == "word" and self.tokens[self.pos + 1].kind == "op" and self.tokens[self.pos + 1].text == "(" \
                and self.tokens[self.pos + 2].kind == "op" and self.tokens[self.pos + 2].text == ")" \
                and tok.plain and not _ASSIGNMENT.match(tok.plain):
            self.pos += 3
            self._skip_newlines()
            node = FuncDef(tok.plain, self._command())
        else:
            return self._simple()
        self._skip_redirections()
        return node

    def _skip_redirections(self) -> str | None:
        """Skip redirections; the text of a here-document among them, if any."""
        heredoc = None
        while self._is_op(*_REDIRECTIONS) or (self.tok.kind == "word" and re.fullmatch(r"\d+", self.tok.text)
                                             and self.tokens[self.pos + 1].kind == "op"
                                             and self.tokens[self.pos + 1].text in _REDIRECTIONS
                                             and self.tokens[self.pos + 1].adjacent):
            if self.tok.kind == "word":
                self._next()
            self._next()
            if self.tok.kind == "word":
                heredoc = self.tok.heredoc if self.tok.heredoc is not None else heredoc
                self._next()
        return heredoc

    def _simple(self) -> Simple:
        line = self.tok.line
        assigns: list[Assign] = []
        decl: list[Assign] = []
        words: list[Word] = []
        heredoc = None
        while True:
            tok = self.tok
            if self._is_op(*_REDIRECTIONS) or (tok.kind == "word" and re.fullmatch(r"\d+", tok.text)
                                              and self.tokens[self.pos + 1].kind == "op"
                                              and self.tokens[self.pos + 1].text in _REDIRECTIONS
                                              and self.tokens[self.pos + 1].adjacent):
                heredoc = self._skip_redirections() or heredoc
                continue
            if tok.kind != "word":
                break
            assign = self._assignment() if (not words or words[0].text in _DECLARATIONS) else None
            if assign is not None:
                (decl if words else assigns).append(assign)
                continue
            self._next()
            words.append(Word(tok.parts, tok.text, tok.line))
        if not assigns and not words and not decl:
            found = "end of file" if self.tok.kind == "eof" else repr(self.tok.text)
            raise ShellSyntaxError(f"line {self.tok.line}: expected a command, found {found}")
        return Simple(tuple(assigns), tuple(words), line, tuple(decl), heredoc)

    def _assignment(self) -> Assign | None:
        """An assignment word at the current token, or None when it is an ordinary word."""
        tok = self.tok
        first = tok.parts[0] if tok.parts else None
        if not isinstance(first, Lit) or first.quoted:
            return None
        m = _ASSIGNMENT.match(first.text)
        if not m:
            return None
        name, index, append = m.group(1), m.group(2), bool(m.group(3))
        rest_text = first.text[m.end():]
        value_parts = ((Lit(rest_text),) if rest_text else ()) + tuple(tok.parts[1:])
        self._next()
        index = index[1:-1] if index else None
        nxt = self.tok
        if not value_parts and nxt.kind == "op" and nxt.text == "(" and nxt.adjacent:
            self._next()
            elements: list[Word] = []
            while True:
                self._skip_newlines()
                if self._is_op(")"):
                    self._next()
                    break
                if self.tok.kind != "word":
                    raise ShellSyntaxError(f"line {tok.line}: array `{name}=(` is not closed by `)`")
                element = self._next()
                elements.append(Word(element.parts, element.text, element.line))
            return Assign(name, tok.line, array=tuple(elements), append=append, index=index)
        value = Word(value_parts, tok.text[tok.text.index("=") + 1:], tok.line)
        return Assign(name, tok.line, value=value, append=append, index=index)

    def _if(self) -> If:
        opened = self._next()
        branches, texts = [], []
        while True:
            texts.append((self.tok.line, self._line_text(self.tok.line)))
            cond = self._list(stop=("then",))
            self._expect_word("then", opened)
            body = self._list(stop=("elif", "else", "fi"))
            branches.append((cond, body))
            if self._is_word("elif"):
                self._next()
                continue
            break
        else_body = None
        if self._is_word("else"):
            self._next()
            else_body = self._list(stop=("fi",))
        self._expect_word("fi", opened)
        return If(tuple(branches), else_body, opened.line, tuple(texts))

    def _for(self) -> For:
        opened = self._next()
        if self.tok.kind == "arith":
            raise ShellSyntaxError(f"line {opened.line}: C-style `for ((...))` loops are not supported; "
                                   "write the values out")
        var = self._next().plain
        if not var:
            raise ShellSyntaxError(f"line {opened.line}: `for` needs a variable name")
        words = None
        self._skip_newlines()
        if self._is_word("in"):
            self._next()
            collected = []
            while self.tok.kind == "word":
                tok = self._next()
                collected.append(Word(tok.parts, tok.text, tok.line))
            words = tuple(collected)
        if self._is_op(";"):
            self._next()
        self._skip_newlines()
        self._expect_word("do", opened)
        body = self._list(stop=("done",))
        self._expect_word("done", opened)
        return For(var, words, body, opened.line)

    def _while(self) -> While:
        opened = self._next()
        text = self._line_text(opened.line)
        cond = self._list(stop=("do",))
        self._expect_word("do", opened)
        body = self._list(stop=("done",))
        self._expect_word("done", opened)
        return While(cond, body, opened.plain == "until", opened.line, text)

    def _case(self) -> Case:
        opened = self._next()
        tok = self._next()
        word = Word(tok.parts, tok.text, tok.line)
        self._skip_newlines()
        self._expect_word("in", opened)
        items = []
        while True:
            self._skip_newlines()
            if self._is_word("esac"):
                self._next()
                break
            if self._is_op("("):
                self._next()
            patterns = []
            while True:
                if self.tok.kind != "word":
                    raise ShellSyntaxError(f"line {self.tok.line}: expected a case pattern")
                pat = self._next()
                patterns.append(Word(pat.parts, pat.text, pat.line))
                if self._is_op("|"):
                    self._next()
                    continue
                break
            if not self._is_op(")"):
                raise ShellSyntaxError(f"line {self.tok.line}: expected `)` after a case pattern")
            self._next()
            body = self._list(stop=("esac",))
            items.append((tuple(patterns), body))
            if self._is_op(";;"):
                self._next()
            elif self.tok.kind == "eof":
                raise ShellSyntaxError(f"line {opened.line}: `case` without `esac`")
        return Case(word, tuple(items), opened.line)

    def _cond(self) -> CondCmd:
        opened = self._next()
        items: list = []
        while not self._is_word("]]"):
            tok = self._next()
            if tok.kind == "eof" or tok.kind == "newline":
                raise ShellSyntaxError(f"line {opened.line}: `[[` without its closing `]]`")
            if tok.kind == "op":
                items.append(tok.text)
            elif tok.plain in ("!",):
                items.append("!")
            else:
                items.append(Word(tok.parts, tok.text, tok.line))
        self._next()
        return CondCmd(tuple(items), opened.line, self._line_text(opened.line))


def parse_script(text: str) -> tuple[Sequence, list[str]]:
    """The syntax tree of a script and the lexer's notes."""
    tokens, notes = tokenize(text)
    return Parser(tokens, text.replace("\r\n", "\n").split("\n")).parse(), notes
