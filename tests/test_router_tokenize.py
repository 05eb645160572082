"""An instance's `POST /tokenize` (for routers' local-prefill choice, and clients: the
tokens too) and `POST /detokenize`, on the scripted engine of test_server_app (one token
per character)."""

from __future__ import annotations

from test_server_app import serve_app

from pdserve.config import ServerConfig


def test_tokenize_counts_completion_and_chat_prompts() -> None:
    with serve_app(ServerConfig()) as srv:
        c = srv.client
        hello = c.post("/tokenize", json={"prompt": "hello"}).json()
        assert hello == {"count": 5, "max_model_len": 64, "tokens": [ord(x) for x in "hello"]}
        assert c.post("/tokenize", json={"prompt": [1, 2, 3]}).json()["tokens"] == [1, 2, 3]
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert c.post("/tokenize", json=chat).json()["count"] == len("<user>hi<assistant>")
        assert c.post("/tokenize", json={"prompt": ""}).status_code == 400
        assert c.post("/tokenize", json={"messages": "nope"}).status_code == 400
        assert c.post("/tokenize", content=b"[1]").status_code == 400
        assert srv.fake.seen == []  # nothing reached the engine


def test_tokenize_needs_the_api_key_when_one_is_set() -> None:
    with serve_app(ServerConfig(api_key="k")) as srv:
        assert srv.client.post("/tokenize", json={"prompt": "a"}).status_code == 401
        ok = srv.client.post(
            "/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer k"}
        )
        assert ok.json()["count"] == 1


def test_detokenize_round_trips_and_refuses_bad_ids() -> None:
    with serve_app(ServerConfig()) as srv:
        c = srv.client
        ids = c.post("/tokenize", json={"prompt": "hello"}).json()["tokens"]
        assert c.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "hello"}
        for bad in ({"tokens": [1, "a"]}, {"tokens": [10**6]}, {"tokens": 3}, {}):
            resp = c.post("/detokenize", json=bad)
            assert resp.status_code == 400, bad
            assert resp.json()["error"]["param"] == "tokens"
