"""Helpers of the quantized-model tests: run a model through the paged forward pass over whole sequences."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from worker.batch import ForwardBatch

BLOCK_SIZE = 16
REFERENCE_ANSWERS = Path(__file__).parents[3] / "shared" / "data" / "mt_bench" / "reference_answer" / "gpt-4.jsonl"
QUESTIONS = Path(__file__).parents[3] / "shared" / "data" / "mt_bench" / "question.jsonl"


def _table(num_tokens: int, first_block: int = 0) -> list[int]:
    return list(range(first_block, first_block + (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE))


def prefill_then_decode(model, prompt: list[int], steps: int, forced: list[int] | None = None
                        ) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill ``prompt`` and decode ``steps`` tokens (greedy, or the ``forced`` ones); return every step's
    logits ``[vocab]`` float32 and the tokens fed."""
    total = len(prompt) + steps + 1
    table = _table(total)
    kv = model.allocate_kv_cache(len(table) + 1, BLOCK_SIZE)
    logits = [model.forward(ForwardBatch.build([prompt], [0], [table], BLOCK_SIZE), kv)[0]]
    fed = []
    for i in range(steps):
        token = forced[i] if forced is not None else int(logits[-1].argmax())
        fed.append(token)
        batch = ForwardBatch.build([[token]], [len(prompt) + i], [table], BLOCK_SIZE)
        logits.append(model.forward(batch, kv)[0])
    return logits, fed


def teacher_forced_nll(model, prompt: list[int], answer: list[int]) -> tuple[float, int]:
    """Return (summed negative log-likelihood in nats, tokens) of ``answer`` after ``prompt`` (one prefill)."""
    ids = prompt + answer
    table = _table(len(ids))
    kv = model.allocate_kv_cache(len(table) + 1, BLOCK_SIZE)
    rows = list(range(len(prompt) - 1, len(ids) - 1))
    batch = ForwardBatch.build([ids], [0], [table], BLOCK_SIZE)
    batch.logits_indices = torch.tensor(rows, dtype=torch.int64)
    logits = model.forward(batch, kv)
    logp = torch.log_softmax(logits.double(), dim=-1)
    nll = -logp[torch.arange(len(rows)), torch.tensor(answer)].sum().item()
    return nll, len(answer)


def perplexity(model, pairs: list[tuple[list[int], list[int]]]) -> float:
    """Token-weighted perplexity of the answers of ``pairs`` (prompt ids, answer ids)."""
    total_nll, total_tokens = 0.0, 0
    for prompt, answer in pairs:
        nll, n = teacher_forced_nll(model, prompt, answer)
        total_nll += nll
        total_tokens += n
    return math.exp(total_nll / total_tokens)


def reference_pairs(tokenizer, count: int, max_answer_tokens: int = 160) -> list[tuple[list[int], list[int]]]:
    """(chat-templated first turn, GPT-4 reference answer) token ids of the first ``count`` MT-Bench questions
    that have a reference answer (answers cut at ``max_answer_tokens``)."""
    questions = {}
    for line in QUESTIONS.read_text().splitlines():
        item = json.loads(line)
        questions[item["question_id"]] = item["turns"][0]
    pairs = []
    for line in REFERENCE_ANSWERS.read_text().splitlines():
        item = json.loads(line)
        question = questions.get(item["question_id"])
        if question is None:
            continue
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               tokenize=True)
        if not isinstance(prompt, list):
            prompt = list(prompt["input_ids"])
        answer = tokenizer(item["choices"][0]["turns"][0], add_special_tokens=False)["input_ids"][:max_answer_tokens]
        pairs.append((list(prompt), answer))
        if len(pairs) == count:
            break
    return pairs
