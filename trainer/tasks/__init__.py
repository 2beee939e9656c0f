"""What a trainer process runs: training (loop.py, the task skeleton and the Trainer), distillation (its networks,
DMD2 and the Distiller), evaluation, and the standby that waits for a run."""
