"""The C decode-attention kernel: against a float64 reference, inside the runner against HF, and the
fallback to torch when no compiler works."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.backend import CpuBackend
from gpu_worker.backends.cpu.kind import CpuKind, requested_kind
from gpu_worker.backends.cpu.matmul import CpuLinear
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.layers import Linear, RMSNorm, apply_rotary
from tests.gpu_worker.helpers import KINDS, MiniScheduler, save_tiny_model
from tests.gpu_worker.test_models import hf_greedy, make_prompts, run_scenario

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernel"
)


def _kernels() -> cpu_kernels.CpuKernels:
    kernels = cpu_kernels.load(requested_kind())
    assert kernels is not None, "a C compiler is on PATH, so the kernel must build"
    return kernels


# Every build this CPU runs, up to the kind the worker acts as (RIVULET_CPU_KIND or native).


@needs_compiler
def test_builds_take_the_path_of_their_kind() -> None:
    """Each kind's build reports the ISA its -march selects; AVX-512 without BF16 runs the AVX2 build."""
    isa = {kind: cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind).isa for kind in KINDS}
    assert isa[CpuKind.PORTABLE] == cpu_kernels.ISA_PORTABLE
    for kind, code in isa.items():
        assert code == cpu_kernels.BUILDS[kind][1], kind
    assert _kernels().kind == requested_kind()


# (q and out, KV cache): a model's own dtype, and float32 activations over a 16-bit cache
# (--kv-cache-dtype); the reference reads the cache as stored, so only the kernel's sums differ.
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float16),
]
DTYPE_IDS = [f"{str(a).removeprefix('torch.')}-kv-{str(b).removeprefix('torch.')}" for a, b in DTYPES]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One row's attention in float64: q [Hq, D] over k, v [L, Hkv, D] (GQA by repeat)."""
    group = q.shape[0] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v64 = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.double()[:, None], k64, v64)[:, 0]


def assert_rows_attend(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    lens: list[int],
) -> None:
    """Row r of ``out`` is q[r]'s attention over the first lens[r] positions of page_table row r."""
    tol = 1e-5 if out.dtype == torch.float32 else 2e-2
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        locs = page_table[r, pos // page_size] * page_size + pos % page_size
        torch.testing.assert_close(
            out[r].double(), reference(q[r], k_cache[locs], v_cache[locs]), rtol=tol, atol=tol
        )


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [
        (9, 3, 64), (8, 2, 64), (4, 4, 16), (6, 2, 80), (4, 1, 128), (4, 2, 128), (8, 4, 256), (20, 1, 64),
        (8, 2, 512), (32, 4, 512),
    ],
)  # fmt: skip
# 256: Gemma's heads; 512: Gemma 4's global heads, the kernel's MAX_HEAD_DIM, (32, 4, 512) at MAX_QUERY_WIDTH;
# (8, 2, 64) and (4, 2, 128): q and the values' sums held in registers (4 and 2 query heads a KV head);
# (20, 1, 64): a KV head's 20 query heads met 8, 8, then 4 (held)
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_attention_matches_float64(
    kernels: cpu_kernels.CpuKernels,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
) -> None:
    """Lengths around the 16-position block (AVX-512) and 64-position chunk (portable), head sizes
    that fill whole vectors and one that does not (80), scattered pages, strided q, and rows written
    only where asked (the others keep their sentinel)."""
    torch.manual_seed(0)
    lens = [1, 5, 16, 17, 63, 64, 65, 200]
    req_pool_idx = [3, 0, 6, 2, 5, 1, 8, 7]
    q_rows = [0, 2, 3, 5, 6, 8, 9, 10]  # rows 1, 4, 7 of q/out are not decode rows
    pages_per_request = -(-max(lens) // page_size)
    num_pages = 9 * pages_per_request + 3
    k_cache = torch.randn(num_pages * page_size, kv_heads, head_dim).to(kv_dtype)
    v_cache = torch.randn(num_pages * page_size, kv_heads, head_dim).to(kv_dtype)
    page_table = torch.zeros(10, pages_per_request + 2, dtype=torch.int64)
    page_table[:9, :pages_per_request] = torch.randperm(num_pages)[: 9 * pages_per_request].view(9, -1)
    qkv = (torch.randn(11, heads + 2 * kv_heads, head_dim) * 3).to(dtype)  # peaky softmax rows too
    q = qkv[:, :heads]  # rows strided like the model's fused qkv output
    out = torch.full((11, heads, head_dim), 7.0, dtype=dtype)
    as_i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    kernels.decode_attention(
        q, k_cache, v_cache, out, as_i64(q_rows), as_i64(req_pool_idx), as_i64(lens), page_table, page_size
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for row, idx, n in zip(q_rows, req_pool_idx, lens, strict=True):
        pos = torch.arange(n)
        locs = page_table[idx, pos // page_size] * page_size + pos % page_size
        ref = reference(q[row], k_cache[locs], v_cache[locs])
        torch.testing.assert_close(out[row].double(), ref, rtol=tol, atol=tol)
    assert (out[[1, 4, 7]] == 7.0).all(), "rows that are not decode rows stay untouched"


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("lens", [[1000], [2], [40, 333], [17, 1, 260]])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 80), (8, 4, 256), (8, 2, 512)]
)
def test_few_rows_split_their_positions(
    kernels: cpu_kernels.CpuKernels,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    lens: list[int],
    threads: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    """Fewer rows than twice the threads: each row's positions run in parts (AVX2 and portable
    builds), merged by their softmax sums. Scores peaky and far apart between the parts (the first
    positions' keys large), so a wrong weight of a part shows; the new K/V land first (NaN before)
    and only the part that holds the last position reads them."""
    torch.manual_seed(3)
    page_size = 16
    pages_per_row = -(-max(lens) // page_size)
    k_cache = torch.randn(len(lens) * pages_per_row * page_size, kv_heads, head_dim)
    k_cache[::7] *= 4  # some positions dominate their part's softmax
    k_cache, v_cache = k_cache.to(kv_dtype), torch.randn_like(k_cache).to(kv_dtype)
    page_table = torch.randperm(len(lens) * pages_per_row).view(len(lens), pages_per_row).contiguous()
    qkv = (torch.randn(len(lens), heads + 2 * kv_heads, head_dim) * 2).to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    last = [page_table[r, (n - 1) // page_size] * page_size + (n - 1) % page_size for r, n in enumerate(lens)]
    for loc in last:
        k_cache[loc], v_cache[loc] = float("nan"), float("nan")
    out = torch.empty(len(lens), heads, head_dim, dtype=dtype)
    ids = torch.arange(len(lens))
    rows = kernels.decode_rows(ids, ids, torch.tensor(lens), page_table, page_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.attend(q, k_cache, v_cache, out, rows, new_kv=(k, v))
    finally:
        torch.set_num_threads(before)
    for r in range(len(lens)):
        assert torch.equal(k_cache[last[r]], k[r].to(kv_dtype)) and torch.equal(
            v_cache[last[r]], v[r].to(kv_dtype)
        )
    assert_rows_attend(out, q, k_cache, v_cache, page_table, page_size, lens)


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefix", [3, 300])
# (32, 4, 512): 4 positions of a verify row a task (their 8 heads' sums fill MAX_QUERY_WIDTH), or 1 (all 32)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 4, 256), (32, 4, 512)])
def test_a_verify_rows_positions_read_each_others_new_kv(
    kernels: cpu_kernels.CpuKernels,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    threads: int,
    prefix: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    """A verify row's tokens as adjacent decode rows of one request (position p attends [0, p]), beside
    lone decode rows and a second verify row: every row's new K/V land before any row attends (they
    read each other's), and each row attends exactly its own positions (its later ones are NaN when
    it reads, were it to read them)."""
    torch.manual_seed(4)
    page_size = 16
    # (req_pool_idx, kv_len) per row: request 0's verify row of 5 positions, a lone row, request 2's of 3.
    rows = [(0, prefix + 1 + j) for j in range(5)] + [(1, prefix + 40)] + [(2, 7 + j) for j in range(3)]
    pages_per_request = -(-(prefix + 48) // page_size)
    k_cache = torch.randn(3 * pages_per_request * page_size, kv_heads, head_dim).to(kv_dtype)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(3 * pages_per_request).view(3, pages_per_request).contiguous()
    qkv = torch.randn(len(rows), heads + 2 * kv_heads, head_dim).to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    locs = [page_table[s, (n - 1) // page_size] * page_size + (n - 1) % page_size for s, n in rows]
    for loc in locs:
        k_cache[loc], v_cache[loc] = float("nan"), float("nan")
    out = torch.empty(len(rows), heads, head_dim, dtype=dtype)
    req_pool_idx = torch.tensor([s for s, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    decode = kernels.decode_rows(torch.arange(len(rows)), req_pool_idx, lens, page_table, page_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.attend(q, k_cache, v_cache, out, decode, new_kv=(k, v))
    finally:
        torch.set_num_threads(before)
    for r, loc in enumerate(locs):
        assert torch.equal(k_cache[loc], k[r].to(kv_dtype)) and torch.equal(v_cache[loc], v[r].to(kv_dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for r, (idx, n) in enumerate(rows):
        pos = torch.arange(n)
        at = page_table[idx, pos // page_size] * page_size + pos % page_size
        expected = reference(q[r], k_cache[at], v_cache[at])
        torch.testing.assert_close(out[r].double(), expected, rtol=tol, atol=tol)


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (32, 4, 128), (20, 2, 48), (4, 4, 80), (8, 2, 512)]
)
def test_a_row_gives_the_same_bits_alone_and_inside_a_verify_row(
    kernels: cpu_kernels.CpuKernels,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    """A lone decode row (its query heads met a KV head's group at a time, up to 8, each K and V row
    widened once for them) and the same position inside a verify row (each query head on its own) sum
    the same products in the same order: the same bits, whatever the group size (3, 8, 10, 1)."""
    torch.manual_seed(6)
    page_size, n, prefix = 16, 5, 37  # short: a lone row's positions are not split over threads
    pages = -(-(prefix + n) // page_size)
    k_cache = torch.randn(pages * page_size, kv_heads, head_dim).to(kv_dtype)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(pages).view(1, pages).contiguous()
    q = torch.randn(n, heads, head_dim).to(dtype)
    lens = torch.arange(prefix + 1, prefix + 1 + n)
    together = torch.empty(n, heads, head_dim, dtype=dtype)
    verify = kernels.decode_rows(
        torch.arange(n), torch.zeros(n, dtype=torch.int64), lens, page_table, page_size
    )
    kernels.attend(q, k_cache, v_cache, together, verify)
    for j in range(n):
        alone = torch.empty(1, heads, head_dim, dtype=dtype)
        row = kernels.decode_rows(
            torch.arange(1), torch.zeros(1, dtype=torch.int64), lens[j : j + 1], page_table, page_size
        )
        kernels.attend(q[j : j + 1], k_cache, v_cache, alone, row)
        assert torch.equal(alone[0], together[j]), f"position {j}"


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_rows", [2, 9])  # 2: short rows, heads split over threads; 9: a task per row
def test_decode_attention_writes_the_new_kv_first(
    kernels: cpu_kernels.CpuKernels, dtype: torch.dtype, kv_dtype: torch.dtype, num_rows: int
) -> None:
    """With new_kv, each row's K/V land at its last position (strided sources, as the model's fused
    qkv gives them; rounded to a 16-bit cache as torch rounds) before it attends: what was there
    (NaN) is never read."""
    torch.manual_seed(2)
    page_size, heads, kv_heads, head_dim = 4, 6, 2, 32
    lens = [1 + 7 * r for r in range(num_rows)]
    pages_per_row = -(-max(lens) // page_size)
    k_cache = torch.randn(num_rows * pages_per_row * page_size, kv_heads, head_dim).to(kv_dtype)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(num_rows * pages_per_row).view(num_rows, pages_per_row).contiguous()
    qkv = torch.randn(num_rows, heads + 2 * kv_heads, head_dim).to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    last = [page_table[r, (n - 1) // page_size] * page_size + (n - 1) % page_size for r, n in enumerate(lens)]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for r, loc in enumerate(last):
        k_cache[loc], v_cache[loc] = float("nan"), float("nan")
        expected_k[loc], expected_v[loc] = k[r].to(kv_dtype), v[r].to(kv_dtype)
    out = torch.empty(num_rows, heads, head_dim, dtype=dtype)
    ids = torch.arange(num_rows)
    rows = kernels.decode_rows(ids, ids, torch.tensor(lens), page_table, page_size)
    kernels.attend(q, k_cache, v_cache, out, rows, new_kv=(k, v))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert_rows_attend(out, q, k_cache, v_cache, page_table, page_size, lens)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: past the rows where the ops go parallel
def test_small_ops_match_the_torch_code_they_replace(
    kernels: cpu_kernels.CpuKernels, dtype: torch.dtype, rows: int
) -> None:
    """RMSNorm (strided rows, a dim past one 256-element piece, per head), rotary in place (other heads
    untouched), silu * up (magnitudes where exp saturates): bfloat16 bit for bit, float32 to rounding."""
    torch.manual_seed(1)
    same = torch.equal if dtype == torch.bfloat16 else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    wide = torch.randn(rows, 700).to(dtype)
    x, weight = wide[:, 30:606], torch.randn(576).to(dtype)  # rows 700 elements apart
    ref = (
        F.rms_norm(x, weight.shape, weight, 1e-5)
        if dtype == torch.float32
        else weight * F.rms_norm(x.float(), weight.shape, None, 1e-5).to(dtype)
    )
    assert same(kernels.rms_norm(x, weight, 1e-5), ref)

    # RMSNorm per head (Qwen3's q and k norms): [T, heads, dim] views of a token's row, one call
    # in float32 (bfloat16 keeps torch's path: over 64 dims the sums differ in the last bit).
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64).to(dtype)
    heads = torch.randn(rows, 15, 64).to(dtype)[:, 3:12]
    plain = norm(heads)
    norm.fused = kernels
    assert same(norm(heads), plain)

    for width in (64, 512):  # 512: Gemma 4's global heads, the kernel's MAX_HEAD_DIM
        qkv = torch.randn(rows, 15, width).to(dtype)
        cos, signed_sin = torch.randn(rows, 1, width).to(dtype), torch.randn(rows, 1, width).to(dtype)
        rotated = qkv.clone()
        kernels.rotary_(rotated, 12, cos, signed_sin)
        assert same(rotated[:, :12], apply_rotary(qkv[:, :12], cos, signed_sin))
        assert torch.equal(rotated[:, 12:], qkv[:, 12:]), "heads past the rotated ones stay as they were"

    gate_up = (torch.randn(rows, 2 * 601) * 8).to(dtype)  # 601: a partial last vector
    gate_up[0, :4] = torch.tensor([-80.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    assert same(kernels.silu_mul(gate_up), F.silu(gate) * up)
    # Below -87 exp(g) is taken as exp(-87): silu is then -1e-36-ish where torch has -1e-42 or -0.
    far = torch.tensor([[-100.0, -300.0, 300.0, 1.0]]).to(dtype)  # gate (-100, -300) | up (300, 1)
    torch.testing.assert_close(
        kernels.silu_mul(far).float(), (F.silu(far[:, :2]) * far[:, 2:]).float(), atol=1e-30, rtol=0
    )


@needs_compiler
@pytest.mark.parametrize(("n", "k"), [(576, 576), (40, 80), (49152, 64), (7, 3), (33, 600), (7, 100)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 8, 10, 11, 13, 16, 32])  # every split into x-row groups
def test_few_row_matmul_rounds_the_float32_sum_once(
    kernels: cpu_kernels.CpuKernels, m: int, n: int, k: int
) -> None:
    """bf16 x @ W.T (+ bias) (+ residual) against the float64 sum of the same bf16 numbers: within
    one bf16 rounding (plus float32 summation error), with and without the extras; x rows strided."""
    torch.manual_seed(3)
    x, weight = torch.randn(m, k + 5).bfloat16()[:, :k], torch.randn(n, k).bfloat16()
    bias, residual = torch.randn(n).bfloat16(), (torch.randn(m, n + 2) * 4).bfloat16()[:, :n]
    exact = x.double() @ weight.double().T
    for extra_bias, extra_residual in ((None, None), (bias, None), (None, residual), (bias, residual)):
        want = exact.clone()
        want += 0 if extra_bias is None else extra_bias.double()
        want += 0 if extra_residual is None else extra_residual.double()
        got = kernels.matmul(x, weight, extra_bias, extra_residual)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-4 * k**0.5)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (5, 37), (3, 49155)])
def test_argmax_is_torch_max_first_index(
    kernels: cpu_kernels.CpuKernels, dtype: torch.dtype, rows: int, vocab: int
) -> None:
    torch.manual_seed(4)
    wide = torch.randn(rows, vocab + 3).to(dtype)
    logits = wide[:, :vocab]  # strided rows
    logits[0, vocab // 3] = logits[0, vocab - 1] = 99.0  # a tie: the first index
    if rows > 1:  # (not over row 0's tie)
        logits[-1, :] = float("-inf")  # nothing above -inf: index 0, as torch
    assert torch.equal(kernels.argmax(logits), logits.max(dim=-1).indices)


def test_kernel_refuses_shapes_beyond_its_buffers() -> None:
    supports = cpu_kernels.CpuKernels.supports
    assert supports(9, 3, 64, torch.bfloat16)
    assert not supports(9, 3, 64, torch.float64)  # float64 stays on torch
    assert not supports(128, 8, 64, torch.float32)  # more heads than MAX_HEADS
    assert supports(64, 8, 256, torch.float32) and supports(32, 8, 512, torch.float32)  # MAX_QUERY_WIDTH
    assert not supports(8, 8, 1024, torch.float32)  # head_dim beyond MAX_HEAD_DIM
    assert not supports(40, 8, 512, torch.float32)  # heads times head_dim beyond MAX_QUERY_WIDTH
    assert not supports(64, 8, 264, torch.float32)  # 264: 288 floats of a head's whole 32-dimension blocks


@needs_compiler
def test_kernel_call_refuses_what_its_buffers_do_not_hold(kernels: cpu_kernels.CpuKernels) -> None:
    """paged_decode_attention itself refuses a shape past its per-task arrays (RV_ERR_HEADS), writing
    nothing; the widest it takes attends."""
    ids, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([3])
    rows = kernels.decode_rows(ids, ids, lens, torch.zeros(1, 1, dtype=torch.int64), 16)
    for heads, head_dim in ((34, 512), (8, 1024), (32, 512)):
        q, cache = torch.randn(1, heads, head_dim), torch.randn(16, 2, head_dim)
        out = torch.full_like(q, 7.0)
        if supports_it := cpu_kernels.CpuKernels.supports(heads, 2, head_dim, torch.float32):
            kernels.attend(q, cache, cache, out, rows)
            assert_rows_attend(out, q, cache, cache, torch.zeros(1, 1, dtype=torch.int64), 16, [3])
        else:
            with pytest.raises(AssertionError, match="refused \\(RV_ERR_HEADS"):
                kernels.attend(q, cache, cache, out, rows)
            assert (out == 7.0).all()
        assert supports_it == ((heads, head_dim) == (32, 512))


def attends_in_c(runner: ModelRunner) -> bool:
    """Whether the runner's decode rows go to the C attention kernel: the CPU backend, its kernels
    built for the model (else torch attends)."""
    backend = runner.backend
    return isinstance(backend, CpuBackend) and backend.kernels is not None


@pytest.fixture(scope="module")
def float32_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    out = {}
    for kind, tie in (("llama", False), ("qwen3", True), ("gpt2", True)):
        path = tmp_path_factory.mktemp(f"{kind}-kernel")
        out[kind] = (path, save_tiny_model(kind, tie, path))
    return out


@needs_compiler
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("kv_cache_dtype", "atol"), [("float32", 1e-4), ("auto", 3e-2)])
def test_runner_with_kernel_matches_hf(
    float32_models: dict, kind: str, page_size: int, kv_cache_dtype: str, atol: float
) -> None:
    """The whole runner in float32 with the kernel on decode rows: logits of a mixed step within
    1e-4 of HF float64 over a float32 KV cache (3e-2 over auto's float16 one), and with float32 KV
    the same greedy tokens."""
    path, hf = float32_models[kind]
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(path), dtype="float32", kv_cache_tokens=256, page_size=page_size,
            max_running_requests=8, num_threads=1, kv_cache_dtype=kv_cache_dtype,
        )
    )  # fmt: skip
    assert attends_in_c(runner), "float32 on CPU with a compiler: decode rows go to the kernel"
    expected_kv = torch.float32 if kv_cache_dtype == "float32" else torch.float16
    assert runner.kv_dtype == expected_kv, "auto: 16-bit KV where the kernels read it"
    users = [m for m in runner.model.modules() if hasattr(type(m), "fused")]  # type: ignore[attr-defined]
    assert all(m.fused is not None for m in users), "the layers' small ops run in C too"
    assert kind == "gpt2" or any(isinstance(m, RMSNorm) for m in users)  # GPT-2: LayerNorm, gelu
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]  # type: ignore[attr-defined]
    impls = [m.impl for m in linears]
    assert impls and all(isinstance(i, CpuLinear) and i.plain is None for i in impls), "float32: no bf16 copy"
    prompts = make_prompts(seed=5)
    sched = MiniScheduler(runner.num_pages, page_size, shuffle_seed=2)
    got = run_scenario(runner, sched, prompts, hf, atol=atol)
    if kv_cache_dtype == "float32":  # a random tiny model's near-ties flip at 16 bits (embedded: top-2)
        for prompt, tokens in zip(prompts, got, strict=True):
            assert tokens == hf_greedy(hf, prompt)


def test_no_working_compiler_falls_back_to_torch(
    float32_models: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that fails: load() says None (and logs why), and the runner attends with torch."""
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))  # no library built here before
    monkeypatch.setenv("CC", "false")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load(requested_kind()) is None
        path, hf = float32_models["llama"]
        runner = ModelRunner(
            WorkerConfig(model_path=str(path), dtype="float32", kv_cache_tokens=256, num_threads=1)
        )
        assert not attends_in_c(runner)
        prompts = make_prompts(seed=5)
        got = run_scenario(runner, MiniScheduler(runner.num_pages, 16), prompts, hf, atol=1e-4)
        assert got[0] == hf_greedy(hf, prompts[0])
    finally:
        cpu_kernels.load.cache_clear()  # later tests build (or find) the real library again
