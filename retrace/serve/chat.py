"""The chat template of the served model's tokenizer (transformers' apply_chat_template).

The template comes from ``--chat-template FILE`` or else from the tokenizer directory (an engine bundle's
``tokenizer/``: ``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``). Without one,
chat requests are refused with a clear error; completions still work.
"""

from __future__ import annotations

from pathlib import Path

from retrace.errors import RetraceError


class ChatTemplate:
    def __init__(self, tokenizer, template: str):
        self.tokenizer = tokenizer
        self.template = template

    @classmethod
    def load(cls, tokenizer_dir: str | Path | None, template_file: str | Path | None = None) -> ChatTemplate | None:
        """The template, or None when there is none (a bad template file is an error)."""
        template = None
        if template_file is not None:
            try:
                template = Path(template_file).read_text()
            except OSError as e:
                raise RetraceError(f"--chat-template {template_file}: {e.strerror}") from None
        if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer.json").is_file():
            if template is not None:
                raise RetraceError("--chat-template needs a model with a tokenizer (tokenizer.json)")
            return None
        d = Path(tokenizer_dir)
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if (d / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(d))
        else:
            tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
        template = template or getattr(tok, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        return cls(tok, template) if template else None

    def render(self, messages: list[dict]) -> str:
        """The prompt text for ``messages`` ({"role", "content"}), ending with the assistant's turn."""
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=True)
        except TemplateError as e:  # raise_exception(...) for messages it refuses, an undefined name, bad syntax
            raise RetraceError(f"the chat template refused these messages: {type(e).__name__}: {e}") from None
        except RetraceError:  # the time limit (serve/offload.py)
            raise
        except Exception as e:  # a template error of another kind (a TypeError in a filter, ...)
            raise RetraceError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
