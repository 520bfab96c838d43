"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``) on
top of the chat route's machinery: protocol.py (the body and its items), rendering.py (items as
chat messages, replies as output items), store.py (stored responses), serving.py (a request to a
response), streaming.py (its events), routes.py (the HTTP routes). docs/responses.md."""
