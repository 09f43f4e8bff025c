"""The greedy draft-and-verify loop that measure_tau.py runs: the target verifies each draft in one forward
pass over its KV cache, commits the longest agreeing prefix plus its own bonus token, and the loop records
what every step drafted and accepted; plus the references it is checked against (the target's own greedy
decoding, transformers' assisted generation). Not a script: imported by measure_tau.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

# A drafter maps (the sequence so far, how many tokens at most) to its proposed continuation.
DraftFn = Callable[[list[int], int], list[int]]


@dataclass
class SpeculativeRun:
    """What one drafter did over all prompts."""

    committed: int = 0
    verify_steps: int = 0
    drafted_per_call: list[int] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)  # per call, as the client sees it
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    # Per draft position i: the steps that drafted at least i + 1 tokens, and those whose drafts 0..i were
    # all accepted; their ratio is the reported P(position i accepted).
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # committed continuation per prompt

    def record_step(self, drafted: int, accepted: int) -> None:
        for position in range(drafted):
            if position == len(self.proposed_at):
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[position] += 1
            self.accepted_at[position] += int(position < accepted)


def verify(target: torch.nn.Module, cache: DynamicCache, last_token: int, draft: list[int]) -> list[int]:
    """The target's greedy token after `last_token` and after each draft token, in one forward.

    The cache holds every committed token but the last; it grows by 1 + len(draft) here."""
    input_ids = torch.tensor([[last_token, *draft]])
    logits = target(input_ids=input_ids, cache=cache, use_cache=True).logits[0]  # [1 + d, V]
    return logits.argmax(-1).tolist()


@torch.inference_mode()
def speculative_generate(
    target: torch.nn.Module,
    draft: DraftFn,
    prompt: list[int],
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    run: SpeculativeRun,
) -> list[int]:
    """Greedy draft-and-verify on one prompt; returns the committed continuation and records into `run`."""
    started = time.perf_counter()
    cache = DynamicCache()
    if len(prompt) > 1:  # keep the invariant: the cache holds all tokens but the last
        target(input_ids=torch.tensor([prompt[:-1]]), cache=cache, use_cache=True)
    sequence = list(prompt)
    while len(sequence) - len(prompt) < max_new_tokens:
        remaining = max_new_tokens - (len(sequence) - len(prompt))
        proposal = []
        if remaining > 1:  # the bonus always commits one token: drafting the last one is wasted (transformers agrees)
            draft_started = time.perf_counter()
            proposal = draft(sequence, min(k, remaining - 1))[:k]
            run.draft_seconds.append(time.perf_counter() - draft_started)
            run.drafted_per_call.append(len(proposal))

        verify_started = time.perf_counter()
        target_tokens = verify(target, cache, sequence[-1], proposal)
        run.verify_seconds += time.perf_counter() - verify_started
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == target_tokens[accepted]:
            accepted += 1
        run.record_step(len(proposal), accepted)
        run.verify_steps += 1

        # Keep the KV of the last committed token and of the accepted drafts; the bonus is fed next step.
        # (This transformers' crop takes the number of tokens to drop, as a negative int.)
        cache.crop(-(len(proposal) - accepted))
        new_tokens = (proposal[:accepted] + [target_tokens[accepted]])[:remaining]
        ends = [i for i, token in enumerate(new_tokens) if token in eos_ids]
        sequence += new_tokens[: ends[0] + 1] if ends else new_tokens
        if ends:
            break
    continuation = sequence[len(prompt) :]
    run.committed += len(continuation)
    run.total_seconds += time.perf_counter() - started
    run.outputs.append(continuation)
    return continuation


@torch.inference_mode()
def target_greedy(target: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The target alone: transformers greedy generate() with its KV cache (the reference output)."""
    return greedy_generate(target, prompt, max_new_tokens, eos_ids)


def greedy_generate(
    target: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos_ids: set[int], **options
) -> list[int]:
    """The continuation transformers' greedy generate() gives `prompt`; `options` go to generate()."""
    stop = sorted(eos_ids) or None  # a target without eos ids generates max_new_tokens every time
    output = target.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stop,
        pad_token_id=stop[0] if stop else None,
        **options,
    )
    return output[0, len(prompt) :].tolist()


@torch.inference_mode()
def assisted_generate(
    target: torch.nn.Module,
    assistant: torch.nn.Module,
    prompt: list[int],
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    run: SpeculativeRun,
) -> None:
    """transformers assisted generation on one prompt: k candidates per step from `assistant`, greedy; the
    verify steps are the target's forward calls (its first one verifies the first candidates with the prompt)."""
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0  # no early stop: k candidates, like ours
    calls = [0]
    hook = target.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    started = time.perf_counter()
    try:
        continuation = greedy_generate(target, prompt, max_new_tokens, eos_ids, assistant_model=assistant)
    finally:
        hook.remove()
    run.total_seconds += time.perf_counter() - started
    run.committed += len(continuation)
    run.verify_steps += calls[0]
    run.outputs.append(continuation)


def eos_token_ids(target: torch.nn.Module) -> set[int]:
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = target.config.eos_token_id
    return set() if eos is None else set([eos] if isinstance(eos, int) else eos)
