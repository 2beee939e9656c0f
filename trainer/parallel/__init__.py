"""Where the model runs: the process layout (distributed.py, layouts.py), DeepSpeed's pipeline stages and
hostfiles, the one-process engine, the partitioned (ZeRO-3) load, and the memory plan with block swap."""
