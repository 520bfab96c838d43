"""The engine's values as plain msgpack-able maps, one way each, for every socket that carries
them: sampling parameters (the RPC server's requests, the router's requests to its workers),
completion outputs and their logprobs (the RPC server's replies, the cluster's ``Outputs`` and
``KVDone`` entries).

A logprob is ``[token_id, logprob, [[token_id, logprob], ...]]`` (the top alternatives). An
output is ``{"index", "text", "token_ids", "finish_reason", "stop_reason", "logprobs"}``, a delta
or cumulative; the cluster's entries add ``offset`` and ``text_offset``, where in the choice's
tokens and text the delta starts.
"""

from __future__ import annotations

import dataclasses

from engine.errors import RequestError
from engine.outputs import CompletionOutput, TokenLogprob
from engine.sampling_params import SamplingParams

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "extra")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_NULLABLE = ("seed", "logprobs", "prompt_logprobs", "structured_outputs")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def params_to_wire(p: SamplingParams) -> dict:
    """Every field but ``extra``, tuples as lists, the structured-output constraint as the map
    of its set fields (StructuredOutputs.to_dict)."""
    d = {f: getattr(p, f) for f in _PARAM_FIELDS}
    d["stop"], d["stop_token_ids"] = list(p.stop), list(p.stop_token_ids)
    so = p.structured_outputs
    d["structured_outputs"] = None if so is None else so.to_dict()
    return d


def params_from_wire(raw: object) -> SamplingParams:
    """SamplingParams from an untrusted map (None: the defaults). Unknown keys and wrong types
    are RequestErrors naming the field and the type it needs; SamplingParams checks the ranges."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise RequestError(f"params must be a map, got {type(raw).__name__}", "params")
    unknown = sorted(str(k) for k in raw if k not in _PARAM_FIELDS)
    if unknown:
        raise RequestError(f"params has unknown fields: {', '.join(unknown)}", "params")
    for name, value in raw.items():
        if value is None and name in _NULLABLE:
            continue
        if name in _BOOL_FIELDS and not isinstance(value, bool):
            raise RequestError(
                f"{name} must be a boolean, got {value!r} ({type(value).__name__})", name
            )
        if name in _INT_FIELDS and not _is_int(value):
            raise RequestError(
                f"{name} must be an integer, got {value!r} ({type(value).__name__})", name
            )
        if name in _FLOAT_FIELDS and not (_is_int(value) or isinstance(value, float)):
            raise RequestError(
                f"{name} must be a number, got {value!r} ({type(value).__name__})", name
            )
    stop = raw.get("stop", [])
    if not isinstance(stop, str) and not (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        raise RequestError(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    ids = raw.get("stop_token_ids", [])
    if not (isinstance(ids, list) and all(_is_int(t) for t in ids)):
        raise RequestError(
            f"stop_token_ids must be a list of integers, got {ids!r}", "stop_token_ids"
        )
    so = raw.get("structured_outputs")
    if so is not None and not isinstance(so, dict):
        raise RequestError(
            f"structured_outputs must be a map, got {type(so).__name__}", "structured_outputs"
        )
    return SamplingParams(**raw)


def logprob_to_wire(lp: TokenLogprob | None) -> list | None:
    if lp is None:
        return None
    return [lp.token_id, lp.logprob, [[t, v] for t, v in lp.top.items()]]


def logprob_from_wire(raw: list | None) -> TokenLogprob | None:
    if raw is None:
        return None
    tid, value, top = raw
    return TokenLogprob(int(tid), float(value), {int(t): float(v) for t, v in top})


def output_to_wire(c: CompletionOutput, delta: bool = True, offsets: bool = False) -> dict:
    """One choice's output: this step's delta or (``delta=False``) all of it; ``offsets``: with
    where the delta starts in the choice's tokens and text (the cluster drops a repeated one)."""
    lps = c.new_logprobs if delta else c.logprobs
    out = {
        "index": c.index,
        "text": c.new_text if delta else c.text,
        "token_ids": list(c.new_token_ids if delta else c.token_ids),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "logprobs": None if lps is None else [logprob_to_wire(lp) for lp in lps],
    }
    if offsets:
        out["offset"] = len(c.token_ids) - len(c.new_token_ids)
        out["text_offset"] = len(c.text) - len(c.new_text)
    return out
