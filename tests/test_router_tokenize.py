"""An instance's `POST /tokenize` (for routers' local-prefill choice), on the scripted
engine of test_server_app (one token per character)."""

from __future__ import annotations

from test_server_app import serve_app

from pdserve.config import ServerConfig


def test_tokenize_counts_completion_and_chat_prompts() -> None:
    with serve_app(ServerConfig()) as srv:
        c = srv.client
        assert c.post("/tokenize", json={"prompt": "hello"}).json() == {"count": 5}
        assert c.post("/tokenize", json={"prompt": [1, 2, 3]}).json() == {"count": 3}
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert c.post("/tokenize", json=chat).json() == {"count": len("<user>hi<assistant>")}
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
        assert ok.json() == {"count": 1}
