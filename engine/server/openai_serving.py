"""The OpenAI completions and chat completions: request -> engine requests -> response bodies.

Knows nothing of HTTP: it returns a dict (a whole response) or an async iterator of server-sent
event bytes, and raises APIError or the engine's own exceptions (mapped in errors.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.errors import RequestError
from engine.model.tokenizer import template_variables
from engine.outputs import CompletionOutput, PromptLogprobs, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.server.completion_logprobs import (
    TextCursor,
    echoed_prompt_logprobs,
    generated_logprobs,
    joined,
)
from engine.server.errors import APIError, to_api_error
from engine.server.openai_protocol import (
    MAX_SEQUENCES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from engine.server.openai_structured import in_field
from engine.server.streams import RequestStreams, check_whole, moved_once
from engine.server.token_text import TokenText, clamp
from engine.server.tokenize_pool import check_prompt_chars
from engine.server.tool_calls import ToolCallStream, calls_json, finish_reason, parse_reply
from engine.structured.tool_parsers import get_parser
from engine.structured.tools import ToolRequest, constraint, detect_format, render_messages

DONE = b"data: [DONE]\n\n"


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


@dataclass
class Job:
    """One API request, resolved: its prompts as token ids and its sampling parameters."""

    chat: bool
    id: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs in the response
    echo: list[str] | None = None  # completions with echo: the prompt texts
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, no generated token
    prompt_logprobs: int | None = None  # vLLM's: per choice (completions) or response (chat)
    cache_salt: str | None = None
    priority: int = 0  # vLLM's: the scheduling policy "priority" serves lower values first
    tools: ToolRequest | None = None  # chat with tools offered: replies are parsed for calls
    constraint_field: str | None = None  # the request field that asked for structured outputs
    created: int = field(default_factory=lambda: int(time.time()))


class OpenAIServing:
    def __init__(self, llm, model_names: list[str], tool_call_parser: str | None = None) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_names = model_names
        # The tool-call format: the chat template's own, or the one named (tools.py).
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_format = tool_call_parser or detect_format(template, template_variables(template))
        self.tool_parser = get_parser(self.tool_format)
        self.text = TokenText(self.tokenizer)

    # -- resolving requests -------------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.model_names:
            return self.model_names[0] if name is None else name
        raise APIError(404, f"The model `{name}` does not exist.", "model")

    def _default_max_tokens(self, prompts: list[list[int]]) -> int:
        return max(1, self.llm.max_model_len - max(len(p) for p in prompts))

    def completion_job(self, req: CompletionRequest) -> Job:
        model = self.check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported by this server", "suffix")
        raw = req.prompts()
        _check_count(len(raw), req.n)
        for p in raw:
            if isinstance(p, str):
                check_prompt_chars(len(p), self.tokenizer, self.llm.max_model_len, "prompt")
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in raw]
        max_tokens, echo_only = req.max_tokens, req.max_tokens == 0 and req.echo
        if max_tokens is None:
            max_tokens = self._default_max_tokens(prompts)
        elif max_tokens == 0 and not req.echo:
            message = "max_tokens must be >= 1 (0 only with echo: the prompt alone), got 0"
            raise APIError(400, message, "max_tokens")
        # echo with max_tokens 0: one token is generated and dropped (as vLLM does).
        params = req.sampling_params(1 if echo_only else max_tokens, req.logprobs)
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in raw]
            if req.logprobs is not None:  # the prompt's logprobs, with as many alternatives
                k = max(req.logprobs, req.prompt_logprobs or 0)
                params = dataclasses.replace(params, prompt_logprobs=k)
        return Job(
            chat=False,
            id=f"cmpl-{uuid.uuid4().hex}",
            model=model,
            prompts=prompts,
            params=params,
            include_usage=req.include_usage,
            top_logprobs=req.logprobs,
            echo=echo,
            echo_only=echo_only,
            prompt_logprobs=req.prompt_logprobs,
            cache_salt=req.cache_salt,
            priority=req.priority,
            constraint_field=req.constraint_field,
        )

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        model = self.check_model(req.model)
        req.check_chat_unsupported()
        tools = req.tool_request()
        prompt = self.render_chat(
            req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools
        )
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = self._default_max_tokens([prompt])
        logprobs = req.engine_logprobs()
        params = req.sampling_params(max_tokens, logprobs)
        if tools is not None:
            params = self._tool_constraint(params, tools)
        return Job(
            chat=True,
            id=f"chatcmpl-{uuid.uuid4().hex}",
            model=model,
            prompts=[prompt],
            params=params,
            include_usage=req.include_usage,
            top_logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            cache_salt=req.cache_salt,
            priority=req.priority,
            tools=tools,
            constraint_field=req.constraint_field or (None if tools is None else "tools"),
        )

    def _tool_constraint(self, params: SamplingParams, tools: ToolRequest) -> SamplingParams:
        """The grammar of the reply's calls (tools.py), added to the request's parameters."""
        try:
            so = constraint(self.tool_format, tools)
        except RequestError as exc:
            raise APIError(400, exc.message, "tools") from None
        if so is None:
            return params
        if params.structured_outputs is not None:
            raise APIError(
                400,
                f"tool_choice {tools.choice!r} constrains the reply itself; it cannot be "
                "combined with response_format or structured_outputs",
                "tool_choice",
            )
        return dataclasses.replace(params, structured_outputs=so)

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        kwargs: dict | None,
        tools: ToolRequest | None = None,
    ) -> list[int]:
        chars = sum(len(m.text()) for m in messages)
        check_prompt_chars(chars, self.tokenizer, self.llm.max_model_len, "messages")
        # Tools, earlier calls and their results: through the template or the generic format.
        dicts, extra = render_messages(
            self.tool_format, [m.as_template_dict() for m in messages], tools
        )
        try:
            text = self.tokenizer.apply_chat_template(
                dicts, add_generation_prompt=add_generation_prompt, **{**(kwargs or {}), **extra}
            )
        except Exception as exc:  # the template rejected the conversation (roles, content ...)
            raise APIError(400, f"messages could not be rendered: {exc}", "messages") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def start(self, job: Job, request_id: str | None = None) -> RequestStreams:
        # More prompts than the server ever admits at once would get a 429 on every retry.
        cap = getattr(self.llm, "max_pending", None)
        if cap is not None and len(job.prompts) > cap:
            raise APIError(
                400,
                f"prompt holds {len(job.prompts)} prompts, more than this server admits at once "
                f"({cap}, --max-pending); send fewer per request",
                "prompt",
            )
        if job.params.structured_outputs is not None:
            await self.compile_grammar(job)
        try:
            return await RequestStreams.start(
                self.llm, job.prompts, job.params, request_id or job.id, job.cache_salt,
                job.priority,
            )  # fmt: skip
        except RequestError as exc:
            # An engine that cannot give prompt logprobs (the cluster router, a pipeline
            # stage): name the field the client sent.
            if exc.param == "prompt_logprobs" and job.prompt_logprobs is None:
                raise APIError(
                    400, f"echo with logprobs needs the prompt's logprobs: {exc.message}", "echo"
                ) from None
            raise

    async def compile_grammar(self, job: Job) -> None:
        """Compile the job's constraint off the event loop before the engine sees it (the
        engine then finds it cached); a 400 naming the field the client sent when it does not
        compile, or not within the compiler's deadline."""
        try:
            await self.llm.compile_grammar(job.params)
        except RequestError as exc:
            field = job.constraint_field
            raise APIError(400, in_field(exc.message, field), field) from None

    # -- whole responses ------------------------------------------------------------------------

    async def full_response(self, job: Job, streams: RequestStreams) -> dict:
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in streams:
                finals[i] = out
        finally:
            await streams.aclose()
        for i in finals:
            check_whole(finals[i], job.id)
        choices = []
        for i in sorted(finals):
            for c in finals[i].outputs:
                choice = self._choice(job, i, c, finals[i].prompt_logprobs)
                if job.prompt_logprobs is not None and not job.chat:
                    choice["prompt_logprobs"] = prompt_logprobs_json(
                        finals[i].prompt_logprobs, job.prompts[i], job.prompt_logprobs
                    )
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        body = {
            "id": job.id,
            "object": "chat.completion" if job.chat else "text_completion",
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "usage": self._usage(job, finals),
        }
        if job.prompt_logprobs is not None and job.chat:  # vLLM puts the chat's on the response
            body["prompt_logprobs"] = prompt_logprobs_json(
                finals[0].prompt_logprobs, job.prompts[0], job.prompt_logprobs
            )
        return body

    def _choice(
        self, job: Job, prompt_index: int, c: CompletionOutput, prompt_lps: PromptLogprobs | None
    ) -> dict:
        index = prompt_index * job.params.n + c.index
        lps = None
        if job.top_logprobs is not None and job.chat and c.logprobs is not None:
            lps = self._chat_logprobs(job, c.logprobs)
        elif job.top_logprobs is not None and (c.logprobs is not None or job.echo is not None):
            cursor = self._cursor(job, prompt_index)
            lps = self._completion_logprobs(job, prompt_index, prompt_lps, c.logprobs, cursor, True)
        out = {"index": index, "logprobs": lps, "finish_reason": c.finish_reason}
        if job.chat and job.tools is not None:
            content, calls = parse_reply(self.tool_parser, c.text, job.tools.parallel)
            out["message"] = {"role": "assistant", "content": content}
            if calls:
                out["message"]["tool_calls"] = calls_json(calls)
            out["finish_reason"] = finish_reason(c.finish_reason, calls)
        elif job.chat:
            out["message"] = {"role": "assistant", "content": c.text}
        else:
            echo = job.echo[prompt_index] if job.echo else ""
            out["text"] = echo if job.echo_only else echo + c.text
        out["stop_reason"] = c.stop_reason
        if job.echo_only:
            out["finish_reason"], out["stop_reason"] = "length", None
        return out

    def _usage(self, job: Job, finals: dict[int, RequestOutput]) -> dict:
        prompt = sum(len(p) for p in job.prompts)
        completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
        completion = 0 if job.echo_only else completion
        cached = sum(out.metrics.num_cached_tokens for out in finals.values() if out.metrics)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # -- streamed responses --------------------------------------------------------------------

    async def stream(self, job: Job, streams: RequestStreams) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per choice that moved, then usage, then [DONE]. An
        error after the headers went out is sent as an error event."""
        finals: dict[int, RequestOutput] = {}
        started: set[int] = set()
        offsets: dict[int, TextCursor] = {}
        tool_streams: dict[int, ToolCallStream] = {}
        ended: set[int] = set()  # choices whose last chunk (with their finish reason) went out
        try:
            async for i, out in streams:
                finals[i] = out
                parts = [
                    sse(self._chunk(job, i, c, started, offsets, tool_streams, out.prompt_logprobs))
                    for c in out.outputs
                    if moved_once(c, i * job.params.n + c.index, ended)
                ]
                if parts:
                    yield b"".join(parts)
        except Exception as exc:
            yield sse(to_api_error(exc).body())
            yield DONE
            return
        finally:
            await streams.aclose()
        if job.include_usage:
            yield sse(self._chunk_head(job, [], usage=self._usage(job, finals)))
        yield DONE

    def _chunk_head(self, job: Job, choices: list, usage: dict | None = None) -> dict:
        out = {
            "id": job.id,
            "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": job.created,
            "model": job.model,
            "choices": choices,
        }
        if job.include_usage:
            out["usage"] = usage
        return out

    def _chunk(
        self,
        job: Job,
        prompt_index: int,
        c: CompletionOutput,
        started: set,
        offsets: dict,
        tool_streams: dict | None = None,
        prompt_lps: PromptLogprobs | None = None,
    ) -> dict:
        index = prompt_index * job.params.n + c.index
        first = index not in started
        started.add(index)
        text = "" if job.echo_only else c.new_text
        lps = None
        if job.top_logprobs is not None and job.chat and c.new_logprobs is not None:
            lps = self._chat_logprobs(job, c.new_logprobs)
        elif job.top_logprobs is not None and (c.new_logprobs is not None or job.echo is not None):
            cursor = offsets.setdefault(index, self._cursor(job, prompt_index))
            lps = self._completion_logprobs(
                job, prompt_index, prompt_lps, c.new_logprobs, cursor, first
            )
        reason = c.finish_reason
        if job.chat and job.tools is not None and tool_streams is not None:
            stream = tool_streams.get(index)
            if stream is None:
                stream = tool_streams[index] = ToolCallStream(self.tool_parser, job.tools.parallel)
            text, calls = stream.feed(text, reason is not None)
            # As OpenAI streams calls: content null until there is some, never "".
            delta = {"role": "assistant", "content": text or None} if first else {}
            if text and not first:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls_json(calls, streamed=True)
            reason = finish_reason(reason, calls)
            choice = {"index": index, "delta": delta}
        elif job.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta}
        else:
            if first and job.echo:
                text = job.echo[prompt_index] + text
            choice = {"index": index, "text": text}
        choice["logprobs"] = lps
        choice["finish_reason"] = reason
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
            if job.echo_only:
                choice["finish_reason"], choice["stop_reason"] = "length", None
        return self._chunk_head(job, [choice])

    # -- logprobs -------------------------------------------------------------------------------

    def _chat_logprobs(self, job: Job, lps: list[TokenLogprob]) -> dict:
        k, text = job.top_logprobs or 0, self.text
        content = []
        for lp in lps:
            top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:k]
            content.append(
                {
                    "token": text.str(lp.token_id),
                    "logprob": clamp(lp.logprob),
                    "bytes": list(text.bytes(lp.token_id)),
                    "top_logprobs": [
                        {"token": text.str(t), "logprob": clamp(v), "bytes": list(text.bytes(t))}
                        for t, v in top
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(
        self,
        job: Job,
        prompt_index: int,
        prompt_lps: PromptLogprobs | None,
        lps: list[TokenLogprob] | None,
        cursor: TextCursor,
        first: bool,
    ) -> dict:
        """A choice's (or a chunk's) legacy logprobs; with echo, the prompt's come first (in a
        choice's first chunk), and an echo with max_tokens 0 drops the generated token's."""
        k = job.top_logprobs or 0
        out = generated_logprobs(self.text, [] if job.echo_only else lps or [], k, cursor)
        if job.echo is not None and first:
            ids, echo = job.prompts[prompt_index], job.echo[prompt_index]
            out = joined(echoed_prompt_logprobs(self.text, ids, prompt_lps, k, echo), out)
        return out

    def _cursor(self, job: Job, prompt_index: int) -> TextCursor:
        """Where a choice's generated text starts: after the echoed prompt, if any."""
        return TextCursor(len(job.echo[prompt_index]) if job.echo is not None else 0)


def prompt_logprobs_json(entries: PromptLogprobs | None, ids: list[int], k: int) -> list | None:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's token (``ids``) and the top ``k`` alternatives (the engine
    computed more when echo with logprobs asked for more)."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {
                "logprob": clamp(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in e.items()
            if lp.rank <= k or t == token_id
        }
        for e, token_id in zip(entries, ids)
    ]


def _check_count(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_SEQUENCES:
        raise RequestError(
            f"prompt count ({num_prompts}) times n ({n}) must be <= {MAX_SEQUENCES}, "
            f"got {num_prompts * n}",
            "prompt",
        )
