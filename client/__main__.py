"""Headless runs: queue an API-format workflow on a ComfyUI server and follow it in the terminal.

    python <pack folder>/client run WORKFLOW_API.json --server HOST:PORT
    python -m ingraph_trainer.client run ...   (when the pack folder is importable under that name)

Exit codes: 0 success, 1 execution error, 2 bad usage or workflow rejected, 3 interrupted,
4 timeout, 5 server unreachable.
"""
import sys
from pathlib import Path

try:
    import websocket  # noqa: F401  (websocket-client, in the pack's requirements)
except ImportError:  # another Python than ComfyUI's: one clear line, not a traceback
    sys.exit(f"error: this Python ({sys.executable}) lacks websocket-client. Run the client with ComfyUI's Python "
             "(ComfyUI/venv/bin/python; Windows: python_embeded\\python.exe in ComfyUI portable), or "
             "`python -m pip install websocket-client`")

if not __package__:
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(here.parent))  # the client package has no heavy or ComfyUI imports
    from client.cli import main
else:
    from .cli import main

sys.exit(main())
