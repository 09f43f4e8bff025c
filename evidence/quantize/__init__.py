"""Stage quantize: the model package (docs/package-format.md). Reads the distilled student and the teacher's
shards (calibration and holdout); gptq_drafter.py writes the GPTQ INT4 package, lora_after_gptq.py adds the
LoRA adapter trained on the frozen INT4 weights to it, and make_random_package.py writes a random-weight
package of a given shape (for the server tests, the benchmarks and the plan's shape checks)."""
