"""The served OpenAPI document describes the API (request bodies, every status and content
type), and schemathesis, driven by it against the running server, finds no server error, no
undocumented status and no undocumented content type."""

from __future__ import annotations

import subprocess
import sys

import pytest
from serverutil import http_server


def test_openapi_describes_bodies_and_errors(http):
    doc = http.get("/openapi.json").json()
    paths = doc["paths"]
    schemas = doc["components"]["schemas"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
    ):
        op = paths[path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in schemas
        assert {"400", "413", "429"} <= set(op["responses"]), path
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat)  # served
    assert "functions" not in chat  # refused, not offered
    assert "tools" not in schemas["CompletionRequest"]["properties"]
    for body in ("ChatCompletionRequest", "CompletionRequest"):
        assert {"response_format", "structured_outputs"} <= set(schemas[body]["properties"])
    formats = {
        ref["$ref"].rsplit("/", 1)[1] for ref in chat["response_format"]["anyOf"][0]["oneOf"]
    }
    assert formats == {"TextFormat", "JSONObjectFormat", "JSONSchemaFormat"}
    assert "schema" in schemas["JSONSchemaSpec"]["properties"]
    so = schemas["StructuredOutputsField"]["properties"]
    assert {"json", "json_object", "regex", "choice", "grammar"} <= set(so)
    assert "structural_tag" not in so  # refused, not offered
    gen = paths["/v1/completions"]["post"]["responses"]
    assert set(gen["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"404", "503"} <= set(gen)
    responses = schemas["ResponsesRequest"]["properties"]
    assert {"input", "instructions", "tools", "text", "previous_response_id"} <= set(responses)
    assert "reasoning" not in responses  # refused, not offered
    stored = paths["/v1/responses/{response_id}"]
    assert {"get", "delete"} <= set(stored) and "404" in stored["get"]["responses"]
    assert set(paths["/v1/responses"]["post"]["responses"]["200"]["content"]) == {
        "application/json",
        "text/event-stream",
    }
    assert not paths["/health"]["get"]["responses"]["200"].get("content")
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert http.get("/docs").status_code == 200  # as vLLM: docs on unless disabled


@pytest.mark.slow
def test_schemathesis_finds_nothing():
    """Real bodies generated from the schema: zero 5xx, zero undocumented statuses or content
    types. A small context keeps every valid request short on a CPU."""
    pytest.importorskip("schemathesis")
    from engine.async_llm import AsyncLLM
    from engine.config import CacheConfig, EngineConfig

    llm = AsyncLLM(config=EngineConfig(max_model_len=48, cache=CacheConfig(kv_cache_memory_gb=0.1)))
    try:
        with http_server(llm) as s:
            checks = "not_a_server_error,status_code_conformance,content_type_conformance"
            cmd = [sys.executable, "-m", "schemathesis.cli", "run", s.url + "/openapi.json"]
            cmd += ["--checks", checks, "-n", "10", "--seed", "1", "--request-timeout", "300"]
            cmd += ["--no-color"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    finally:
        llm.close()
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
