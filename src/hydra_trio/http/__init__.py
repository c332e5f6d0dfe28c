"""The HTTP front end, a folder per API (as vLLM's entrypoints/openai/<api>/), each entered
through its face. What every route stands on: ``plumbing/`` (the route table, auth,
connections, bodies and errors, SSE, the model a request names); one generation for every
API: ``generation/`` (the run, the one dialect route, the one streaming event machine).
The APIs: ``completions/`` (OpenAI's chat and text), ``messages/`` (Anthropic's),
``responses/`` (OpenAI's Responses), ``decode_results/``, ``infill/``, ``tokenizer/``,
``pooling/`` (embeddings, rerank), ``slots/``, ``status/``, ``models/``, ``sessions/``. A
dialect's folder holds its routes (``messages_routes.py``), its protocol
(``messages_protocol.py``: its requests and replies) and its serving (``messages_serving.py``:
a generation answered); a small API's one module holds all three. ``server.py`` builds the app from them all."""
