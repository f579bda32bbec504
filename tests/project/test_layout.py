"""The layout holds: no import circles among the package's and the kernels' modules (read from
the source), small modules that each say what they hold, and a wheel that carries every module
and trains from another directory."""

from __future__ import annotations

import ast
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, REPO, finish, start

# The importable packages and the folders they are built from (kernels/ installs under a
# project name, since PyPI's `kernels` is another project).
PACKAGES = {"megatronish": REPO / "megatronish", "megatronish_kernels": REPO / "kernels"}
MAX_LINES = 400
MAX_FUNCTION_LINES = 60  # outside kernels/, whose Triton kernels are written out whole


def source_modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under each package folder."""
    modules = {}
    for package, base in packages.items():
        for path in sorted(base.rglob("*.py")):
            parts = [package, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported_names(module: str, path: Path) -> list[str]:
    """Every name `module` imports, anywhere in its source (inside functions and under
    TYPE_CHECKING too), relative imports resolved."""
    is_package = path.name == "__init__.py"
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = node.module or ""
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            names += [prefix, *(f"{prefix}.{alias.name}" for alias in node.names)]
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules importing it runs. Importing a.b.c runs the packages a and a.b
    first (their __init__), so each enclosing package is an edge too, except the importer's
    own enclosing packages (already being imported when it runs)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name in _imported_names(module, path):
            while name and name not in modules:  # a.b.func -> a.b
                name = name.rpartition(".")[0]
            parts = name.split(".") if name else []
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in modules and dep != module and not module.startswith(dep + "."):
                    graph[module].add(dep)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_among_the_package_and_kernel_modules():
    cycles = import_cycles(import_graph(source_modules(PACKAGES)))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_circle_through_a_function_import_and_a_package_init(tmp_path):
    # pkg/__init__ imports pkg.a at module level; pkg.a imports pkg.b inside a function;
    # other/x imports pkg.b.thing, which runs pkg/__init__ first: a circle through a package.
    for name, text in {
        "pkg/__init__.py": "from pkg import a\n",
        "pkg/a.py": "def f():\n    from pkg.b import g\n",
        "pkg/b.py": "from other.x import h\n",
        "other/__init__.py": "",
        "other/x.py": "from pkg.c import thing\n",
        "pkg/c.py": "thing = 1\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(source_modules({"pkg": tmp_path / "pkg", "other": tmp_path / "other"}))
    assert import_cycles(graph) == [["other.x", "pkg", "pkg.a", "pkg.b"]]


def test_every_module_opens_with_a_docstring_and_stays_under_the_line_limit():
    too_long, undocumented = [], []
    for module, path in source_modules(PACKAGES).items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_LINES:
            too_long.append(f"{module} ({len(text.splitlines())} lines)")
        if text.strip() and ast.get_docstring(ast.parse(text)) is None:
            undocumented.append(module)
    assert not too_long, f"modules over {MAX_LINES} lines: {', '.join(too_long)}"
    assert not undocumented, f"modules without an opening docstring: {', '.join(undocumented)}"


def long_functions(path: Path, limit: int) -> list[str]:
    """'name (n lines)' for every function or method in path over limit lines, from its `def`
    line to its last (decorators not counted)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{node.name} ({lines} lines)")
    return found


def test_no_function_of_the_package_is_over_the_function_line_limit():
    too_long = [
        f"{module}.{function}"
        for module, path in source_modules({"megatronish": PACKAGES["megatronish"]}).items()
        for function in long_functions(path, MAX_FUNCTION_LINES)
    ]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(too_long)}"


def test_the_function_length_counts_from_the_def_line_to_the_last(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    path = tmp_path / "m.py"
    path.write_text(f"@decorated\ndef fits():\n{body}\n\ndef over():\n{body}    x = 0\n")
    assert long_functions(path, MAX_FUNCTION_LINES) == ["over (61 lines)"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built, as `pip install .` builds one, from a copy of the source (so the build
    leaves nothing in the checkout)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in PACKAGES.values():
        shutil.copytree(folder, source / folder.name, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    done = finish(start([*build, "-w", str(out), str(source)]), timeout=240)
    assert done.returncode == 0, done.stderr
    (built,) = out.glob("megatronish-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_holds_every_module_of_the_source_tree(wheel):
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {n for n in archive.namelist() if n.endswith(".py")}
    expected = {
        f"{package}/{path.relative_to(base).as_posix()}"
        for package, base in PACKAGES.items()
        for path in base.rglob("*.py")
        if "__pycache__" not in path.parts
    }
    missing = sorted(expected - in_wheel)
    assert not missing, f"modules missing from the wheel: {', '.join(missing)}"


@pytest.mark.slow
def test_the_installed_wheel_trains_the_tiny_config_from_another_directory(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Only the unpacked wheel provides megatronish: the checkout is neither the working
    # directory nor on the path, and an editable install's finder comes after the path.
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONSAFEPATH="1")
    code = "import megatronish, megatronish_kernels; print(megatronish.__file__)"
    shown = finish(start([sys.executable, "-c", code], env=env, cwd=elsewhere))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip().startswith(str(site))
    train = [
        sys.executable, "-m", "megatronish", "train", "--config", str(CONFIGS / "tiny.yaml"),
        "--set", "train.steps=2", "--set", "train.eval_every=0", "--set", "train.log_every=1",
        "--set", "run.out_dir=run",
    ]  # fmt: skip
    trained = finish(start(train, env=env, cwd=elsewhere))
    assert trained.returncode == 0, trained.stderr
    assert (elsewhere / "run" / "metrics.jsonl").read_text().count('"loss"') == 2
