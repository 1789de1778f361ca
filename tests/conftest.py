"""pytest configuration: the run ends with one line that says why CUDA tests were skipped, if they were.
Shared helpers live in tests/ops_reference.py (ops) and tests/bm_model.py (block manager); pytest puts
tests/ on sys.path."""
import torch


def pytest_terminal_summary(terminalreporter):
    if torch.cuda.is_available() or not terminalreporter.stats.get("skipped"):
        return
    why = "this torch has no CUDA" if torch.version.cuda is None else "no GPU is visible"
    terminalreporter.write_line(f"pagedkv: the CUDA variants were skipped ({why}); the CUDA kernels run on the "
                                "CPU emulator in the C++ tests instead")
