"""Stage measure: tau, the tokens committed per target verify step. Reads a drafter (package or checkpoint)
with the teacher's shards (tau.py, category_tau.py: exact offline replay) or with a real target and the
MT-bench questions (measure_tau.py, through spec_loop.py's draft-and-verify loop); prints tables, writes
JSON reports (--json) and, with measure_tau.py --record, a key of architecture.json."""
