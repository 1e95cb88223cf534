"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), built on the chat pipeline.

Life cycle of a request here (routes.py):
1. Parse (protocol.py): strictly, and unlike chat, a field this server does not act on is a
   400 naming it (a Responses client relies on fields such as `background` or `reasoning`
   having an effect; ignoring one would change the answer silently).
2. Continue a stored response (store.py), if `previous_response_id` names one: its
   conversation (earlier input + output, as chat messages) comes first.
3. Convert (convert.py) into a chat completion request and prepare it as chat is prepared:
   template, tokens, tools, structured output, sampling; a refusal there names the
   Responses field.
4. Run it on the cluster (router/generation/run.py), parse each piece of text into answer,
   reasoning and tool calls as chat does, and build the output items and, streaming, the
   events (output.py, run.py).
5. Store the finished conversation (when the store is on and the request did not opt out).
"""
