"""Old import paths of moved modules resolve, for one release, to the module at the new path itself, with a
DeprecationWarning that names the new path (each check in a fresh interpreter: imports are cached)."""
import os
import pathlib
import subprocess
import sys

import pytest

from pagedkv._moved import MOVED

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECK = """
import importlib, sys, warnings
old, new = sys.argv[1], sys.argv[2]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    module = importlib.import_module(old)
messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
assert any(old in m and new in m for m in messages), messages
assert module is importlib.import_module(new) and sys.modules[old] is module
assert module.__name__ == new and module.__spec__.name == new, (module.__name__, module.__spec__.name)
"""


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_with_a_warning(old):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", CHECK, old, MOVED[old]], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_new_path_exists_and_no_old_file_is_left():
    for old, new in MOVED.items():
        assert (ROOT / (new.replace(".", "/") + ".py")).is_file() or (ROOT / new.replace(".", "/")).is_dir(), new
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), old


def test_from_import_of_an_old_submodule_works():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    from pagedkv.engine import llama\nexcept DeprecationWarning as e:\n    print('warned', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert "warned pagedkv.engine.llama moved to pagedkv.engine.models.llama" in result.stdout, result.stderr
