"""pagedkv's modules import each other without a cycle. The graph is read from the source with `ast`:
an edge A -> B for every `import` of a pagedkv module B in module A (`from X import name` names the
submodule X.name when there is one, else X; the compiled pagedkv._C is a leaf). Two graphs are checked: the imports that run when A is
imported (module level, including under `if` and `try`), which decide whether importing works in every
order; and those plus the imports inside functions, so that deferring an import cannot hide a cycle
between two modules that need each other.

The engine's rooms (pagedkv/engine/*/, each folder's docstring says what it owns) and the rules on what
each may import are in RULES, checked over every import, module or function level."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "pagedkv"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def extension_modules() -> set[str]:
    """Compiled modules (pagedkv._C, known by its stub): leaves of the graph."""
    return {module_name(p) for p in (ROOT / PACKAGE).rglob("*.pyi")}


def imports(path: pathlib.Path, name: str, known: set[str], function_level: bool) -> set[str]:
    """The pagedkv modules that module `name` (at `path`) imports."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and (function_level or not in_function):
                found.update(targets(child))
            visit(child, nested)

    def targets(node):
        if isinstance(node, ast.Import):
            return {alias.name for alias in node.names if alias.name in known}
        base = package
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = ".".join(filter(None, [base if node.level else "", node.module or ""]))
        out = set()
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            out.add(sub if sub in known else source)
        return {m for m in out if m in known}

    visit(tree, False)
    found.discard(name)
    return found


def graph(function_level: bool) -> dict[str, set[str]]:
    found = modules()
    known = set(found) | extension_modules()
    return {name: imports(path, name, known, function_level) for name, path in found.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle as [m0, m1, ..., m0], or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_is_read():
    edges = graph(function_level=False)
    assert len(edges) > 20
    assert "pagedkv.engine.tp.runners" in edges["pagedkv.engine.serving.llm_engine"]
    assert "pagedkv.engine.config" in edges["pagedkv.engine.tp.shard"]          # a relative `from ..x import`
    assert "pagedkv" in edges["pagedkv.engine.serving.scheduler"]                       # `from pagedkv import ...`


@pytest.mark.parametrize("function_level", [False, True], ids=["module-level", "with-function-level"])
def test_no_import_cycle(function_level):
    cycle = find_cycle(graph(function_level))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found_and_printed():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


E = "pagedkv.engine"
APPS = ("pagedkv.engine", "pagedkv.demo", "pagedkv.integrations")
# (rule, the modules it binds, the modules they must not import, the exceptions): a name stands for the module
# and everything under it.
RULES = [
    ("the library never imports the engine, the demo or the integrations",
     lambda m: not m.startswith(APPS), APPS, ()),
    ("the engine never imports the demo or the integrations",
     lambda m: m.startswith(E), ("pagedkv.demo", "pagedkv.integrations"), ()),
    ("models never import checkpoints, serving, execution, kv or tp (models know layers and config only)",
     lambda m: m.startswith(f"{E}.models"),
     (f"{E}.checkpoints", f"{E}.serving", f"{E}.execution", f"{E}.kv", f"{E}.tp"), ()),
    ("checkpoints never import a model's internals (only the registry), serving or execution",
     lambda m: m.startswith(f"{E}.checkpoints"),
     (f"{E}.models", f"{E}.serving", f"{E}.execution"), (f"{E}.models.registry",)),
    ("serving never imports a model (models are reached through execution)",
     lambda m: m.startswith(f"{E}.serving"), (f"{E}.models",), ()),
    ("the scheduler, sequences, sampling, speculation and metrics never import execution, tp or checkpoints",
     lambda m: m.startswith(f"{E}.serving") and m != f"{E}.serving.llm_engine",
     (f"{E}.execution", f"{E}.tp", f"{E}.checkpoints"), ()),
    ("kv never imports models, checkpoints, execution or tp",
     lambda m: m.startswith(f"{E}.kv"), (f"{E}.models", f"{E}.checkpoints", f"{E}.execution", f"{E}.tp"), ()),
    ("execution and tp never import the LLM API",
     lambda m: m.startswith((f"{E}.execution", f"{E}.tp")), (f"{E}.serving.llm_engine",), ()),
]


def under(module: str, names) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for rule, binds, forbidden, allowed in RULES:
        for module in sorted(m for m in edges if binds(m)):
            for target in sorted(edges[module]):
                if under(target, forbidden) and not under(target, allowed) and not under(module, (target,)):
                    found.append(f"{module} imports {target}: {rule}")
    return found


def test_the_rooms_exist_and_say_what_they_own():
    for room in ("models", "checkpoints", "kv", "serving", "execution", "tp"):
        init = ROOT / PACKAGE / "engine" / room / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, f"{init} must say what the room owns and what it may import"


def test_the_import_rules_hold():
    assert violations(graph(function_level=True)) == []


def test_a_broken_rule_is_reported():
    edges = {f"{E}.models.llama": {f"{E}.serving.scheduler", f"{E}.config"},
             f"{E}.checkpoints.loader": {f"{E}.models.registry", f"{E}.models.layers"},
             "pagedkv.cache": {"pagedkv.validation"}}
    assert violations(edges) == [
        f"{E}.models.llama imports {E}.serving.scheduler: " + RULES[2][0],
        f"{E}.checkpoints.loader imports {E}.models.layers: " + RULES[3][0],
    ]
