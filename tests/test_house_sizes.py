"""House sizes (issue 56): no library file over 600 lines, no function over 60 code lines.

A reader should hold a module in their head and a function on one screen; past these sizes a file
or a function does several jobs. A function's code lines are the lines of its body that hold code:
not blank, not a comment alone, not its docstring (a nested function's lines count in its parent
too: they are part of its body). The library: packing/, runtime/, model/, rl/, testing/ and
train.py; bench/, scripts/, launch/ and tests/ are programs and tests that use it.
"""

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("packing", "runtime", "model", "rl", "testing")  # and train.py
MAX_FILE_LINES = 600
MAX_CODE_LINES = 60
# Files that must stay whole over MAX_FILE_LINES: their own ceiling, and why.
ALLOWED_LONG_FILES: dict[str, tuple[int, str]] = {
    # 639 lines: an 80-line docstring (the threat model, mechanism by mechanism) and ~560 of code whose
    # one seam, the child's bootstrap source (~165 lines), cannot leave it. The module must stay one
    # standard-library file: tests/test_sandbox_escape.py copies it alone and runs it as another user.
    # Under 600 would take halving the threat model or packing the security code tighter.
    "rl/tasks/sandbox.py": (650, "one stdlib-only file, copied alone by tests/test_sandbox_escape.py"),
}


def library_files() -> list[Path]:
    return [ROOT / "train.py", *sorted(p for pkg in LIBRARY for p in (ROOT / pkg).rglob("*.py"))]


def code_lines(source: str) -> set[int]:
    """The lines that hold code: a token other than a comment or a line break (a string spanning
    lines counts each of its lines)."""
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
              tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in layout:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def function_sizes(source: str) -> list[tuple[int, str, int]]:
    """(line, qualified name, code lines) of every function and method in `source`."""
    code = code_lines(source)
    sizes = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                start = body[0].lineno
                if ast.get_docstring(child, clean=False) is not None:
                    start = body[0].end_lineno + 1
                sizes.append((child.lineno, prefix + child.name,
                              sum(1 for n in code if start <= n <= child.end_lineno)))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return sizes


def oversized(files: list[Path]) -> list[str]:
    """Every file over MAX_FILE_LINES (an allowed one: over its own ceiling) and function over
    MAX_CODE_LINES, as `path:line what count`."""
    found = []
    for path in files:
        source = path.read_text()
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        lines = len(source.splitlines())
        most = ALLOWED_LONG_FILES.get(name, (MAX_FILE_LINES, ""))[0]
        if lines > most:
            found.append(f"{name}:1 file has {lines} lines (at most {most})")
        for line, function, count in function_sizes(source):
            if count > MAX_CODE_LINES:
                found.append(f"{name}:{line} {function} has {count} code lines (at most {MAX_CODE_LINES})")
    return found


def test_no_library_file_or_function_is_over_the_house_sizes():
    found = oversized(library_files())
    assert not found, "over the house sizes (split at a seam, see docs/design.md):\n" + "\n".join(found)


def test_an_allowed_long_file_is_still_long_and_says_why():
    for name, (most, why) in ALLOWED_LONG_FILES.items():
        assert why and most > MAX_FILE_LINES, (name, most, why)
        lines = len((ROOT / name).read_text().splitlines())
        assert lines > MAX_FILE_LINES, f"{name} has {lines} lines: take it off ALLOWED_LONG_FILES"


def test_code_lines_skip_blanks_comments_and_the_docstring(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CODE_LINES - 2))
    source = (
        "class Holder:\n"
        "    def method(self):\n"
        '        """A docstring\n\n        over three lines."""\n'
        "        # a comment alone\n"
        "\n"
        "        text = '''a string\n"
        "        of two lines'''  # counts twice\n"
        "        return text\n"
        "\n"
        "def long_one():\n"
        f"{body}\n"
        "    def inner():\n"
        "        return 1\n"
    )
    assert function_sizes(source) == [(2, "Holder.method", 3), (12, "long_one", MAX_CODE_LINES),
                                      (MAX_CODE_LINES + 11, "long_one.inner", 1)]
    at_limit = tmp_path / "at_limit.py"
    at_limit.write_text(source)
    assert oversized([at_limit]) == []
    # control: one code line more, and a file one line over, are named with where and how many
    over = tmp_path / "over.py"
    over.write_text(source + "        return 2\n" + "#\n" * (MAX_FILE_LINES - source.count("\n")))
    assert oversized([over]) == [
        f"{over}:1 file has {MAX_FILE_LINES + 1} lines (at most {MAX_FILE_LINES})",
        f"{over}:12 long_one has {MAX_CODE_LINES + 1} code lines (at most {MAX_CODE_LINES})",
    ]
