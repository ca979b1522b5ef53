"""The OpenAI-compatible HTTP API of the scheduler service (FastAPI + uvicorn, in the scheduler's process).

API keys and TLS are the public port's (``services.api.security``: ``Authorization: Bearer KEY``).

| module | what |
|---|---|
| ``app`` | ``create_app`` (the app over the front door), ``serve_api`` |
| ``context`` | what every route shares: the door, served names, the caller check, the chat template, defaults |
| ``generation`` | ``/v1/completions`` and ``/v1/chat/completions``: one admitted request per choice |
| ``tokens`` | ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` |
| ``server`` | ``HttpServer`` / ``serve_http``: uvicorn on the running loop, without its signal handlers |
| ``schemas`` | request bodies (pydantic) -> the engine's ``RequestParams`` |
| ``responses`` | engine events -> completion / chat objects and SSE chunks, with the served-depth extension |
| ``structured`` | structured output (``response_format``, ``structured_outputs``, ``guided_*``) -> ``Structure`` |
| ``tools`` | chat tool calls: ``tools`` / ``tool_choice`` -> a ``Structure``; the generated text -> ``tool_calls`` |
| ``streaming`` | the SSE body of a streamed response, the wait of a non-streamed one (a client gone aborts) |
| ``calls`` | one choice, admitted at the front door with its metrics and trace (the drain covers it) |
| ``chat_template`` | the chat template the API renders with: the tokenizer's, or ``--chat-template`` |
| ``errors`` | OpenAI-style error bodies and HTTP statuses (classified by ``services.api.errors``) |
"""

from services.http.app import create_app, serve_api
from services.http.server import HttpServer, serve_http

__all__ = ["HttpServer", "create_app", "serve_api", "serve_http"]
