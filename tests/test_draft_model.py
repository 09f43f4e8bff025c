"""The drafter core against transformers (and peft) as the reference: fp32 on CPU, no network."""

import random

import pytest
import torch
from tiny_models import (
    forward_all,
    make_hf_model,
    random_rows,
    reference_greedy,
    write_hf_checkpoint,
)

import checkpoint
import draft_model
import engine
from planning import chunk_end
from transformer import StepPlan

# (architecture, overrides): tied and untied, GQA ratios 1/2/4, head_dim != hidden/heads, rope thetas.
FORWARD_CASES = [
    ("qwen3", dict(num_attention_heads=4, num_key_value_heads=4)),
    (
        "qwen3",
        dict(tie_word_embeddings=False, head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
    ("llama", dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32)),
    ("qwen2", dict()),
    (
        "qwen2",
        dict(
            tie_word_embeddings=False,
            num_key_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
]


def forward_stepwise(drafter: draft_model.Drafter, tokens: list[int]) -> torch.Tensor:
    """Our logits fed one token at a time by the decode step, each step reading the KV cached by the previous
    ones: (T, vocab)."""
    cache, slot = drafter.cache, torch.tensor([0])
    cache.clear_garbage([0], cache.capacity)
    logits = []
    for t, token in enumerate(tokens):
        plan = StepPlan(torch.tensor([t]), slot, slot, torch.arange(chunk_end(t, cache.capacity)).view(-1, 64))
        logits.append(engine.forward_step(drafter.model, cache, plan, torch.tensor([token]))[0])
    return torch.stack(logits)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny random Qwen3 saved as a Hugging Face checkpoint, and its transformers model."""
    hf_model = make_hf_model("qwen3")
    directory = write_hf_checkpoint(hf_model, tmp_path_factory.mktemp("qwen3"))
    return hf_model, directory


# ---- forward vs transformers


@pytest.mark.parametrize("architecture,overrides", FORWARD_CASES)
def test_logits_match_transformers(tmp_path, architecture, overrides):
    hf_model = make_hf_model(architecture, **overrides)
    drafter = draft_model.load_model(write_hf_checkpoint(hf_model, tmp_path), cache_slots=2)
    tokens = random_rows([37], seed=1)[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
        assert (forward_all(drafter, tokens) - expected).abs().max() <= 1e-4
        assert (forward_stepwise(drafter, tokens) - expected).abs().max() <= 1e-4


def test_config_reads_legacy_top_level_rope_theta():
    legacy = dict(
        model_type="qwen3",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_theta=1e6,
    )
    assert checkpoint.model_config(legacy).rope_theta == 1e6


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_type", "mistral"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}),
        ("use_sliding_window", True),
        ("hidden_act", "gelu"),
    ],
)
def test_unsupported_config_is_refused(field, value):
    config = dict(
        model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    config[field] = value
    with pytest.raises(draft_model.ModelLoadError, match=field.split("_")[0]):
        checkpoint.model_config(config)


# ---- greedy drafting


def test_draft_batch_equals_transformers_generate(qwen3):
    hf_model, directory = qwen3
    drafter = draft_model.load_model(directory, cache_slots=32)
    rows = random_rows([1, 2, 7, 31, 64, 129, 200, 300, 5], seed=2)
    drafts = draft_model.draft_batch(drafter, rows, max_tokens=16)
    for row, draft in zip(rows, drafts):
        assert draft == reference_greedy(hf_model, row, 16)
        assert draft.cached_tokens == 0
    assert len({tuple(d) for d in drafts}) == len(rows), "rows should draft different continuations"
    # Each row alone, on a fresh pool, gives the same draft as inside the batch.
    for row, draft in zip(rows, drafts):
        alone = draft_model.draft_batch(draft_model.load_model(directory, cache_slots=2), [row], max_tokens=16)
        assert alone == [draft]


def test_prefix_cache_reuse_is_exact_and_counted(qwen3):
    hf_model, directory = qwen3
    drafter = draft_model.load_model(directory, cache_slots=8)
    prompt = random_rows([120], seed=3)[0]
    first = draft_model.draft_batch(drafter, [prompt], max_tokens=16)[0]
    # The harness' follow-up: prompt + accepted drafts + the target's bonus token.
    follow_up = prompt + first[:5] + [17]
    warm = draft_model.draft_batch(drafter, [follow_up], max_tokens=16)[0]
    assert warm.cached_tokens == len(prompt) + 5
    assert sum(1 for n in drafter.cache.lengths if n) == 1, "the follow-up continues in its slot, no copy"
    cold = draft_model.draft_batch(draft_model.load_model(directory, cache_slots=8), [follow_up], max_tokens=16)[0]
    assert warm == cold == reference_greedy(hf_model, follow_up, 16)
    assert cold.cached_tokens == 0
    # The same request again reuses all but its last token; a shared prefix is copied, not clobbered.
    again = draft_model.draft_batch(drafter, [follow_up], max_tokens=16)[0]
    assert again == warm and again.cached_tokens == len(follow_up) - 1
    branch = prompt[:100] + [9, 9, 9]
    branched = draft_model.draft_batch(drafter, [branch], max_tokens=16)[0]
    assert branched.cached_tokens == 100 and branched == reference_greedy(hf_model, branch, 16)
    assert draft_model.draft_batch(drafter, [follow_up + [3]], max_tokens=16)[0].cached_tokens == len(follow_up)


def test_eviction_never_yields_a_wrong_draft(qwen3):
    hf_model, directory = qwen3
    drafter = draft_model.load_model(directory, cache_slots=4)
    conversations = random_rows([40, 50, 60, 70, 80], seed=4)
    expected = {}
    generator = torch.Generator().manual_seed(5)
    for turn in range(12):
        # Interleave more conversations than slots, in batches of two, some sharing prefixes.
        picks = torch.randperm(len(conversations), generator=generator)[:2].tolist()
        batch = [conversations[i] for i in picks]
        for i, draft in zip(picks, draft_model.draft_batch(drafter, batch, max_tokens=8)):
            key = tuple(conversations[i])
            expected.setdefault(key, reference_greedy(hf_model, conversations[i], 8))
            assert draft == expected[key], f"turn {turn}: conversation {i} drafted differently"
            conversations[i] = conversations[i] + draft[:3] + [11]


def test_stop_tokens_and_context_limit(qwen3):
    hf_model, directory = qwen3
    drafter = draft_model.load_model(directory, cache_slots=4, max_context=40)
    row = random_rows([20], seed=6)[0]
    full = draft_model.draft_batch(drafter, [row], max_tokens=12)[0]
    stop_at = full[4]
    stopped = draft_model.draft_batch(drafter, [row], max_tokens=12, stop_token_ids=[stop_at])[0]
    assert stopped == full[: full.index(stop_at) + 1]
    near_limit = random_rows([36], seed=7)[0]
    assert len(draft_model.draft_batch(drafter, [near_limit], max_tokens=12)[0]) == 4
    assert draft_model.draft_batch(drafter, [random_rows([40], seed=8)[0]], max_tokens=12)[0] == []
    mixed = draft_model.draft_batch(drafter, [row, row[:5]], max_tokens=[3, 7])
    assert mixed == [full[:3], reference_greedy(hf_model, row[:5], 7)]


def test_never_written_cache_memory_cannot_leak_into_drafts(qwen3):
    """Uninitialised memory (recycled on CUDA) may hold NaN; a masked key still multiplies its value by 0."""
    hf_model, directory = qwen3
    drafter = draft_model.load_model(directory, cache_slots=4)
    for pool in drafter.cache.keys + drafter.cache.values:
        pool.fill_(float("nan"))
    long, short = random_rows([100, 10], seed=24)
    drafts = draft_model.draft_batch(drafter, [long, short], max_tokens=[1, 16], return_logprobs=True)
    assert drafts[1] == reference_greedy(hf_model, short, 16)
    assert all(torch.isfinite(torch.tensor(d.logprobs)).all() for d in drafts)


def test_shared_prefixes_duplicates_and_eviction_stay_exact(qwen3):
    """Harness-style conversations sharing a prefix, duplicate rows in one batch, prefixes of a
    conversation and mixed budgets, through a pool too small to keep them all."""
    hf_model, directory = qwen3
    drafter = draft_model.load_model(directory, cache_slots=4)
    shared = random_rows([10], seed=25)[0]
    conversations = [shared + tail for tail in random_rows([5, 8, 12], seed=26)] + random_rows([20], seed=27)
    generator = torch.Generator().manual_seed(28)
    expected = {}
    for turn in range(30):
        picks = torch.randint(0, len(conversations), (2,), generator=generator).tolist()
        batch = [conversations[i] for i in picks]
        if turn % 5 == 4:
            batch[1] = batch[1][: len(batch[1]) // 2]  # a prefix of a conversation
        budgets = [[0, 1, 4, 16][int(b)] for b in torch.randint(0, 4, (2,), generator=generator)]
        for row, budget, draft in zip(batch, budgets, draft_model.draft_batch(drafter, batch, max_tokens=budgets)):
            key = tuple(row)
            expected.setdefault(key, reference_greedy(hf_model, row, 16))
            assert draft == expected[key][:budget], f"turn {turn}: a row of {len(row)} tokens drafted differently"
        for i, draft in zip(picks, draft_model.draft_batch(drafter, [conversations[i] for i in picks], max_tokens=8)):
            conversations[i] = conversations[i] + draft[:3] + [11]


def test_logprobs_match_reference_log_softmax(qwen3):
    hf_model, directory = qwen3
    drafter = draft_model.load_model(directory, cache_slots=4)
    rows = random_rows([10, 33], seed=9)
    for row, draft in zip(rows, draft_model.draft_batch(drafter, rows, max_tokens=8, return_logprobs=True)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([row + draft])).logits[0, len(row) - 1 : -1].log_softmax(-1)
        expected = reference.gather(1, torch.tensor(draft)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(draft.logprobs), expected, atol=1e-4)


@pytest.mark.parametrize(
    "row,message",
    [
        ([], "empty"),
        ([5, 256], "token id 256 at position 1 is outside the vocabulary 0..255"),
        ([5, -1], "token id -1 at position 1 is negative; token ids are 0..255"),
        ([5, True], "token id True at position 1 is not an int"),
        (list(range(3, 3 + 41)), "41 tokens exceed the context limit of 40"),
    ],
)
def test_bad_rows_are_refused(qwen3, row, message):
    drafter = draft_model.load_model(qwen3[1], cache_slots=2, max_context=40)
    with pytest.raises(ValueError, match=message):
        draft_model.draft_batch(drafter, [[4, 5], row])


# ---- GPTQ INT4 layout


def test_min_confidence_stops_a_row_after_its_first_unsure_token(qwen3):
    hf_model, directory = qwen3
    drafter = draft_model.load_model(directory, cache_slots=4)
    row = random_rows([25], seed=20)[0]
    full = draft_model.draft_batch(drafter, [row], max_tokens=16, return_logprobs=True)[0]
    probabilities = torch.tensor(full.logprobs).exp()
    threshold = float(probabilities[3:].min()) + 1e-6  # below it somewhere after the third token
    first_unsure = int((probabilities < threshold).nonzero()[0])
    adaptive, fixed = draft_model.draft_batch(drafter, [row, row], max_tokens=16, min_confidence=[threshold, 0.0])
    assert adaptive == full[: first_unsure + 1] and fixed == full
    with pytest.raises(ValueError, match="min_confidence must be a probability"):
        draft_model.draft_batch(drafter, [row], min_confidence=1.5)


def naive_prompt_lookup(tokens: list[int], max_tokens: int, min_match: int, max_match: int) -> list[int]:
    for n in range(min(max_match, len(tokens) - 1), min_match - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == tokens[-n:]:
                extended = list(tokens)
                for _ in range(max_tokens):  # copy one token at a time, each from the sequence so far
                    extended.append(extended[start + n + len(extended) - len(tokens)])
                return extended[len(tokens) :]
    return []


def test_prompt_lookup_finds_the_longest_latest_earlier_match():
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        tokens = torch.randint(
            0, 3 + trial % 5, (1 + trial % 40,), generator=generator
        ).tolist()  # small vocabularies repeat
        for min_match in (1, 2, 4):
            assert draft_model.prompt_lookup(tokens, 5, min_match) == naive_prompt_lookup(
                tokens, 5, min_match, draft_model.LOOKUP_MAX_MATCH
            )
    assert draft_model.prompt_lookup([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 3) == [8, 1]  # the latest of two occurrences
    assert draft_model.prompt_lookup([5, 6, 7, 5, 6], 4, 3) == []  # only a 2-token repeat
    assert draft_model.prompt_lookup([4, 1, 2, 1, 2], 5, 2) == [
        1,
        2,
        1,
        2,
        1,
    ]  # a running loop continues past its period


def test_hybrid_rows_copy_repeats_and_the_rest_draft_as_before(qwen3):
    hf_model, directory = qwen3
    drafter = draft_model.load_model(directory, cache_slots=4)
    plain, opening = random_rows([30, 20], seed=21)
    repeating = opening + [1, 2] + opening[:5]
    stop = opening[9]
    hybrid = draft_model.draft_batch(
        drafter, [plain, repeating, repeating], max_tokens=6, lookup_min_match=[3, 3, 0], stop_token_ids=[stop]
    )
    assert (
        hybrid[0] == draft_model.draft_batch(drafter, [plain], max_tokens=6, stop_token_ids=[stop])[0]
        and hybrid[0].source == "model"
    )
    assert (
        hybrid[1] == opening[5:10] and hybrid[1].source == "lookup" and hybrid[1].logprobs is None
    )  # through the stop token
    assert hybrid[2] == reference_greedy(hf_model, repeating, 6)[: len(hybrid[2])] and hybrid[2].source == "model"
    with pytest.raises(ValueError, match="lookup_min_match must be"):
        draft_model.draft_batch(drafter, [plain], lookup_min_match=draft_model.LOOKUP_MAX_MATCH + 1)


def test_max_context_must_fit_the_model(qwen3):
    with pytest.raises(draft_model.ModelLoadError, match="max_context 600 must lie in 1..512"):
        draft_model.load_model(qwen3[1], max_context=600)


# Drafts of the shipped model/ on the exact path (dense fp32), recorded when model/ was last replaced (the
# 12-layer package trained on shards 0-98): refactoring the drafter must not change what model/ drafts.
PINNED_MODEL_DRAFTS = [
    [30, 533, 451, 1671, 28, 665, 314, 253],
    [282, 260, 1142, 1142, 1142, 1142, 1142, 1142],
    [282, 260, 6128, 30, 378, 6128, 314, 253],
    [30, 909, 314, 253, 3476, 338, 314, 253],
    [260, 3414, 282, 260, 3414, 282, 260, 3414],
]


def test_shipped_model_drafts_what_it_drafted_when_recorded(repo_root):
    drafter = draft_model.load_model(repo_root / "model", "cpu", "float32", weights="dequant", cache_slots=8)
    generator = random.Random(7)
    rows = [[generator.randrange(drafter.vocab_size) for _ in range(n)] for n in (5, 40, 64, 100, 300)]
    assert draft_model.draft_batch(drafter, rows, max_tokens=8, stop_token_ids=[]) == PINNED_MODEL_DRAFTS
