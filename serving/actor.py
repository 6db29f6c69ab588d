"""ServerActor: the thin Ray shell around one DecodeServer (all logic lives in server.py, which tests
drive without Ray).

Owns: building the server inside the actor's process from a zero-argument builder, and exposing it
as async actor methods: `stream` (an async generator: the caller reads it as a Ray streaming
generator, `actor.stream.options(num_returns="streaming").remote(request)`; router.RayReplica does),
`swap_head`, `set_canary`, `status`, `head_version`. Must not touch: anything but forwarding. Decoding runs on
the server's own decode thread, so the actor's event loop keeps answering `status` and
`swap_head` while a request decodes.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from serving.messages import DecodeRequest, Event
from serving.router import LocalReplica, RayReplica
from serving.server import DecodeServer, settle_heap


class ServerActor(LocalReplica):
    """Use as `ray.remote(ServerActor).options(...).remote(builder)`; `builder()` returns the
    DecodeServer (it runs in the actor's process, so the target loads there). The forwarding is
    LocalReplica's; only `stream` differs, because Ray streams an async generator method."""

    def __init__(self, builder: Callable[[], DecodeServer]) -> None:
        super().__init__(builder())
        settle_heap()  # this actor's process holds one replica's model: out of the collector's reach

    async def stream(self, request: DecodeRequest) -> AsyncIterator[Event]:
        async for event in self.server.astream(request):
            yield event

    async def head_version(self) -> str:
        return self.server.head_version

    async def close(self) -> None:
        await asyncio.to_thread(self.server.close)


def remote_server_actor(builder: Callable[[], DecodeServer], name: str, max_inflight: int = 1, **options):
    """Start a ServerActor (`options`: Ray actor options such as num_cpus, num_gpus) and return a
    router.RayReplica over it that routes it up to `max_inflight` requests at once."""
    import ray

    handle = ray.remote(ServerActor).options(name=None, **options).remote(builder)
    return RayReplica(handle, name, max_inflight)
