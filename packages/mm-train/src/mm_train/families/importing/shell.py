"""A launch script read, never run: its variable assignments (with `$VAR`, `${VAR}`, `${VAR:-x}` and
`$(( ... ))` integer arithmetic evaluated as bash does) and the command that starts training.

What the example scripts of Megatron-style trainers are made of: `NAME=value` and `export NAME=value`
lines, double-quoted multi-line flag lists (`GPT_ARGS="--tp 2 \\ ..."`), backslash continuations, and
one `msrun` / `torchrun` / `python` line running a `.py` file with those lists expanded unquoted
(split into words). A `$( command )` substitution is never run: its value is unknown, and a flag that
needs it is reported as unreadable. Conditionals and loops are not followed (their lines are read
as plain statements, in order).
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

UNKNOWN = "\0unknown\0"  # the value of a command substitution (never run)
LAUNCHERS = ("msrun", "torchrun", "python", "python3", "bash", "deepspeed")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.floordiv, ast.Mod: operator.mod}


@dataclass
class Script:
    variables: Dict[str, str] = field(default_factory=dict)
    launcher: List[str] = field(default_factory=list)  # the launcher and its own flags, before the .py file
    program: Optional[str] = None  # the .py file it runs
    args: List[str] = field(default_factory=list)  # the program's arguments, expanded and split


def arithmetic(text: str, variables: Dict[str, str]) -> int:
    """bash's $(( text )): integers, + - * / %, parentheses, names with or without $ (unset: 0)."""
    expr = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", text).replace("/", "//").replace("////", "//")

    def value(node) -> int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            raw = variables.get(node.id, "0") or "0"
            if UNKNOWN in raw:
                raise ValueError(f"$(( {text} )): {node.id} comes from a command substitution, which is never run: "
                                 f"give it with --var {node.id}=VALUE")
            if not re.fullmatch(r"-?\d+", raw.strip()):
                raise ValueError(f"$(( {text} )): {node.id}={raw!r} is not an integer")
            return int(raw)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(f"$(( {text} )): only integer + - * / % and parentheses are read")

    return value(ast.parse(expr.strip(), mode="eval"))


def _closing(text: str, start: int, opening: str, closing: str) -> int:
    """Index just past the bracket that closes the one before ``start`` (brackets in quotes not counted)."""
    depth, i, quote = 1, start, None
    while i < len(text) and depth:
        c = text[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        else:
            depth += (c == opening) - (c == closing)
        i += 1
    if depth:
        raise ValueError(f"unclosed {opening!r} in {text[start - 2:start + 40]!r}")
    return i


def _dollar(text: str, i: int, variables: Dict[str, str]):
    """(value, next index) of the expansion that starts at text[i] == '$'."""
    if text.startswith("$((", i):
        end = _closing(text, i + 3, "(", ")")
        if text[end:end + 1] != ")":
            raise ValueError(f"unclosed $(( in {text[i:i + 40]!r}")
        return str(arithmetic(text[i + 3:end - 1], variables)), end + 1
    if text.startswith("$(", i):
        return UNKNOWN, _closing(text, i + 2, "(", ")")
    if text.startswith("${", i):
        end = text.index("}", i)
        inner = text[i + 2:end]
        name, _, default = inner.partition(":-")
        found = variables.get(name, "")
        return (found or default if ":-" in inner else found), end + 1
    match = _NAME.match(text, i + 1)
    if match:
        return variables.get(match.group(0), ""), match.end()
    return "$", i + 1


def _split_into(value: str, current: List[str], have: bool, out: List[str]):
    """bash's field splitting of an unquoted expansion inside a word: returns (current, have)."""
    fields = value.split()
    if have and (not fields or value[0].isspace()) and value:
        out.append("".join(current))
        current, have = [], False
    for k, piece in enumerate(fields):
        if k:
            out.append("".join(current))
            current = []
        current.append(piece)
        have = True
    if fields and value[-1].isspace():
        out.append("".join(current))
        current, have = [], False
    return current, have


def words(statement: str, variables: Dict[str, str]) -> List[str]:
    """The words of one statement after expansion: quotes removed, unquoted expansions split on blanks."""
    out: List[str] = []
    current, have, i, quote = [], False, 0, None
    while i < len(statement):
        c = statement[i]
        if quote == "'":
            if c == "'":
                quote = None
            else:
                current.append(c)
            i += 1
        elif c == "\\" and i + 1 < len(statement):
            current.append(statement[i + 1])
            have, i = True, i + 2
        elif c == "$":
            value, i = _dollar(statement, i, variables)
            if quote:
                current.append(value)
                have = True
            else:  # unquoted: split into fields, the first joining the word before, the last the word after
                current, have = _split_into(value, current, have, out)
        elif c in "\"'" and quote is None:
            quote, have, i = c, True, i + 1
        elif c == '"' and quote == '"':
            quote, i = None, i + 1
        elif c.isspace() and quote is None:
            if have:
                out.append("".join(current))
            current, have, i = [], False, i + 1
        else:
            current.append(c)
            have, i = True, i + 1
    if have:
        out.append("".join(current))
    return _without_redirections(out)


def _without_redirections(found: List[str]) -> List[str]:
    """Drop output redirections: '2>&1', '> file', '>> file', '>file' (where output goes is no setting)."""
    kept, skip = [], False
    for word in found:
        if skip:
            skip = False
        elif re.fullmatch(r"\d*>>?", word):
            skip = True  # its target is the next word
        elif not re.fullmatch(r"\d*>>?(&\d+|\S+)", word):
            kept.append(word)
    return kept


def statements(text: str) -> List[str]:
    """The script's statements: comments dropped, continuations joined, quotes kept whole, split at
    newlines, ';', '|' and '&&' outside quotes."""
    out, current, i, quote = [], [], 0, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"' and text[i + 1:i + 2] == "\n":
                i += 2
                continue
            current.append(c)
            if c == quote:
                quote = None
        elif c == "\\" and text[i + 1:i + 2] == "\n":
            current.append(" ")
            i += 2
            continue
        elif c == "\\":
            current.append(text[i:i + 2])
            i += 2
            continue
        elif c in "\"'":
            quote = c
            current.append(c)
        elif text.startswith("$(", i):  # a substitution or arithmetic is one piece, '|' and newlines included
            end = _closing(text, i + 2, "(", ")")
            current.append(text[i:end])
            i = end
            continue
        elif c == "#" and (not current or current[-1].isspace()):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif c in "\n;|&" and not (c == "&" and current and current[-1] == ">"):  # 2>&1 is a redirection
            out.append("".join(current).strip())
            current = []
        else:
            current.append(c)
        i += 1
    out.append("".join(current).strip())
    return [s for s in out if s]


def read_script(text: str, preset: Optional[Dict[str, str]] = None) -> Script:
    """Assignments in order, then the first statement that runs a .py file (its words expanded)."""
    script = Script(variables=dict(preset or {}))
    for statement in statements(text):
        body = statement[len("export "):].lstrip() if statement.startswith("export ") else statement
        match = re.match(r"([A-Za-z_][A-Za-z0-9_]*)=", body)
        if match and match.group(1) in (preset or {}):
            continue  # given by the user (mm-train import --var): the script's own value is not used
        if match and (statement.startswith("export ") or " " not in body[:match.end()]):
            value = words(body[match.end():] or "''", script.variables)
            script.variables[match.group(1)] = " ".join(value)
            continue
        expanded = words(statement, script.variables)
        if expanded and expanded[0].split("/")[-1] in LAUNCHERS and script.program is None:
            at = next((k for k, w in enumerate(expanded) if w.endswith(".py")), None)
            if at is not None:
                script.launcher, script.program, script.args = expanded[:at], expanded[at], expanded[at + 1:]
    return script


def flags(args: List[str]) -> Dict[str, object]:
    """Megatron-style argv as {flag: value}: '--name value' (the value may be several words up to the
    next flag, joined by spaces), a bare '--name' is True; later ones win, as argparse's do."""
    found: Dict[str, object] = {}
    name = None
    for word in args:
        if word.startswith("--"):
            key, eq, value = word[2:].partition("=")
            name = None if eq else key
            found[key] = value if eq else True
        elif name is not None:
            found[name] = word if found[name] is True else f"{found[name]} {word}"
    return found
