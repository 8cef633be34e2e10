"""Benchmark workloads: what each request asks for and when it is sent. Seeded and reproducible.

Five generators, all returning ``WorkItem``s:

- ``repeated_prompt_workload`` (``--workload repeated-prompt``, the default): benchmark_streaming's
  "Hello" prompts, ``--prompt-repeats "512,1,1,1"`` cycling over requests (request i repeats the
  prompt ``repeats[i % len(repeats)]`` times), ``--unique-prompts`` putting "SEED.NUMBER: " first
  so no two prompts share a prefix (nor do two runs with different seeds, which keeps a prefix
  cache from carrying hits between runs).
- ``random_workload``: prompts of random words with exact token lengths drawn uniformly from
  ``[input_len * range_ratio, input_len]`` (outputs likewise).
- ``shared_prefix_workload``: G groups x Q questions; the questions of a group share one
  P-token system prompt; the requests are shuffled.
- ``rewrite_workload`` and ``compose_workload``: chat prompts (the model's chat template) whose
  answers repeat the prompt (a list to repeat with numbers, code to rewrite with one name
  changed) or do not (a short story on a topic): what speculative decoding by n-gram lookup gains
  on, and what it must not lose on. EOS ends them (outputs of one model are the same tokens with
  and without drafts).

Exact lengths: prompts are built from a pool of single-token words (" apple"), which a
byte-level BPE tokenizer encodes back to exactly the same ids, so ``input_ids`` (sent on
ZMQ) and ``text`` (sent over HTTP) are the same prompt.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

WORD = re.compile(r"^ [a-z]{3,12}$")


@dataclass(frozen=True)
class WorkItem:
    """One request: ``text`` always (HTTP sends it), ``input_ids`` when the tokens are exact."""

    text: str
    input_ids: list[int] | None
    max_new_tokens: int
    ignore_eos: bool


class WordPool:
    """Single-token words of a tokenizer that encode back to themselves, for exact-length prompts."""

    def __init__(self, tokenizer_json: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        ids = sorted(self.tokenizer.get_vocab().values())
        texts = self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        candidates = [(i, t) for i, t in zip(ids, texts, strict=True) if WORD.match(t)]
        encoded = self.tokenizer.encode_batch([t for _, t in candidates], add_special_tokens=False)
        self.words = [(i, t) for (i, t), e in zip(candidates, encoded, strict=True) if e.ids == [i]]
        assert len(self.words) >= 100, f"only {len(self.words)} single-token words in {tokenizer_json}"

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def sample(self, rng: random.Random, num_tokens: int) -> tuple[str, list[int]]:
        """A prompt of exactly ``num_tokens`` tokens: (text, ids)."""
        picked = [self.words[rng.randrange(len(self.words))] for _ in range(num_tokens)]
        text = "".join(t for _, t in picked)
        ids = [i for i, _ in picked]
        assert self.encode(text) == ids, "single-token words must encode back to the same ids"
        return text, ids


def parse_repeats(spec: str) -> list[int]:
    """ "512,1,1,1" -> [512, 1, 1, 1]."""
    repeats = [int(x) for x in spec.split(",") if x.strip()]
    assert repeats and all(r >= 1 for r in repeats), f"--prompt-repeats wants positive ints, got {spec!r}"
    return repeats


def repeated_prompt_workload(
    prompt: str,
    repeats: list[int],
    num_requests: int,
    unique: bool,
    max_new_tokens: int,
    ignore_eos: bool,
    seed: int = 0,
) -> list[WorkItem]:
    """roseinfer's benchmark_streaming prompts (text only: the engine tokenizes them)."""
    items = []
    for i in range(num_requests):
        text = " ".join([prompt] * repeats[i % len(repeats)])
        if unique:
            text = f"{seed}.{i}: {text}"
        items.append(WorkItem(text, None, max_new_tokens, ignore_eos))
    return items


def _length(rng: random.Random, full: int, range_ratio: float) -> int:
    assert full >= 1 and 0.0 <= range_ratio <= 1.0, f"bad length {full} / range ratio {range_ratio}"
    return rng.randint(max(1, int(full * range_ratio)), full)


def random_workload(
    pool: WordPool, num_requests: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[WorkItem]:
    """Random-word prompts; every length uniform in [len * range_ratio, len]; EOS ignored."""
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        text, ids = pool.sample(rng, _length(rng, input_len, range_ratio))
        items.append(WorkItem(text, ids, _length(rng, output_len, range_ratio), True))
    return items


def shared_prefix_workload(
    pool: WordPool,
    groups: int,
    questions: int,
    system_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[WorkItem]:
    """``groups * questions`` requests; a group's requests share a ``system_len``-token prefix."""
    rng = random.Random(seed)
    items = []
    for _ in range(groups):
        sys_text, sys_ids = pool.sample(rng, system_len)
        for _ in range(questions):
            q_text, q_ids = pool.sample(rng, question_len)
            items.append(WorkItem(sys_text + q_text, sys_ids + q_ids, output_len, True))
    rng.shuffle(items)
    return items


def arrival_offsets_s(
    num_requests: int, submit_interval_ms: float, request_rate: float, seed: int
) -> list[float]:
    """When each request is sent, relative to the first: all at once, evenly spaced, or Poisson.

    ``request_rate`` (requests/s, inf = no limit) draws exponential gaps; it and a
    positive ``submit_interval_ms`` exclude each other.
    """
    assert not (submit_interval_ms > 0 and request_rate != float("inf")), (
        "--submit-interval-ms and --request-rate exclude each other"
    )
    assert request_rate > 0, f"--request-rate must be positive, got {request_rate}"
    if request_rate != float("inf"):
        rng = random.Random(seed)
        offsets, t = [], 0.0
        for _ in range(num_requests):
            offsets.append(t)
            t += rng.expovariate(request_rate)
        return offsets
    return [i * submit_interval_ms / 1e3 for i in range(num_requests)]


_FUNCTION = """def {name}({a}, {b}):
    total = 0
    for item in {a}:
        if item > {b}:
            total += item * {k}
        else:
            total -= {k}
    return total
"""
_CLASS = """class {cls}:
    def __init__(self, {a}):
        self.{a} = {a}
        self.count = 0

    def {name}(self, {b}):
        self.count += 1
        return self.{a} + {b} * {k}
"""


def _ident(rng: random.Random, pool: WordPool) -> str:
    return pool.words[rng.randrange(len(pool.words))][1].strip()


def _code(rng: random.Random, pool: WordPool, blocks: int) -> tuple[str, str]:
    """(Python source of ``blocks`` functions and classes, the name of its first function)."""
    parts, first = [], ""
    for i in range(blocks):
        names = {f: _ident(rng, pool) for f in ("name", "a", "b")}
        first = first or names["name"]
        template = _FUNCTION if i % 2 == 0 else _CLASS
        parts.append(template.format(cls=_ident(rng, pool).capitalize(), k=rng.randint(2, 9), **names))
    return "\n".join(parts), first


def _chat(tokenizer_dir: Path, question: str) -> str:
    """``question`` as one user turn in the model's chat template, ready for the answer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [{"role": "user", "content": question}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def rewrite_workload(
    pool: WordPool, tokenizer_dir: Path, num_requests: int, max_new_tokens: int, seed: int
) -> list[WorkItem]:
    """Requests whose answers repeat their prompts: every other one a list of 12-24 words to number
    (SmolLM2-135M repeats it), the others 2-3 Python functions and classes to rewrite with one name
    changed."""
    rng = random.Random(seed)
    items = []
    for i in range(num_requests):
        if i % 2 == 0:
            words = [_ident(rng, pool) for _ in range(rng.randint(12, 24))]
            lines = "\n".join(f"- {word}" for word in words)
            question = f"Number each item of this list:\n{lines}"
        else:
            code, name = _code(rng, pool, rng.randint(2, 3))
            question = (
                f"Rewrite this Python code with the function `{name}` renamed to `{name}_v2`. "
                f"Change nothing else and answer with the code only.\n\n```python\n{code}```"
            )
        items.append(WorkItem(_chat(tokenizer_dir, question), None, max_new_tokens, False))
    return items


def compose_workload(
    pool: WordPool, tokenizer_dir: Path, num_requests: int, max_new_tokens: int, seed: int
) -> list[WorkItem]:
    """Requests whose answers are new text: a short story on a topic of two random words."""
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        topic = f"{_ident(rng, pool)} and {_ident(rng, pool)}"
        question = f"Write a short story about {topic}, in about two hundred words."
        items.append(WorkItem(_chat(tokenizer_dir, question), None, max_new_tokens, False))
    return items


class ChatTurns:
    """A multi-turn chat as a workload (bench/chat_turns.py): each request is the last one's prompt,
    the answer the engine gave it, and ``turn_len`` new tokens, so a prefix cache can resume every
    turn where the last one ended; the first turn is ``first_len`` tokens (a system prompt and the
    first message). Token ids only: the answers of a random bench model are not text."""

    def __init__(self, pool: WordPool, first_len: int, turn_len: int, seed: int) -> None:
        self.pool, self.turn_len, self.rng = pool, turn_len, random.Random(seed)
        self.first = pool.sample(self.rng, first_len)[1]

    def next_prompt(self, prompt: list[int], answer: list[int]) -> list[int]:
        """The turn after ``prompt`` was answered with ``answer``."""
        return prompt + answer + self.pool.sample(self.rng, self.turn_len)[1]
