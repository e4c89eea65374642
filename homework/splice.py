"""Splice, don't trust: a submitted lab's exercises run inside the course's own copy of the lab.

A student hands in whole lab files but owns only the exercises in them. `grade` and `check` (so
that students see what graders see) run the tests against the course's own copy of each lab, the
student edition's, in which each exercise's stub is replaced by the student's code for it, plus
the helpers the student added: module-level functions, classes, imports and constants under names
the course does not use, and methods or attributes added to a class that holds an exercise.
Everything else of the submitted file (an edited instrument, reference, runner or test helper,
module-level code, a definition that reuses a course name, a changed signature) is reported and
never executed: what the tests measure is the course's code. nbgrader does this for notebooks by
restoring every cell that is not a solution from the instructor's copy before autograding
(`OverwriteCells`, nbgrader/preprocessors/overwritecells.py); otter-grader grades each
submission in a fresh copy of the assignment.

Where an exercise's code is. The student edition has no marker lines: an exercise is a function
(`name`, `Class.method`) whose body holds the stub (homework.solutions). The student's code for
it is what their function of that name holds in the stub's place: the statements between the
course's statements before the stub (the docstring, argument checks) and those after it, matched
by their syntax tree, comments and blank lines kept. The course's statements around it stay the
course's, edited or not.

Refused (the exercise then raises a RuntimeError that gives the reason, and the feedback says it): a
`global` naming a course name (it would rebind the course's code as it runs), and code that no
longer parses once put back. Flagged for review (run, and listed for the instructor): spliced
code that assigns to an attribute or item of an imported module or of a course definition (also
with setattr or delattr), or calls exec, eval, compile, globals, vars or __import__: ways to change the
course's code at run time, which no splice can prevent (the sandbox bounds what they can reach).

Stdlib only.
"""
from __future__ import annotations

import ast
import copy
import difflib
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from homework.solutions import STUB_COMMENT
from helpers.notice import STUB_PREFIX

COURSE_LABS = ".course/labs"     # the student edition's copy of the course's labs (release writes it)
REFUSED = "RuntimeError"         # what a refused exercise raises (a builtin: the lab imports nothing)
RUNTIME_CHANGES = {"setattr", "delattr", "exec", "eval", "compile", "globals", "vars", "__import__"}
SHOWN_CHARS = 60


@dataclass
class _Edit:
    first: int          # the course's lines first..last (1-based) become `lines`; last = first - 1: an insertion
    last: int
    lines: list[str]
    exercise: str = ""  # the exercise it puts in ("" for a helper)
    seq: int = 0        # the order it was made in: outer bodies' insertions after inner ones


@dataclass
class Spliced:
    """A submitted lab put back together: `text` is what the tests run."""

    path: str                                     # labs/lab04_ring.py
    text: str                                     # the course's lab with the student's exercises
    submitted: str                                # the submitted file, as handed in
    exercises: dict[str, str] = field(default_factory=dict)  # name -> "yours", "missing: why", "refused: why"
    unused: list[str] = field(default_factory=list)   # parts of the submitted file not run
    helpers: list[str] = field(default_factory=list)  # the student's own definitions kept
    review: list[str] = field(default_factory=list)   # kept code that can change the course's code
    _lines: dict[int, int] | None = None

    def submitted_line(self, line: int) -> int | None:
        """The line of the submitted file that line `line` of `text` came from (None: a line of
        the course's copy that the submitted file does not have)."""
        if self._lines is None:
            matcher = difflib.SequenceMatcher(None, self.text.splitlines(), self.submitted.splitlines(),
                                              autojunk=False)
            self._lines = {}
            for a, b, size in matcher.get_matching_blocks():
                for offset in range(size):
                    self._lines[a + offset + 1] = b + offset + 1
        return self._lines.get(line)

    def notes(self) -> list[str]:
        """One line per thing of the submission that was not used as handed in."""
        notes = [f"{self.path}: exercise {name} {state}" for name, state in self.exercises.items()
                 if state != "yours"]
        if self.unused:
            notes.append(f"{self.path}: not run (the course's own code ran instead): "
                         + "; ".join(self.unused))
        return notes


# ---------------------------------------------------------------------------- syntax helpers
def _is_doc(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
        and isinstance(node.value.value, str)


def _without_docstrings(node: ast.AST) -> ast.AST:
    node = copy.deepcopy(node)
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) \
                and inner.body and _is_doc(inner.body[0]):
            inner.body = inner.body[1:] or [ast.Pass()]
    return node


def _same(a: ast.AST, b: ast.AST) -> bool:
    """The same code, docstrings, comments and formatting aside."""
    return ast.dump(a) == ast.dump(b) or \
        ast.dump(_without_docstrings(a)) == ast.dump(_without_docstrings(b))  # (copies: rarely)


def _header(node: ast.AST) -> str:
    """A compound statement without its bodies (a def's signature and decorators, a class's
    bases, an if's test)."""
    shell = copy.copy(node)
    for name in ("body", "orelse", "finalbody", "handlers", "cases"):
        if hasattr(shell, name):
            setattr(shell, name, [])
    return ast.dump(shell)


def _first_line(node: ast.AST) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def _is_def(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))


def _bound(node: ast.AST) -> set[str]:
    """Names a module- or class-level statement binds."""
    if _is_def(node):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    names = set()
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)) else []
    for target in targets:
        names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    for inner in ("body", "orelse", "finalbody", "handlers"):  # if/try/with at module level
        for child in getattr(node, inner, []) if not _is_def(node) else []:
            names |= _bound(child)
    if isinstance(node, (ast.With, ast.AsyncWith)):
        names |= {n.id for item in node.items if item.optional_vars
                  for n in ast.walk(item.optional_vars) if isinstance(n, ast.Name)}
    return names


def _is_stub(node: ast.AST) -> bool:
    return (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
            and isinstance(node.exc.func, ast.Name) and node.exc.func.id == "NotImplementedError"
            and bool(node.exc.args) and isinstance(node.exc.args[0], ast.Constant)
            and isinstance(node.exc.args[0].value, str)
            and node.exc.args[0].value.startswith(STUB_PREFIX))


def _stub_paths(function: ast.AST) -> list[list[tuple[ast.AST, str, int]]]:
    """Where the stubs sit in `function` (not inside a nested def), in order: for each, the
    [(node, body field, index), ...] from the function down to the list that holds it."""
    def search(node: ast.AST) -> list[list]:
        found = []
        for name in ("body", "orelse", "finalbody", "handlers"):
            for index, child in enumerate(getattr(node, name, None) or []):
                if _is_stub(child):
                    found.append([(node, name, index)])
                elif not _is_def(child):
                    found += [[(node, name, index)] + inner for inner in search(child)]
        return found
    return search(function)


def _is_main_guard(node: ast.AST) -> bool:
    """`if __name__ == "__main__":`"""
    return isinstance(node, ast.If) and "__main__" in ast.dump(node.test) and "__name__" in ast.dump(node.test)


def _root(node: ast.AST) -> str:
    """The name an attribute or item chain starts from (`lab` in `lab.trace.x[0]`), or ""."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def _holds_stub(node: ast.AST) -> bool:
    return any(_is_stub(inner) for inner in ast.walk(node))


def _shown(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


# ---------------------------------------------------------------------------- the splice
class _Splicer:
    def __init__(self, path: str, course: str, submitted: str):
        self.path = path
        self.course, self.submitted = course, submitted
        self.course_lines = course.splitlines()
        self.lines = submitted.splitlines()
        self.result = Spliced(path, course, submitted)
        self.edits: list[_Edit] = []
        self.course_tree = ast.parse(course)
        self.module_names = set().union(*[_bound(n) for n in self.course_tree.body]) \
            if self.course_tree.body else set()
        self.imported: set[str] = {n for node in self.course_tree.body
                                   if isinstance(node, (ast.Import, ast.ImportFrom)) for n in _bound(node)}
        self.definitions = {n.name for n in self.course_tree.body if _is_def(n)}

    # -- text
    def _segment(self, body: list[ast.AST], index: int) -> tuple[int, int]:
        """Lines (1-based, inclusive) of statement `index` of `body` in the submitted file, with
        the comments and blank lines right above it."""
        node = body[index]
        start = _first_line(node)
        floor = body[index - 1].end_lineno + 1 if index > 0 else 1
        while start - 1 >= floor and (not self.lines[start - 2].strip()
                                      or self.lines[start - 2].lstrip().startswith("#")):
            start -= 1
        return start, node.end_lineno

    def _reindent(self, lines: list[str], have: int, want: int) -> list[str]:
        if have == want:
            return lines
        out = []
        for line in lines:
            lead = len(line) - len(line.lstrip(" "))
            out.append(" " * want + line[have:] if lead >= have and line.strip() else line)
        return out

    def _describe(self, node: ast.AST, prefix: str) -> str:
        if _is_def(node):
            return f"{prefix}{node.name}"
        code = self.course_lines[node.lineno - 1] if node.lineno <= len(self.course_lines) else ""
        return f"`{_shown(code)}`"

    def _describe_submitted(self, node: ast.AST, prefix: str) -> str:
        if _is_def(node):
            return f"{prefix}{node.name} (line {node.lineno})"
        return f"line {node.lineno} `{_shown(self.lines[node.lineno - 1])}`"

    # -- review
    def _review(self, nodes: list[ast.AST], where: str, module_aliases: set[str]) -> None:
        roots = module_aliases | self.imported | self.definitions
        for node in nodes:
            for inner in ast.walk(node):
                what = ""
                if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) \
                        and inner.func.id in RUNTIME_CHANGES:
                    if inner.func.id not in ("setattr", "delattr"):
                        what = f"calls {inner.func.id}()"
                    elif inner.args and _root(inner.args[0]) in roots:  # setattr(module, ...)
                        what = f"calls {inner.func.id}() on `{_shown(ast.unparse(inner.args[0]))}`"
                elif isinstance(inner, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                    targets = inner.targets if isinstance(inner, (ast.Assign, ast.Delete)) else [inner.target]
                    for target in targets:
                        if isinstance(target, (ast.Attribute, ast.Subscript)) and _root(target) in roots:
                            what = f"assigns `{_shown(ast.unparse(target))}`"
                if what:
                    self.result.review.append(f"{self.path}:{inner.lineno} ({where}) {what}: it can "
                                              "change the course's code as the tests run; review it")

    # -- exercises
    def _exercise(self, course_fn: ast.AST, mine: ast.AST | None, name: str, aliases: set[str]) -> None:
        """Put the submitted function's code in place of each stub of `course_fn` (an exercise
        may have several blocks; those of one list are told apart by the course's statements
        between them)."""
        paths = _stub_paths(course_fn)
        if not paths:
            return
        if mine is None or not isinstance(mine, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.result.exercises[name] = ("missing: not in the submitted file" if mine is None else
                                           "missing: not a function in the submitted file") + \
                " (graded as not done)"
            return
        if _header(course_fn) != _header(mine):
            self.result.unused.append(f"the signature or decorators of {name} (yours differ)")
        self.result.exercises[name] = "yours"
        lists: dict[tuple[int, str], list] = {}  # one entry per list that holds stubs
        for path in paths:
            lists.setdefault((id(path[-1][0]), path[-1][1]), []).append(path)
        for group in lists.values():
            self._blocks(course_fn, mine, name, group, aliases)

    def _stub_lines(self, stub: ast.AST) -> tuple[int, int, int]:
        """(first, last, indent) of a stub: its raise, and the comment line above it."""
        first = stub.lineno - 1 if stub.lineno >= 2 and \
            self.course_lines[stub.lineno - 2].strip() == STUB_COMMENT else stub.lineno
        return first, stub.end_lineno, stub.col_offset

    def _blocks(self, course_fn: ast.AST, mine: ast.AST, name: str, paths: list, aliases: set[str]) -> None:
        node, field_name, _ = paths[0][-1]
        course_list = getattr(node, field_name)
        stubs = sorted(path[-1][2] for path in paths)
        spans = [self._stub_lines(course_list[k]) for k in stubs]
        # the submitted list that plays this list's part
        theirs: ast.AST = mine
        for outer, outer_field, outer_index in paths[0][:-1]:
            wanted = getattr(outer, outer_field)[outer_index]
            candidates = [c for c in (getattr(theirs, outer_field, None) or []) if _header(c) == _header(wanted)]
            if not candidates:
                for first, last, indent in spans:
                    self._refuse(name, first, last, indent, "the course's code around the exercise's "
                                 "block is not in your function any more")
                return
            theirs = candidates[0]
        their_list = list(getattr(theirs, field_name, None) or [])
        # the course's statements: before the first stub, between stubs, after the last
        segments = [course_list[:stubs[0]]] + [course_list[a + 1:b] for a, b in zip(stubs, stubs[1:])] \
            + [course_list[stubs[-1] + 1:]]
        start = 0
        if segments[0] and _is_doc(segments[0][0]) and node is course_fn:
            segments[0] = segments[0][1:]
            if their_list and _is_doc(their_list[0]):
                start = 1
        end = len(their_list)

        def differs(statement: ast.AST) -> None:
            self.result.unused.append(f"in {name}: the course's {self._describe(statement, '')} "
                                      "(yours differs or is missing; the course's ran)")

        for statement in reversed(segments[-1]):  # after the last block: matched from the end
            found = next((j for j in range(end - 1, start - 1, -1) if _same(their_list[j], statement)), None)
            if found is None:
                differs(statement)
            else:
                end = found

        def yours_outside(j: int) -> None:
            self.result.unused.append(f"in {name}: your {self._describe_submitted(their_list[j], '')}, "
                                      "between the course's statements around the exercise's code")

        position = start
        for statement in segments[0]:  # before the first block: matched from the start
            found = next((j for j in range(position, end) if _same(their_list[j], statement)), None)
            if found is None:
                differs(statement)
                continue
            for j in range(position, found):
                yours_outside(j)
            position = found + 1
        blocks: list[tuple[int, int] | None] = []  # each block's statements in their_list
        block_start = position
        for segment in segments[1:-1]:  # between two blocks
            first_match = None
            for statement in segment:
                found = next((j for j in range(position, end) if _same(their_list[j], statement)), None)
                if found is None:
                    differs(statement)
                    continue
                if first_match is None:
                    first_match = found
                else:
                    for j in range(position, found):
                        yours_outside(j)
                position = found + 1
            if first_match is None:  # where one block ends and the next begins is not known
                break
            blocks.append((block_start, first_match))
            block_start = position
        blocks.append((block_start, end))
        blocks += [None] * (len(spans) - len(blocks))
        for bound, (first, last, indent) in zip(blocks, spans):
            if bound is None:
                self._refuse(name, first, last, indent, "the course's code between its blocks is not "
                             "in your function any more")
                continue
            self._block(name, their_list, bound[0], their_list[bound[0]:bound[1]], first, last,
                        indent, aliases)

    def _block(self, name: str, their_list: list, index: int, region: list, first: int, last: int,
               indent: int, aliases: set[str]) -> None:
        """The submitted statements `region` (from their_list[index]) in place of the stub lines
        first..last of the course's copy."""
        if region:
            first_line = self._segment(their_list, index)[0]
            text = self._reindent(self.lines[first_line - 1: region[-1].end_lineno],
                                  region[0].col_offset, indent)
            while text and not text[0].strip():
                text = text[1:]
        else:
            text = []
        rebinding = sorted({n for statement in region for inner in ast.walk(statement)
                            if isinstance(inner, ast.Global) for n in inner.names} & self.module_names)
        if rebinding:
            self._refuse(name, first, last, indent, "it rebinds the course's "
                         + ", ".join(f"`{n}`" for n in rebinding) + " with `global`")
            return
        self._review(region, f"in {name}", aliases)
        self._edit(first, last, text or [" " * indent + "pass"], name)

    def _refuse(self, name: str, first: int, last: int, indent: int, why: str) -> None:
        message = f"{self.path}: grading did not run your {name}: {why}"
        self._edit(first, last, [" " * indent + f"raise {REFUSED}({message!r})"], name)
        if not self.result.exercises.get(name, "").startswith("refused"):
            self.result.exercises[name] = f"refused: {why}"

    # -- bodies
    def merge(self, course_body: list, their_body: list, prefix: str, may_add: bool,
              aliases: set[str]) -> None:
        """Pair the course's statements of a body with the submission's; splice the exercises
        found in them, keep the submission's new helpers, note the rest."""
        names = set().union(*[_bound(n) for n in course_body]) if course_body else set()
        by_name: dict[str, int] = {}
        others: dict[str, list[int]] = {}
        for j, node in enumerate(their_body):
            if _is_def(node):
                by_name.setdefault(node.name, j)
            elif not (j == 0 and _is_doc(node)):
                others.setdefault(ast.dump(_without_docstrings(node)), []).append(j)
        partner: dict[int, int] = {}   # submitted index -> course index
        for i, node in enumerate(course_body):
            if i == 0 and _is_doc(node):
                if their_body and _is_doc(their_body[0]):
                    partner[0] = i
                continue
            if _is_def(node):
                j = by_name.get(node.name)
            else:
                queue = others.get(ast.dump(_without_docstrings(node)), [])
                j = queue.pop(0) if queue else None
            mine = their_body[j] if j is not None else None
            if j is not None:
                partner[j] = i
            full = f"{prefix}{node.name}" if _is_def(node) else ""
            if _is_def(node) and _holds_stub(node):
                if isinstance(node, ast.ClassDef):
                    if mine is None or not isinstance(mine, ast.ClassDef):
                        for inner, inner_name in _exercises_in(node, prefix):
                            self.result.exercises[inner_name] = "missing: not in the submitted file " \
                                "(graded as not done)"
                        continue
                    if _header(node) != _header(mine):
                        self.result.unused.append(f"the bases or decorators of class {full} (yours differ)")
                    self.merge(node.body, mine.body, full + ".", True, aliases)
                elif _stub_paths(node):
                    self._exercise(node, mine, full, aliases)
                else:  # a function that holds an exercise in a nested function
                    if mine is None or _header(node) != _header(mine):
                        for inner, inner_name in _exercises_in(node, prefix):
                            self.result.exercises[inner_name] = "missing: not found where the course " \
                                "has it (graded as not done)"
                        continue
                    self.merge(node.body, mine.body, full + ".", False, aliases)
                continue
            if mine is None:
                if _is_def(node):
                    self.result.unused.append(f"{full} (yours is missing or not at this level; the "
                                              "course's ran)")
                elif not (isinstance(node, ast.Expr) and _is_doc(node)):
                    self.result.unused.append(f"the course's {self._describe(node, prefix)} (yours "
                                              "differs or is missing; the course's ran)")
            elif not _same(node, mine):
                self.result.unused.append(_changes(node, mine, full) if full else self._describe(node, prefix))
        # the submission's statements without a partner: new helpers, or code that is not run
        anchor: int | None = None      # course index of the last paired statement above
        inserts: dict[int | None, list[str]] = {}
        for j, node in enumerate(their_body):
            if j in partner:
                anchor = partner[j]
                continue
            if j == 0 and _is_doc(node):
                continue
            what = self._describe_submitted(node, prefix)
            bound = _bound(node)
            if not may_add:
                self.result.unused.append(f"{what}: added outside the exercise's block")
                continue
            if _is_def(node) and node.name in names:
                self.result.unused.append(f"{what}: a second definition of the course's {prefix}{node.name}")
                continue
            kind_ok = _is_def(node) or isinstance(node, (ast.Import, ast.ImportFrom)) or (
                isinstance(node, (ast.Assign, ast.AnnAssign)) and bound and all(
                    isinstance(t, ast.Name) for t in (node.targets if isinstance(node, ast.Assign)
                                                      else [node.target])))
            if not kind_ok:
                self.result.unused.append(f"{what}: {'module' if not prefix else 'class'}-level code "
                                          "that is not a definition")
                continue
            clash = sorted(bound & names)
            if clash:
                self.result.unused.append(f"{what}: it rebinds the course's "
                                          + ", ".join(f"{prefix}{n}" for n in clash))
                continue
            rebinding = sorted({n for inner in ast.walk(node) if isinstance(inner, ast.Global)
                                for n in inner.names} & self.module_names)
            if rebinding:
                self.result.unused.append(f"{what}: it rebinds the course's "
                                          + ", ".join(f"`{n}`" for n in rebinding) + " with `global`")
                continue
            self._review([node], f"{prefix}{node.name}" if _is_def(node) else what, aliases)
            first, last = self._segment(their_body, j)
            lines = self.lines[first - 1: last]
            want = course_body[0].col_offset if course_body else node.col_offset
            inserts.setdefault(anchor, []).extend(self._reindent(lines, node.col_offset, want))
            self.result.helpers.append(f"{prefix}{node.name}" if _is_def(node) else
                                       ", ".join(sorted(bound)))
        for where, lines in inserts.items():
            if where is None:  # above every paired statement: after the docstring and __future__
                leading = [n for n in course_body[:3] if _is_doc(n) or (
                    isinstance(n, ast.ImportFrom) and n.module == "__future__")]
                after = max((n.end_lineno for n in leading), default=None)
                if after is None:
                    at = _first_line(course_body[0]) if course_body else len(self.course_lines) + 1
                    self._edit(at, at - 1, lines + [""])
                    continue
            elif _is_main_guard(course_body[where]):  # helpers run before the script's main()
                at = _first_line(course_body[where])
                self._edit(at, at - 1, lines + ["", ""])
                continue
            else:
                after = course_body[where].end_lineno
            self._edit(after + 1, after, lines if lines and not lines[0].strip() else [""] + lines)

    def _edit(self, first: int, last: int, lines: list[str], exercise: str = "") -> None:
        self.edits.append(_Edit(first, last, lines, exercise, len(self.edits)))

    # -- the whole file
    def apply(self, edits: list[_Edit]) -> str:
        """The course's text with `edits` made, from the bottom up; of two insertions at one place
        the one made first (an inner body's) ends up above."""
        lines = list(self.course_lines)
        for edit in sorted(edits, key=lambda e: (e.first, e.last, e.seq), reverse=True):
            lines[edit.first - 1: edit.last] = edit.lines
        return "\n".join(lines) + ("\n" if self.course.endswith("\n") else "")

    def run(self, their_tree: ast.Module) -> Spliced:
        aliases = {n for node in ast.walk(their_tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for n in _bound(node)}
        self.merge(self.course_tree.body, their_tree.body, "", True, aliases)
        text = self.apply(self.edits)
        try:
            ast.parse(text)
            self.result.text = text
            return self.result
        except SyntaxError:
            pass
        # put the edits in one at a time: one that does not parse is dropped, with the reason
        kept: list[_Edit] = []
        for edit in sorted(self.edits, key=lambda e: (e.exercise == "", e.seq)):
            try:
                ast.parse(self.apply(kept + [edit]))
            except SyntaxError as exc:
                if edit.exercise:
                    why = f"it does not parse inside the course's code ({exc.msg})"
                    self.result.exercises[edit.exercise] = f"refused: {why}"
                    message = f"{self.path}: grading did not run your {edit.exercise}: {why}"
                    line = self.course_lines[edit.first - 1]
                    indent = len(line) - len(line.lstrip())
                    kept.append(_Edit(edit.first, edit.last,
                                      [" " * indent + f"raise {REFUSED}({message!r})"], edit.exercise, edit.seq))
                else:
                    self.result.unused.append(f"your code added above line {edit.first} of the "
                                              f"course's copy: it does not parse there ({exc.msg})")
                continue
            kept.append(edit)
        self.result.text = self.apply(kept)
        return self.result


def _changes(course: ast.AST, theirs: ast.AST, name: str) -> str:
    """What differs between two versions of a definition: "Trace.peak (changed)", or for a class
    the members that differ, added or are missing ("Trace.peak, Trace.reset (changed)")."""
    if not (isinstance(course, ast.ClassDef) and isinstance(theirs, ast.ClassDef)) \
            or _header(course) != _header(theirs):
        return f"{name} (changed)"
    def members(node: ast.ClassDef) -> dict[str, str]:
        found = {}
        for index, member in enumerate(node.body):
            if index == 0 and _is_doc(member):
                continue
            key = member.name if _is_def(member) else ", ".join(sorted(_bound(member))) or f"#{index}"
            found[key] = ast.dump(_without_docstrings(member))
        return found
    mine, yours = members(course), members(theirs)
    differ = [k for k in mine if yours.get(k) != mine[k]] + [k for k in yours if k not in mine]
    return ", ".join(f"{name}.{k}" for k in differ) + " (changed)" if differ else f"{name} (changed)"


def _exercises_in(node: ast.AST, prefix: str) -> list[tuple[ast.AST, str]]:
    """The exercise functions inside `node` (itself included), with their dotted names."""
    found = []
    name = f"{prefix}{node.name}"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _stub_paths(node):
        found.append((node, name))
    for child in ast.iter_child_nodes(node):
        if _is_def(child):
            found += _exercises_in(child, name + ".")
    return found


def exercises(course: str) -> list[str]:
    """The exercises (dotted function names) of a course lab in its student-edition form."""
    tree = ast.parse(course)
    return [name for node in tree.body if _is_def(node) for _, name in _exercises_in(node, "")]


def splice(path: str, course: str, submitted: str | None) -> Spliced:
    """The course's lab `course` (student edition: stubs in place) with the exercises and helpers
    of `submitted` spliced in; `submitted` None: the file is missing from the submission."""
    names = exercises(course)
    if submitted is None:
        return Spliced(path, course, "", {n: "missing: the file is not in the submission (graded "
                                            "as not done)" for n in names})
    try:
        tree = ast.parse(submitted)
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None)
        why = f"the file does not parse ({getattr(exc, 'msg', exc)}{f', line {line}' if line else ''})"
        return Spliced(path, course, submitted, {n: f"missing: {why}; graded as not done" for n in names},
                       [f"the whole file: {why}"] if not names else [])
    if submitted == course:
        return Spliced(path, course, submitted, {n: "yours" for n in names})
    return _Splicer(path, course, submitted).run(tree)


LOCATION = re.compile(r"(?P<path>labs/[A-Za-z0-9_]+\.py):(?P<line>\d+)")


def to_submitted(text: str, spliced: dict[str, Spliced]) -> str:
    """`text` (a test's message) with each "labs/x.py:N" of a spliced file turned into the line of
    the submitted file it came from, or marked as the course's copy's line."""
    def swap(match: re.Match) -> str:
        splice_ = spliced.get(match["path"])
        if splice_ is None or splice_.text == splice_.submitted:
            return match.group(0)
        line = splice_.submitted_line(int(match["line"]))
        return f"{match['path']}:{line}" if line else f"{match['path']} (the course's copy):{match['line']}"
    return LOCATION.sub(swap, text)


def _differs(course: str, submitted: str) -> bool:
    """Does `submitted` differ from `course` as code (docstrings, comments, formatting aside)?"""
    if course == submitted:
        return False
    try:
        return not _same(ast.parse(course), ast.parse(submitted))
    except (SyntaxError, ValueError):
        return True


def splice_folder(course: Path, submitted: dict[str, bytes], dest: Path) -> tuple[dict[str, Spliced], list[str]]:
    """Write into `dest` (a folder) one file per lab of `course` (a folder of the course's own
    labs/*.py, student edition): the course's copy with the exercises of `submitted`
    ({"labs/x.py": data}) spliced in. Returns the splices of the labs that hold exercises and
    the notes about what of the submission was not used (one line each)."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in course.iterdir():  # what is not a lab module (data, folders): the course's
        if path.is_dir() and path.name != "__pycache__":
            shutil.copytree(path, dest / path.name, dirs_exist_ok=True)
        elif path.is_file() and path.suffix != ".py":
            shutil.copyfile(path, dest / path.name)
    splices: dict[str, Spliced] = {}
    notes: list[str] = []
    texts: dict[str, str | None] = {}
    for rel, data in submitted.items():
        try:
            texts[rel] = data.decode("utf-8")
        except UnicodeDecodeError:
            texts[rel] = "\0"  # does not parse: reported as such
    for path in sorted(course.glob("*.py")):
        rel = f"labs/{path.name}"
        text = path.read_text(encoding="utf-8")
        if exercises(text):
            spliced = splice(rel, text, texts.get(rel))
            splices[rel] = spliced
            notes += spliced.notes()
            text = spliced.text
        elif rel in texts and _differs(text, texts[rel]):
            notes.append(f"{rel}: a file without an exercise: the course's copy ran, not yours")
        (dest / path.name).write_text(text, encoding="utf-8")
    for rel in sorted(set(texts) - {f"labs/{p.name}" for p in course.glob("*.py")}):
        notes.append(f"{rel}: not a file of the course: not used")
    return splices, notes
