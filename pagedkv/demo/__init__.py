"""pagedkv.demo: the applications built on the library and the engine, apart from both: the chat demo
(`python -m pagedkv.demo`, chat.py), the block-manager serving simulation (`python -m pagedkv.demo.simulate`)
and the chat workload the demo, benchmarks and tests share (chat_workload.py). Nothing in the library or
the engine imports this package."""
from .chat import build_tiny_llama

__all__ = ["build_tiny_llama"]
