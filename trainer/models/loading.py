"""Loading a model file with ComfyUI's own loaders without holding the whole file in memory alongside the model.

ComfyUI's `load_torch_file` memory-maps a safetensors file and `load_model_weights` hands every tensor to
`load_state_dict`, which copies them into the model one module at a time. Each page of the file it reads stays
mapped into the process until the loader returns, so the load peaks at the model plus the whole file (1.9-3x the
weights held, file-backed pages count in the process's memory). `released_after_copy` drops each tensor's pages
of the file from the process right after load_state_dict has copied it, while ComfyUI's code path runs unchanged:
the same detection, dtype choice, weight_dtype casting and key processing, so the weights are ComfyUI's bit for
bit. Dropping a clean page of a file mapping loses nothing (it is read back from the file if touched again); a
page anyone wrote to (copy-on-write, no longer the file's) is never dropped, nor is anything outside the file's
own mappings (tensors ComfyUI computed while processing keys, the model's own weights).

Where this does nothing, the load is ComfyUI's as before, with its peak: on systems without /proc/self/maps and
madvise (not Linux), with ComfyUI's --disable-mmap (the file is copied, not mapped), and with a model class that
overrides `load_model_weights` or modules that override `_load_from_state_dict` without its pre-hooks.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import struct

MADV_DONTNEED = 4
PAGEMAP_PRESENT = 1 << 63
PAGEMAP_SWAPPED = 1 << 62
PAGEMAP_FILE_OR_SHARED = 1 << 61  # clear for a private page that was written to (copy-on-write)


def file_mappings(path: str) -> list[tuple[int, int]]:
    """(start, end) of this process's memory mappings of `path`, from /proc/self/maps; empty where unknown."""
    target = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].rstrip("\n") == target:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


class PageReleaser:
    """Drops ranges of a file's mappings from the process (madvise MADV_DONTNEED), page-aligned inward, and only
    where every resident page still holds the file's bytes."""

    def __init__(self, ranges: list[tuple[int, int]]):
        self.ranges = ranges
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.madvise = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.pagemap = open("/proc/self/pagemap", "rb", buffering=0)
        self.released_bytes = 0

    def close(self) -> None:
        self.pagemap.close()

    def _all_file_pages(self, start: int, end: int) -> bool:
        count = (end - start) // self.page
        try:
            self.pagemap.seek(start // self.page * 8)
            entries = self.pagemap.read(count * 8)
        except OSError:
            return False
        if len(entries) != count * 8:
            return False
        # a page swapped out (not present, but in swap) may hold written data that the file cannot give back
        return all(not (e & (PAGEMAP_PRESENT | PAGEMAP_SWAPPED)) or e & PAGEMAP_FILE_OR_SHARED
                   for e in struct.unpack(f"<{count}Q", entries))

    def release_all(self, chunk: int = 1 << 20) -> None:
        """Every clean page of the file's mappings (a page written to keeps its chunk), e.g. those the kernel read
        ahead while ComfyUI read the file's header and detected the model."""
        for lo, hi in self.ranges:
            for start in range(lo, hi, chunk):
                end = min(hi, start + chunk)
                if self._all_file_pages(start, end) and self.madvise(start, end - start, MADV_DONTNEED) == 0:
                    self.released_bytes += end - start

    def release(self, tensor) -> None:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return
        span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        first = tensor.data_ptr()
        last = first + span * tensor.element_size()
        start = -(-first // self.page) * self.page
        end = last // self.page * self.page
        if end <= start or not any(lo <= start and end <= hi for lo, hi in self.ranges):
            return
        if not self._all_file_pages(start, end):
            return
        if self.madvise(start, end - start, MADV_DONTNEED) == 0:
            self.released_bytes += end - start


def why_not_deferred(diffusion_model) -> str | None:
    """Why the parameters of this freshly built model cannot be left unfilled for a later, partitioned load
    (None: they can): a module whose own state-dict loading would do more than copy each tensor into its parameter
    (a scaled-fp8 or quantized layer), or weights ComfyUI creates while loading (0.33's dynamic VRAM)."""
    import torch
    own = torch.nn.Module._load_from_state_dict
    for name, module in diffusion_model.named_modules():
        loader = type(module)._load_from_state_dict
        # ComfyUI's plain ops override it only to create the weights lazily (0.33's dynamic VRAM), else defer to
        # torch's own, which is what a deferred load repeats
        plain_comfy_op = loader.__module__ == "comfy.ops" and loader.__qualname__.startswith("disable_weight_init.")
        if loader is not own and not plain_comfy_op:
            return f"{name or 'the model'} ({type(module).__name__}) loads its weights its own way"
        if plain_comfy_op and getattr(module, "weight", 0) is None:
            return f"{name} creates its weights while loading (ComfyUI's dynamic VRAM)"
    return None


def _deferring_load(diffusion_model, deferred: dict):
    """A load_state_dict for `diffusion_model` that loads its buffers and records, for each parameter, the file's
    tensor (memory-mapped, not read) in `deferred` instead of copying it: ComfyUI's key processing and checks run as
    before, and the parameters stay as built (torch.empty: no page of them is touched until a partition is taken)."""
    import torch

    def load_state_dict(state_dict, strict=True, assign=False):
        params = dict(diffusion_model.named_parameters(remove_duplicate=False))
        rest = {k: v for k, v in state_dict.items() if k not in params}
        result = torch.nn.Module.load_state_dict(diffusion_model, rest, strict=False)
        missing = [k for k in result.missing_keys if k not in params]
        for name, param in params.items():
            source = state_dict.get(name)
            if source is None:
                missing.append(name)
                continue
            if tuple(source.shape) != tuple(param.shape):
                raise RuntimeError(f"size mismatch for {name}: the file has {tuple(source.shape)}, "
                                   f"the model {tuple(param.shape)}")
            deferred[param] = source
        return result._replace(missing_keys=missing)
    return load_state_dict


def file_releaser(path: str) -> PageReleaser | None:
    """A PageReleaser for this process's mappings of `path`; None where it has none, or where the system has no
    pagemap or madvise (then nothing is dropped: ComfyUI's load as it is)."""
    ranges = file_mappings(path)
    try:
        return PageReleaser(ranges) if ranges else None
    except (OSError, AttributeError):
        return None


def _release_mapped_file(path: str, report: dict) -> None:
    releaser = file_releaser(path)
    if releaser is not None:
        releaser.release_all()
        report["released_bytes"] += releaser.released_bytes
        releaser.close()


@contextlib.contextmanager
def released_after_copy(path: str, deferred: dict | None = None, before_whole_load=None):
    """While ComfyUI loads `path` (comfy.sd.load_diffusion_model, load_checkpoint_guess_config), each tensor of
    the file leaves the process's memory as soon as the model holds its copy. Yields a dict whose
    "released_bytes" tells how much was dropped (0 where nothing could be).

    With `deferred` (a dict), the diffusion model's parameters are not filled at all where why_not_deferred allows:
    `deferred` maps each parameter to its tensor of the file, for a partitioned load (partitioned_load.py), and the
    report's "deferred" says why not where they were filled; `before_whole_load(why)` is called then, before the
    model is filled."""
    import comfy.model_base
    from ..comfy_compat import wrap_method
    report = {"released_bytes": 0}

    def make_wrapper(original):
        def load_model_weights(self, sd, *args, **kwargs):
            if kwargs.get("assign") or (len(args) > 1 and args[1]):
                # the model takes the file's tensors as its own (ComfyUI 0.33's dynamic VRAM): nothing is copied,
                # so nothing may be released
                report["deferred"] = "the model takes the file's tensors as its own (ComfyUI's dynamic VRAM)"
                if deferred is not None and before_whole_load is not None:
                    before_whole_load(report["deferred"])
                return original(self, sd, *args, **kwargs)
            if deferred is not None:
                report["deferred"] = why_not_deferred(self.diffusion_model)
                if report["deferred"] is not None and before_whole_load is not None:
                    before_whole_load(report["deferred"])
                if report["deferred"] is None:
                    self.diffusion_model.load_state_dict = _deferring_load(self.diffusion_model, deferred)
                    try:
                        return original(self, sd, *args, **kwargs)
                    finally:
                        del self.diffusion_model.load_state_dict
                        _release_mapped_file(path, report)  # its pages are read again, a slice each, later
            releaser = file_releaser(path)
            if releaser is None:
                return original(self, sd, *args, **kwargs)
            copied: list = []  # the file tensors of the module load_state_dict is filling now

            def before_module(module, state_dict, prefix, *_):
                # modules are filled one after another, each before its children: when the next one starts,
                # the previous one's tensors have been copied
                for tensor in copied:
                    releaser.release(tensor)
                copied.clear()
                for name in (*module._parameters, *module._buffers):
                    source = state_dict.get(prefix + name)
                    if source is not None and hasattr(source, "data_ptr"):
                        copied.append(source)

            hooks = [m.register_load_state_dict_pre_hook(before_module) for m in self.diffusion_model.modules()]
            try:
                return original(self, sd, *args, **kwargs)
            finally:
                for hook in hooks:
                    hook.remove()
                for tensor in copied:
                    releaser.release(tensor)
                report["released_bytes"] += releaser.released_bytes
                releaser.close()
        return load_model_weights

    with wrap_method(comfy.model_base.BaseModel, "load_model_weights", make_wrapper):
        yield report
