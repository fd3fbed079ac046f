"""Chat templates: the Jinja template a Hugging Face tokenizer carries (`chat_template` in its
tokenizer_config.json, or chat_template.jinja) turns a list of messages into the text the model
was fine-tuned on. Templates come from model files, so they render in Jinja's immutable sandbox
(as transformers does): they can format text, not reach Python objects. `{% generation %}` blocks
(transformers' marker of the assistant's tokens) render their body.

A model without a template gets DEFAULT_TEMPLATE when `tformer train --task sft` fine-tunes it: the
tokenizer's own BOS and EOS tokens delimit the turns, so no new token (and no new embedding row) is
needed, and the EOS that ends each assistant turn is what generation stops on:

    <bos>system\\nBe brief.<eos><bos>user\\nHi<eos><bos>assistant\\nHello!<eos>
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.exceptions import TemplateSyntaxError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, _generation_extension()])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The text of `messages` ([{"role", "content"}, ...]); with add_generation_prompt, ending where the
        assistant's reply starts; `tools` (OpenAI's function definitions) for templates that describe them,
        as transformers passes them. Raises ValueError when the template refuses the conversation (e.g.
        roles out of order)."""
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)
        except (TemplateError, TypeError) as e:
            raise ValueError(f"the model's chat template refused the messages: {e}") from None


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _generation_extension():
    """`{% generation %}...{% endgeneration %}`: renders its body (the markers only tell transformers
    which characters are the assistant's; tformer finds them by rendering incrementally, data/chat.py)."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def _token_text(value) -> str:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def find_chat_template(directory: Path) -> ChatTemplate | None:
    """The chat template stored in a checkpoint directory (copied there by `tformer import-hf` or
    `import-gguf`, written by `tformer train --task sft`), or None."""
    source = chat_template_source(directory)
    if source is None:
        return None
    config = tokenizer_config(directory)
    return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


def chat_template_source(directory: Path) -> str | None:
    """The Jinja text of a directory's chat template: chat_template.jinja, else tokenizer_config.json's
    chat_template (its "default" one when it names several); None when it has none."""
    directory = Path(directory)
    if (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text(encoding="utf-8") or None
    source = tokenizer_config(directory).get("chat_template")
    if isinstance(source, list):     # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    return source if isinstance(source, str) and source else None


def tokenizer_config(directory: Path) -> dict:
    """A directory's tokenizer_config.json ({} when it has none)."""
    config_file = Path(directory) / TOKENIZER_CONFIG
    return json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
