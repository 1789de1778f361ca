"""pagedkv/_C.pyi, the type stub of the native module, against the built module: every member is in the
stub with a docstring, and every function's parameters (names, positional or keyword-only, defaults) are
the bindings'. mypy's stubtest (`make test-stubs`) checks what the stub declares exists at run time, but
cannot read the signatures of pybind11 functions; these tests read them from the functions' docstrings."""
import ast
import pathlib
import re

import pytest

import pagedkv
from pagedkv import _C

STUB_PATH = pathlib.Path(pagedkv.__file__).with_name("_C.pyi")
UNDOCUMENTED = {"__eq__", "__ne__", "__hash__", "__index__", "__int__", "__repr__"}   # their meaning is Python's
PYBIND11_INTERNALS = {"_pybind11_conduit_v1_", "__doc__", "__module__", "__entries", "__getstate__", "__setstate__",
                      "__str__", "__repr__", "__members__"}


def stub_tree():
    return ast.parse(STUB_PATH.read_text())


def stub_members():
    """{qualified name: ast node} of the stub's module-level functions and variables, classes, and the
    classes' methods, properties and class variables."""
    out = {}
    for node in stub_tree().body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.ClassDef):
            out[node.name] = node
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = item
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out[f"{node.name}.{item.target.id}"] = item
    return out


def runtime_members():
    """{qualified name: object} of everything the built module defines (pybind11's own helpers aside)."""
    out = {}
    for name in dir(_C):
        if name.startswith("__"):
            continue
        obj = getattr(_C, name)
        out[name] = obj
        if isinstance(obj, type):
            for attr, value in vars(obj).items():
                if attr not in PYBIND11_INTERNALS:
                    out[f"{name}.{attr}"] = value
    return out


def test_every_member_of_the_module_is_in_the_stub():
    missing = sorted(set(runtime_members()) - set(stub_members()))
    assert not missing, f"pagedkv/_C.pyi lacks {missing}"
    assert len([m for m in runtime_members() if m.startswith("BlockManager.")]) >= 58


def test_every_stub_function_class_and_property_has_a_docstring():
    bare = [name for name, node in stub_members().items()
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and name.split(".")[-1] not in UNDOCUMENTED
            and not ("." in name and name.startswith("_"))       # a private helper type of the stub's own
            and ast.get_docstring(node) is None]
    assert not bare, f"no docstring in pagedkv/_C.pyi: {bare}"


def runtime_signature(qualname, obj):
    """The pybind11 signature line of obj's docstring, parsed as a Python def (its annotations and
    defaults are Python expressions); None for overloaded functions and non-functions."""
    name = qualname.split(".")[-1]
    doc = getattr(obj, "__doc__", None) or ""
    if "Overloaded function" in doc:
        return None
    line = next((ln for ln in doc.splitlines() if ln.startswith(f"{name}(")), None)
    if line is None:
        return None
    return ast.parse(f"def {line}: pass").body[0].args


def described(args: ast.arguments, skip_self: bool):
    """(positional [(name, default)], positional-only names, keyword-only [(name, default)])."""
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults))[1 if skip_self else 0:]
    value = lambda d: "<required>" if d is None else ast.literal_eval(d)   # noqa: E731
    return ([(a.arg, value(d)) for a, d in pairs], {a.arg for a in args.posonlyargs},
            [(a.arg, value(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)])


FUNCTIONS = sorted(q for q, obj in runtime_members().items() if callable(obj) and not isinstance(obj, type)
                   and runtime_signature(q, obj) is not None)


@pytest.mark.parametrize("qualname", FUNCTIONS)
def test_stub_parameters_are_the_bindings(qualname):
    obj = runtime_members()[qualname]
    runtime = runtime_signature(qualname, obj)
    stub = stub_members()[qualname].args
    is_method = "." in qualname
    r_pos, _, r_kw = described(runtime, is_method)
    s_pos, s_posonly, s_kw = described(stub, is_method)
    assert r_kw == s_kw, f"{qualname}: keyword-only parameters {r_kw} at run time, {s_kw} in the stub"
    assert [d for _, d in r_pos] == [d for _, d in s_pos], f"{qualname}: defaults {r_pos} vs {s_pos}"
    for (r_name, _), (s_name, _) in zip(r_pos, s_pos):
        if r_name.startswith("arg") and r_name[3:].isdigit():   # pybind11 names it: positional only
            assert s_name in s_posonly, f"{qualname}: {s_name} must be positional-only (`/`): it is {r_name}"
        else:
            assert r_name == s_name, f"{qualname}: parameter {r_name} at run time is {s_name} in the stub"


def typed_dict_keys(name):
    node = next(n for n in stub_tree().body if isinstance(n, ast.ClassDef) and n.name == name)
    return {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)}


@pytest.mark.parametrize("kwargs", [{}, {"num_host_blocks": 8, "num_disk_blocks": 8, "group_windows": [None]},
                                    {"group_windows": [None, 8]}])
def test_the_stats_typed_dict_names_every_key_stats_returns(kwargs):
    # The keys come from one X-macro in block_manager_stats.h; the stub's _Stats must follow it.
    bm = _C.BlockManager(16, 4, **kwargs)
    assert set(bm.stats()) == typed_dict_keys("_Stats")
    assert set(bm.take_step_stats()) == typed_dict_keys("_Stats")


STATS_HEADER = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "core" / "block_manager_stats.h"


def stats_macro_keys():
    """[(name, python type)] of PAGEDKV_BLOCK_MANAGER_STATS, in its order: counters and gauges are ints,
    ratios floats."""
    text = STATS_HEADER.read_text()
    out = []
    for counter, gauge, ratio in re.findall(r"^\s*(?:COUNTER\((\w+)\)|GAUGE\(\w+,\s*(\w+)\)|RATIO\((\w+),)", text,
                                             re.M):
        out.append((counter or gauge or ratio, "float" if ratio else "int"))
    return out


@pytest.mark.skipif(not STATS_HEADER.exists(), reason="needs the source tree (csrc/core/block_manager_stats.h)")
def test_stats_typeddict_is_the_x_macro_list():
    """The statistics are listed once, in the X-macro; the stub's _Stats TypedDict must name the same keys
    with the same types in the same order, and stats() must return exactly them."""
    keys = stats_macro_keys()
    assert len(keys) > 30
    stats_class = next(n for n in stub_tree().body if isinstance(n, ast.ClassDef) and n.name == "_Stats")
    stub = [(item.target.id, ast.unparse(item.annotation)) for item in stats_class.body
            if isinstance(item, ast.AnnAssign)]
    assert stub == keys
    stats = pagedkv.BlockManager(8, 4).stats()
    assert [(k, type(v).__name__) for k, v in stats.items()] == keys
