"""Chat templates for the server: the runtime's rendering (specdeploy.runtime.chat), so that `serve`, `run
--chat` and `generate(messages=...)` render a conversation the same way."""

from ..runtime.chat import NO_TEMPLATE, ChatTemplate, load_chat_template

__all__ = ["NO_TEMPLATE", "ChatTemplate", "load_chat_template"]
