"""The OpenAI-compatible HTTP API of the scheduler service (FastAPI + uvicorn, in the scheduler's process).

API keys and TLS are the public port's (``services.api.security``: ``Authorization: Bearer KEY``).

| module | what |
|---|---|
| ``app`` | ``create_app`` (the routes), ``HttpServer`` / ``serve_http`` (uvicorn on the running loop), ``serve_api`` |
| ``schemas`` | request bodies (pydantic) -> the engine's ``RequestParams`` |
| ``responses`` | engine events -> completion / chat objects and SSE chunks, with the served-depth extension |
| ``streaming`` | the SSE body of a streamed response, the wait of a non-streamed one (a client gone aborts) |
| ``calls`` | one choice's engine stream: validated, observed, registered with the service (drain covers it) |
| ``chat_template`` | the chat template the API renders with: the tokenizer's, or ``--chat-template`` |
| ``errors`` | OpenAI-style error bodies and HTTP statuses (classified by ``services.api.errors``) |
"""

from services.http.app import HttpServer, create_app, serve_api, serve_http

__all__ = ["HttpServer", "create_app", "serve_api", "serve_http"]
