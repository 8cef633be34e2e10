"""``/v1/embeddings`` through the official ``openai`` package against a real engine (tiny random
Llama in float32), pooled as the model's config says: last token (no sentence-transformers
config), and mean (a Pooling module's config, with Matryoshka sizes in config.json). Values are
checked against HF transformers in float64: the final-norm hidden states, pooled, normalized."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from client import AsyncClient, Client, EngineError
from tests.tokenizer_proc.http.server import HttpEngine, http_engine, metrics
from tokenizer_proc.model_info import load_tokenizer

TEXTS = ["The river runs to the sea.", "Embeddings of a tiny random model", "x"]
LONG = "A prompt long enough to fill a few KV pages of sixteen tokens, twice over. " * 3


@pytest.fixture(scope="module", params=["last", "mean"])
def model_dir(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny Llama as is (last-token pooling), or with a sentence-transformers mean Pooling
    module and Matryoshka sizes."""
    if request.param == "last":
        return tiny_llama_dir
    out = tmp_path_factory.mktemp("tiny-mean")
    shutil.copytree(tiny_llama_dir, out, dirs_exist_ok=True)
    st = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"}]  # fmt: skip
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    modes = {
        "pooling_mode_mean_tokens": True,
        "pooling_mode_cls_token": False,
        "pooling_mode_lasttoken": False,
    }
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    return out


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    tmp = tmp_path_factory.mktemp("embed-http")
    # a float32 KV pool too: --kv-cache-dtype auto would keep float16 K/V, which moves the pooled
    # values by ~1e-4, past what the comparison with HF in float64 allows
    args = ("--dtype", "float32", "--kv-cache-dtype", "float32", "--served-model-name", "tiny")
    with http_engine(model_dir, tmp, *args) as e:
        yield e


@pytest.fixture
def oai(engine: HttpEngine) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=engine.v1, api_key="none", max_retries=0, timeout=60.0) as client:
        yield client


def _reference(model_dir: Path, ids: list[int], mean: bool | None = None) -> np.ndarray:
    """HF float64: the final hidden state (after the final norm), pooled, normalized; ``mean`` None:
    pooled as the model's files say (our fixture's sentence-transformers config is mean)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64)
    with torch.no_grad():
        states = model.model(torch.tensor([ids])).last_hidden_state[0]
    mean = (model_dir / "modules.json").exists() if mean is None else mean
    pooled = states.mean(0) if mean else states[-1]
    return (pooled / pooled.norm()).numpy()


def test_values_equal_hf_float64(oai: openai.OpenAI, model_dir: Path) -> None:
    out = oai.embeddings.create(model="tiny", input=TEXTS + [LONG], encoding_format="float")
    tokenizer = load_tokenizer(str(model_dir))
    assert [d.index for d in out.data] == [0, 1, 2, 3] and out.model == "tiny" and out.object == "list"
    for text, datum in zip(TEXTS + [LONG], out.data, strict=True):
        got = np.array(datum.embedding)
        assert got.shape == (64,) and abs(np.linalg.norm(got) - 1) < 1e-9
        np.testing.assert_allclose(got, _reference(model_dir, tokenizer.encode(text)), atol=2e-5)
    lengths = [len(tokenizer.encode(t)) for t in TEXTS + [LONG]]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(lengths)


def test_token_ids_batches_and_base64_agree(oai: openai.OpenAI, engine: HttpEngine, model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(model_dir))
    ids = [tokenizer.encode(t) for t in TEXTS]
    floats = [
        d.embedding for d in oai.embeddings.create(model="tiny", input=TEXTS, encoding_format="float").data
    ]
    by_ids = oai.embeddings.create(model="tiny", input=ids, encoding_format="float").data
    one = oai.embeddings.create(model="tiny", input=ids[0], encoding_format="float").data
    single = oai.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float").data
    np.testing.assert_allclose([d.embedding for d in by_ids], floats, atol=1e-6)
    np.testing.assert_allclose(one[0].embedding, floats[0], atol=1e-6)
    np.testing.assert_allclose(single[0].embedding, floats[1], atol=1e-6)  # batched or alone
    decoded = oai.embeddings.create(model="tiny", input=TEXTS).data  # the package asks for base64
    np.testing.assert_allclose([d.embedding for d in decoded], floats, rtol=1e-6, atol=1e-7)
    raw = httpx.post(engine.v1 + "/embeddings", json={"input": "x", "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, floats[2], rtol=1e-6, atol=1e-7)


def test_the_zmq_client_gets_the_same_vector(oai: openai.OpenAI, engine: HttpEngine) -> None:
    over_http = oai.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float").data[0]
    with Client(engine.engine.endpoint, timeout_s=60) as c:
        reply = c.generate(TEXTS[0], embed=True)
    assert reply.embedding is not None and reply.text == "" and reply.token_ids == []
    np.testing.assert_allclose(reply.embedding, over_http.embedding, atol=1e-6)


def test_the_clients_embed_gives_the_routes_vector(
    oai: openai.OpenAI, engine: HttpEngine, model_dir: Path
) -> None:
    """``Client.embed`` and ``AsyncClient.embed``, of a text and of its token ids, give the vector
    /v1/embeddings gives; an error reply (a token id past the vocabulary) raises EngineError."""
    over_http = oai.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float").data[0]
    ids = load_tokenizer(str(model_dir)).encode(TEXTS[1])
    with Client(engine.engine.endpoint, timeout_s=60) as c:
        got = [c.embed(TEXTS[1]), c.embed(ids)]
        with pytest.raises(EngineError, match="vocab"):
            c.embed([1, 99999999])

    async def embed_async() -> list[list[float]]:
        async with AsyncClient(engine.engine.endpoint, timeout_s=60) as c:
            with pytest.raises(EngineError, match="vocab"):
                await c.embed([99999999])
            return list(await asyncio.gather(c.embed(TEXTS[1]), c.embed(ids)))

    got += asyncio.run(embed_async())
    for vector in got:
        assert isinstance(vector, list) and len(vector) == 64 and abs(np.linalg.norm(vector) - 1) < 1e-9
        np.testing.assert_allclose(vector, over_http.embedding, atol=1e-6)


def test_last_token_pooling_uses_the_prefix_cache(
    oai: openai.OpenAI, engine: HttpEngine, model_dir: Path
) -> None:
    before = metrics(engine.base_url)["rivulet_cached_prompt_tokens_total"]
    first = oai.embeddings.create(model="tiny", input=LONG + "one", encoding_format="float").data[0]
    second = oai.embeddings.create(model="tiny", input=LONG + "one", encoding_format="float").data[0]
    cached = metrics(engine.base_url)["rivulet_cached_prompt_tokens_total"] - before
    np.testing.assert_allclose(first.embedding, second.embedding, atol=1e-6)
    mean = (model_dir / "modules.json").exists()
    assert (cached == 0) if mean else (cached >= 32), "MEAN computes every position; LAST reuses the cache"


def test_dimensions(oai: openai.OpenAI, model_dir: Path) -> None:
    full = np.array(oai.embeddings.create(model="tiny", input="x", encoding_format="float").data[0].embedding)
    same = oai.embeddings.create(model="tiny", input="x", dimensions=64, encoding_format="float").data[0]
    np.testing.assert_allclose(same.embedding, full)
    if not (model_dir / "modules.json").exists():
        with pytest.raises(openai.BadRequestError) as err:
            oai.embeddings.create(model="tiny", input="x", dimensions=16)
        assert isinstance(err.value.body, dict) and err.value.body["param"] == "dimensions"
        return
    cut = np.array(
        oai.embeddings.create(model="tiny", input="x", dimensions=16, encoding_format="float")
        .data[0]
        .embedding
    )
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-9)
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model="tiny", input="x", dimensions=20)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["a", [1, 2]]}, 400, "input"),
        ({"input": [[1, 2], [99999999]]}, 400, "input"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "model": "other"}, 404, "model"),
        ({"input": "x", "colour": 1}, 400, "colour"),
    ],
)
def test_bad_requests(engine: HttpEngine, body: dict[str, object], status: int, param: str) -> None:
    got = httpx.post(engine.v1 + "/embeddings", json=body)
    assert got.status_code == status and got.json()["error"]["param"] == param, got.text


def test_pooling_flag_mean_on_a_model_without_its_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """``--pooling mean`` on the tiny Llama, which has no sentence-transformers config (so ``auto``
    would pool its last token): the vector is HF's mean over every position, not its last one."""
    args = ("--dtype", "float32", "--kv-cache-dtype", "float32", "--pooling", "mean")
    with http_engine(tiny_llama_dir, tmp_path, *args) as e:
        body = {"input": LONG, "encoding_format": "float"}
        before = metrics(e.base_url)["rivulet_cached_prompt_tokens_total"]
        got = [np.array(httpx.post(e.v1 + "/embeddings", json=body).json()["data"][0]["embedding"])]
        got.append(np.array(httpx.post(e.v1 + "/embeddings", json=body).json()["data"][0]["embedding"]))
        cached = metrics(e.base_url)["rivulet_cached_prompt_tokens_total"] - before
    ids = load_tokenizer(str(tiny_llama_dir)).encode(LONG)
    np.testing.assert_allclose(got[0], _reference(tiny_llama_dir, ids, mean=True), atol=2e-5)
    assert not np.allclose(got[0], _reference(tiny_llama_dir, ids, mean=False), atol=1e-2)
    np.testing.assert_allclose(got[1], got[0], atol=1e-6)
    assert cached == 0, "MEAN computes every position, the second time too"
