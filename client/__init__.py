"""Talk to a ComfyUI server over its HTTP and websocket API (no torch, no ComfyUI imports)."""
