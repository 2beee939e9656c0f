from . import __getattr__  # noqa: F401  every attribute raises, naming torchaudio
