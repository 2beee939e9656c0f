"""A run's folder and lifetime: its file names (layout.py), checkpoints and their trust, events, stop requests,
run control and the result written at its end."""
