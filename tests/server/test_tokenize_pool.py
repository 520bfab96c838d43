"""Request preparation off the event loop (tokenize_pool.py): a long prompt is tokenized on a worker
thread while the server keeps answering, and a prompt whose length in characters alone proves
it too long for the context is refused before it is tokenized."""

from __future__ import annotations

import threading
import time

import httpx
from serverutil import MAX_MODEL_LEN


def test_prompt_too_long_by_its_characters_is_refused_at_once(http):
    prompt = "x" * (15 * 1024 * 1024)  # 15 MB, under the 16 MiB body limit
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt"
    assert "characters" in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    messages = [{"role": "user", "content": prompt}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_health_is_answered_while_a_long_prompt_is_tokenized(server):
    """Ordering, not timing: /health (sent while a 4 MB text is being tokenized) answers before
    the tokenization does. On the event loop, it could only answer after."""
    done: list[str] = []

    def tokenize() -> None:
        text = "hello world, this is some text. " * 125_000  # 4 MB: seconds of tokenizing
        r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=120)
        assert r.status_code == 200 and r.json()["count"] > 500_000
        done.append("tokenize")

    t = threading.Thread(target=tokenize)
    t.start()
    time.sleep(0.8)  # the body is sent and tokenizing has begun
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    done.append("health")
    t.join(120)
    assert done == ["health", "tokenize"]
