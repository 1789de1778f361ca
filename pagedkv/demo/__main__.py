"""`python -m pagedkv.demo`: the chat demo (chat.py)."""
import sys

from .chat import main

sys.exit(main())
