"""The KV path in one process, with the real default model: a prefill engine streams layer by
layer (shared memory and TCP) into a decode engine's receiver, which admits the request after
its first token; outputs equal the colocated engine's (greedy, chunked prefill, seeded n > 1
with logprobs, stop at the first token). The receiver takes layers in any order exactly once and
fails transfers that are corrupt, incomplete, duplicated or late."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import zmq
from engines import make_engine, run_all
from synthetic_kv import BS, NB, D, H, L, send_layers, synthetic, wait_event, wait_freed

from engine.cluster import messages as m
from engine.cluster.transfer.receiver import KVReceiver
from engine.cluster.transfer.sender import KVSender
from engine.cluster.transfer.staging import KVLayout, StagingArena, checksum
from engine.cluster.worker.decode_role import DecodeRole
from engine.cluster.worker.prefill_role import PrefillRole
from engine.ipc.wire import params_to_wire
from engine.sampling_params import SamplingParams

PROMPT = list(range(1000, 1000 + 150))
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, logprobs=3, max_tokens=10)


class Pair:
    """A prefill role and a decode role wired as the router would, in one process."""

    def __init__(
        self,
        transport: str,
        prefill_tokens: int = 2048,
        policy: str = "recompute",
        decode_pool: str | None = None,
    ):
        self.arena = StagingArena(64 << 20, shared=transport == "shm")
        self.transport = transport
        self.router: list[m.Message] = []
        self.peer, self.base, mc = "", 0, None
        if transport == "mooncake":
            from engine.cluster.transfer.mooncake import MooncakeEndpoint

            d_mc, mc = MooncakeEndpoint(), MooncakeEndpoint()
            self.peer, self.base = d_mc.address, d_mc.register(self.arena.buf)
            self._keep = d_mc

        def sender(cache, inner):
            return KVSender(cache.kv, cache.block_size, mooncake=mc)

        def receiver(cache, inner):
            return KVReceiver(
                cache.kv,
                cache.block_size,
                self.arena,
                remote_writes=transport != "tcp",
                inner=inner,  # its KV pool, as the decode worker passes it
            )

        # Each engine built with its connector, as a worker builds it.
        self.p_engine = make_engine(max_tokens=prefill_tokens, connector_factory=sender)
        self.d_engine = (
            make_engine(connector_factory=receiver)
            if decode_pool is None
            else pool_engine(decode_pool, receiver)
        )
        self.sender, self.receiver = self.p_engine.connector, self.d_engine.connector
        self.prefill = PrefillRole(self.p_engine, self.sender, "p0", self.router.append)
        self.decode = DecodeRole(self.d_engine, self.receiver, "d0", self.router.append, policy)

    def run(self, rid: str, prompt, params, corrupt=None, timeout=60.0, prefill_prompt=None):
        """``prefill_prompt``: what the prefill worker is told (default: ``prompt``)."""
        wire = params_to_wire(params)
        self.decode.handle(m.DecodeRequest(rid, prompt, wire, 30.0))
        ready = self.router.pop()
        assert isinstance(ready, m.DecodeReady) and ready.error is None
        self.prefill.handle(
            m.PrefillRequest(
                rid,
                prompt if prefill_prompt is None else prefill_prompt,
                wire,
                "d0",
                self.receiver.address,
                self.transport,
                self.arena.path,
                ready.offset,
                ready.nbytes,
                peer_address=self.peer,
                peer_base=self.base,
            )
        )
        while self.p_engine.has_unfinished_requests():
            self.prefill.after_step(self.p_engine.step())
        if corrupt is not None:
            corrupt(self)
        deadline = time.monotonic() + timeout
        while True:  # the receiver thread reports the transfer
            try:
                self.decode.on_transfer(self.receiver.events.get(timeout=0.1))
                break
            except Exception:
                self.decode.check_deadlines()
                assert time.monotonic() < deadline
        while self.d_engine.has_unfinished_requests():
            self.decode.after_step(self.d_engine.step())
        return assemble(self.router, rid, params.n)

    def close(self):
        self.sender.close()
        self.receiver.close()
        self.arena.close()


def pool_engine(spec: str, connector_factory=None):
    from engine.config import CacheConfig, EngineConfig
    from engine.core.llm_engine import LLMEngine

    cache = CacheConfig(num_blocks=256, block_size=16)
    config = EngineConfig(dtype="float32", device="cpu", cache=cache, kv_pool=spec)
    return LLMEngine(config, connector_factory=connector_factory)


def assemble(msgs, rid, n):
    """Tokens and text per choice from the Outputs messages (as the router does)."""
    toks = [[] for _ in range(n)]
    text = ["" for _ in range(n)]
    lps = [[] for _ in range(n)]
    for msg in msgs:
        if isinstance(msg, m.Outputs) and msg.request_id == rid:
            for o in msg.outputs:
                i = o["index"]
                skip = len(toks[i]) - o["offset"]
                toks[i] += o["token_ids"][skip:]
                if o["logprobs"]:
                    lps[i] += [lp[0] for lp in o["logprobs"][skip:]]
                text[i] += o["text"][len(text[i]) - o["text_offset"] :]
    return toks, text, lps


def colocated(params, prompt=PROMPT):
    out = run_all(make_engine(), [prompt], params)[0]
    return (
        [c.token_ids for c in out.outputs],
        [c.text for c in out.outputs],
        [[lp.token_id for lp in c.logprobs] if c.logprobs else [] for c in out.outputs],
    )


@pytest.fixture(scope="module")
def expected():
    return {"greedy": colocated(GREEDY), "seeded": colocated(SEEDED)}


@pytest.mark.slow  # tests/cluster/test_cluster.py covers the default path end to end
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_streamed_kv_matches_colocated(expected, transport):
    pair = Pair(transport, prefill_tokens=64)  # 150 tokens: chunks of 64, 64, 22
    try:
        assert pair.run("g", PROMPT, GREEDY) == expected["greedy"]
        assert pair.run("s", PROMPT, SEEDED) == expected["seeded"]
        # Every prompt token came over the wire (nothing recomputed on the decode side).
        assert pair.d_engine.metrics.computed_prompt_tokens == 0
        # The first request: 3 chunks x 30 layers. The second found 144 tokens in the prefill
        # worker's prefix cache: they left with its only chunk's layers (30 more).
        assert pair.sender.counters["layers_sent"] == 3 * 30 + 30
        assert not any(isinstance(x, m.TransferFailed) for x in pair.router)
        for e in (pair.p_engine, pair.d_engine):
            e.check_integrity()
            assert e.kv.pool.counts().used == 0
        assert pair.arena.used == 0
    finally:
        pair.close()


@pytest.mark.parametrize("policy", ["recompute", pytest.param("fail", marks=pytest.mark.slow)])
def test_corrupt_layer_follows_policy(expected, policy):
    pair = Pair("shm", policy=policy)
    try:
        # A request that ends at its first token never reaches the decode engine; its staging
        # area is freed all the same.
        one = SamplingParams(temperature=0.0, max_tokens=1)
        assert len(pair.run("one", PROMPT[:40], one)[0][0]) == 1
        assert not pair.d_engine.has_unfinished_requests() and pair.arena.used == 0

        corrupt_layer(pair, 3)
        toks, _, _ = pair.run("c", PROMPT, GREEDY)
        failed = [x for x in pair.router if isinstance(x, m.TransferFailed)]
        assert len(failed) == 1 and "layer 3: checksum mismatch" in failed[0].reason
        # The prefill side counts what it passed on as handed over, never as aborted.
        assert pair.p_engine.metrics.finished == {"length": 1, "handed_over": 1}
        if policy == "recompute":
            assert failed[0].recompute
            assert toks == expected["greedy"][0]  # the decode worker prefilled it itself
            assert pair.d_engine.metrics.computed_prompt_tokens == len(PROMPT)
        else:
            assert not failed[0].recompute and toks[0] == expected["greedy"][0][0][:1]
        # Released at the failure, the shared area is freed once the sender's KVDone came.
        deadline = time.monotonic() + 10
        while pair.arena.used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pair.arena.used == 0
        pair.d_engine.check_integrity()
    finally:
        pair.close()


def test_kv_of_another_prompt_is_refused_by_its_seal_and_never_answered(expected):
    """The decode worker was told one prompt, the prefill worker computed another of the same
    length: every layer arrives intact (its checksum passes), but the KVDone's seal covers the
    prompt, the pieces and the first tokens, so the decode worker refuses the transfer and
    recomputes its own prompt; the router then refuses the decode worker's continuation of a
    first token that is not the one the prefill worker sent (cluster/transfer/seal.py)."""
    from types import SimpleNamespace

    from engine.cluster.router.outputs import integrity_problem
    from engine.cluster.router.request import Choice

    other = PROMPT[::-1]
    pair = Pair("tcp", prefill_tokens=64)
    try:
        assert pair.run("ok", PROMPT, GREEDY)[0] == expected["greedy"][0]
        assert not any(isinstance(x, m.TransferFailed) for x in pair.router)  # sealed and kept
        pair.router.clear()
        pair.run("x", PROMPT, GREEDY, prefill_prompt=other)
        failed = [x for x in pair.router if isinstance(x, m.TransferFailed)]
        assert len(failed) == 1 and failed[0].reason.startswith("integrity:"), failed
        assert pair.d_engine.metrics.computed_prompt_tokens > 0  # recomputed (past its cache hit)
        outs = [x for x in pair.router if isinstance(x, m.Outputs)]
        first = [x for x in outs if x.worker_id == "p0"][0].outputs[0]
        decoded = [x for x in outs if x.worker_id == "d0"]
        assert decoded[0].outputs[0]["first"] == expected["greedy"][0][0][0]  # its own prompt's
        assert first["token_ids"][0] != expected["greedy"][0][0][0]  # the other prompt's
        req = SimpleNamespace(choices=[Choice(output_token_ids=list(first["token_ids"]))])
        assert "went on from token" in integrity_problem(req, decoded[0].outputs)
        # A KVDone sealed for other first tokens is refused too.
        t = pair.receiver.expect("y", 4, 30.0, prompt_digest=b"p")
        assert "integrity" in t.seal_problem(m.KVDone("y", 4, t.layout.num_layers, 0, [],
                                                      seal="00" * 16))  # fmt: skip
        pair.receiver.release("y")
        pair.d_engine.check_integrity()
    finally:
        pair.close()


def test_router_refuses_internal_finish_reasons_and_rewritten_tokens():
    from types import SimpleNamespace

    from engine.cluster.router.outputs import integrity_problem
    from engine.cluster.router.request import Choice

    req = SimpleNamespace(choices=[Choice(output_token_ids=[5, 6, 7])])

    def out(**kw):
        return [{"index": 0, "offset": 3, "token_ids": [8], "finish_reason": None, **kw}]

    assert integrity_problem(req, out()) is None
    assert integrity_problem(req, out(first=5, finish_reason="stop")) is None
    for reason in ("handed_over", "stage_done", "abort"):
        assert reason in integrity_problem(req, out(finish_reason=reason))
    assert "went on from token" in integrity_problem(req, out(first=4))
    assert "differ" in integrity_problem(req, out(offset=1, token_ids=[6, 9, 8]))
    assert integrity_problem(req, out(offset=1, token_ids=[6, 7, 8])) is None  # a repeat


def corrupt_layer(pair, layer: int) -> None:
    """From now on, flip a byte of ``layer``'s staged KV just before the receiver checks it."""
    orig = pair.receiver._take_layer

    def take(t, msg):
        if msg.layer == layer:
            pair.arena.buf[t.offset + t.layout.run(layer, 0, 0, 1)[0]] ^= 0xFF
        return orig(t, msg)

    pair.receiver._take_layer = take


def test_constrained_request_streamed_and_recomputed_equals_colocated():
    """A seeded JSON-schema request (n=2): its first tokens are sampled on the prefill side under
    the grammar, the decode side builds its own matchers and feeds them those tokens. Once with
    the KV streamed, once with a corrupt layer, so that the decode side recomputes the prompt:
    both give the colocated tokens, and the output still validates."""
    small = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {"type": "object", "properties": {"n": small, "ok": {"type": "boolean"}}}
    params = SamplingParams(
        temperature=1.0, seed=9, n=2, logprobs=1, max_tokens=40, structured_outputs={"json": schema}
    )
    prompt = PROMPT[:40]
    want = colocated(params, prompt)
    pair = Pair("shm")
    try:
        assert pair.run("streamed", prompt, params) == want
        assert pair.d_engine.metrics.computed_prompt_tokens == 0
        corrupt_layer(pair, 3)
        assert pair.run("recomputed", prompt, params) == want
        (failed,) = [x for x in pair.router if isinstance(x, m.TransferFailed)]
        # Recomputed here (the blocks its prefix cache kept from the first run aside).
        assert failed.recompute and pair.d_engine.metrics.computed_prompt_tokens > 0
        for text in want[1]:
            assert set(json.loads(text)) <= {"n", "ok"}
        pair.d_engine.check_integrity()
    finally:
        pair.close()


def test_decode_side_saves_the_blocks_it_generates_to_its_own_pool():
    """--kv-pool on a decode worker: the blocks it completes while decoding go to its tiers
    (the prompt's came over the wire and are the prefill worker's to save)."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = PROMPT[:40]  # blocks 0-1 full after prefill; 2-3 fill up while decoding
    want = colocated(params, prompt)
    pair = Pair("tcp", decode_pool="dram=16MiB")
    try:
        assert pair.run("g", prompt, params) == want
        assert pair.d_engine.metrics.computed_prompt_tokens == 0  # the KV came over TCP
        assert pair.d_engine.connector is pair.receiver
        assert pair.receiver.inner.flush()
        dram = pair.receiver.stats()["tiers"]["dram"]
        assert dram["blocks"] == 2  # blocks 2 and 3: tokens 32-63
        assert pair.d_engine.metrics_snapshot().kv_pool["tiers"]["dram"]["blocks"] == 2
        pair.d_engine.check_integrity()
    finally:
        pair.close()
    assert pair.receiver.inner is None  # closed with the receiver


# -- the receiver alone, with synthetic layers ---------------------------------------------------

CHUNKS = [(layer, a, b) for layer in range(L) for a, b in ((0, 5), (5, 9), (9, 10))]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("seed, first", [(0, 0), (1, 0), (2, 6)])
def test_every_layer_once_in_any_order(transport, seed, first):
    """first: tokens the decode side holds already (its prefix cache); the rest is loaded."""
    kv, arena, rx = synthetic(transport)
    try:
        t = rx.expect("r", 10, 30.0)
        full = send_layers(rx, arena, t, CHUNKS, seed, inline=transport == "tcp")
        assert wait_event(rx) == "r" and t.ok, t.error
        if transport == "tcp":  # received from the frames into the staging area, in its layout
            staged = arena.view(t.offset, t.layout.nbytes).view(torch.float32)
            assert torch.equal(staged.view(L, 2, 10, H, D), full[:L, :, :10])
        rx.admit("r", ["r"])

        class Req:
            request_id, num_tokens = "r", 11

        assert rx.lookup(Req, [], first) == 10 - first
        table = [5, 2, 7]  # tokens 0-3 -> block 5, 4-7 -> 2, 8-9 -> 7
        rx.start_load(Req, table, first, 10 - first)
        (done,) = rx.finished_loads()
        assert done.num_tokens == 10 - first and done.error is None
        for tok in range(10):
            blk, off = table[tok // BS], tok % BS
            want = full[:L, :, tok] if tok >= first else torch.zeros_like(full[:L, :, tok])
            assert torch.equal(kv[:, :, blk, off], want), tok
        assert arena.used == 0
    finally:
        rx.close()
        arena.close()


@pytest.mark.parametrize(
    "chunks, tamper, words",
    [
        (CHUNKS + [(1, 5, 9)], None, "delivered twice"),
        (CHUNKS + [(2, 3, 6)], None, "delivered twice"),
        ([c for c in CHUNKS if c != (2, 5, 9)], None, "layer 2 is missing"),
        (CHUNKS, (1, 5), "layer 1: checksum mismatch"),
        (CHUNKS + [(3, 0, 5)], None, "layer 3 is out of range"),
        (CHUNKS + [(0, 9, 11)], None, "out of range"),
    ],
)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_bad_transfers_fail(transport, chunks, tamper, words):
    kv, arena, rx = synthetic(transport)
    try:
        t = rx.expect("r", 10, 30.0)
        send_layers(rx, arena, t, chunks, 0, inline=transport == "tcp", tamper=tamper)
        assert wait_event(rx) == "r"
        assert not t.ok and words in t.error
        rx.release("r")
        wait_freed(arena)  # freed once the sender's KVDone came (not before)
    finally:
        rx.close()
        arena.close()


@pytest.mark.parametrize(
    "sizes, words",
    [
        ([32, 32], "frames of [32, 32] bytes for 2 x 64"),  # short: truncated rows
        ([64, 96], "frames of [64, 96] bytes for 2 x 64"),  # long: would overrun the area
        ([64], "frames of [64] bytes"),  # V missing
        ([64, 64, 8], "frames of [64, 64, '?'] bytes"),  # a frame too many
    ],
)
def test_tcp_frames_of_the_wrong_size_fail_and_stay_in_their_area(sizes, words):
    """A TCP layer is received straight into its staging area: frames of the wrong size or count
    end the transfer, nothing is written past the area, and the receiver keeps serving."""
    kv, arena, rx = synthetic("tcp")
    try:
        t = rx.expect("r", 2, 30.0)  # 2 tokens x 32 bytes per K (or V) row set: 64 bytes
        other = rx.expect("o", 2, 30.0)
        staged = arena.view(other.offset, other.layout.nbytes)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(rx.address)
        frames = [bytes([7]) * n for n in sizes]
        head = m.encode(m.KVLayer("r", 0, 0, 2, checksum(*frames), True))[0]
        push.send_multipart([head, *frames])
        assert wait_event(rx) == "r"
        assert not t.ok and words in t.error, t.error
        rest = arena.view(t.offset, t.layout.nbytes)[128:]  # past layer 0's K and V rows
        assert int(rest.count_nonzero()) == 0 and int(staged.count_nonzero()) == 0
        push.close()
        send_layers(rx, arena, other, [(layer, 0, 2) for layer in range(L)], 0, True, rid="o")
        assert wait_event(rx) == "o" and other.ok, other.error
    finally:
        rx.close()
        arena.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_sender_killed_mid_transfer_fails_it_at_once(transport):
    # A prefill worker SIGKILLed after the router has its first token takes its unsent layers
    # and KVDone with it; the decode side must not wait for the (long) transfer deadline.
    kv, arena, rx = synthetic(transport)
    sender = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t = rx.expect("r", 10, 600.0, sender_pid=sender.pid, sender_local=True)
        far = rx.expect("f", 10, 600.0, sender_pid=sender.pid, sender_local=False)
        assert rx.expire(time.monotonic()) == []  # alive: keep waiting
        sender.kill()
        sender.wait(timeout=10)
        assert rx.expire(time.monotonic()) == ["r"]
        assert not t.ok and "is gone" in t.error, t.error
        assert not far.finished  # another host's process cannot be watched from here
        rx.release("r")
        rx.release("f")
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(timeout=10)
        rx.close()
        arena.close()


@pytest.mark.parametrize("ending", ["deadline", "source gone"])
def test_recompute_without_kvdone_goes_on_from_the_first_token_the_client_saw(ending):
    # The prefill worker's KVDone never arrives (it died, or its KVDone was late, after the
    # router had relayed its first token to the client). The decode worker recomputes the prompt
    # and must go on from that first token (the router's FirstTokens), not sample its own: with
    # unseeded sampling the continuation would follow a token the client never saw. The
    # transfer ends at its deadline, or at once when the router says the prefill worker died
    # (SourceGone: across hosts the decode worker cannot watch that process itself).
    pair = Pair("shm")
    params = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True)  # unseeded
    rid, wire = "lost", params_to_wire(params)
    deadline = 0.2 if ending == "deadline" else 600.0
    try:
        pair.sender.finish = lambda request_id, done: None  # the KVDone is lost
        pair.decode.handle(m.DecodeRequest(rid, PROMPT, wire, deadline))
        ready = pair.router.pop()
        pair.prefill.handle(
            m.PrefillRequest(
                rid,
                PROMPT,
                wire,
                "d0",
                pair.receiver.address,
                "shm",
                pair.arena.path,
                ready.offset,
                ready.nbytes,
            )  # fmt: skip
        )
        while pair.p_engine.has_unfinished_requests():
            pair.prefill.after_step(pair.p_engine.step())
        (first,) = [x for x in pair.router if isinstance(x, m.Outputs)]
        pair.decode.first_tokens(m.FirstTokens(rid, first.outputs))  # as the router relays it
        if ending == "deadline":
            time.sleep(0.3)
            pair.decode.check_deadlines()
        else:
            pair.decode.check_deadlines()
            assert not any(isinstance(x, m.TransferFailed) for x in pair.router)  # still waiting
            pair.decode.source_gone(m.SourceGone(rid, "p0"))
            pair.decode.on_transfer(pair.receiver.events.get(timeout=5))
        (failed,) = [x for x in pair.router if isinstance(x, m.TransferFailed)]
        assert failed.recompute
        assert ("deadline" if ending == "deadline" else "prefill worker p0 died") in failed.reason
        while pair.d_engine.has_unfinished_requests():
            pair.decode.after_step(pair.d_engine.step())
        deltas = [x for x in pair.router if isinstance(x, m.Outputs) and x.worker_id == "d0"]
        assert deltas[0].outputs[0]["offset"] == 1  # it did not sample a first token of its own
        toks, _, _ = assemble(pair.router, rid, 1)
        assert len(toks[0]) == 8 and toks[0][0] == first.outputs[0]["token_ids"][0]
        assert pair.d_engine.metrics.computed_prompt_tokens == len(PROMPT)
        pair.d_engine.check_integrity()
    finally:
        pair.close()


def test_first_tokens_that_are_not_first_tokens_are_ignored():
    from engine.cluster.worker.decode_role import seen_first

    good = {"index": 1, "offset": 0, "token_ids": [7], "text": "ab", "finish_reason": None,
            "logprobs": [[7, -0.5, [[7, -0.5]]]]}  # fmt: skip
    want = {"index": 1, "token": 7, "logprob": [7, -0.5, [[7, -0.5]]], "sent_text_len": 2,
            "finish_reason": None, "generator": False}  # fmt: skip
    assert seen_first(good, 2) == want
    assert seen_first({**good, "logprobs": [[1, 2]]}, 2)["logprob"] is None
    for bad in ({**good, "index": 2}, {**good, "offset": 1}, {**good, "token_ids": []},
                {**good, "token_ids": [-1]}, {**good, "token_ids": "7"}, {**good, "text": None},
                "not a dict"):  # fmt: skip
        assert seen_first(bad, 2) is None, bad


def test_deadline_expires_and_shm_area_waits_for_sender():
    kv, arena, rx = synthetic("shm")
    try:
        t = rx.expect("r", 10, 0.05)
        time.sleep(0.1)
        assert rx.expire(time.monotonic()) == ["r"]
        assert "deadline" in t.error
        rx.release("r")
        assert arena.used > 0  # the prefill worker might still write: quarantined
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(rx.address)
        push.send_multipart(m.encode(m.KVAbort("r", "gave up")))
        push.close(linger=5000)
        wait_freed(arena)
    finally:
        rx.close()
        arena.close()


def test_arena_allocator_merges_free_runs():
    arena = StagingArena(1024, shared=False)
    a, b, c = (arena.alloc(256) for _ in range(3))
    assert arena.alloc(512) is None
    arena.free(b)
    arena.free(a)
    assert arena.alloc(512) == 0
    arena.free(0)
    arena.free(c)
    assert arena.used == 0 and arena.alloc(1024) == 0
    arena.close()
    assert KVLayout(2, 3, 8).run(1, 1, 1, 3) == (((1 * 2 + 1) * 3 + 1) * 8, 16)


@pytest.mark.parametrize("start, end", [(0, 10), (3, 10), (4, 8), (1, 3), (5, 12), (0, 12)])
def test_gather_and_scatter_tokens_by_blocks_and_tokens(start, end):
    from engine.cluster.transfer.staging import gather_tokens, scatter_tokens

    kv = torch.randn(L, 2, NB, BS, H, D)
    table = torch.tensor([6, 1, 3], dtype=torch.long)
    tok = torch.arange(start, end)
    slots = table[tok // BS] * BS + tok % BS
    want = kv.view(L, 2, NB * BS, H, D)[:, :, slots]
    got = torch.empty(L, 2, end - start, H, D)
    for layer in range(L):
        for k in (0, 1):
            gather_tokens(kv[layer, k], table, start, end, got[layer, k])
    assert torch.equal(got, want)
    dst = torch.zeros_like(kv)
    scatter_tokens(got, dst, table, start)
    assert torch.equal(dst.view(L, 2, NB * BS, H, D)[:, :, slots], want)
    assert torch.count_nonzero(dst) == torch.count_nonzero(want)  # nothing else written


@pytest.mark.slow
def test_mooncake_transfer_engine_matches_colocated(expected):
    pytest.importorskip("mooncake.engine")
    pair = Pair("mooncake", prefill_tokens=64)
    try:
        assert pair.run("g", PROMPT, GREEDY) == expected["greedy"]
        assert pair.d_engine.metrics.computed_prompt_tokens == 0
        assert not any(isinstance(x, m.TransferFailed) for x in pair.router)
    finally:
        pair.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sender_streamed_and_not_streamed(transport):
    """The sender as the engine drives it: layers from the forward's hook (inference mode), or all
    after the prefill (streaming off, outside it), reusing the streamed sends' buffers."""
    from engine.cluster.transfer.sender import SendTarget
    from engine.kv_connector.base import StepBlocks

    kv, arena, rx = synthetic(transport)
    cache = torch.randn(L, 2, NB, BS, H, D)
    sender = KVSender(cache, BS)
    table = [5, 2, 7]

    class Req:
        request_id = "x"
        num_computed_tokens = 0

    try:
        for rid, stream in (("a", True), ("b", False), ("c", True), ("d", False)):
            t = rx.expect(rid, 10, 30.0)
            Req.request_id = rid
            layout = KVLayout(L, 10, H * D * 4)
            sender.add(SendTarget(rid, rid, rx.address, transport, arena.path, t.offset, layout,
                                  stream_layers=stream))  # fmt: skip
            step = [StepBlocks(Req, list(range(10)), table)]
            with torch.inference_mode():  # the model's forward
                for layer in range(L):
                    sender.save_layer(layer, step)
            sender.finish(rid, m.KVDone(rid, 10, L, 0, [{"index": 0, "token": 1}]))
            assert wait_event(rx) == rid and t.ok, t.error
            rx.admit(rid, [])  # nothing to load: frees the area
        assert sender.counters["layers_sent"] == 4 * L
    finally:
        sender.close()
        rx.close()
        arena.close()


def test_a_new_staging_arena_removes_those_of_dead_workers_only():
    """A SIGKILLed worker cannot unlink its staging file; the next arena made on the host does,
    and leaves a live process's alone."""
    import os
    import subprocess
    import sys

    from engine.cluster.transfer.staging import ARENA_PREFIX

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = f"/dev/shm/{ARENA_PREFIX}{dead.pid}-0badc0de"
    live = f"/dev/shm/{ARENA_PREFIX}{os.getpid()}-0badc0de"
    for path in (orphan, live):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        arena = StagingArena(1 << 20)
        try:
            assert not os.path.exists(orphan)
            assert os.path.exists(live)
        finally:
            arena.close()
    finally:
        for path in (orphan, live):
            if os.path.exists(path):
                os.unlink(path)
