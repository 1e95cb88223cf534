"""Tool calling at the router: the request's function tools, the parsers that find calls in
a model's text (one per model family's format, by vLLM's names), and the constraint that
makes `tool_choice` "required" or a named function always yield valid calls."""
