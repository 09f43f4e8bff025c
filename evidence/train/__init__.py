"""Stage train: distillation of the drafter. Reads the base (student) model and the teacher's shards (or,
with --teacher, the teacher itself to recompute its top-k per batch); writes the Hugging Face checkpoint with
the best holdout tau, its `.train_drafter.json` report and, with --checkpoint-every, a resumable checkpoint. dense_from_package
turns a model package back into a dense checkpoint (INT4 dequantized, LoRA merged) to continue from."""
