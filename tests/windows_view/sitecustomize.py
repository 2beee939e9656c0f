"""Windows, as the pack's platform module sees it, in a real Linux process (tests/unit/test_windows_branches.py puts this
folder on PYTHONPATH of a ComfyUI server, whose trainers inherit it): `trainer/os_support.py` reads an `os` whose
name is "nt" and lacks killpg; os.killpg and socket.send_fds are removed from the process; Popen
takes Windows' CREATE_NEW_PROCESS_GROUP as a new session (POSIX refuses creationflags). Each process whose platform
module was loaded this way appends its pid to INGRAPH_FAKE_WINDOWS_MARK."""
import importlib.abc
import os
import socket
import subprocess
import sys
import types

CREATE_NEW_PROCESS_GROUP = 0x200

if os.environ.get("INGRAPH_FAKE_WINDOWS") == "1":
    _real_init = subprocess.Popen.__init__

    def _init(self, *args, creationflags=0, **kwargs):
        if creationflags == CREATE_NEW_PROCESS_GROUP:
            kwargs.setdefault("start_new_session", True)
            creationflags = 0
        _real_init(self, *args, creationflags=creationflags, **kwargs)
    subprocess.Popen.__init__ = _init

    class _WindowsView(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if not name.endswith(".trainer.os_support"):
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            real_exec = spec.loader.exec_module

            def exec_module(module):
                real_exec(module)
                view = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os)
                                                if not k.startswith("__") and k not in ("killpg", "getpgid", "setsid")})
                view.name = "nt"
                module.os = view
                with open(os.environ["INGRAPH_FAKE_WINDOWS_MARK"], "a") as mark:
                    mark.write(f"{os.getpid()}\n")
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _WindowsView())
    import psutil  # noqa: F401  Linux psutil (what the Windows branches call here) reads AF_UNIX when imported
    # socket.AF_UNIX and signal.SIGKILL stay: Linux's asyncio makes its self-pipe with the one, and torch and
    # transformers name the other when imported (their Windows builds do not); the in-process tests remove both
    for _module, _name in ((os, "killpg"), (socket, "send_fds")):
        if hasattr(_module, _name):
            delattr(_module, _name)
