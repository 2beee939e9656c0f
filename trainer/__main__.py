"""Entry point. Works as `python -m <package>.trainer` and as `python <pack folder>/trainer`.

Run as a path, the pack's folder (whatever it is called) is registered as the package
`ingraph_trainer` so that relative imports work and the top-level `nodes/` never shadows
ComfyUI's own `nodes` module.
"""
import sys
import types
from pathlib import Path

PACKAGE = "ingraph_trainer"

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

sys.exit(main())
