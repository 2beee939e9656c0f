"""The ComfyUI side of a training run: model hand-off, run directories, launching and watching the trainer."""
