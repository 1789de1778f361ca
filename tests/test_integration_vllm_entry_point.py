"""pagedkv's vLLM plugin seen from an environment without vLLM: the `vllm.general_plugins` entry point is
declared, `pagedkv.integrations` imports no engine, and `import pagedkv.integrations.vllm` fails with an
ImportError that says what is missing (tests/test_integration_vllm.py runs the plugin itself, with vLLM)."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_keyword(name: str):
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == name))


def test_entry_point_declared():
    assert setup_keyword("entry_points") == {
        "vllm.general_plugins": ["pagedkv = pagedkv.integrations.vllm:register"]}


def run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter on this checkout, with vLLM made unimportable."""
    blocker = "import sys; sys.modules['vllm'] = None\n"  # an installed vLLM is hidden too
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "PAGEDKV_VLLM_ATTENTION": "1"}, timeout=120)


def test_import_without_vllm_names_what_is_missing():
    out = run_python("import pagedkv.integrations.vllm")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: pagedkv.integrations.vllm needs vLLM"), out.stderr
    assert "scripts/setup_vllm_venv.sh" in last


def test_integrations_package_imports_no_engine():
    out = run_python("import sys, pagedkv.integrations\n"
                     "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'transformers') "
                     "and sys.modules[m] is not None))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
