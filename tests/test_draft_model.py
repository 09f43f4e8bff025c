"""The drafter core against transformers (and peft) as the reference: fp32 on CPU, no network."""

import json
import shutil

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_hf_model, write_hf_checkpoint

import draft_model

# (architecture, overrides): tied and untied, GQA ratios 1/2/4, head_dim != hidden/heads, rope thetas.
FORWARD_CASES = [
    ("qwen3", dict(num_attention_heads=4, num_key_value_heads=4)),
    ("qwen3", dict(tie_word_embeddings=False, head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
    ("llama", dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32)),
    ("qwen2", dict()),
    ("qwen2", dict(tie_word_embeddings=False, num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
]


def forward_all(drafter: draft_model.Drafter, tokens: list[int]) -> torch.Tensor:
    """Our logits for every position of one sequence in one forward through cache slot 0: (T, vocab)."""
    T = len(tokens)
    at = draft_model.ForwardInputs(torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long), [0], T)
    return drafter.model.logits(drafter.model(torch.tensor([tokens]), drafter.cache, at))[0]


def forward_stepwise(drafter: draft_model.Drafter, tokens: list[int]) -> torch.Tensor:
    """Our logits fed one token at a time, each step reading the KV cached by the previous ones: (T, vocab)."""
    logits = []
    for t, token in enumerate(tokens):
        at = draft_model.ForwardInputs(torch.tensor([[t]]), torch.zeros(1, 1, dtype=torch.long), [0], t + 1)
        logits.append(drafter.model.logits(drafter.model(torch.tensor([[token]]), drafter.cache, at))[0, 0])
    return torch.stack(logits)


def reference_greedy(hf_model, row: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(row) :].tolist()


def random_rows(lengths: list[int], seed: int, vocab: int = 256) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


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
    legacy = dict(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, rope_theta=1e6)
    assert draft_model.ModelConfig.from_hf(legacy).rope_theta == 1e6


@pytest.mark.parametrize("field,value", [("model_type", "mistral"), ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}), ("use_sliding_window", True)])
def test_unsupported_config_is_refused(field, value):
    config = dict(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    config[field] = value
    with pytest.raises(draft_model.ModelLoadError, match=field.split("_")[0]):
        draft_model.ModelConfig.from_hf(config)


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
    cold = draft_model.draft_batch(draft_model.load_model(directory, cache_slots=8), [follow_up], max_tokens=16)[0]
    assert warm == cold == reference_greedy(hf_model, follow_up, 16)
    assert cold.cached_tokens == 0
    # The same request again reuses all but its last token; a shared prefix is copied, not clobbered.
    again = draft_model.draft_batch(drafter, [follow_up], max_tokens=16)[0]
    assert again == warm and again.cached_tokens == len(follow_up) - 1
    branch = prompt[:60] + [9, 9, 9]
    branched = draft_model.draft_batch(drafter, [branch], max_tokens=16)[0]
    assert branched.cached_tokens == 60 and branched == reference_greedy(hf_model, branch, 16)
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
    assert [len(d) for d in mixed] == [3, 7]


def test_logprobs_match_reference_log_softmax(qwen3):
    hf_model, directory = qwen3
    drafter = draft_model.load_model(directory, cache_slots=4)
    rows = random_rows([10, 33], seed=9)
    for row, draft in zip(rows, draft_model.draft_batch(drafter, rows, max_tokens=8, return_logprobs=True)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([row + draft])).logits[0, len(row) - 1 : -1].log_softmax(-1)
        expected = reference.gather(1, torch.tensor(draft)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(draft.logprobs), expected, atol=1e-4)


@pytest.mark.parametrize("row,message", [([], "empty"), ([5, 256], "token id 256 at position 1"), ([5, -1], "token id -1"), (list(range(3, 3 + 41)), "41 tokens exceed the context limit of 40")])
def test_bad_rows_are_refused(qwen3, row, message):
    drafter = draft_model.load_model(qwen3[1], cache_slots=2, max_context=40)
    with pytest.raises(ValueError, match=message):
        draft_model.draft_batch(drafter, [[4, 5], row])
