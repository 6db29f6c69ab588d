"""The gateway: an OpenAI-compatible HTTP front over the decode replicas (FastAPI app factory).

Owns: the endpoints (`/v1/chat/completions`, `/v1/completions` with SSE streaming, `/v1/models`,
`/health`, `/metrics`, `/admin/status|swap|canary`), API-key and admin-token checks, mapping
replica events to OpenAI responses, recording each finished request into the metrics and the live
samples the policy reads (its sink, policies.canary.LiveSamples). Must not touch: decoding (replicas),
routing rules (router.py), swap rules (fleet.py), Ray (the caller hands in replicas).

Every response carries the request's speculative metrics in the extra top-level field
`adaptive_eagle` (also in the final SSE chunk); see openai_api.py for the fields and the request
extras. Errors are OpenAI-style bodies `{"error": {message, type, param, code}}`: 400 bad input
(the field and its allowed range named), 401 missing or wrong API key / missing admin token, 403
wrong admin token, 404 unknown model or path, 405 wrong method, 409 a swap or canary refused (a refused
swap's body keeps its per-replica `results` next to the error), 429 queue full. Bad client input is never
a 5xx; a 500 is a server fault (a replica that reported a failed decode). Bearer tokens are compared as the
bytes sent.

A replica that fails itself (its stream raises: a Ray actor that died, crashed or ran out of memory; Ray
restarts it, and never replays a stream) is a 503 `replica_unavailable` naming the replica, with
`Retry-After`, or after the 200 of a stream an SSE error event and `[DONE]`; never a bare 500 or a reset
connection. A request whose replica failed before producing any event (nothing decoded) is first retried
once on another eligible replica. Each such failure is counted in `ae_replica_failures_total{replica}`.
A client that leaves (cancellation) is not a replica failure.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from starlette.exceptions import HTTPException

from policies.canary import LiveSamples
from serving import openai_api as api
from serving.config import ServingConfig
from serving.fleet import GatewayFleet, live_sample
from serving.messages import Delta, Event, Finished, Refused, ServerStatus
from serving.metrics import GatewayMetrics
from serving.router import LocalReplica, NoReplica, QueueFull, Replica, Router
from serving.sglang_swap import registry_refusal
from serving.server import DecodeServer
from serving.tools import CallStream

log = logging.getLogger(__name__)
STATUS_TIMEOUT_S = 5.0
# /metrics waits at most this long for a replica's status (one that does not answer reads ae_replica_up 0), so a
# scrape answers well inside Prometheus's scrape timeout (10 s by default) even while a replica restarts: a
# scrape that timed out would read as the gateway down
METRICS_STATUS_TIMEOUT_S = 2.0
RECONCILE_EVERY_S = 5.0  # how often the gateway checks that each replica serves the head it is routed as
STARTUP_TIMEOUT_S = 300.0


class SwapBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str = Field(..., min_length=1, description='a registry version, or "none" for plain decoding')


class CanaryBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Optional[str] = Field(None, description="the candidate head; null ends the canary")
    fraction: float = Field(0.1, ge=0.0, le=1.0, allow_inf_nan=False,
                            description="share of requests routed to the candidate")


@dataclass
class ReplicaStream:
    """One request's events from the replica that serves it, the first already read; `stack` holds the
    replica's lease and closes the stream."""

    first: Event
    events: AsyncIterator[Event]  # the rest; a replica failure ends them with a 503 Refused
    stack: AsyncExitStack


def _bearer(request: Request) -> Optional[bytes]:
    """The bearer token as the bytes the client sent (starlette decodes headers as latin-1, which
    round-trips every byte); None when there is none. Only ASCII blanks are trimmed: a UTF-8 token may end
    in byte 0xa0, which str.strip would take for a no-break space."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    token = value.strip(" \t").encode("latin-1")
    return token if scheme.lower() == "bearer" and token else None


def _secret_is(given: bytes, secret: SecretStr) -> bool:
    """Constant-time comparison of a token with a configured secret (sent as UTF-8). Bytes on both
    sides: hmac.compare_digest refuses a str holding non-ASCII characters."""
    return hmac.compare_digest(given, secret.get_secret_value().encode("utf-8"))


class ReplicaSilent(Exception):
    """A leased replica did not start the request in time (ServingConfig.first_event_timeout_s)."""


class Gateway:
    """The app's state and handlers (one per app; no module state)."""

    def __init__(self, config: ServingConfig, replicas: Sequence[Union[Replica, DecodeServer]], rng=None) -> None:
        self.config = config
        reps = [LocalReplica(r) if isinstance(r, DecodeServer) else r for r in replicas]
        versions = [r.server.head_version if isinstance(r, LocalReplica) else "none" for r in reps]
        self.router = Router(reps, versions, config.queue_size, config.request_timeout_s, rng)
        self.samples = LiveSamples(config.live_samples_max)
        sglang = config.backend == "sglang"  # SGLang replicas swap one at a time and serve dense heads only
        refusal = registry_refusal(config.registry_path) if sglang and config.registry_path is not None else None
        self.fleet = GatewayFleet(self.router, self.samples, rolling=sglang, refusal=refusal)
        self.metrics = GatewayMetrics()
        self._silent: set[str] = set()  # replicas whose last status call failed

    # ---- auth ---------------------------------------------------------------------------------
    def check_api_key(self, request: Request) -> None:
        if not self.config.api_keys:
            return
        given = _bearer(request)
        if given is None or not any(_secret_is(given, k) for k in self.config.api_keys):
            raise api.ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)", None,
                               "invalid_api_key")

    def check_admin(self, request: Request) -> None:
        token = self.config.admin_token
        given = _bearer(request)
        if given is None:
            raise api.ApiError(401, "admin endpoints need Authorization: Bearer <admin token>", None,
                               "missing_admin_token")
        if token is None or not _secret_is(given, token):
            why = "no admin_token is configured: admin endpoints are disabled" if token is None else "wrong admin token"
            raise api.ApiError(403, why, None, "invalid_admin_token")

    # ---- statuses -----------------------------------------------------------------------------
    async def replica_statuses(self, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Optional[ServerStatus]]:
        """Every replica's status by name, None for one that did not answer (its actor died or restarts)."""
        async def one(slot):
            name = slot.replica.name
            try:
                st = await asyncio.wait_for(slot.replica.status(), timeout_s)
            except Exception as e:  # noqa: BLE001 - one silent replica must not hide the others
                if name not in self._silent:  # logged when it stops answering (ae_replica_up shows every scrape)
                    self._silent.add(name)
                    log.warning("status of %s failed: %s", name, e)
                self.router.replica_failed(slot.replica)  # passed over until it answers again
                return None
            await self._replica_ok(slot.replica)
            if name in self._silent:
                self._silent.discard(name)
                log.info("%s answers its status again", name)
            return st

        answers = await asyncio.gather(*(one(s) for s in self.router.slots))
        return {slot.replica.name: st for slot, st in zip(self.router.slots, answers)}

    async def statuses(self, timeout_s: float = STATUS_TIMEOUT_S) -> list:
        """The statuses of the replicas that answered."""
        return [s for s in (await self.replica_statuses(timeout_s)).values() if s is not None]

    async def keep_fleet(self, every_s: float = RECONCILE_EVERY_S) -> None:
        """Every `every_s`: a replica that serves another head than the router routes to it (its actor restarted
        with the registry's champion, dropping a canary) is swapped back, or routed as what it serves
        (GatewayFleet.areconcile). A failed pass is logged and counted; the loop goes on."""
        while True:
            await asyncio.sleep(every_s)
            try:
                changes = self.fleet.changes  # a swap finishing while the statuses come in makes them stale
                statuses = await self.replica_statuses(METRICS_STATUS_TIMEOUT_S)
                for line in await self.fleet.areconcile(statuses, changes):
                    log.warning("fleet: %s", line)
                    self.metrics.fleet_reconciled.inc()
            except Exception as e:  # noqa: BLE001 - counted and logged; the next pass tries again
                self.metrics.fleet_reconcile_errors.inc()
                log.error("fleet: reconciling the replicas failed: %s: %s", type(e).__name__, e)

    async def refresh_versions(self) -> None:
        """The head each replica serves, asked once at start (actors may still be loading their target)."""
        for st in await self.statuses(STARTUP_TIMEOUT_S):
            for slot in self.router.slots:
                if slot.replica.name == st.replica:
                    slot.version = st.head_version

    # ---- completions --------------------------------------------------------------------------
    def _record(self, endpoint: str, status: int, finished: Optional[Finished] = None) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if finished is not None:
            self.metrics.observe(finished.spec, finished.completion_tokens)
            self.samples.add(live_sample(finished.spec, finished.request_id, finished.completion_tokens))

    async def complete(self, request: Request, chat: bool) -> Response:
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        self.check_api_key(request)
        body = api.parse_json(await request.body())
        parse = api.parse_chat if chat else api.parse_completion
        b, req = parse(body, self.config.max_tokens_limit, self.config.default_max_tokens)
        if b.model != self.config.model_name:
            raise api.ApiError(404, f"the model {b.model!r} does not exist; this server serves "
                                    f"{self.config.model_name!r}", "model", "model_not_found")
        rs = await self._open(req)
        first, events, stack = rs.first, rs.events, rs.stack
        if isinstance(first, Refused):
            await stack.aclose()
            raise _error(first)
        if b.stream:
            return StreamingResponse(self._sse(events, stack, req.request_id, chat, endpoint,
                                               b.tool_spec if chat else None),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        async with stack:
            finished = None
            async for event in events:
                if isinstance(event, Refused):
                    raise _error(event)
                if isinstance(event, Finished):
                    finished = event
        if finished is None:
            raise api.ApiError(500, "the replica ended the request without a result", None, "server_error")
        self._record(endpoint, 200, finished)
        if chat:
            return JSONResponse(api.chat_response(req.request_id, self.config.model_name, finished, b.tool_spec))
        return JSONResponse(api.completion_response(req.request_id, self.config.model_name, finished))

    async def _open(self, req) -> ReplicaStream:
        """Lease a replica and read its first event. A replica that fails before producing any event has
        decoded nothing for the request, so it is retried once on another eligible replica; when there is
        none, or the retry's replica fails too, the answer is a 503."""
        failed: Optional[Replica] = None
        first_error: Optional[Exception] = None
        while True:
            stack = AsyncExitStack()
            try:
                slot = await stack.enter_async_context(self.router.lease(req.head, avoid=failed))
            except QueueFull as e:
                raise api.ApiError(429, str(e), None, "queue_full") from None
            except NoReplica as e:
                if failed is None:
                    raise api.ApiError(400, str(e), "metadata.head", "unknown_head") from None
                raise _error(self._unavailable(failed, first_error)) from None
            replica, events = slot.replica, slot.replica.stream(req)
            stack.push_async_callback(events.aclose)
            try:
                first = await self._first_event(replica, events)
            except Exception as e:  # noqa: BLE001 - the replica failed (StopAsyncIteration: it ended with no event)
                await stack.aclose()
                self._replica_failed(replica, e, req.request_id)
                if failed is None:
                    failed, first_error = replica, e
                    continue
                raise _error(self._unavailable(replica, e)) from None
            except BaseException:  # the client left (cancelled): not the replica's fault, and nothing to answer
                await stack.aclose()
                raise
            await self._replica_ok(replica)
            rest = self._guarded(replica, events, req.request_id)
            stack.push_async_callback(rest.aclose)  # closed before the replica's stream (last in, first out)
            return ReplicaStream(first, rest, stack)

    async def _first_event(self, replica: Replica, events: AsyncIterator[Event]) -> Event:
        """The replica's first event (Started, or Refused), within first_event_timeout_s: a replica starts a
        request it was leased at once (the router leases it no more than it takes), so one that stays silent
        is gone or was never placed (a Ray actor waiting for a node holds its calls, without an error), and
        waiting for it would hang the request."""
        try:
            return await asyncio.wait_for(events.__anext__(), self.config.first_event_timeout_s)
        except asyncio.TimeoutError:
            raise ReplicaSilent(f"replica {replica.name} did not start the request within "
                                f"{self.config.first_event_timeout_s:g} s") from None

    async def _guarded(self, replica: Replica, events: AsyncIterator[Event], rid: str) -> AsyncIterator[Event]:
        """`events`, ended by a 503 Refused when the replica fails after its first event: the request may have
        decoded tokens (and a stream sent them), so it is not replayed, and both response paths answer a
        Refused already (an error body, or after a stream's 200 an SSE error event)."""
        try:
            async for event in events:
                yield event
        except Exception as e:  # noqa: BLE001 - CancelledError (the client left) is a BaseException and passes
            self._replica_failed(replica, e, rid)
            yield self._unavailable(replica, e)

    async def _replica_ok(self, replica: Replica) -> None:
        """`replica` answered (a status, a request's first event): healthy again; if it was a suspect, requests
        waiting for a healthy replica may take it now."""
        if self.router.replica_ok(replica):
            await self.router.fleet_changed()

    def _replica_failed(self, replica: Replica, error: Exception, rid: str) -> None:
        log.warning("replica %s failed while serving request %s: %s: %s", replica.name, rid,
                    type(error).__name__, error)
        self.metrics.replica_failures.labels(replica.name).inc()
        self.router.replica_failed(replica)  # passed over while it may be gone

    @staticmethod
    def _unavailable(replica: Replica, error: Exception) -> Refused:
        return Refused(503, f"replica {replica.name} failed while serving this request ({type(error).__name__}); "
                            "retry the request", None, "replica_unavailable")

    async def _sse(self, events, stack: AsyncExitStack, rid: str, chat: bool, endpoint: str, tools=None):
        model = self.config.model_name
        calls = CallStream(tools) if tools is not None and tools.active else None  # text split into tool calls
        sent_calls = 0
        async with stack:
            if chat:
                yield api.sse(api.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
            async for event in events:
                if isinstance(event, Delta) and calls is not None:
                    for delta in api.tool_deltas(parsed := calls.feed(event.text), sent_calls):
                        yield api.sse(api.chat_chunk(rid, model, delta))
                    sent_calls += sum(k == "call" for k, _ in parsed)
                elif isinstance(event, Delta):
                    yield api.sse(api.chat_chunk(rid, model, {"content": event.text}) if chat
                                  else api.completion_chunk(rid, model, event.text))
                elif isinstance(event, Finished):
                    self._record(endpoint, 200, event)
                    if calls is not None:
                        for delta in api.tool_deltas(parsed := calls.close(), sent_calls):
                            yield api.sse(api.chat_chunk(rid, model, delta))
                        sent_calls += sum(k == "call" for k, _ in parsed)
                    yield api.sse(api.chat_chunk(rid, model, {}, event, "tool_calls" if sent_calls else None)
                                  if chat else api.completion_chunk(rid, model, "", event))
                elif isinstance(event, Refused):  # after the 200 went out: an error event, then the end
                    self._record(endpoint, event.status)
                    yield api.sse(_error(event).body())
                    break
            yield api.SSE_DONE

    # ---- admin --------------------------------------------------------------------------------
    async def admin_status(self) -> dict:
        canary = self.router.canary
        return {"replicas": [s.to_json() for s in await self.statuses()],
                "serving_versions": self.router.serving_versions(), "champion": self.fleet.champion,
                "canary": None if canary is None else canary.to_json(),
                "suspect_replicas": self.router.suspects(),
                "queue": {"waiting": self.router.waiting, "busy": self.router.busy, "inflight": self.router.inflight,
                          "capacity": self.router.capacity, "size": self.config.queue_size}}

    async def admin_swap(self, request: Request) -> JSONResponse:
        body = api.validate_body(SwapBody, api.parse_json(await request.body()))
        results = await self.fleet.aswap(body.version)
        ok = all(r.ok for r in results)
        out = {"ok": ok, "results": [r.__dict__ for r in results], "serving_versions": self.router.serving_versions()}
        if not ok:  # the refusals as an error body too, as every other 4xx
            why = "; ".join(dict.fromkeys(r.message for r in results if not r.ok))
            out.update(api.ApiError(409, f"swap to {body.version!r} refused: {why}", "version", "swap_refused").body())
        return JSONResponse(out, status_code=200 if ok else 409)

    async def admin_canary(self, request: Request) -> JSONResponse:
        body = api.validate_body(CanaryBody, api.parse_json(await request.body()))
        try:
            results = await self.fleet.aset_canary(body.version, body.fraction)
        except ValueError as e:
            raise api.ApiError(409, str(e), "version", "canary_refused") from None
        return JSONResponse({"ok": True, "results": [r.__dict__ for r in results],
                             "serving_versions": self.router.serving_versions(),
                             "canary": None if body.version is None else body.model_dump()})

    async def render_metrics(self) -> Response:
        canary = self.router.canary
        answers = await self.replica_statuses(METRICS_STATUS_TIMEOUT_S)
        self.metrics.refresh([s for s in answers.values() if s is not None], self.router.waiting, self.router.busy,
                             canary.fraction if canary else 0.0,
                             replicas_up={name: s is not None for name, s in answers.items()},
                             inflight=self.router.inflight, capacity=self.router.capacity)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _error(refused: Refused) -> api.ApiError:
    return api.ApiError(refused.status, refused.message, refused.param, refused.code)


def create_app(config: ServingConfig, replicas: Sequence[Union[Replica, DecodeServer]], *, rng=None) -> FastAPI:
    """The gateway over `replicas` (DecodeServers in this process, or Replica handles such as
    router.RayReplica). `app.state.gateway.fleet` is the GatewayFleet the policy drives."""
    gw = Gateway(config, replicas, rng)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.fleet.loop = asyncio.get_running_loop()
        await gw.refresh_versions()
        keeper = asyncio.create_task(gw.keep_fleet(), name="fleet-reconcile")
        yield
        keeper.cancel()
        gw.fleet.loop = None

    app = FastAPI(title="adaptive-eagle gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw

    @app.exception_handler(api.ApiError)
    async def _api_error(request: Request, exc: api.ApiError):
        gw.metrics.requests.labels(request.url.path, str(exc.status)).inc()
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):  # unknown path, wrong method: OpenAI-style
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        err = api.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)  # not counted: any path

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await gw.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await gw.complete(request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        gw.check_api_key(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "adaptive-eagle",
                                            "adaptive_eagle": {"heads": gw.router.serving_versions()}}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "replicas": len(gw.router.slots), "busy": gw.router.busy,
                "inflight": gw.router.inflight, "capacity": gw.router.capacity, "waiting": gw.router.waiting, "serving_versions": gw.router.serving_versions()}

    @app.get("/metrics")
    async def metrics():
        return await gw.render_metrics()

    @app.get("/admin/status")
    async def admin_status(request: Request):
        gw.check_admin(request)
        return await gw.admin_status()

    @app.post("/admin/swap")
    async def admin_swap(request: Request):
        gw.check_admin(request)
        return await gw.admin_swap(request)

    @app.post("/admin/canary")
    async def admin_canary(request: Request):
        gw.check_admin(request)
        return await gw.admin_canary(request)

    return app


class GatewayThread:
    """Serve an app with uvicorn on a background thread (tests, benchmarks, the local stack)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)
        self.url = ""

    def start(self, timeout: float = 30.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
