"""Our models over the paged KV pool equal HF transformers token for token (float64).

One scenario per (model, tie, page size), shaped like real scheduling: whole
prompts, a prompt chunked over three batches, a prompt whose prefix pages are
shared from another request, decode rows mixed with extend rows, non-contiguous
req_pool_idx values and shuffled pages.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol.messages import PENDING
from tests.gpu_worker.helpers import GREEDY, VOCAB, MiniScheduler, save_tiny_model

MODELS = [
    ("llama", True),
    ("llama", False),
    ("qwen2", False),
    ("qwen3", True),
    ("gpt2", True),
    ("mistral", False),
]
NEW_TOKENS = 6
REQ_POOL_IDX = [5, 0, 3, 7, 2]  # request i uses REQ_POOL_IDX[i]
SHARED_TOKENS = 16  # request 4 reuses request 2's first 16 tokens of KV


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], tuple[Path, Any]]:
    out = {}
    for kind, tie in MODELS:
        path = tmp_path_factory.mktemp(f"{kind}-{tie}")
        out[(kind, tie)] = (path, save_tiny_model(kind, tie, path))
    return out


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 6, 19, 40)]
    prompts.append(prompts[2][:SHARED_TOKENS] + [rng.randrange(VOCAB) for _ in range(7)])
    return prompts


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    # An explicit mask: otherwise generate masks every token equal to pad_token_id.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0, len(prompt) :].tolist()


def hf_last_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def run_scenario(
    runner: ModelRunner, sched: MiniScheduler, prompts: list[list[int]], hf: Any, atol: float = 1e-9
) -> list[list[int]]:
    """Drive the runner like a scheduler; check one mixed step's logits against HF; return the tokens."""
    out: list[list[int]] = [[] for _ in prompts]
    rng = random.Random(1)

    def step(
        rows: list[tuple[int, int, list[int], bool, Any]], requests: list[int], check: bool = False
    ) -> None:
        order = list(range(len(rows)))
        rng.shuffle(order)  # row order must not matter
        batch = sched.batch([rows[i] for i in order])
        sampled = [requests[i] for i in order if rows[i][3]]
        if check:
            logits = runner.compute_logits(batch)
            tokens = logits.argmax(-1).tolist()
            for row, r in enumerate(sampled):
                ref = hf_last_logits(hf, prompts[r] + out[r])
                torch.testing.assert_close(logits[row].to(ref.dtype), ref, rtol=0, atol=atol)
        else:
            tokens = runner.execute(batch).token_ids
        assert len(tokens) == len(sampled), "one token per sample row"
        for r, token in zip(sampled, tokens, strict=True):
            out[r].append(token)

    def decode_row(r: int) -> tuple[int, int, list[int], bool, Any]:
        return (REQ_POOL_IDX[r], len(prompts[r]) + len(out[r]) - 1, [out[r][-1]], True, None)

    p = prompts
    step(
        [
            (REQ_POOL_IDX[0], 0, p[0], True, GREEDY),
            (REQ_POOL_IDX[1], 0, p[1], True, GREEDY),
            (REQ_POOL_IDX[2], 0, p[2], True, GREEDY),
            (REQ_POOL_IDX[3], 0, p[3][:16], False, GREEDY),
        ],
        [0, 1, 2, 3],
    )
    step(
        [decode_row(0), decode_row(1), decode_row(2), (REQ_POOL_IDX[3], 16, p[3][16:32], False, None)],
        [0, 1, 2, 3],
    )
    sched.share(REQ_POOL_IDX[2], REQ_POOL_IDX[4], SHARED_TOKENS // sched.page_size)
    step(
        [
            decode_row(0),
            decode_row(1),
            decode_row(2),
            (REQ_POOL_IDX[3], 32, p[3][32:], True, None),
            (REQ_POOL_IDX[4], SHARED_TOKENS, p[4][SHARED_TOKENS:], True, GREEDY),
        ],
        [0, 1, 2, 3, 4],
        check=True,
    )
    while any(len(o) < NEW_TOKENS for o in out):
        live = [r for r in range(len(prompts)) if len(out[r]) < NEW_TOKENS]
        step([decode_row(r) for r in live], live)
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("kind", "tie"), MODELS)
def test_greedy_matches_hf(tiny_models: dict, kind: str, tie: bool, page_size: int) -> None:
    path, hf = tiny_models[(kind, tie)]
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(path),
            dtype="float64",
            kv_cache_tokens=256,
            page_size=page_size,
            max_running_requests=8,
            num_threads=1,
        )
    )
    sched = MiniScheduler(runner.num_pages, page_size, shuffle_seed=page_size)
    prompts = make_prompts(seed=len(kind) + page_size)
    got = run_scenario(runner, sched, prompts, hf)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt)


def test_runner_properties(tiny_models: dict) -> None:
    path, hf = tiny_models[("gpt2", True)]
    runner = ModelRunner(
        WorkerConfig(model_path=str(path), dtype="float64", kv_cache_tokens=100, page_size=16, num_threads=1)
    )
    assert runner.num_pages == 100 // 16
    # The served context: the model's, bounded by what the pool holds (6 pages of 16 tokens).
    assert runner.context_len == min(hf.config.n_positions, 96) == 96
    assert runner.dtype == torch.float64 and runner.device.type == "cpu"
    assert runner.kv.k[0].shape == (runner.num_pages * 16, 4, 16)
    assert runner.kv.page_table.shape == (128, 96 // 16)


def test_rope_theta_from_old_and_new_config_spellings() -> None:
    from types import SimpleNamespace

    from gpu_worker.models.rope import rope_inv_freq

    old = SimpleNamespace(rope_theta=500.0)
    new = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    for cfg in (old, new):
        inv_freq, scaling = rope_inv_freq(cfg, head_dim=8)
        assert scaling == 1.0
        torch.testing.assert_close(inv_freq, 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    with pytest.raises(NotImplementedError):
        rope_inv_freq(SimpleNamespace(rope_parameters={"rope_type": "dynamic", "rope_theta": 1.0}), 8)


def test_decode_rows_grouped_by_length_match_hf(tiny_models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no padding allowance, the scenario's decode rows split into several length groups."""
    from gpu_worker.backends.torch import attention

    monkeypatch.setattr(attention, "PAD_FLOOR_TOKENS", 0)
    groups = attention.length_groups({0: 3, 1: 47, 2: 20, 3: 45})
    assert groups == [[1, 2, 3], [0]], groups  # 3 x 47 pads 29 tokens over 112: allowed; 4 x 47: not
    seen: list[int] = []
    real_length_groups = attention.length_groups
    monkeypatch.setattr(attention, "length_groups", lambda lens: _count(real_length_groups(lens), seen))
    path, hf = tiny_models[("llama", False)]
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(path), dtype="float64", kv_cache_tokens=256, page_size=1, max_running_requests=8,
            num_threads=1,
        )
    )  # fmt: skip
    prompts = make_prompts(seed=11)
    got = run_scenario(runner, MiniScheduler(runner.num_pages, 1, shuffle_seed=3), prompts, hf)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt)
    assert max(seen) >= 2, f"decode groups per batch: {seen}"


def _count(groups: list[list[int]], seen: list[int]) -> list[list[int]]:
    seen.append(len(groups))
    return groups


def test_length_groups_bound_the_padding() -> None:
    from gpu_worker.backends.torch.attention import PAD_FLOOR_TOKENS, length_groups

    rng = random.Random(5)
    lens = {i: rng.choice([rng.randrange(1, 64), rng.randrange(1000, 8000)]) for i in range(128)}
    groups = length_groups(lens)
    assert sorted(r for g in groups for r in g) == list(range(128))
    assert 1 < len(groups) < 20, f"{len(groups)} groups"
    for group in groups:
        real = sum(lens[r] for r in group)
        padded = len(group) * max(lens[r] for r in group)
        assert padded - real <= max(real // 2, PAD_FLOOR_TOKENS), (padded, real)
    assert length_groups({i: 90 + i % 7 for i in range(32)}) == [list(range(32))]


def test_decode_only_metadata_is_the_general_paths() -> None:
    """A batch of decode rows only (the CPU backend's kernel attends them) takes a short path: its
    positions and KV write locations are those the general path gives the same rows beside an
    extend row."""
    from gpu_worker.backends.torch.attention import build_metadata

    page_size, cpu = 4, torch.device("cpu")
    page_table = torch.randperm(6 * 8, generator=torch.Generator().manual_seed(3)).view(6, 8)
    rows, prefix = [4, 0, 2, 5], [0, 9, 13, 30]
    positions, meta = build_metadata(page_table, page_size, rows, prefix, [1] * 4, cpu, kernel_max_extend=16)
    assert positions.tolist() == prefix and meta.decode == () and meta.extends == () and not meta.in_order
    pairs = zip(rows, prefix, strict=True)
    want = [int(page_table[r, p // page_size]) * page_size + p % page_size for r, p in pairs]
    assert meta.out_locs.tolist() == want
    # The general path: the same decode rows after a 20-token extend row (row 1, 3 tokens cached).
    g_positions, g_meta = build_metadata(
        page_table, page_size, [1, *rows], [3, *prefix], [20, *[1] * 4], cpu, kernel_max_extend=16
    )
    assert torch.equal(g_positions[20:], positions) and torch.equal(g_meta.out_locs[20:], meta.out_locs)
    assert g_positions.dtype == positions.dtype and g_meta.out_locs.dtype == meta.out_locs.dtype


@pytest.mark.timeout(600)
def test_compiled_dense_code_matches_hf(tiny_models: dict) -> None:
    """--compile: every layer's compiled forward gives HF's tokens too."""
    path, hf = tiny_models[("qwen3", True)]
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(path), dtype="float64", kv_cache_tokens=256, page_size=16, max_running_requests=8,
            num_threads=1, compile=True,
        )
    )  # fmt: skip
    assert isinstance(runner.model, torch.nn.Module)
    assert not any(p.is_mkldnn for p in runner.model.parameters()), "compiled graphs read plain weights"
    prompts = make_prompts(seed=5)
    # Inductor fuses the float32 norm statistics its own way: equal to ~1e-6, not bit for bit.
    got = run_scenario(runner, MiniScheduler(runner.num_pages, 16, shuffle_seed=2), prompts, hf, atol=1e-5)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt)


def test_pending_inputs_take_the_token_the_request_drew_last(tiny_models: dict) -> None:
    """Overlap scheduling: a decode row sent before its input was drawn carries PENDING."""
    path, hf = tiny_models[("llama", False)]
    runner = ModelRunner(
        WorkerConfig(model_path=str(path), dtype="float64", kv_cache_tokens=256, page_size=4, num_threads=1)
    )
    sched = MiniScheduler(runner.num_pages, 4)
    prompts = make_prompts(seed=3)[:2]
    first = runner.execute(sched.batch([(REQ_POOL_IDX[r], 0, prompts[r], True, GREEDY) for r in range(2)]))
    out = [[token] for token in first.token_ids]
    for _ in range(5):
        rows: list[tuple[int, int, list[int], bool, Any]] = [
            (REQ_POOL_IDX[r], len(prompts[r]) + len(out[r]) - 1, [PENDING], True, None) for r in range(2)
        ]
        for r, token in enumerate(runner.execute(sched.batch(rows)).token_ids):
            out[r].append(token)
    for r in range(2):
        assert out[r] == hf_greedy(hf, prompts[r])[:6]
    with pytest.raises(ValueError, match="PENDING may only be a row's last token"):
        runner.execute(sched.batch([(REQ_POOL_IDX[0], 20, [PENDING, 5], True, None)]))
