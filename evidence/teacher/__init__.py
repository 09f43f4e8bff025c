"""Stage teacher: the teacher's labels. Reads a `prompts.jsonl` and the teacher model; writes its greedy
continuation of every prompt and the top-k token ids and log-probabilities at every position, as
safetensors shards with an `index.json` manifest (holdout rows marked), resumable shard by shard."""
