"""The offline tau estimator (evidence/measure/tau.py) against a real greedy draft-and-verify loop."""

import pytest
import torch
from pipeline_fixtures import perturbed_copy
from tiny_models import make_hf_model

from evidence.measure.tau import committed_per_step, offline_tau, tau_from_matches
from evidence.teacher.gen_data import generate_transformers


@torch.no_grad()
def greedy_tokens(model: torch.nn.Module, context: list[int], count: int) -> list[int]:
    """Greedy decoding by full forwards (no cache), the plainest reference."""
    tokens = list(context)
    for _ in range(count):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(context) :]


@torch.no_grad()
def draft_and_verify(teacher, student, prompt: list[int], length: int, k: int) -> tuple[list[int], int]:
    """The harness loop: the student drafts k greedy tokens, the teacher scores context + drafts in
    one forward, the agreeing prefix plus the teacher's bonus token is committed. Returns the committed
    tokens (cut at `length`) and the number of verify steps."""
    context, steps = list(prompt), 0
    while len(context) - len(prompt) < length:
        draft = greedy_tokens(student, context, k)
        logits = teacher(torch.tensor([context + draft])).logits[0]  # [len(context) + k, V]
        verified = logits[len(context) - 1 :].argmax(-1).tolist()  # teacher's token at each draft slot + bonus
        accepted = 0
        while accepted < k and draft[accepted] == verified[accepted]:
            accepted += 1
        new = (draft[:accepted] + [verified[accepted]])[: length - (len(context) - len(prompt))]
        context += new
        steps += 1
    return context[len(prompt) :], steps


def test_committed_per_step_by_hand():
    # matches 1 1 0 1 1 1 1 0, k = 3: [1,1 + bonus] [1,1,1 + bonus] [bonus at the last mismatch] ...
    matches = [True, True, False, True, True, True, True, False]
    assert committed_per_step(matches, k=3) == [3, 4, 1]
    assert committed_per_step([True] * 5, k=16) == [5]  # all drafts accepted, cut at the continuation's end
    assert committed_per_step([False] * 3, k=4) == [1, 1, 1]  # only bonus tokens: tau = 1
    report = tau_from_matches([matches, [False] * 3], k=3)
    assert (report.committed, report.steps) == (11, 6)
    assert report.tau == pytest.approx(11 / 6)


@pytest.mark.parametrize("k", [1, 6])
def test_offline_tau_equals_draft_and_verify_loop(k):
    teacher = make_hf_model("qwen3", seed=3)
    student = perturbed_copy(teacher, noise=0.05, seed=4)
    length = 24
    prompts = [[5 + i, 17 * i % 250 + 3, 40 + 3 * i, 9] for i in range(4)]
    generations = generate_transformers(teacher, prompts, max_new_tokens=length, top_k=5, eos_ids=[-1])
    examples = []
    loop_steps = 0
    for prompt, (tokens, topk_ids, topk_logprobs) in zip(prompts, generations):
        committed, steps = draft_and_verify(teacher, student, prompt, length, k)
        assert committed == tokens.tolist() == greedy_tokens(teacher, prompt, length)  # lossless, and the cache agrees
        loop_steps += steps
        examples.append(
            dict(
                id=str(prompt),
                prompt_ids=torch.tensor(prompt),
                tokens=tokens,
                topk_ids=topk_ids,
                topk_logprobs=topk_logprobs,
            )
        )
    report = offline_tau(student, examples, k=k, batch_size=4, progress=False)
    assert report.steps == loop_steps
    assert report.tau == pytest.approx(len(prompts) * length / loop_steps)
    assert 0.3 < report.top1_agreement < 0.98  # the student agrees often but not always: the test can fail
    if k > 1:
        assert report.tau > 2.0
