"""Offline fixtures for the evidence pipeline tests: a word-level tokenizer with a chat template, parquet
files with the real column layouts of the five declared datasets in a mirror directory, and a data
manifest locked to those files; a measurement-only prompt set and the pipeline's command line for them
(conftest.py runs it once per session). Everything is made on the fly; nothing touches the network."""

import copy
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from evidence import common
from evidence.prompts import prepare_prompts
from package_manifest import sha256_file

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "evidence" / "configs" / "tiny.json"
FAKE_REVISION = "0123456789abcdef0123456789abcdef01234567"  # a fixture's pin: only its shape matters here
SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>"]  # ids 0..4: pad, bos, eos as in tiny_models
ROLES = ["system", "user", "assistant", "<think>", "</think>"]
WORDS = (
    "the a of to and is in it you that he was for on are with as I his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water than "
    "call first who may down side been now find any new work part take get place made live where after "
    "back little only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right boy old too same "
    "tell does set three want air well also play small end put home read hand port large spell add even "
    "land here must big high such follow act why ask men change went light kind off need house picture try "
    "us again animal point mother world near build self earth father head stand own page should country found "
    "answer school grow study still learn plant cover food sun four between state keep eye never last let "
    "thought city tree cross farm hard start might story saw far sea draw left late run while press close "
    "night real life few north open seem together next white children begin got walk example ease paper"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% if enable_thinking is defined and not enable_thinking %}"
    "<think> </think> {% endif %}{% endif %}"
)
VOCAB_SIZE = 256


def write_tokenizer(directory: Path) -> Path:
    """A 256-entry word-level tokenizer with a Qwen-like chat template (thinking switch included)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [w for w in dict.fromkeys(WORDS) if w not in SPECIALS + ROLES]
    vocab = {token: i for i, token in enumerate((SPECIALS + ROLES + words)[:VOCAB_SIZE])}
    assert len(vocab) == VOCAB_SIZE, len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return Path(directory)


def sentence(rng: random.Random, length: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(length))


def dataset_tables(rows: int, seed: int = 0) -> dict[str, pa.Table]:
    """name -> a table with that dataset's real columns. Row 2 of no_robots repeats row 1 (a duplicate
    prompt); its last row is longer than any sensible --max-prompt-tokens of the tests."""
    rng = random.Random(seed)
    no_robots = []
    for i in range(rows):
        prompt = sentence(rng, rng.randint(4, 12)) if i != 2 else no_robots[1]["prompt"]
        if i == rows - 1:
            prompt = sentence(rng, 300)
        messages = [{"content": "you are a help", "role": "system"}] if i % 3 == 0 else []
        messages += [{"content": prompt, "role": "user"}, {"content": sentence(rng, 8), "role": "assistant"}]
        no_robots.append(
            {
                "prompt": prompt,
                "prompt_id": f"nr{i:04d}",
                "messages": messages,
                "category": rng.choice(["Chat", "Brainstorm"]),
            }
        )
    gsm8k = [
        {"question": sentence(rng, rng.randint(6, 14)), "answer": sentence(rng, 10) + " #### 7"} for _ in range(rows)
    ]
    languages = [("English", "eng"), ("French", "fra"), ("Swahili", "swh")]
    aya = []
    for i in range(rows * 2):
        language, code = languages[i % 3]
        aya.append(
            {
                "inputs": sentence(rng, rng.randint(4, 10)),
                "targets": sentence(rng, 6),
                "language": language,
                "language_code": code,
                "annotation_type": "original-annotations",
                "user_id": f"u{i % 5}",
            }
        )
    tulu_code, tulu_if = [], []
    for i in range(rows):
        for table, prefix in ((tulu_code, "code"), (tulu_if, "if")):
            prompt = sentence(rng, rng.randint(5, 12))
            messages = [{"content": prompt, "role": "user"}, {"content": sentence(rng, 9), "role": "assistant"}]
            table.append({"id": f"{prefix}_{i}", "prompt": prompt, "messages": messages})
    for row in tulu_if:
        row["constraints"] = ["Use at most 50 words."]
    return {
        name: pa.Table.from_pylist(table)
        for name, table in {
            "no_robots": no_robots,
            "gsm8k": gsm8k,
            "aya": aya,
            "tulu_code": tulu_code,
            "tulu_if": tulu_if,
        }.items()
    }


def write_mirror(mirror: Path, manifest_out: Path, rows: int = 12, seed: int = 0) -> dict:
    """Parquet files laid out as MIRROR/<repo>/<path>, and a copy of the repo's manifest locked to them."""
    manifest = copy.deepcopy(json.loads((ROOT / "data_manifest.json").read_text()))
    for name, table in dataset_tables(rows, seed).items():
        entry = manifest["datasets"][name]
        relative = entry["file_pattern"].replace("*", "00000-of-00001")
        path = mirror / entry["repo"] / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        entry.update(
            revision=FAKE_REVISION,
            files=[{"path": relative, "sha256": sha256_file(path), "rows": table.num_rows}],
            rows=table.num_rows,
            locked=True,
        )
    manifest_out.write_text(json.dumps(manifest, indent=2))
    return manifest


def perturbed_copy(model: torch.nn.Module, noise: float, seed: int) -> torch.nn.Module:
    """A copy of `model` with every parameter jittered by `noise` times its spread: a student that
    agrees with the teacher often but not always."""
    student = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in student.parameters():
            parameter += noise * parameter.std() * torch.randn(parameter.shape, generator=generator)
    return student


def write_eval_prompts(tokenizer_dir: Path, path: Path) -> Path:
    """A measurement-only prompt set (as MT-bench is for the small real case), disjoint from training."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    questions = [
        "what is the long story of the north sea",
        "tell me how to draw a tree",
        "why do children play with paper",
        "write a letter to my mother about the city",
        "how many days are in four years",
        "give an example of a kind act",
    ]
    rows = []
    for number, question in enumerate(questions):
        messages = [{"role": "user", "content": question}]
        rows.append(
            {
                "id": f"eval:{number}",
                "source": "eval",
                "messages": messages,
                "token_ids": prepare_prompts.encode(tokenizer, messages, enable_thinking=False),
            }
        )
    common.write_jsonl(path, rows)
    return path


def pipeline_argv(inputs: dict[str, Path], work: Path, out: Path) -> list[str]:
    return [
        "--config",
        str(TINY_CONFIG),
        "--work",
        str(work),
        "--out",
        str(out),
        "--mirror",
        str(inputs["mirror"]),
        "--manifest",
        str(inputs["manifest"]),
        "--teacher",
        str(inputs["teacher"]),
        "--base",
        str(inputs["base"]),
        "--tokenizer",
        str(inputs["tokenizer"]),
        "--eval-prompts",
        str(inputs["eval_prompts"]),
    ]
