"""Entry point. Works as `python -m <package>.trainer` and as `python <pack folder>/trainer`.

Run as a path, the pack's folder (whatever it is called) is registered as the package
`ingraph_trainer` so that relative imports work and the top-level `nodes/` never shadows
ComfyUI's own `nodes` module.
"""
import sys
import types
from pathlib import Path

PACKAGE = "ingraph_trainer"

import importlib.util  # noqa: E402

if importlib.util.find_spec("torch") is None:  # another Python than ComfyUI's: one clear line, not a traceback
    sys.exit(f"error: this Python ({sys.executable}) has no torch. Run the trainer with ComfyUI's Python: "
             "ComfyUI/venv/bin/python (Windows: ComfyUI\\venv\\Scripts\\python.exe, or python_embeded\\python.exe in "
             "ComfyUI portable)")

if not __package__:
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(here.parent)]
        sys.modules[PACKAGE] = package
    from ingraph_trainer.trainer.main import main
else:
    from .main import main

code = main()
if code != 0:  # a failed run may leave a writer open (the health log): the interpreter's teardown as usual
    sys.exit(code)
# The run is over and everything it writes is closed (events, adapter, checkpoints, health log, process group):
# skip the interpreter's teardown of torch, ComfyUI and DeepSpeed, ~3 s on 2 CPU cores that the node would wait for
import logging  # noqa: E402
import os  # noqa: E402

logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
from ingraph_trainer.trainer.os_support import flush_c_stdio  # noqa: E402

flush_c_stdio()  # what C and C++ libraries printed into the run's log through C's own buffers
os._exit(0)
