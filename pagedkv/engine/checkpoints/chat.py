"""Chat: a model's chat template (Jinja, as Hugging Face and GGUF files ship it) rendered the way
transformers' `apply_chat_template` renders it, and the conversations `LLM.chat` accepts, checked."""
import json
import os
from datetime import datetime
from functools import lru_cache


@lru_cache(maxsize=8)
def compile_template(source: str):
    """The template compiled in a sandbox (templates come with downloaded models): trim_blocks and
    lstrip_blocks, `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII text, as in
    transformers."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install jinja2 (or pagedkv[engine])") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the model's chat template does not compile: {e}") from None


class ChatTemplate:
    """A model's chat template with the special tokens it may refer to (bos_token, eos_token, ...)."""

    def __init__(self, source: str, special_tokens: dict):
        if not isinstance(source, str) or not source.strip():
            raise ValueError("the model's chat template is empty")
        self.source = source
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}

    def render(self, conversation: list[dict], *, add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return compile_template(self.source).render(messages=conversation,
                                                        add_generation_prompt=add_generation_prompt,
                                                        **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ValueError(f"the model's chat template refused the conversation: {e}") from None

    @classmethod
    def from_model_dir(cls, path: str) -> "ChatTemplate | None":
        """The template of a Hugging Face folder: chat_template.jinja, else tokenizer_config.json's
        chat_template (a string, or the list of named templates whose "default" is used); None without one."""
        config = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        source = None
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path) as f:
                source = f.read()
        else:
            source = config.get("chat_template")
            if isinstance(source, list):
                source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if source is None:
            return None

        def token_text(value):
            return value.get("content") if isinstance(value, dict) else value

        return cls(source, {name: token_text(config.get(name)) for name in
                            ("bos_token", "eos_token", "unk_token", "pad_token")})


def conversation_list(conversations) -> list[list[dict]]:
    """One conversation (a list of {"role", "content"} messages) or a list of them, as a list of
    conversations; a clear TypeError / ValueError naming the bad message otherwise."""
    if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict):
        conversations = [conversations]
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise TypeError("conversations must be a conversation (a list of {'role', 'content'} dicts) or a "
                        f"non-empty list of them, got {conversations!r}")
    checked = []
    for i, conv in enumerate(conversations):
        if not isinstance(conv, (list, tuple)) or not conv:
            raise TypeError(f"conversations[{i}] must be a non-empty list of messages, got {conv!r}")
        for j, message in enumerate(conv):
            where = f"conversations[{i}][{j}]"
            if not isinstance(message, dict):
                raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
            if not isinstance(message.get("role"), str) or not message["role"]:
                raise ValueError(f"{where} needs a 'role' string (system, user, assistant, ...), got "
                                 f"{message.get('role')!r}")
            if not isinstance(message.get("content"), str):
                raise ValueError(f"{where} needs a 'content' string, got {message.get('content')!r}")
        checked.append([dict(m) for m in conv])
    return checked
