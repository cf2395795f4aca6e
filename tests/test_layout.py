"""The package's layout: the import graph between megatok's modules (read from the source with ast, imports
at module level and inside functions alike), every command importable with its ``main``, importing no
other command and defining nothing but its argument parsing and ``main``, no strategy option read by name
outside megatok/boundaries/, no function over the length limit, a tests/ folder for every subpackage, and
pyproject.toml agreeing with requirements.txt and with the packages on disk."""

from __future__ import annotations

import ast
import importlib
import inspect
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "megatok"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or (
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (top-level names: ``deepspeed.utils`` counts as ``deepspeed`` too),
    at module level or in a function; not under ``if TYPE_CHECKING:``, which never runs."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            # ``from megatok.run import checkpoints``: the submodule, where it is one
            out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {name.split(".")[0] for name in out} | out


GRAPH = {mod: {m for m in imports(path) if m in MODULES and m != mod} for mod, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_import_graph_finds_real_imports():
    """The reader sees what the tests below rely on (a parse that found nothing would pass them all)."""
    assert "megatok.run.checkpoints" in GRAPH["megatok.train.checkpointer"]
    assert "megatok.run.reader" in GRAPH["megatok.eval.head_to_head"]
    assert "megatok.dsconfig" in GRAPH["megatok.config"] and "megatok.config" not in GRAPH["megatok.dsconfig"]
    assert "deepspeed" in imports(MODULES["megatok.run.merge"])  # inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles_among_megatok_modules():
    assert cycles(GRAPH) == []


@pytest.mark.parametrize("package", ["megatok.run", "megatok.eval", "megatok.model", "megatok.boundaries"])
def test_readers_evaluation_and_model_code_never_import_the_trainer(package):
    bad = {mod: sorted(m for m in deps if m == "megatok.train" or m.startswith("megatok.train."))
           for mod, deps in GRAPH.items() if mod == package or mod.startswith(package + ".")}
    assert {mod: deps for mod, deps in bad.items() if deps} == {}


@pytest.mark.parametrize("package", ["megatok.model", "megatok.boundaries"])
def test_model_code_never_imports_deepspeed(package):
    bad = {mod: "deepspeed" for mod, path in MODULES.items()
           if (mod == package or mod.startswith(package + ".")) and "deepspeed" in imports(path)}
    assert bad == {}


def test_no_module_edits_sys_path():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "launch").rglob("*.py")]
    assert [str(f) for f in files if "sys.path" in f.read_text()] == []


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
COMMANDS = sorted(p.stem for p in (PACKAGE / "cli").glob("*.py") if p.stem != "__init__")


def test_every_command_is_declared_and_has_main():
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts == {f"megatok-{name.replace('_', '-')}": f"megatok.cli.{name}:main" for name in COMMANDS}
    for name in COMMANDS:
        main = importlib.import_module(f"megatok.cli.{name}").main
        assert list(inspect.signature(main).parameters) == ["argv"], name


def test_tools_holds_shell_scripts_only():
    assert sorted(p.name for p in (ROOT / "tools").iterdir() if p.is_file()) == [
        "cluster.sh", "gpu_bench.sh", "gpu_site.sh", "gpu_study.sh", "gpu_wheels.sh", "head_to_head.sh", "quickstart.sh", "setup.sh", "test.sh"]


def test_pyproject_ranges_start_at_requirements_txt_pins_and_list_every_package():
    pins = [ln.strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    project = PYPROJECT["project"]

    def ranged(pin: str) -> str:  # name==X.Y.Z -> name>=X.Y.Z,<X+1 (<0.Y+1 for 0.x)
        name, version = pin.split("==")
        major, minor = (int(v) for v in version.split(".")[:2])
        return f"{name}>={version},<{major + 1 if major else f'0.{minor + 1}'}"

    assert project["dependencies"] == [ranged(p) for p in pins if not p.startswith("pytest")]
    assert project["optional-dependencies"]["test"] == [ranged(p) for p in pins if p.startswith("pytest")]
    on_disk = {module_name(p.parent / "__init__.py") for p in PACKAGE.rglob("__init__.py")}
    configs = {"megatok.configs"} | {f"megatok.configs.{p.name}" for p in (ROOT / "configs").iterdir() if p.is_dir()}
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == on_disk | configs
    for sub in (ROOT / "configs").iterdir():  # every configs/ folder is installed with its JSON files
        if sub.is_dir():
            assert PYPROJECT["tool"]["setuptools"]["package-data"][f"megatok.configs.{sub.name}"] == ["*.json"]


# --------------------------------------------------------------------------- commands, strategies, functions

def test_commands_import_no_other_command_and_the_library_no_command():
    """A command is its arguments and a library call: what two commands share lives in the library
    (megatok/studies/, megatok/eval/, ...), which never imports a command."""
    cli = {mod for mod in MODULES if mod.startswith("megatok.cli.")}
    bad = {mod: sorted(deps & cli) for mod, deps in GRAPH.items() if deps & cli}
    assert bad == {}


#: The one library module that names a command to run, and why: the GPU check runs megatok-generate itself in
#: a new process on the GPU (as it runs launch/pretrain.py), a check of the command a user types.
RUNS_A_COMMAND = {"megatok.perf.gpu_trainer": {"megatok.cli.generate"}}


def command_names(source: str) -> list[tuple[int, str]]:
    """Where ``source`` names a command module in code, as (line, string): a string (or an f-string's
    fixed part) starting "megatok.cli", as an import or ``python -m`` takes it; docstrings left out (a
    usage line shows a command)."""
    tree = ast.parse(source)
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            and node.value.startswith("megatok.cli")]


def test_the_command_name_reader_finds_modules_named_to_run():
    source = ('"""Usage: python -m megatok.cli.bench"""\nimport importlib\n\n\ndef f(name):\n'
              '    """megatok.cli.x"""\n    importlib.import_module(f"megatok.cli.{name}")\n'
              '    run(["-m", "megatok.cli.zero_init_check"])\n    # megatok.cli.y\n    return "megatok-cli"\n')
    assert command_names(source) == [(7, "megatok.cli."), (8, "megatok.cli.zero_init_check")]


def test_the_library_never_runs_a_command_module():
    """The library calls the library: a study runs megatok-make-corpus, -build-shards, ... as the
    functions those commands call, and starts its own processes with ``python -m`` of a library module,
    never through megatok/cli/ (which may change with the command line alone)."""
    found = {mod: {name for _, name in names} for mod, path in MODULES.items()
             if not mod.startswith("megatok.cli.") and (names := command_names(path.read_text()))}
    assert found == RUNS_A_COMMAND


#: What a command module defines: its parser (``build_parser()``, ``parse_args(argv)``, ``parse_<what>`` for
#: one option's value) and ``main(argv)``; the rest is the library's.
COMMAND_FUNCTIONS = ("main", "build_parser", "parse_args")
#: The most lines a command's ``main`` may have: its arguments, one library call, printing and exit codes.
LONGEST_MAIN = 60


def command_extras(source: str) -> list[str]:
    """What a command module's source defines at module level besides its docstring, imports, parser
    functions, ``main`` and the ``if __name__ == "__main__":`` block, as "line: what"; and a ``main`` over
    LONGEST_MAIN lines."""
    out = []
    for i, node in enumerate(ast.parse(source).body):
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (i == 0 and isinstance(node, ast.Expr)
                                                               and isinstance(node.value, ast.Constant)):
            continue
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                node.name in COMMAND_FUNCTIONS or node.name.startswith("parse_")):
            if node.name == "main" and node.end_lineno - node.lineno + 1 > LONGEST_MAIN:
                out.append(f"{node.lineno}: main is {node.end_lineno - node.lineno + 1} lines")
            continue
        name = getattr(node, "name", None) or ast.unparse(node).splitlines()[0]
        out.append(f"{node.lineno}: {type(node).__name__} {name}")
    return out


def test_the_command_reader_finds_library_code():
    source = ('"""doc"""\nimport sys\nMB = 10\n\n\nclass Row:\n    pass\n\n\ndef helper():\n    pass\n\n\n'
              'def parse_seeds(text):\n    return text\n\n\ndef main(argv=None):\n' + "    x = 1\n" * 60
              + '\n\nif __name__ == "__main__":\n    sys.exit(main())\n')
    assert command_extras(source) == ["3: Assign MB = 10", "6: ClassDef Row", "10: FunctionDef helper",
                                      "18: main is 61 lines"]


def test_every_command_is_its_arguments_and_main():
    """A command module holds its argument parsing and ``main``; what it computes, writes or prints as a
    table lives in the library (megatok/data/, megatok/eval/, megatok/studies/, ...)."""
    extras = {mod: command_extras(path.read_text()) for mod, path in MODULES.items() if mod.startswith("megatok.cli.")}
    assert {mod: found for mod, found in extras.items() if found} == {}


def namespace_parameters(source: str) -> list[str]:
    """The functions of ``source`` with a parameter named ``args`` or ``namespace`` (a parsed command line
    handed on), as "line: name"."""
    return [f"{node.lineno}: {node.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and {a.arg for a in node.args.args + node.args.kwonlyargs} & {"args", "namespace"}]


def test_the_namespace_reader_finds_parsed_command_lines_handed_on():
    source = "def run(args):\n    pass\n\n\nclass Bench:\n    def __init__(self, args, device):\n        pass\n"
    assert namespace_parameters(source) == ["1: run", "6: __init__"]
    assert namespace_parameters("def run(settings, *names):\n    pass\n") == []


def test_the_library_takes_typed_settings_not_a_parsed_command_line():
    """What a command hands the library is typed (a Settings dataclass, keywords), so the library is callable
    without a command line and its settings are checked where they are defined."""
    found = {mod: hits for mod, path in MODULES.items()
             if not mod.startswith("megatok.cli.") and (hits := namespace_parameters(path.read_text()))}
    assert found == {}


#: Where a subpackage's tests are when not in tests/<name>/: the commands' in tests/tools/ (with the shell
#: scripts of tools/), and a command's also beside its library's (megatok-boundary-value's in tests/eval/,
#: megatok-model-size's in tests/scale/, ...).
TESTS_OF = {"cli": "tools"}


def test_every_subpackage_has_its_tests_folder():
    """tests/ mirrors the package: every subpackage of megatok/ has a tests/ folder of its name (or the one
    TESTS_OF names) holding test files."""
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert {"train", "run", "eval", "cli"} <= set(subpackages)
    missing = [name for name in subpackages if not any((ROOT / "tests" / TESTS_OF.get(name, name)).glob("test_*.py"))]
    assert missing == []


def _options_node(node) -> bool:
    """An expression reached through a strategy's options: ``X.options``, ``X.options.model_dump()``, ..."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr == "options":
            return True
        node = node.func if isinstance(node, ast.Call) else node.value
    return False


def option_reads(source: str, names: set[str]) -> list[str]:
    """Where ``source`` reads a strategy's option by name: ``X.options[...]``, ``X.options.get(...)``,
    ``X.options.<one of names>``, ``getattr(X.options, ...)`` (also through ``.model_dump()``), as
    "line: code"."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _options_node(node.value):
            hit = node
        elif isinstance(node, ast.Attribute) and _options_node(node.value) and (node.attr in names or node.attr == "get"):
            hit = node
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and node.args and _options_node(node.args[0])):
            hit = node
        else:
            continue
        out.append(f"{hit.lineno}: {ast.unparse(hit)}")
    return out


def strategy_option_names() -> set[str]:
    from megatok.boundaries import available, strategy_options

    return {name for s in available() for name in strategy_options(s).model_fields}


def test_the_option_reader_finds_reads_by_name():
    names = strategy_option_names()
    assert {"window", "samples", "lambda_policy", "model_path"} <= names
    reads = ["cfg.boundary.options['window']", "cfg.boundary.options.get('samples', 1)", "m.boundary.options.window",
             "getattr(model.boundary.options, 'window', 1)", "cfg.boundary.options.model_dump()['gamma']"]
    assert [len(option_reads(r, names)) for r in reads] == [1, 1, 1, 1, 1]
    asked = ["build_strategy(b.strategy, options=b.options)", "strat.options = variants[name]",
             "param_count(cfg.boundary, d)", "cfg.boundary.options.model_dump(mode='json')", "sp_options['model_type']"]
    assert [option_reads(a, names) for a in asked] == [[]] * 5


def test_no_strategy_option_is_read_by_name_outside_the_boundaries_package():
    """A strategy answers for itself (megatok.boundaries: its checks, counts, samples, files); nothing
    else reads its options by name, so a new strategy or option is a change in its own file."""
    names = strategy_option_names()
    bad = {mod: reads for mod, path in MODULES.items()
           if not mod.startswith("megatok.boundaries") and (reads := option_reads(path.read_text(), names))}
    assert bad == {}


#: The most lines a function in megatok/ may have (from its ``def`` to its last line).
LONGEST = 80


def function_lengths() -> dict[str, int]:
    """{module.function or module.Class.method: lines} of every function in megatok/ (nested ones by their
    enclosing function's name)."""
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{prefix}.{child.name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")

    for mod, path in MODULES.items():
        visit(ast.parse(path.read_text()), mod)
    return out


def test_no_function_is_longer_than_the_limit():
    lengths = function_lengths()
    assert lengths["megatok.config.load_config"] > 10 and "megatok.train.engine.Engine.backward" in lengths
    assert {name: n for name, n in lengths.items() if n > LONGEST} == {}


@pytest.mark.parametrize("directory", ["data", "runs", "exports"])
def test_what_the_docs_write_in_the_checkout_is_ignored_by_git(directory):
    """The corpus and shards (data/), runs (runs/) and exports (exports/NAME in docs/api.md) made by following
    the docs stay out of git status and of the files the docs tests read."""
    import subprocess

    r = subprocess.run(["git", "check-ignore", "-q", f"{directory}/x"], cwd=ROOT, timeout=60)
    if r.returncode == 128:
        pytest.skip("not a git checkout")
    assert r.returncode == 0, f"{directory}/ is not in .gitignore"
