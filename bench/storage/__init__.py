"""``kvstore bench storage`` in parts: targets (kvstore, its variants), the Redis baseline,
the workload and its phases, and the report (records, ratios, best of each). The command
itself (arguments, the run, the tables) is bench/storage_bench.py."""
