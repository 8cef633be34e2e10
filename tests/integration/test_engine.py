"""The real launcher, three real processes, real ZMQ sockets, a tiny random Llama in float64."""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from client import Client, EngineError
from protocol import ClientReply, FinishReason, GenerateOutput
from tests.integration.engine import RunningEngine, pid_alive, running_engine, wait_gone

KV_TOKENS = 1024  # == the tiny model's context, so one leaked page shows up as a request that never fits
NEW_TOKENS = 10


def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Reference: HF transformers' own forward, float64, greedy, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    args = ("--dtype", "float64", "--kv-cache-tokens", str(KV_TOKENS), "--page-size", "16")
    with running_engine(
        tiny_llama_dir, tmp_path_factory.mktemp("engine"), *args, "--chunked-prefill-size", "48"
    ) as e:
        yield e


def _collect(endpoint: str, input_ids: list[int], out: dict[int, list[GenerateOutput]], key: int) -> None:
    with Client(endpoint, timeout_s=120) as client:
        out[key] = list(
            client.generate(
                input_ids=input_ids, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, stream=True
            )
        )


@pytest.mark.timeout(300)
def test_sixteen_concurrent_streams_match_hf(engine: RunningEngine, tiny_llama_dir: Path) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 120))] for _ in range(16)]
    results: dict[int, list[GenerateOutput]] = {}
    threads = [
        threading.Thread(target=_collect, args=(engine.endpoint, p, results, i))
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert sorted(results) == list(range(16)), "every client must finish"
    expected = hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
    for i, chunks in results.items():
        assert chunks[-1].finish_reason == FinishReason.LENGTH
        assert all(c.finish_reason is None for c in chunks[:-1])
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == expected[i], f"request {i} (prompt {len(prompts[i])} tokens)"
        assert chunks[-1].usage is not None
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
            len(prompts[i]),
            NEW_TOKENS,
        )


@pytest.mark.timeout(300)
def test_abort_mid_stream_frees_its_pages(engine: RunningEngine) -> None:
    with Client(engine.endpoint, timeout_s=60) as client:
        stream = client.generate(
            input_ids=list(range(5, 205)),
            max_new_tokens=700,
            temperature=0,
            ignore_eos=True,
            stream=True,
            rid="long",
        )
        for _ in range(3):
            chunk = next(stream)
            assert chunk.finish_reason is None
        client.abort("long")
        tail = list(stream)
        assert tail and tail[-1].finish_reason == FinishReason.ABORT
        # Needs all but one page of the pool: only fits if the aborted request's pages came back.
        big = client.generate(
            input_ids=[7] * (KV_TOKENS - 24), max_new_tokens=8, temperature=0, ignore_eos=True
        )
        assert big.finish_reason == FinishReason.LENGTH
        assert len(big.token_ids) == 8


@pytest.mark.timeout(300)
def test_bad_request_gets_error_while_others_proceed(engine: RunningEngine) -> None:
    with Client(engine.endpoint, timeout_s=60) as good, Client(engine.endpoint, timeout_s=60) as bad:
        stream = good.generate(
            "once upon a time", max_new_tokens=12, temperature=0, ignore_eos=True, stream=True
        )
        first = next(stream)
        for kwargs in ({"temperature": -1.0}, {"top_p": 0.0}, {"max_new_tokens": -3}):
            with pytest.raises(EngineError, match=next(iter(kwargs))):
                bad.generate("hi", **kwargs)
        with pytest.raises(EngineError, match="context"):
            bad.generate(input_ids=[5] * (KV_TOKENS + 10), max_new_tokens=4)
        rest = list(stream)
        assert rest[-1].finish_reason == FinishReason.LENGTH
        assert sum(len(c.token_ids) for c in [first, *rest]) == 12


@pytest.mark.timeout(120)
def test_garbage_frame_is_survived(engine: RunningEngine) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.endpoint)
    try:
        decoder = msgspec.msgpack.Decoder(ClientReply)
        for frame in (
            b"\x00\xffnot msgpack",
            msgspec.msgpack.encode({"type": "generate", "rid": "g", "bogus": 1}),
        ):
            sock.send(frame)
            assert sock.poll(30_000), "the engine must answer a garbage frame"
            reply = decoder.decode(sock.recv())
            assert reply.finish_reason == FinishReason.ERROR and reply.error
        assert reply.rid == "g", "the rid of a parseable map is echoed back"
    finally:
        sock.close()
        ctx.term()
    with Client(engine.endpoint, timeout_s=60) as client:
        out = client.generate("still alive?", max_new_tokens=3, temperature=0, ignore_eos=True)
        assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 3


@pytest.mark.timeout(120)
def test_sigterm_leaves_no_process_behind(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with running_engine(tiny_llama_dir, tmp_path, "--kv-cache-tokens", "512") as e:
        pids = list(e.child_pids.values())
        assert set(e.child_pids) == {"gpu_worker", "tokenizer", "scheduler"}
        assert all(pid_alive(p) for p in pids)
        e.proc.send_signal(signal.SIGTERM)
        assert e.proc.wait(10) == 0  # STOP_GRACE_S + SIGKILL keeps it well inside this
        assert not wait_gone(pids, 1.0), "children outlived the launcher"


@pytest.mark.timeout(180)
def test_killing_the_worker_stops_everything_and_clients_get_an_error(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    with running_engine(tiny_llama_dir, tmp_path, "--kv-cache-tokens", "1024") as e:
        errors: list[BaseException] = []
        streaming = threading.Event()

        def wait_long() -> None:
            try:
                with Client(e.endpoint, timeout_s=60) as client:
                    chunks = client.generate(
                        input_ids=[9] * 50, max_new_tokens=900, temperature=0, ignore_eos=True, stream=True
                    )
                    for _ in chunks:
                        streaming.set()
            except BaseException as exc:  # the assertion below inspects it
                errors.append(exc)

        waiter = threading.Thread(target=wait_long)
        waiter.start()
        # Killed at its first token, not after a fixed sleep: a fast worker finishes 900 tokens in 2 s.
        assert streaming.wait(60), "the request never started streaming"
        import os

        os.kill(e.child_pids["gpu_worker"], signal.SIGKILL)
        assert e.proc.wait(15) != 0
        waiter.join(30)
        assert not waiter.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], EngineError), errors
        assert "gpu_worker" in e.log() and "exited with code" in e.log()
        assert not wait_gone(list(e.child_pids.values()), 5.0)
