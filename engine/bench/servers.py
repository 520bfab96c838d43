"""What the peer benchmarks (profiling/bench_peer.py, profiling/bench_spec.py) share: a server
process started for a run and stopped with its whole group, the thread-count environment every
system gets, the model's GGUF (llama-server loads only those), chat-formatted prompt ids, and one
streamed greedy completion timed as the client sees it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx


def chat_ids(tok, system: str | None, user: str) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


class Server:
    """A server process started for the run and killed (its whole group) when done."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict, log: str) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_healthy(600)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; log {self.log.name}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} not healthy in {timeout:.0f} s; log {self.log.name}")

    def model_id(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def thread_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def gguf_file(model: str) -> str:
    from engine.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if os.path.isdir(path):
        path = os.path.join(path, next(f for f in sorted(os.listdir(path)) if f.endswith(".gguf")))
    if not path.endswith(".gguf"):
        raise SystemExit(f"bench_peer needs a GGUF model (llama-server loads only those): {path}")
    return path


async def stream_completion(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, ignore_eos: bool
) -> dict:
    """One streamed greedy /v1/completions request: time to its first text, end to end, output
    tokens (the usage, else the chunks with text) and the text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, usage, text = None, None, []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                text.append(chunk["choices"][0]["text"])
                if ttft is None:
                    ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    return {"ttft": ttft or e2e, "e2e": e2e, "out": usage or len(text), "text": "".join(text)}
