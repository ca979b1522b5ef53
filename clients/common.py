"""The names the clients' users import from here, re-exported from where they live: ``clients.messages`` (the
calls' typed values and their protobuf conversions); ``clients.channel``, ``clients.resume`` and ``clients.base``
hold the rest of what the sync and asyncio clients share."""

from clients.messages import GenerateOptions as GenerateOptions
from clients.messages import StreamFinish as StreamFinish
from clients.messages import StreamToken as StreamToken
