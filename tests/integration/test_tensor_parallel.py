"""--tp-size 2: every layer split over two worker ranks (gloo all-reduce), on the real launcher.

Greedy outputs equal --tp-size 1's token for token in float64, on random Llama, Qwen2, Qwen3 and
GPT-2 models whose heads divide by 2, through chunked prefill and the prefix cache (prompts share
a prefix); a model whose heads do not divide is refused at start, naming them. A GGUF's blocks
stay blocks on every rank: with the activations of one rank (float32), 2 and 3 ranks' greedy tokens
are one rank's (a near tie may flip, to one rank's second choice: the partial sums of o and down
add in another order), and the embedded model answers alike at 3 ranks on every CPU kind.

Mixtures of experts (Qwen3-MoE, Mixtral) run expert-parallel (each rank its range of the experts,
the router on every rank): 2 and 3 ranks give one rank's tokens in float64 from an HF directory,
and, with the experts kept in their GGUF blocks, in float32 by the same near-tie rule.
"""

from __future__ import annotations

import random
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from client import Client
from gpu_worker.backends.cpu.kind import ENV_VAR
from tests.conftest import TOKENIZER_FILES
from tests.gguf_writer import write_gguf
from tests.gpu_worker.helpers import KINDS
from tests.gpu_worker.test_gguf_weights import TYPES
from tests.gpu_worker.test_tp_moe import tp_moe_config
from tests.integration.engine import launched, running_engine, wait_gone
from tests.models import VOCAB, save_tiny_model

FLAGS = ("--dtype", "float64", "--chunked-prefill-size", "8", "--page-size", "4")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    return [shared + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(4)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gpt2"])
def model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Path:
    out = tmp_path_factory.mktemp(f"tp-{request.param}")
    save_tiny_model(request.param, False, out)
    for name in TOKENIZER_FILES:  # ids below VOCAB decode as SmolLM2's tokens: text is not compared
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, out / name)
    return out


def greedy(model: Path, tmp: Path, *flags: str) -> Iterator[list[int]]:
    with running_engine(model, tmp, *FLAGS, *flags) as engine, Client(engine.endpoint, timeout_s=120) as c:
        for p in prompts():
            yield c.generate(input_ids=p, max_new_tokens=12, temperature=0, ignore_eos=True).token_ids


def test_two_ranks_equal_one(model_dir: Path, tmp_path: Path) -> None:
    """The ranks sum through shared memory (--tp-all-reduce auto, on one machine); the Llama also
    through gloo."""
    reductions = ["auto", "gloo"] if model_dir.name.startswith("tp-llama") else ["auto"]
    (tmp_path / "tp1").mkdir()
    one = list(greedy(model_dir, tmp_path / "tp1"))
    assert len({tuple(t) for t in one}) > 1, "the prompts gave different outputs"
    for how in reductions:
        (tmp_path / how).mkdir()
        two = list(greedy(model_dir, tmp_path / how, "--tp-size", "2", "--tp-all-reduce", how))
        assert two == one, f"--tp-all-reduce {how}"
        used = "shared memory" if how == "auto" else "gloo"
        assert f"tensor-parallel all-reduce: {used}" in (tmp_path / how / "launcher.log").read_text()


def test_heads_that_do_not_divide_are_refused_at_start(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The tiny Llama has 4 heads and 2 KV heads: 3 ranks cannot split them."""
    with (
        pytest.raises(RuntimeError, match="exited"),
        running_engine(tiny_llama_dir, tmp_path, "--tp-size", "3"),
    ):
        pass
    log = (tmp_path / "launcher.log").read_text(errors="replace")
    assert "--tp-size 3 does not divide" in log and "attention heads" in log


@pytest.mark.parametrize("kind", [kind.value for kind in KINDS])
def test_the_embedded_smollm2_at_three_ranks(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """9 heads and 3 KV heads over 3 ranks, its Q4_1 blocks split (float32 activations, as one rank
    has them): the same answer, acting as each CPU kind this CPU runs."""
    monkeypatch.setenv(ENV_VAR, kind)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with (
        running_engine(None, tmp_path, "--tp-size", "3") as engine,
        Client(engine.endpoint, timeout_s=300) as c,
    ):
        out = c.generate(messages=question, max_new_tokens=12, temperature=0)
    assert out.text.startswith("The capital of France is Paris"), out.text
    log = (tmp_path / "launcher.log").read_text(errors="replace")
    assert "gguf Q4_1" in log and "on cpu/float32" in log, "the ranks compute on the file's blocks"


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama of SmolLM2's vocabulary as a GGUF of Q8_0/Q4_1/Q4_0 blocks (q/k/v of
    three types), its tokenizer fields copied from the embedded model's. 12 heads and 6 KV heads of
    16, o's 192 and down's 384 input columns: whole rows and whole blocks of 32 at 2 and 3 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpu_worker.weights.model_files import embedded_gguf_path

    out = tmp_path_factory.mktemp("tp-gguf")
    config = LlamaConfig(vocab_size=49152, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    write_gguf(out / "model.gguf", LlamaForCausalLM(config), TYPES, tokenizer_from=embedded_gguf_path())
    return out / "model.gguf"


Top2 = list[tuple[list[int], list[list[int]]]]  # per prompt: greedy tokens, the top two per position


def greedy_top2(model: Path, tmp: Path, *flags: str) -> Top2:
    """Each prompt's greedy tokens and the two likeliest tokens at each position."""
    tmp.mkdir()
    flags = ("--chunked-prefill-size", "8", "--page-size", "4", *flags)
    with running_engine(model, tmp, *flags) as engine, Client(engine.endpoint, timeout_s=120) as c:
        outs = [c.generate(input_ids=p, max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True,
                           top_logprobs=2) for p in prompts()]  # fmt: skip
    return [(o.token_ids, [t.token_ids for t in o.top_logprobs or []]) for o in outs]


@pytest.fixture(scope="module")
def gguf_one_rank(gguf_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Top2:
    return greedy_top2(gguf_llama, tmp_path_factory.mktemp("tp-gguf-one") / "tp1")


@pytest.mark.parametrize("ranks", [2, 3])
def test_gguf_blocks_ranks_equal_one(
    gguf_llama: Path, gguf_one_rank: Top2, ranks: int, tmp_path: Path
) -> None:
    assert_ranks_equal_one(gguf_llama, gguf_one_rank, ranks, tmp_path, kept="gguf Q8_0+Q4_1+Q4_0")


def assert_ranks_equal_one(model: Path, one: Top2, ranks: int, tmp_path: Path, kept: str) -> None:
    """``ranks`` ranks give ``one`` rank's tokens (``assert_one_ranks_tokens``), every rank ran, and
    the log's weights line says ``kept``: the ranks compute on the blocks, in float32."""
    many = greedy_top2(model, tmp_path / f"tp{ranks}", "--tp-size", str(ranks))
    assert_one_ranks_tokens(one, many)
    log = (tmp_path / f"tp{ranks}" / "launcher.log").read_text(errors="replace")
    assert kept in log and "on cpu/float32" in log, f"the ranks keep the blocks ({kept})"
    assert f"tp{ranks - 1}" in log, f"{ranks} worker ranks ran"


def assert_one_ranks_tokens(one: Top2, many: Top2) -> None:
    """``many`` ranks' greedy tokens are one rank's, but where a near tie flipped (to one rank's
    second choice, the rest following it), in one prompt at most."""
    assert len({tuple(tokens) for tokens, _ in one}) > 1, "the prompts gave different outputs"
    for (want, top2), (got, _) in zip(one, many, strict=True):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            if a != b:  # a near tie flipped: to one rank's second choice, and the rest follows it
                assert b in top2[i], (i, want, got, top2[i])
                break
    same = sum(want == got for (want, _), (got, _) in zip(one, many, strict=True))
    assert same >= len(one) - 1, f"only {same} of {len(one)} prompts gave one rank's tokens"


@pytest.mark.parametrize(("kind", "top_k"), [("qwen3_moe", 4), ("mixtral", 2)])
def test_moe_ranks_equal_one_in_float64(kind: str, top_k: int, tmp_path: Path, smollm2_dir: Path) -> None:
    """An HF directory's experts split 4 + 4 and 3 + 3 + 2 (Qwen3-MoE's top 4: a token's experts
    on several ranks): one rank's tokens at 2 and 3 ranks."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tp_moe_config(kind, top_k)).save_pretrained(model_dir)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, model_dir / name)
    (tmp_path / "tp1").mkdir()
    one = list(greedy(model_dir, tmp_path / "tp1"))
    assert len({tuple(t) for t in one}) > 1, "the prompts gave different outputs"
    for ranks in (2, 3):
        (tmp_path / f"tp{ranks}").mkdir()
        many = list(greedy(model_dir, tmp_path / f"tp{ranks}", "--tp-size", str(ranks)))
        assert many == one, f"--tp-size {ranks}"
        assert f"tp{ranks - 1}" in (tmp_path / f"tp{ranks}" / "launcher.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def gguf_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3-MoE of SmolLM2's vocabulary and tokenizer fields as a GGUF of Q8_0 experts and
    attention (top 4 of 8 experts)."""
    from transformers import AutoModelForCausalLM

    from gpu_worker.weights.model_files import embedded_gguf_path
    from tests.exactness.test_moe import QUANT

    out = tmp_path_factory.mktemp("tp-gguf-moe")
    config = tp_moe_config("qwen3_moe", top_k=4)
    config.vocab_size = 49152
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    write_gguf(out / "model.gguf", model, QUANT, tokenizer_from=embedded_gguf_path())
    return out / "model.gguf"


def test_gguf_moe_blocks_ranks_equal_one(gguf_moe: Path, tmp_path: Path) -> None:
    """Each rank's experts stay in their Q8_0 blocks (the CPU kernels, csrc/moe.c): 2 and 3 ranks
    give one rank's float32 tokens (near ties aside)."""
    one = greedy_top2(gguf_moe, tmp_path / "tp1")
    for ranks in (2, 3):
        assert_ranks_equal_one(gguf_moe, one, ranks, tmp_path, kept="gguf experts 2")


def test_two_nodes_on_one_machine_equal_one_rank(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--nnodes 2 as two launchers on 127.0.0.1 (node 1 holds rank 1 and takes batches over tcp):
    the same tokens as one rank; when the head node stops, node 1 stops by itself, exit code 0."""
    for name in ("one", "head", "node1"):
        (tmp_path / name).mkdir()
    one = list(greedy(tiny_llama_dir, tmp_path / "one"))
    nodes = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}")
    with launched(tiny_llama_dir, tmp_path / "node1", *FLAGS, *nodes, "--node-rank", "1") as node1:
        two = list(greedy(tiny_llama_dir, tmp_path / "head", *nodes))
        pids = node1.wait_ready()  # printed once rank 0 joined: while the head was up
        assert list(pids) == ["gpu_worker.tp1"], pids
        assert node1.proc.wait(30) == 0, node1.log()
        assert not wait_gone(list(pids.values()), 5.0), "node 1's rank outlived the head node"
    assert "the head node stopped" in node1.log()
    assert two == one


def test_two_replicas_of_two_ranks_equal_one_rank(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--dp-size 2 --tp-size 2: two process groups of two ranks each (four workers), the requests
    routed over both replicas; the same tokens as one rank."""
    (tmp_path / "one").mkdir()
    (tmp_path / "dp2tp2").mkdir()
    one = list(greedy(tiny_llama_dir, tmp_path / "one"))
    flags = ("--dp-size", "2", "--tp-size", "2", "--dp-routing", "round_robin")
    with running_engine(tiny_llama_dir, tmp_path / "dp2tp2", *FLAGS, *flags) as engine:
        workers = {name for name in engine.child_pids if name.startswith("gpu_worker")}
        assert workers == {"gpu_worker", "gpu_worker.tp1", "gpu_worker.1", "gpu_worker.1.tp1"}
        with Client(engine.endpoint, timeout_s=120) as c:
            two = [
                c.generate(input_ids=p, max_new_tokens=12, temperature=0, ignore_eos=True).token_ids
                for p in prompts()
            ]
    assert two == one
