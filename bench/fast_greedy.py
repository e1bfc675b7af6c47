"""Greedy decoding straight on a FastTarget, with or without a drafter: the GPU tests' and the GPU
benchmark's reference loop (the server's loop is server.engine; this one has no cost model, no
prefix cache and no stop strings, so a test sees the fast path alone)."""
from __future__ import annotations

import random

from server.backend import accept
from server.fast_path import FastTarget
from server.sampling import row_argmax


def greedy_generate(fast: FastTarget, prompt_ids: list[int], max_new: int, propose=None,
                    max_draft: int | None = None, reuse: bool = False) -> tuple[list[int], int]:
    """Greedy tokens after `prompt_ids` and the number of forwards after the prefill. With
    `propose(context, room) -> list[int]`, drafts are verified (lossless: same tokens as without).
    `reuse`: the prefill resumes from the prefix cache (an agent's next turn), else from position 0."""
    max_draft = fast.max_bucket - 1 if max_draft is None else max_draft
    out = [int(fast.start(prompt_ids, reuse=reuse).logits.argmax())]  # reuse=False: FastTarget.prefill
    steps = 0
    while len(out) < max_new:
        room = min(max_new - len(out) - 1, max_draft)
        draft = list(propose(prompt_ids + out, room))[:room] if (propose is not None and room > 0) else []
        if draft:
            out += verify(fast, out[-1], draft)
        else:
            out.append(row_argmax(fast.step([out[-1]]))[0])
        steps += 1
    return out[:max_new], steps


def verify(fast: FastTarget, pending: int, draft: list[int]) -> list[int]:
    """Verify `draft` after `pending` with server.backend.accept's rule; the accepted tokens + 1."""
    target = row_argmax(fast.step([pending, *draft]))
    k = accept(draft, target)
    fast.rollback(len(draft) - k)
    return list(draft[:k]) + [target[k]]


def oracle(reference: list[int], prompt_len: int, error_rate: float = 0.2, vocab: int = 262144, seed: int = 0):
    """A `propose` for greedy_generate that knows the answer: the true continuation `reference`
    (the tokens after the prompt of `prompt_len`), a random length, some tokens wrong (so rollbacks
    happen)."""
    rng = random.Random(seed)

    def propose(context, room):
        start = len(context) - prompt_len
        draft = reference[start:start + rng.randint(1, room)]
        return [rng.randrange(vocab) if rng.random() < error_rate else t for t in draft]
    return propose
