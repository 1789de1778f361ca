"""The README is a front door: at most 300 lines, its quick start near the top, and every Python block in
it runs as written. Relative links in the README and docs/ point at files and headings that exist."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_is_short_and_starts_with_the_quick_start():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines"
    first = next(i for i, line in enumerate(lines) if line.startswith("## Quick start"))
    assert first < 60, f"the first quick start is at line {first + 1}"


@pytest.mark.parametrize("index", range(len(python_blocks(README))))
def test_readme_python_block_runs(index, tmp_path):
    code = python_blocks(README)[index].replace("/tmp/tiny-llama", str(tmp_path / "tiny-llama"))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"README python block {index} failed:\n{code}\n{done.stdout}\n{done.stderr}"


def anchor(heading):
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    return {anchor(m) for m in re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, fragment = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(target)
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(target)
    assert not broken, f"{doc.name}: broken links {broken}"
