"""A stand-in for torchaudio where no build matches the installed torch (ComfyUI 0.33 imports it at start-up; the
pack never uses audio). Importing works; using anything raises, naming the missing package. Test environments
only: scripts/setup.sh puts it on the path of the ComfyUI 0.33 tier (DESIGN.md, the third round's facts)."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"torchaudio.{name}: torchaudio is not installed (a test stand-in; audio is not supported here)")
