"""The built-in tool call parsers (each registers itself on import)."""

from router.parsers.tools import granite, hermes, llama3_json, mistral, pythonic

__all__ = ["granite", "hermes", "llama3_json", "mistral", "pythonic"]
