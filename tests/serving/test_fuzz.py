"""The gateway's HTTP surface under fuzz (hypothesis, derandomized: CI sees the same examples every run).

A real app over two tiny-target replicas, driven in process (starlette TestClient, server exceptions
answered as 500s): arbitrary JSON bodies, fields of the right type with odd values (NaN, infinities, huge
integers, lone surrogates, unknown fields), fields of the wrong type, malformed bytes, odd content types and
Authorization headers, against every endpoint. The contract: no response is a 5xx, not even an error event
inside a 200 stream; every 4xx is an OpenAI error body whose message says what is wrong and names the
field at fault (`param`) when there is one. Valid requests decode at most MAX_TOKENS tokens.
"""

import json

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from serving.config import ServingConfig
from serving.gateway import create_app

ADMIN, KEY, MODEL = "admin-secret", "key-1", "tiny-eagle"
MAX_TOKENS = 2  # valid requests decode this many tokens at most: a decode is the costly part
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])
FUZZ_WIDE = settings(FUZZ, max_examples=300)  # surfaces that seldom reach a replica: cheap examples
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def client(stack):
    servers = [stack.server("v1", f"fuzz-{i}") for i in range(2)]
    config = ServingConfig(model_name=MODEL, replicas=2, queue_size=8, max_prompt_tokens=40,
                           max_tokens_limit=MAX_TOKENS, default_max_tokens=1, admin_token=ADMIN, api_keys=(KEY,))
    try:
        with TestClient(create_app(config, servers), raise_server_exceptions=False) as c:
            yield c
    finally:
        for s in servers:
            s.close()


# ---- what every answer must be --------------------------------------------------------------------
def check(r, sent) -> None:
    """No 5xx (nor a server error inside a 200 stream); a 4xx is an OpenAI error body that says what is wrong."""
    if currently_in_test_context():
        event(f"status {r.status_code}")  # the spread of answers: --hypothesis-show-statistics
    assert r.status_code < 500, f"{r.status_code} {r.text[:400]} for {sent!r:.400}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"].strip(), r.text
        assert err["type"] and err["code"], r.text
        if err["param"] is not None:
            assert err["message"].startswith(err["param"]), r.text  # the field at fault, named first
        if err["code"] == "invalid_value":
            assert err["param"], r.text  # a bad value names its field
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                assert chunk.get("error", {}).get("type", "") != "server_error", f"{line} for {sent!r:.400}"


def post(client, path, body, headers=AUTH):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN/Infinity go out as such
    r = client.post(path, content=raw, headers={"Content-Type": "application/json", **headers})
    check(r, body)
    return r


# ---- strategies ------------------------------------------------------------------------------------
def mostly(valid, odd, one_in: int = 4):
    """`valid`, but `odd` one time in `one_in`: enough examples stay valid to reach the replicas."""
    return st.integers(1, one_in).flatmap(lambda i: odd if i == 1 else valid)


WORDS = st.lists(st.integers(4, 63).map(lambda i: f"w{i}"), min_size=1, max_size=6).map(" ".join)
SURROGATES = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)
TEXT = st.one_of(WORDS, st.text(max_size=12), st.text(st.characters(min_codepoint=0x80), max_size=6))
ODD_TEXT = st.one_of(SURROGATES, st.sampled_from(["", " ", "\x00", "w5" * 40, "w5 " * 60]))
HUGE = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, -(10**30)])
INTS = st.one_of(st.integers(-3, 6), st.integers(), HUGE)
FLOATS = st.one_of(st.floats(0, 2), st.floats(), st.sampled_from([0.0, 5e-324, 1e-300, 1e-30, 2.0, 1e308]))
ANY = st.recursive(st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT, ODD_TEXT),
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                   max_leaves=6)
UNKNOWN = mostly(st.just({}), st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(
    ["logprobs", "tools", "echo", "suffix", "response_format", "presence_penalty", "stream_options"])), ANY,
    min_size=1, max_size=2), one_in=3)


def field(valid, odd, any_shape: bool):
    """A field's values: valid ones (edges included), odd ones of its type, and (any_shape) anything."""
    return mostly(valid, st.one_of(odd, ANY) if any_shape else odd)


def sampling_fields(any_shape: bool) -> dict:
    """The fields chat and completions share."""
    meta = st.fixed_dictionaries({}, optional={"capture": st.one_of(st.booleans(), TEXT, INTS), "tenant": TEXT,
                                               "domain": TEXT, "head": st.sampled_from(["v1", "v2", "v7", "none"])})
    return {
        "max_tokens": field(st.one_of(st.integers(1, MAX_TOKENS), st.none()), INTS, any_shape),
        "temperature": field(st.one_of(st.just(0.0), st.floats(0, 2)), FLOATS, any_shape),
        "top_p": field(st.floats(0, 1, exclude_min=True), FLOATS, any_shape),
        "top_k": field(st.one_of(st.integers(0, 100), st.sampled_from([2**31, 2**63 - 1])), INTS, any_shape),
        "seed": field(st.one_of(st.integers(-(2**63), 2**63 - 1), st.none()), INTS, any_shape),
        "stop": field(st.one_of(TEXT.filter(bool), st.lists(TEXT.filter(bool), max_size=4), st.none()),
                      st.one_of(ODD_TEXT, st.lists(st.one_of(TEXT, ODD_TEXT), max_size=6)), any_shape),
        "stream": field(st.booleans(), st.sampled_from(["yes", "true", 0, 1, 2]), any_shape),
        "n": field(st.just(1), INTS, any_shape),
        "metadata": field(st.one_of(meta, st.none()), st.dictionaries(st.text(max_size=6), ANY, max_size=3), any_shape),
        "user": field(st.one_of(TEXT, st.none()), ODD_TEXT, any_shape)}


def message(any_shape: bool):
    part = st.fixed_dictionaries({"type": mostly(st.just("text"), st.sampled_from(["image_url", "Text"])),
                                  "text": mostly(TEXT, ODD_TEXT)})
    return st.fixed_dictionaries(
        {"role": field(st.sampled_from(["system", "user", "assistant", "developer"]),
                       st.sampled_from(["tool", "function", "USER", ""]), any_shape)},
        optional={"content": field(st.one_of(TEXT, st.lists(part, max_size=2)), st.one_of(ODD_TEXT, st.none()),
                                   any_shape),
                  "name": TEXT})


def chat_bodies(any_shape: bool):
    model = field(st.just(MODEL), st.sampled_from(["gpt-9", "", MODEL.upper()]), any_shape)
    messages = field(st.lists(message(any_shape), min_size=1, max_size=3), st.just([]), any_shape)
    body = st.fixed_dictionaries({"model": model, "messages": messages},
                                 optional={**sampling_fields(any_shape), "max_completion_tokens": INTS})
    return st.builds(lambda b, extra: {**extra, **b}, body, UNKNOWN)


def completion_bodies(any_shape: bool):
    prompt = field(st.one_of(TEXT, st.lists(st.integers(0, 63), min_size=1, max_size=6), st.lists(TEXT, max_size=1)),
                   st.one_of(ODD_TEXT, st.lists(st.one_of(st.integers(-2, 70), INTS), max_size=4),
                             st.lists(TEXT, min_size=2, max_size=3), st.just([])), any_shape)
    body = st.fixed_dictionaries({"model": field(st.just(MODEL), st.just("gpt-9"), any_shape), "prompt": prompt},
                                 optional=sampling_fields(any_shape))
    return st.builds(lambda b, extra: {**extra, **b}, body, UNKNOWN)


MALFORMED = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b"1e999", b"NaN", b"\xff\xfe{}",
                     b"[" * 5000 + b"]" * 5000, b"[" * 900 + b"]" * 900, b'{"a":' * 3000 + b"1" + b"}" * 3000,
                     b'{"model": 1' + b"0" * 5000 + b"}", b'{"model": "\\ud800", "messages": []}',
                     '{"model": "\u00e9"}'.encode("latin-1")]),
    ANY.map(lambda v: json.dumps(v).encode()))
CONTENT_TYPES = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=latin-1", ""])
AUTHORIZATION = st.one_of(
    st.sampled_from([f"Bearer {KEY}", f"Bearer {ADMIN}", f"bearer  {KEY} ", "Bearer", "Bearer ", "Basic eA==",
                     f"Bearer {KEY}\u00e9", "Bearer cl\u00e9", "Bearer \u00ff\u00fe", KEY, ""]).map(str.encode),
    st.binary(max_size=16).map(lambda b: b"Bearer " + b.replace(b"\r", b"").replace(b"\n", b"")),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x10FFFF, exclude_categories=("Cs",)), max_size=8).map(
        lambda t: ("Bearer " + t).encode("utf-8")))


def headers(auth: bytes) -> dict:
    return {"Authorization": auth} if auth else {}


# ---- the endpoints ---------------------------------------------------------------------------------
@FUZZ
@given(body=chat_bodies(any_shape=False))
def test_chat_fields_of_their_type_with_odd_values_never_5xx(client, body):
    post(client, "/v1/chat/completions", body)


@FUZZ
@given(body=chat_bodies(any_shape=True))
def test_chat_fields_of_any_shape_never_5xx(client, body):
    post(client, "/v1/chat/completions", body)


@FUZZ
@given(body=st.one_of(completion_bodies(any_shape=False), completion_bodies(any_shape=True)))
def test_completion_bodies_never_5xx(client, body):
    post(client, "/v1/completions", body)


@FUZZ_WIDE
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/admin/swap", "/admin/canary"]),
       raw=MALFORMED, content_type=CONTENT_TYPES)
def test_malformed_bytes_and_content_types_never_5xx(client, path, raw, content_type):
    auth = ADMIN if path.startswith("/admin") else KEY
    r = client.post(path, content=raw, headers={"Authorization": f"Bearer {auth}", "Content-Type": content_type})
    check(r, raw)
    if path.startswith("/v1"):
        assert r.status_code in (400, 404), r.text  # 404: a valid body for another model


@FUZZ_WIDE
@given(path=st.sampled_from(["/v1/models", "/health", "/admin/status", "/v1/chat/completions", "/admin/swap",
                             "/admin/canary", "/v1/nowhere"]),
       method=st.sampled_from(["GET", "POST"]), auth=AUTHORIZATION)
def test_any_authorization_header_on_any_endpoint_never_5xx(client, path, method, auth):
    body = b'{"version": "v7"}' if path.startswith("/admin/") else b"{}"  # never a swap that succeeds
    r = client.request(method, path, content=body if method == "POST" else None, headers=headers(auth))
    check(r, (method, path, auth))
    if path.startswith("/admin") and auth != f"Bearer {ADMIN}".encode():
        assert r.status_code in (401, 403, 405), r.text


@FUZZ_WIDE
@given(path=st.sampled_from(["/admin/swap", "/admin/canary"]),
       body=st.one_of(st.fixed_dictionaries({}, optional={
           "version": st.one_of(st.sampled_from(["v7", "none", "../v1", "v1/../v2", ""]), TEXT, st.none(), ANY),
           "fraction": st.one_of(FLOATS, ANY)}), ANY),
       token=st.sampled_from([None, "nope", ADMIN]))
def test_admin_bodies_with_and_without_the_token_never_5xx(client, path, body, token):
    auth = {} if token is None else {"Authorization": f"Bearer {token}"}
    r = post(client, path, body, auth)
    if token != ADMIN:
        assert r.status_code == (401 if token is None else 403), r.text


def test_the_fuzzed_gateway_still_serves(client):
    """After all of the above (canaries and swaps included), a plain request still decodes."""
    for path, body in (("/admin/canary", {"version": None}), ("/admin/swap", {"version": "v1"})):
        assert client.post(path, json=body, headers=ADMIN_AUTH).status_code == 200
    r = post(client, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5 w9"}],
                                               "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["adaptive_eagle"]["head_version"] == "v1"


def test_a_genuine_server_fault_is_still_a_500(stack):
    """The 4xx answers above are validation, not a net: a replica that fails is a 500 (a server_error event
    inside a stream that already answered 200)."""
    server = stack.server("v1", "faulty")

    def broken(*args, **kw):
        raise RuntimeError("the target fell over")
        yield

    server.backend.stream = broken
    config = ServingConfig(model_name=MODEL, replicas=1, max_tokens_limit=MAX_TOKENS, default_max_tokens=2)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5 w9"}]}
    try:
        with TestClient(create_app(config, [server]), raise_server_exceptions=False) as c:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 500 and r.json()["error"]["code"] == "server_error"
            assert "the target fell over" in r.json()["error"]["message"]
            streamed = c.post("/v1/chat/completions", json={**body, "stream": True})
            assert streamed.status_code == 200 and '"type":"server_error"' in streamed.text
    finally:
        server.close()
