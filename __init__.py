"""InGraph Trainer: train diffusion-model adapters inside a ComfyUI graph.

ComfyUI imports this folder (under whatever name it was cloned as) and calls `comfy_entrypoint`.
Everything heavy (peft, diffusers, deepspeed, bitsandbytes) lives in the trainer process, never here.
"""
import importlib.util

WEB_DIRECTORY = "./web"

if importlib.util.find_spec("comfy_api") is not None:  # inside ComfyUI; absent when the trainer runs via -m
    from .runner import paths as _paths
    _paths.use_data_folder_secret()  # before anything signs: this server's runs, not every server's in this home
    from .nodes import comfy_entrypoint  # noqa: F401
    from .runner import routes as _routes  # noqa: F401  registers the /ingraph HTTP routes
    from .runner import standby as _standby
    _standby.register_prompt_hook()  # a queued training prompt starts a trainer process ahead of need

