"""ONE test with real Ray actors: the gateway serving through two ServerActors (a Ray streaming
generator per request), a hot swap through the actors, and status from the actors' processes."""

import functools

import httpx
import openai

from serving.actor import remote_server_actor
from serving.config import ServingConfig
from serving.gateway import GatewayThread, create_app


def build(registry_root, name):
    """Runs inside the actor's process: the target is built there, the registry opened by path."""
    from adaptive_eagle.registry import HeadRegistry
    from tests.serving.conftest import Stack, make_target

    return Stack(make_target(), HeadRegistry(registry_root)).server("v1", name)


def test_gateway_serves_through_ray_server_actors(ray_session, stack):
    config = ServingConfig(model_name="tiny-eagle", replicas=2, admin_token="t", max_tokens_limit=64,
                           default_max_tokens=16)
    replicas = [remote_server_actor(functools.partial(build, str(stack.registry.root), f"actor-{i}"), f"actor-{i}", num_cpus=0)
                for i in range(2)]
    thread = GatewayThread(create_app(config, replicas))
    url = thread.start()
    try:
        # the timeout only stops a hang: on a loaded machine the actors build their targets slowly
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        msgs = [{"role": "user", "content": "w5 w9 w12 w7 w30"}]
        want = stack.plain_text(msgs, 12).text
        resp = client.chat.completions.create(model="tiny-eagle", messages=msgs, temperature=0, max_tokens=12)
        assert resp.choices[0].message.content == want and resp.adaptive_eagle["replica"].startswith("actor-")
        chunks = list(client.chat.completions.create(model="tiny-eagle", messages=msgs, temperature=0,
                                                     max_tokens=12, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        swap = httpx.post(url + "/admin/swap", json={"version": "v2"}, headers={"Authorization": "Bearer t"},
                          timeout=120)
        assert swap.status_code == 200 and [r["version"] for r in swap.json()["results"]] == ["v2", "v2"]
        after = client.chat.completions.create(model="tiny-eagle", messages=msgs, temperature=0, max_tokens=12)
        assert after.adaptive_eagle["head_version"] == "v2" and after.choices[0].message.content == want
        status = httpx.get(url + "/admin/status", headers={"Authorization": "Bearer t"}, timeout=60).json()
        assert sorted(r["replica"] for r in status["replicas"]) == ["actor-0", "actor-1"]
        assert sum(r["served"] for r in status["replicas"]) == 3
    finally:
        thread.stop()
