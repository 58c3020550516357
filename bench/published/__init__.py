"""The cost model against published training runs: the pieces of bench/bench_published.py.

- rows.py      bench/reference/published_runs.yaml -> Row (shape, cluster, Fixed configuration,
               measured figures, approximation notes)
- models.py    the model file each row's shape describes (GPT/Megatron attention, Llama, MPT)
- predict.py   profiles per shape (fake tensors, worker processes) and the prediction of a row
- report.py    the table and the per-source summary
- fit.py       --fit and --loso: grid search of MATMUL_EFFICIENCY, MEMORY_EFFICIENCY and OVERLAP_CONTENTION
"""
