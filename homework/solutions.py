"""Find solution blocks and replace them by stubs.

A block is the lines strictly between a BEGIN and an END marker line (nbgrader's markers, written
here as "###" + " BEGIN SOLUTION" so that this file holds no marker line itself). Exercises live in
labs/*.py only (release refuses markers anywhere else, notebooks included). The block becomes

    # Exercise: write your code here, in place of the raise below.
    raise NotImplementedError(
        "Exercise <name> (notebook NN_topic.ipynb): <first docstring line>. Fill in the block in "
        "labs/labNN_x.py and run ./run.sh check NN")

at the BEGIN marker's indentation, where <name> is the enclosing function (`Class.method`).
Anything odd (a misspelt or unpaired marker,
a block outside a function, a stubbed file that no longer parses) raises ExerciseError naming the
file and line, so a release never goes out half-stubbed.
"""
from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

BEGIN = "###" + " BEGIN SOLUTION"
END = "###" + " END SOLUTION"
# Anything that looks like a marker, exact or not: "#BEGIN SOLUTION", "## end solution", ...
MARKER_LIKE = re.compile(r"^\s*#+\s*(BEGIN|END)\s+SOLUTION\b", re.IGNORECASE)
STUB_COMMENT = "# Exercise: write your code here, in place of the raise below."
LAB_NAME = re.compile(r"^lab(\d+)_")
_PLACEHOLDER = "__HOMEWORK_STUB_{}__"


class ExerciseError(ValueError):
    """A solution block that cannot be stubbed safely; the message names file and line."""


@dataclass
class Block:
    path: str                 # file the block is in (relative, posix), e.g. labs/lab04_ring.py
    begin: int                # 1-based line of the BEGIN marker
    end: int                  # 1-based line of the END marker
    indent: str               # the BEGIN marker's indentation, reused by the stub
    solution: list[str]       # the lines between the markers, as written
    exercise: str = ""        # enclosing function: "ring_all_reduce" or "Bucketer.add"
    hint: str = ""            # first line of that function's docstring


@dataclass
class StubbedText:
    text: str
    blocks: list[Block] = field(default_factory=list)


def is_marker_like(line: str) -> bool:
    return bool(MARKER_LIKE.match(line))


def find_blocks(text: str, path: str) -> list[Block]:
    """The solution blocks of one source text; ExerciseError for malformed or unpaired markers."""
    where = path
    blocks: list[Block] = []
    open_block: Block | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not is_marker_like(line):
            if open_block is not None:
                open_block.solution.append(line)
            continue
        if stripped not in (BEGIN, END):
            raise ExerciseError(f"{where}:{number}: malformed solution marker {stripped!r}; "
                                f"write exactly {BEGIN!r} or {END!r} on a line of its own")
        indent = line[: len(line) - len(line.lstrip())]
        if stripped == BEGIN:
            if open_block is not None:
                raise ExerciseError(f"{where}:{number}: BEGIN SOLUTION inside the block opened at "
                                    f"line {open_block.begin}; close it first")
            open_block = Block(path, number, 0, indent, [])
        else:
            if open_block is None:
                raise ExerciseError(f"{where}:{number}: END SOLUTION without a BEGIN SOLUTION")
            if indent != open_block.indent:
                raise ExerciseError(f"{where}:{number}: END SOLUTION is indented differently from "
                                    f"its BEGIN SOLUTION at line {open_block.begin}")
            open_block.end = number
            blocks.append(open_block)
            open_block = None
    if open_block is not None:
        raise ExerciseError(f"{where}:{open_block.begin}: BEGIN SOLUTION is never closed")
    return blocks


def lab_number(path: str) -> str:
    """'04' for labs/lab04_collectives.py, '' when the name has no number."""
    match = LAB_NAME.match(Path(path).name)
    return match.group(1) if match else ""


def stub_message(block: Block, notebook: str, number: str) -> str:
    # a docstring that opens with "Exercise (name): ..." would repeat the word: keep what follows
    hint = re.sub(r"^Exercise\b[^:]{0,60}:\s*", "", block.hint).rstrip(". ") or "see the notebook"
    where = f"notebook {notebook}" if notebook else (f"notebook {number}" if number else "its notebook")
    check = f"./run.sh check {number}" if number else "./run.sh check"
    return f"Exercise {block.exercise} ({where}): {hint}. Fill in the block in {block.path} and run {check}"


def _raise_lines(indent: str, message: str) -> list[str]:
    chunks = textwrap.wrap(message, width=max(30, 88 - len(indent)), drop_whitespace=False)
    body = [f"{indent}    {chunk!r}" for chunk in chunks] or [f"{indent}    ''"]
    body[-1] += ")"
    return [f"{indent}{STUB_COMMENT}", f"{indent}raise NotImplementedError(", *body]


def _replace(lines: list[str], blocks: list[Block], make) -> list[str]:
    """`lines` with each block (markers included) replaced by `make(index, block)`."""
    out: list[str] = []
    previous_end = 0
    for index, block in enumerate(blocks):
        out += lines[previous_end: block.begin - 1]
        out += make(index, block)
        previous_end = block.end
    out += lines[previous_end:]
    return out


def _functions(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """Every function in `tree` with its dotted name: f, Class.method, outer.inner."""
    found: list[tuple[ast.AST, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((child, name))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


_PLACEHOLDER_NAME = re.compile(r"__HOMEWORK_STUB_(\d+)__")


def _name_blocks(stubbed: str, blocks: list[Block], where: str) -> None:
    """Give each block its enclosing function's name and docstring, from a placeholder parse."""
    try:
        tree = ast.parse(stubbed)
    except SyntaxError as exc:
        raise ExerciseError(f"{where}:{exc.lineno}: the file is not valid Python once its solution "
                            f"blocks are replaced by a raise ({exc.msg}); keep each block a "
                            "complete run of statements inside a function body") from None
    owners: dict[int, tuple[str, str]] = {}
    for function, name in _functions(tree):  # outer functions first: the innermost one wins
        for node in ast.walk(function):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args
                    and isinstance(node.exc.args[0], ast.Name)
                    and _PLACEHOLDER_NAME.fullmatch(node.exc.args[0].id)):
                index = int(_PLACEHOLDER_NAME.fullmatch(node.exc.args[0].id).group(1))
                doc = ast.get_docstring(function) or ""
                first = next((line.strip() for line in doc.splitlines() if line.strip()), "")
                owners[index] = (name, first)
    for index, block in enumerate(blocks):
        if index in owners:
            block.exercise, block.hint = owners[index]
        else:
            raise ExerciseError(f"{where}:{block.begin}: this solution block is not inside a "
                                "function or method body; put exercise code in a function")


def stub_python(text: str, path: str, notebook: str = "") -> StubbedText:
    """Replace every solution block of a Python file by its NotImplementedError stub."""
    blocks = find_blocks(text, path)
    if not blocks:
        return StubbedText(text, [])
    lines = text.splitlines()
    placeholder = _replace(lines, blocks, lambda i, b: [
        f"{b.indent}raise NotImplementedError({_PLACEHOLDER.format(i)})"])
    _name_blocks("\n".join(placeholder) + "\n", blocks, path)
    number = lab_number(path)
    final = _replace(lines, blocks, lambda i, b: _raise_lines(b.indent, stub_message(b, notebook, number)))
    result = "\n".join(final) + ("\n" if text.endswith("\n") else "")
    try:
        ast.parse(result)
    except SyntaxError as exc:  # cannot happen once the placeholder parsed; kept as a guard
        raise ExerciseError(f"{path}:{exc.lineno}: stubbed code does not parse: {exc.msg}") from None
    return StubbedText(result, blocks)


def notebook_for(root: Path, number: str) -> str:
    """The notebook that explains lab NN (its file name), or '' when there is none yet."""
    if not number:
        return ""
    found = sorted((root / "notebooks").glob(f"{number}_*.ipynb"))
    return found[0].name if found else ""
