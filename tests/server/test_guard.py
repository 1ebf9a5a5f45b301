"""The guard in front of every route: the admin token (or loopback only without one), the API
key, and the checks that hold whatever the tokens (Host, Origin, Content-Type)."""

from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from scripted_engine import ScriptedEngine
from tandem.actors.engine_actor import EngineActor
from tandem.config import ServerConfig
from tandem.server.app import build_app
from tandem.server.guard import Guard, is_loopback, split_host

CHAT = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LIMITS = {"reserve_slack_gib": 0.5}


def scripted(loaded, config):
    engine = ScriptedEngine([11, 12, 13], window=config.engine.window)
    return build_app(config, loaded, engine=EngineActor("engine", make_engine=lambda: engine))


def from_peer(app: web.Application, remote: str) -> None:
    """Every request of ``app`` seems to come from ``remote`` (as seen by the guard and the
    routes): a middleware just inside error_middleware."""

    @web.middleware
    async def peer(request, handler):
        return await handler(request.clone(remote=remote))

    app.middlewares.insert(1, peer)


async def call(server, method, path, *, json=None, data=None, headers=None):
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"http://127.0.0.1:{server.port}{path}", json=json,
                                data=data, headers=headers) as r:
            return r.status, await r.json(content_type=None)


def forced(**extra):
    return {**CHAT, "tandem_forced_output": "ok", **extra}


# -- the admin routes ------------------------------------------------------------------------


async def test_without_an_admin_token_the_admin_routes_answer_only_loopback_clients(
        small_loaded, make_config, serve):
    app = build_app(make_config(allow_forced_output=True), small_loaded)
    async with serve(app) as server:
        status, _ = await call(server, "POST", "/v1/memory/limits", json=LIMITS)
        assert status == 200
        status, _ = await call(server, "POST", "/v1/chat/completions", json=forced())
        assert status == 200

    app = build_app(make_config(allow_forced_output=True), small_loaded)
    from_peer(app, "203.0.113.7")
    async with serve(app) as server:
        status, body = await call(server, "POST", "/v1/memory/limits", json=LIMITS)
        assert status == 403 and body["error"]["code"] == "admin_only"
        status, body = await call(server, "POST", "/v1/chat/completions", json=forced())
        assert status == 403 and body["error"]["code"] == "admin_only"
        # What changes nothing stays open to anyone.
        status, _ = await call(server, "POST", "/v1/chat/completions", json=CHAT)
        assert status == 200
        status, _ = await call(server, "GET", "/v1/memory")
        assert status == 200


async def test_with_an_admin_token_the_admin_routes_need_it_from_any_client(
        small_loaded, make_config, serve):
    app = build_app(make_config(allow_forced_output=True, admin_token="s3cret"), small_loaded)
    from_peer(app, "203.0.113.7")
    async with serve(app) as server:
        status, body = await call(server, "POST", "/v1/memory/limits", json=LIMITS)
        assert status == 401 and body["error"]["code"] == "admin_token_required"
        status, body = await call(server, "POST", "/v1/memory/limits", json=LIMITS,
                                  headers={"Authorization": "Bearer nope"})
        assert status == 403 and body["error"]["code"] == "admin_token_wrong"
        status, body = await call(server, "POST", "/v1/memory/limits", json=LIMITS,
                                  headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and body["limits"]["reserve_slack_gib"] == 0.5
        status, body = await call(server, "POST", "/v1/chat/completions", json=forced())
        assert status == 401
        status, body = await call(server, "POST", "/v1/chat/completions", json=forced(),
                                  headers={"Authorization": "Bearer s3cret"})
        assert status == 200
    # A loopback client needs it too, once it is set.
    app = build_app(make_config(admin_token="s3cret"), small_loaded)
    async with serve(app) as server:
        status, _ = await call(server, "POST", "/v1/memory/limits", json=LIMITS)
        assert status == 401


def test_the_admin_check_reads_the_peer_address_and_compares_tokens_in_constant_time():
    guard = Guard(ServerConfig(admin_token="tok"))
    outside = make_mocked_request("POST", "/v1/memory/limits",
                                  headers={"Authorization": "Bearer tok"})
    with mock.patch("tandem.server.guard.hmac.compare_digest", return_value=True) as compare:
        assert guard.admin_denial(outside) is None
        compare.assert_called_once_with(b"tok", b"tok")
    unset = Guard(ServerConfig())
    far = make_mocked_request("POST", "/v1/memory/limits")
    with mock.patch.object(type(far), "remote", new_callable=mock.PropertyMock,
                           return_value="198.51.100.2"):
        assert unset.admin_denial(far).status == 403
    with mock.patch.object(type(far), "remote", new_callable=mock.PropertyMock,
                           return_value="::1"):
        assert unset.admin_denial(far) is None
    assert is_loopback("127.0.0.1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("10.0.0.1") and not is_loopback(None) and not is_loopback("x")


# -- the API key -----------------------------------------------------------------------------


async def test_an_api_key_guards_every_v1_route_as_the_openai_clients_send_it(
        small_loaded, make_config, serve, sdk):
    import openai

    app = scripted(small_loaded, make_config(api_key="sk-test", admin_token="adm"))
    async with serve(app) as server:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/actors"), ("GET", "/v1/cache/stats")):
            status, body = await call(server, method, path, json=CHAT)
            assert status == 401, path
            assert body["error"]["code"] == "invalid_api_key"
            assert body["error"]["type"] == "invalid_request_error"
        for path in ("/health", "/metrics", "/console"):
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{server.port}{path}") as r:
                    assert r.status == 200, path
        with pytest.raises(openai.AuthenticationError):
            await sdk(server).models.list()  # api_key="none"
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1",
                                    api_key="sk-test", max_retries=0)
        reply = await client.chat.completions.create(**CHAT)
        assert reply.choices[0].finish_reason == "length"
        # The admin token is accepted where the API key is, so one client can carry both.
        status, _ = await call(server, "GET", "/v1/models",
                               headers={"Authorization": "Bearer adm"})
        assert status == 200


# -- what holds whatever the tokens ----------------------------------------------------------


async def test_a_post_from_another_origin_is_403_and_from_the_servers_own_passes(
        small_loaded, make_config, serve):
    app = scripted(small_loaded, make_config())
    async with serve(app) as server:
        own = f"http://127.0.0.1:{server.port}"
        for origin in ("http://evil.example", "null", f"http://127.0.0.1:{server.port + 1}",
                       f"http://localhost:{server.port + 1}", "http://127.0.0.1",
                       f"http://evil.example:{server.port}"):
            status, body = await call(server, "POST", "/v1/chat/completions", json=CHAT,
                                      headers={"Origin": origin})
            assert status == 403, origin
            assert body["error"]["code"] == "cross_origin"
        for origin in (own, f"http://localhost:{server.port}", f"http://[::1]:{server.port}"):
            status, _ = await call(server, "POST", "/v1/chat/completions", json=CHAT,
                                   headers={"Origin": origin})
            assert status == 200, origin
        # A GET is not a cross-site write: the Origin is not checked on it.
        status, _ = await call(server, "GET", "/v1/models",
                               headers={"Origin": "http://evil.example"})
        assert status == 200


async def test_a_post_that_is_not_json_is_415(small_loaded, make_config, serve):
    app = scripted(small_loaded, make_config())
    async with serve(app) as server:
        body = b'{"mem_ceiling_gib": 1}'
        for content_type in ("text/plain", "application/x-www-form-urlencoded",
                             "multipart/form-data; boundary=x", None):
            headers = {"Content-Type": content_type} if content_type else {}
            status, doc = await call(server, "POST", "/v1/memory/limits", data=body,
                                     headers=headers)
            assert status == 415, content_type
            assert doc["error"]["code"] == "unsupported_media_type"
        status, _ = await call(server, "POST", "/v1/chat/completions", data=b'{"x": 1}',
                               headers={"Content-Type": "application/json; charset=utf-8"})
        assert status == 400  # past the guard: the route's own check of the body


async def test_a_host_that_names_another_server_is_421(small_loaded, make_config, serve):
    app = scripted(small_loaded, make_config(allowed_hosts="tandem.lan, Box.Example."))
    async with serve(app) as server:
        port = server.port
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.2", "localhost.evil"):
            status, body = await call(server, "GET", "/v1/models", headers={"Host": host})
            assert status == 421, host
            assert body["error"]["code"] == "misdirected_request"
        for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "[::1]",
                     "tandem.lan", f"box.example:{port}", "LOCALHOST."):
            status, _ = await call(server, "GET", "/v1/models", headers={"Host": host})
            assert status == 200, host


def test_a_wildcard_bind_answers_by_the_address_the_client_reached():
    guard = Guard(ServerConfig(host="0.0.0.0"))
    transport = mock.Mock()
    transport.get_extra_info.return_value = ("192.168.7.9", 8000)
    reached = make_mocked_request("GET", "/health", headers={"Host": "192.168.7.9:8000"},
                                  transport=transport)
    assert guard.check_host(reached) == ("192.168.7.9", 8000)
    other = make_mocked_request("GET", "/health", headers={"Host": "192.168.7.10:8000"},
                                transport=transport)
    with pytest.raises(Exception) as refused:
        guard.check_host(other)
    assert refused.value.status == 421
    assert Guard(ServerConfig(allowed_hosts="*")).check_host(other) is not None
    assert split_host("[::1]:80") == ("::1", 80) and split_host("A.b.:1") == ("a.b", 1)
