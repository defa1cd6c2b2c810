"""What the gateway's HTTP API refuses, and how (nesa_node/gateway/app.py, requests.py, handlers.py, middleware.py):
a prompt bound to pass the context is refused after tokenizing a prefix of it, strings that are not valid Unicode
are a 400 naming their field, as is a field of another JSON type than its own, a model name is quoted safely, API
keys are checked before the body is read, and Starlette's own refusals come in OpenAI's error shape; adapters are
managed with an admin key where the gateway has admin keys."""

from __future__ import annotations

import json
import logging

import pytest

from nesa_node.gateway.app import create_app
from nesa_node.gateway.auth import ApiKeys
from tests.support.gateway import asgi_request, error_of, fake_gateway

CONTEXT = 64  # tokens: the fake model's context, so that 32 characters a token allow prompts of 2048 characters


@pytest.mark.parametrize("chat", [False, True])
async def test_a_prompt_far_past_the_context_is_refused_after_tokenizing_a_prefix(chat):
    gateway = fake_gateway(max_length=CONTEXT)
    prompt = "a " * 1000  # 2000 characters, 1000 tokens: within the characters allowed, far past the context
    body = (
        {"model": "m", "messages": [{"role": "user", "content": prompt}]} if chat else {"model": "m", "prompt": prompt}
    )
    answer = await asgi_request(
        create_app(gateway), "POST", "/v1/chat/completions" if chat else "/v1/completions", body
    )
    assert answer["status"] == 400
    error = error_of(answer)
    assert error["code"] == "context_length_exceeded" and error["param"] == ("messages" if chat else "prompt")
    assert f"the model's context of {CONTEXT} holds" in error["message"]
    # 4 then 8 characters a token of the context: never the whole prompt
    assert gateway.tokenizer.tokenized == [4 * CONTEXT, 8 * CONTEXT]


async def test_a_long_prompt_that_fits_is_tokenized_whole():
    gateway = fake_gateway(max_length=CONTEXT)
    prompt = "abcdefghi " * 40  # 400 characters, past the first prefix's 256, in 40 tokens: it fits
    answer = await asgi_request(create_app(gateway), "POST", "/v1/completions", {"model": "m", "prompt": prompt})
    assert answer["status"] == 200, answer["body"]
    assert gateway.tokenizer.tokenized == [4 * CONTEXT, len(prompt)]
    assert answer["body"].count(b'"prompt_tokens":40') == 1


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": "m", "prompt": "hi \ud800"}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": ["ok \udfff"]}, "prompt.0"),
        ("/v1/completions", {"model": "x\ud800", "prompt": "hi"}, "model"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "stop": ["ok", "\ud800"]}, "stop.1"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "\udfff"}]}, "messages.0.content"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "ok"}, {"role": "user",
         "content": [{"type": "text", "text": "a\ud800b"}]}]}, "messages.1.content.0.text"),
    ],
)  # fmt: skip
async def test_a_lone_surrogate_is_a_400_naming_its_field(path, body, param, caplog):
    with caplog.at_level(logging.ERROR):
        answer = await asgi_request(create_app(fake_gateway()), "POST", path, body)  # JSON escapes it: "\ud800"
    assert answer["status"] == 400, answer["body"]
    error = error_of(answer)
    assert error["code"] == "invalid_unicode" and error["param"] == param and f"`{param}`" in error["message"]
    assert "Traceback" not in caplog.text and not caplog.records


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/completions", {"max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 5.0}, "max_tokens"),
        ("/v1/completions", {"stream": "yes"}, "stream"),
        ("/v1/completions", {"stream": 1}, "stream"),
        ("/v1/completions", {"temperature": True}, "temperature"),
        ("/v1/completions", {"temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"seed": False}, "seed"),
        ("/v1/completions", {"prompt": 7}, "prompt.str"),
        ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content.str"),
    ],
)  # fmt: skip
async def test_a_field_of_another_json_type_is_a_400_not_read_as_one(path, change, param):
    """As OpenAI's schema: true is not 1, "5" and 5.0 are not the integer 5, "yes" and 1 are not true; each is a 400
    naming its field, where a lax reading would have run a generation other than the one asked for."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 2} if path == "/v1/completions" else {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}  # fmt: skip
    answer = await asgi_request(create_app(fake_gateway()), "POST", path, {**body, **change})
    assert answer["status"] == 400, answer["body"]
    assert error_of(answer)["param"] == param
    ints = await asgi_request(create_app(fake_gateway()), "POST", path, {**body, "temperature": 0})
    assert ints["status"] == 200  # an integer where a number is asked for is that number


async def test_an_unknown_model_name_is_quoted_escaped_and_cut():
    name = "\x1b[31mred\n" + "y" * 5000
    answer = await asgi_request(create_app(fake_gateway()), "POST", "/v1/completions", {"model": name, "prompt": "hi"})
    assert answer["status"] == 404
    error = error_of(answer)
    assert error["code"] == "model_not_found" and len(error["message"]) < 300
    assert "`\\x1b[31mred\\nyyy" in error["message"] and "\x1b" not in error["message"]


async def test_an_api_key_is_checked_before_the_body_is_read():
    app = create_app(fake_gateway(api_keys=ApiKeys(["sk-a"])))
    answer = await asgi_request(app, "POST", "/v1/completions", b'{"model":')
    assert answer["status"] == 401 and error_of(answer)["code"] == "invalid_api_key"
    assert answer["reads"] == 0  # nothing of the body received
    answer = await asgi_request(app, "POST", "/v1/completions", b'{"model":', headers={"Authorization": "Bearer sk-a"})
    assert answer["status"] == 400 and "not valid JSON" in error_of(answer)["message"]
    answer = await asgi_request(app, "GET", "/health")  # open without a key
    assert answer["status"] == 200


async def test_starlettes_own_refusals_come_in_openais_shape():
    app = create_app(fake_gateway())
    answer = await asgi_request(app, "GET", "/v1/nothing-here")
    assert answer["status"] == 404
    error = error_of(answer)
    assert error["code"] == "not_found" and error["type"] == "invalid_request_error"
    assert "/v1/nothing-here" in error["message"] and "/v1/chat/completions" in error["message"]
    answer = await asgi_request(app, "GET", "/v1/completions")
    assert answer["status"] == 405 and error_of(answer)["code"] == "method_not_allowed"
    assert answer["headers"]["allow"] == "POST"


@pytest.mark.parametrize("user_keys", [True, False], ids=["with-api-keys", "open-v1"])
async def test_admin_keys_alone_manage_adapters_from_anywhere(user_keys):
    """With admin keys, loading and unloading adapters takes one of them (403 `permission_error` for a user's key or
    none, from this machine too) and works from any address; an admin key is an API key for the rest of /v1."""
    app = create_app(fake_gateway(api_keys=ApiKeys(["sk-user"]) if user_keys else None, admin_keys=ApiKeys(["sk-op"])))
    user, admin = {"Authorization": "Bearer sk-user"}, {"Authorization": "Bearer sk-op"}
    remote = ("192.0.2.7", 40000)
    for headers in (user, {}):
        for path, body in (("/v1/adapters/unload", {"name": "x"}), ("/v1/adapters/load", {"name": "x", "path": "x"})):
            answer = await asgi_request(app, "POST", path, body, headers=headers)
            status, error = answer["status"], error_of(answer)
            if user_keys and not headers:
                assert status == 401 and error["code"] == "invalid_api_key", answer
            else:
                assert status == 403 and error["type"] == "permission_error", answer
                assert "admin keys" in error["message"]
    # refused before the body is read, which the app would otherwise read and parse first
    answer = await asgi_request(app, "POST", "/v1/adapters/load", b'{"name":', headers=user if user_keys else {})
    assert answer["status"] == 403 and answer["reads"] == 0
    # past the checks: no adapter of that name to unload, and no --adapter-dir to load from
    answer = await asgi_request(app, "POST", "/v1/adapters/unload", {"name": "x"}, headers=admin, client=remote)
    assert answer["status"] == 404 and error_of(answer)["code"] == "adapter_missing"
    load = {"name": "x", "path": "x"}
    answer = await asgi_request(app, "POST", "/v1/adapters/load", load, headers=admin, client=remote)
    assert answer["status"] == 403 and "--adapter-dir" in error_of(answer)["message"]
    answer = await asgi_request(app, "POST", "/v1/completions", {"model": "m", "prompt": "hi"}, headers=admin)
    assert answer["status"] == 200, answer["body"]
    if user_keys:
        answer = await asgi_request(app, "POST", "/v1/completions", {"model": "m", "prompt": "hi"}, headers=user)
        assert answer["status"] == 200, answer["body"]
        answer = await asgi_request(app, "POST", "/v1/completions", {"model": "m", "prompt": "hi"})
        assert answer["status"] == 401


async def test_without_admin_keys_any_api_key_manages_adapters_and_without_keys_only_this_machine():
    keyed = create_app(fake_gateway(api_keys=ApiKeys(["sk-user"])))
    answer = await asgi_request(
        keyed, "POST", "/v1/adapters/unload", {"name": "x"}, headers={"Authorization": "Bearer sk-user"},
        client=("192.0.2.7", 40000),
    )  # fmt: skip
    assert answer["status"] == 404
    open_app = create_app(fake_gateway())
    answer = await asgi_request(open_app, "POST", "/v1/adapters/unload", {"name": "x"}, client=("192.0.2.7", 40000))
    assert answer["status"] == 403 and "this machine only" in error_of(answer)["message"]
    assert (await asgi_request(open_app, "POST", "/v1/adapters/unload", {"name": "x"}))["status"] == 404


async def test_more_messages_than_the_context_has_tokens_are_refused_before_the_template_renders_them():
    """Each message is a token of the rendered prompt at least: a chat of more messages than the context has tokens
    (empty ones, which the characters' pre-check does not count) is refused before any template runs or any
    tokenizer reads them; past MAX_MESSAGES the request does not even validate."""
    from nesa_node.gateway.requests import MAX_MESSAGES

    gateway = fake_gateway(max_length=CONTEXT)
    app = create_app(gateway)
    answer = await asgi_request(
        app, "POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user"}] * 65}
    )
    assert answer["status"] == 400
    error = error_of(answer)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"65 messages: more than the model's context of {CONTEXT} tokens" in error["message"]
    assert gateway.tokenizer.tokenized == []
    many = {"model": "m", "messages": [{"role": "user"}] * (MAX_MESSAGES + 1)}  # 1.1 MB: within a long context's body
    answer = await asgi_request(create_app(fake_gateway(max_length=4096)), "POST", "/v1/chat/completions", many)
    assert answer["status"] == 400 and error_of(answer)["param"] == "messages", answer


@pytest.mark.parametrize("path", ["x\u0000y", "x\ud800"], ids=["nul", "lone-surrogate"])
async def test_an_adapter_path_the_file_system_cannot_take_is_a_400(path, tmp_path):
    app = create_app(fake_gateway(adapter_dir=str(tmp_path)))
    body = json.dumps({"name": "x", "path": path}).encode()
    answer = await asgi_request(app, "POST", "/v1/adapters/load", body)
    assert answer["status"] == 400, answer
    assert error_of(answer)["param"].startswith("path") or "path" in error_of(answer)["message"], answer


async def test_under_a_root_path_adapters_still_take_an_admin_key():
    """Mounted under a root path (uvicorn --root-path, or inside another app) the request's path is the prefixed one,
    which the middleware's check before the body does not match: the route checks the admin key itself."""
    app = create_app(fake_gateway(api_keys=ApiKeys(["sk-user"]), admin_keys=ApiKeys(["sk-op"])))

    async def mounted(scope, receive, send):
        await app({**scope, "path": "/api" + scope["path"], "root_path": "/api"}, receive, send)

    user, admin = {"Authorization": "Bearer sk-user"}, {"Authorization": "Bearer sk-op"}
    answer = await asgi_request(mounted, "POST", "/v1/adapters/unload", {"name": "x"}, headers=user)
    assert answer["status"] == 403 and "admin keys" in error_of(answer)["message"], answer
    answer = await asgi_request(mounted, "POST", "/v1/adapters/unload", {"name": "x"}, headers=admin)
    assert answer["status"] == 404 and error_of(answer)["code"] == "adapter_missing", answer
