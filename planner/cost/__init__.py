"""The cost model: pure functions from (profile, cluster, training setup, candidate) to seconds
and bytes. No solver and no I/O here; search/ calls these."""
