"""The run's data: the cached dataset loaded (loading.py), each step's batches with prior images mixed in
(batch_mix.py), and what a family asks of a dataset (dataset_checks.py)."""
