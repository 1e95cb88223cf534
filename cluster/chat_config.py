"""The chat flags (vLLM's names): how the router renders a conversation and reads a chat
answer — the chat template, tool calling, reasoning. The router owns them
(router/generation/chat_tools.py reads them); `pdserve up` takes the same flags and passes them on,
so they live here, where both may import them (local_cluster never imports router:
tests/test_imports.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from engine.checks import check_fields
from engine.flags import option

GROUP = "chat (tool calling, reasoning; docs/router.md)"


@dataclass(frozen=True)
class ChatConfig:
    chat_template: str | None = option(None, metavar="FILE_OR_TEMPLATE")
    """The chat template (a Jinja file, or the template itself) instead of the model's own
    (vLLM's flag): e.g. one that renders `tools` for a model whose template does not
    (examples/tool_chat_template_chatml.jinja for ChatML models such as SmolLM2)."""
    enable_auto_tool_choice: bool = False
    """Let the model decide to call tools (`tool_choice: "auto"`, the default when a
    request has tools): its text is parsed with --tool-call-parser (vLLM's flag)."""
    tool_call_parser: str | None = option(None, metavar="NAME")
    """How the model writes tool calls: hermes (also Qwen2.5/Qwen3), llama3_json, mistral,
    pythonic, granite, or a name a --tool-parser-plugin registers."""
    tool_parser_plugin: str | None = option(None, metavar="FILE")
    """A Python file whose classes register more tool parsers
    (`router.parsers.tools.parser.register_tool_parser`)."""
    reasoning_parser: str | None = option(None, metavar="NAME")
    """Split a reasoning model's thinking into `reasoning_content`: deepseek_r1 or qwen3.
    Structured outputs and tool parsing then apply to the answer only."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            [
                (
                    not self.enable_auto_tool_choice or self.tool_call_parser is not None,
                    "enable_auto_tool_choice",
                    "needs --tool-call-parser (how to read the calls)",
                ),
            ],
        )

    def absolute(self) -> "ChatConfig":
        """The same, with the files named by absolute paths (for a process started elsewhere)."""
        template = self.chat_template
        if template is not None and Path(template).is_file():
            template = str(Path(template).resolve())
        plugin = self.tool_parser_plugin
        if plugin is not None:
            plugin = str(Path(plugin).resolve())
        return replace(self, chat_template=template, tool_parser_plugin=plugin)
