"""What every route of the HTTP API shares: the front door, the served names, the caller check, the chat template
and the checkpoint's generation defaults."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any

from fastapi import Request

from cdb_model.loader import load_generation_defaults
from services.api.door import FrontDoor
from services.api.security import CallerAuth, read_api_keys
from services.http.chat_template import ChatTemplate, read_chat_template
from services.http.errors import ApiError
from services.settings import Settings, served_names


class ApiContext:
    """The state of one app (``create_app``'s arguments, resolved once)."""

    def __init__(
        self,
        door: FrontDoor,
        settings: Settings,
        *,
        model_names: Sequence[str] = (),
        api_keys: Collection[str] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.door = door
        self.settings = settings
        self.prep = prep = door.prep
        self.templates = ChatTemplate(prep.tokenizer, read_chat_template(chat_template or settings.chat_template))
        self.names = list(model_names) or served_names(settings.served_model_name) or [prep.config.model]
        self.served = self.names[0]
        if api_keys is not None:
            self.auth = CallerAuth(api_keys)
        else:  # the gRPC port's keys when it has some, else the settings' (a door built without its port's auth)
            self.auth = door.auth if door.auth.keys_on else CallerAuth(read_api_keys(settings))
        self.created = int(time.time())
        # sampling defaults of unset fields, max_new_tokens
        self.generation = load_generation_defaults(prep.config.model)
        # requests the engine holds at once (resident + waiting): a body of more choices could never be admitted
        self.capacity = prep.config.max_num_seqs + prep.config.max_waiting
        self.share = (door.shares.max_requests, door.shares.max_streams)  # one caller's, at most

    def authorized(self, request: Request) -> None:
        why = self.auth.refusal(request.headers.items())
        if why is not None:
            raise ApiError(401, f"{why} (send the header 'Authorization: Bearer KEY')", code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            known = ", ".join(f"'{n}'" for n in self.names)
            raise ApiError(
                404, f"the model '{model}' does not exist (served: {known})", param="model", code="model_not_found"
            )

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.served,
            "object": "model",
            "created": self.created,
            "owned_by": "cdb",
            "root": self.prep.config.model,  # what was loaded: a preset, a folder, a cache snapshot
            "parent": None,
            "max_model_len": self.prep.limits.max_total_tokens,  # the context length: prompt + generated tokens
        }
