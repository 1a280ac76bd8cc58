"""The layering of docs/architecture.md: every import of a longkv module goes down a floor (or
stays inside its own package), so there is no upward arrow and no circle between packages; and
its sizes: modules of at most 450 lines, functions of at most 80."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "longkv"
# floor of each room (a package, or a top-level module): imports go to lower floors only
FLOORS: dict[str, int] = {
    "checks": 0, "dtypes": 0, "heap": 0, "results": 0, "vml": 0, "data": 0, "nll": 0, "version": 0,
    "attention": 1, "rwkv": 1, "decoding": 1,
    "kvm": 2, "ovq": 2,
    "models": 3,
    "fold": 4,
    "caches": 5,
    "evals": 6, "train": 6, "document": 6,
    "study": 7, "bench": 7, "serve": 7,
    "cli": 8,
    "__main__": 9,
}  # fmt: skip


def room(module: str) -> str:
    """The room of a dotted module name inside longkv ("longkv.fold.fold" -> "fold")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "longkv"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `import longkv...` / `from longkv... import` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n == "longkv" or n.startswith("longkv.")]
    return found


def upward_imports(src: Path) -> list[str]:
    """Each import in src that does not go down a floor: "file:line room -> room"."""
    bad = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src.parent).with_suffix("")
        own = room(".".join(rel.parts).removesuffix(".__init__"))
        if own == "longkv":
            continue  # the package's own __init__ sits above every room
        for line, module in imports(path):
            target = room(module)
            if target == own:
                continue
            if target not in FLOORS or own not in FLOORS or FLOORS[target] >= FLOORS[own]:
                bad.append(f"{path.relative_to(src)}:{line} {own} -> {target}")
    return bad


MODULE_LINES, FUNCTION_LINES = 450, 80


def oversized(src: Path) -> list[str]:
    """Each module in src longer than MODULE_LINES and each function longer than
    FUNCTION_LINES (decorators and docstring included): "file: n lines", "file:line name: n"."""
    found = []
    for path in sorted(src.rglob("*.py")):
        text, rel = path.read_text(), path.relative_to(src)
        if len(text.splitlines()) > MODULE_LINES:
            found.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                n = (node.end_lineno or node.lineno) - first + 1
                if n > FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name}: {n}")
    return found


def test_modules_and_functions_stay_within_their_sizes() -> None:
    assert oversized(SRC) == []


def test_an_oversized_module_and_function_are_found(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    (tmp_path / "long.py").write_text("def f():\n" + body + "\n" * 400)
    (tmp_path / "short.py").write_text("def g():\n" + body[: -len("    x79 = 79\n")])
    assert oversized(tmp_path) == ["long.py: 481 lines", "long.py:1 f: 81"]


def test_every_room_has_a_floor() -> None:
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in SRC.glob("*.py")} - {"__init__"}
    assert packages | modules == set(FLOORS)


def test_no_module_imports_upward() -> None:
    assert upward_imports(SRC) == []


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "longkv"
    for name, text in {
        "checks.py": "from longkv.cli.main import main\n",
        "fold/fold.py": "import longkv.fold.attention\nfrom longkv.kvm import KVMConfig\n",
        "evals/x.py": "from longkv.train.loop import train\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert upward_imports(pkg) == ["checks.py:1 checks -> cli", "evals/x.py:1 evals -> train"]
