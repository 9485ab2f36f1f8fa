"""docs/architecture.md's tree lists every module: a module added, moved or
removed without its line there fails here (as the public API is checked)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

# Packages whose tree lists one line per module; the others are described as
# a whole on their own line (storage/, tools/drill/, ...) and only have to exist.
PER_MODULE = ("clone", "clone/wire", "clone/server", "clone/client")

_ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[A-Za-z_][\w.]*/?)(?: {2,}|$)")


def documented() -> set[str]:
    """Every path the tree names (``a/b.py``, ``a/b/``), from its indentation."""
    text = DOC.read_text()
    block = text.split("## The tree", 1)[1].split("```", 2)[1]
    stack: list[tuple[int, str]] = []
    out: set[str] = set()
    for line in block.splitlines():
        m = _ENTRY.match(line)
        if m is None:
            continue
        name = m["name"]
        if not (name.endswith("/") or name.endswith(".py")):
            continue
        depth = len(m["indent"])
        while stack and stack[-1][0] >= depth:
            stack.pop()
        path = "".join(p for _, p in stack) + name
        out.add(path)
        if name.endswith("/"):
            stack.append((depth, name))
    return out


def on_disk(package: str) -> set[str]:
    folder = ROOT / package
    names = {f"{package}/{p.name}" for p in folder.glob("*.py")}
    names |= {f"{package}/{p.name}/" for p in folder.iterdir() if (p / "__init__.py").exists()}
    names |= {f"{package}/{p.name}/" for p in folder.iterdir() if p.is_dir() and p.name == "web"}
    if package != "clone":
        names.discard(f"{package}/__init__.py")  # the package's line says it
    return names


def test_the_tree_parses() -> None:
    got = documented()
    assert "clone/server/core.py" in got and "clone/wire/" in got and "bstar/" in got


def test_every_module_has_its_line() -> None:
    got = documented()
    missing = sorted(path for pkg in PER_MODULE for path in on_disk(pkg) - got)
    assert not missing, "modules missing from docs/architecture.md's tree: " + ", ".join(missing)


def test_every_line_names_a_module_that_exists() -> None:
    stale = sorted(path for path in documented() if not (ROOT / path.rstrip("/")).exists())
    assert not stale, "docs/architecture.md's tree names what is gone: " + ", ".join(stale)


# "issue 27" means nothing to a reader without the tracker, and the tracker's
# numbers outlive their meaning: code and docs say what they refer to in
# words.  Another project's bug is cited as owner/name#N (zeromq/libzmq#3937).
_ISSUE_NUMBER = re.compile(r"\bissues? #?\d", re.IGNORECASE)
NO_ISSUE_NUMBERS = ("clone", "bstar", "scripts", "docs")


def _texts() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in NO_ISSUE_NUMBERS:
        files += [
            p for p in (ROOT / top).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
            and p.suffix not in (".pyc", ".png", ".jpg", ".ico", ".gz", ".db")
        ]
    return files


def test_no_issue_numbers_in_code_or_docs() -> None:
    found = []
    for path in _texts():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if _ISSUE_NUMBER.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:80]}")
    assert not found, "issue numbers (say in words what they refer to):\n" + "\n".join(found)


def test_the_issue_number_check_sees_them() -> None:
    assert _ISSUE_NUMBER.search("fixed in issue 27's second round")
    assert _ISSUE_NUMBER.search("(Issue 26, the byte bounds)")
    assert not _ISSUE_NUMBER.search("zeromq/libzmq#3937, an issue 'tis")



# Small modules: one duty each, readable in a sitting.  The packages the
# house's size rule names, and their limit in lines; tools and the pipeline
# (a drill's or a job's whole flow in one place) may run longer.
SIZE_LIMITS = {
    "clone/server": 600,
    "clone/client": 600,
    "clone/wire": 600,
    "bstar": 600,
    "clone/tools": 800,
    "clone/pipeline": 800,
}
# A module over its limit because a table or a docstring is most of it says
# so in a comment line starting with this, and the test checks the claim.
SIZE_MARKER = "# size: a table or a docstring is most of this module"


def _table_and_docstring_lines(source: str) -> int:
    """Lines in docstrings (module, class, function) and in module-level
    tables (an assignment of a dict, list, tuple or set literal, or of a call
    wrapping one, as ``MappingProxyType({...})``)."""
    tree = ast.parse(source)
    lines: set[int] = set()

    def span(node: ast.stmt) -> None:
        lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                span(first)
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            value = stmt.value
            if isinstance(value, ast.Call) and value.args:
                value = value.args[0]
            if isinstance(value, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
                span(stmt)
    return len(lines)


def size_problem(path: str, source: str, limit: int) -> str | None:
    """Why ``path`` is too long, or None."""
    count = len(source.splitlines())
    if count <= limit:
        return None
    if not any(line.startswith(SIZE_MARKER) for line in source.splitlines()):
        return f"{path}: {count} lines (limit {limit}): split it along a duty"
    mostly = _table_and_docstring_lines(source)
    if 2 * mostly > count:
        return None
    return (f"{path}: {count} lines (limit {limit}); it says a table or a docstring"
            f" is most of it, but they are {mostly} lines")


def _modules() -> list[tuple[str, str, int]]:
    """(path, source, limit) of every module under a limit."""
    out = []
    for package, limit in SIZE_LIMITS.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            out.append((str(path.relative_to(ROOT)), path.read_text(), limit))
    return out


def test_modules_stay_small() -> None:
    over = [why for why in (size_problem(*module) for module in _modules()) if why]
    assert not over, "modules over the size limit:\n" + "\n".join(over)


def test_the_size_check_sees_every_package() -> None:
    paths = {path for path, _, _ in _modules()}
    for package in SIZE_LIMITS:
        assert any(path.startswith(package + "/") for path in paths), package
    assert "clone/client/commands/kv.py" in paths  # subpackages count too


def test_the_size_marker_is_checked() -> None:
    docstring = '"""' + "\n" * 8 + '"""\n'
    code = "".join(f"x{n} = {n}\n" for n in range(8))
    table = "T = {\n" + "".join(f"    {n}: {n},\n" for n in range(8)) + "}\n"
    assert _table_and_docstring_lines(docstring + code + table) == 9 + 10
    marked = SIZE_MARKER + "\n"
    assert size_problem("m.py", docstring + code, 20) is None  # under the limit
    assert "split it" in (size_problem("m.py", docstring + code, 10) or "")
    assert size_problem("m.py", marked + docstring + table, 10) is None  # mostly table
    assert "they are 9 lines" in (size_problem("m.py", marked + docstring + code * 2, 10) or "")


# What a package may import of ours, as docs/architecture.md's tree intro and
# each package's docstring say (tools, pipeline, server and client are wider
# and are checked by their purity tests where it matters).
MAY_IMPORT = {
    "clone/wire": ("clone.wire", "clone.errors"),
    "clone/storage": ("clone.storage", "clone.errors", "clone.release"),
    "clone/security": ("clone.security", "clone.errors", "clone.ratelimit"),
    "bstar": ("bstar",),
}


def _imports(source: str) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def test_packages_import_only_what_they_may() -> None:
    wrong = []
    for package, allowed in MAY_IMPORT.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in sorted(_imports(path.read_text())):
                ours = name.split(".")[0] in ("clone", "bstar")
                if ours and not any(name == a or name.startswith(a + ".") for a in allowed):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "imports a package may not make:\n" + "\n".join(wrong)
