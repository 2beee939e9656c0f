"""Real-size bench: the project's shipped workflow on a random-weight checkpoint with the full SD1.5 architecture
(860M UNet, CLIP-L, KL VAE; tools/realsize_models.py), in a headless ComfyUI server.

    python bench/realsize.py [--checkpoint realsize_sd15.safetensors] [--steps 4] [--no-native] [--no-base-bytes]
                             [--workflow train_evaluate_compare_api.json] [--work DIR --keep]

What it prints, for a first and a second run of the workflow in one server (the second changes only the
Train node's output name, as a user re-queueing does; ComfyUI re-runs what depends on the Train node):
- queue -> first training step (POST /prompt to the relayed first `step` event);
- the hand-off: the Train node's start (receipt of ComfyUI's `executing` message for its id) to the trainer's
  `started` event (its own `time` field; both wall clocks of this machine);
- bytes of model weights written, per node that wrote them, anywhere under the server's base directory
  (output/ingraph/models, the run folders, models/, temp/, and the system temp folder, which the server and its
  children get as <base>/tmp). Files are seen by a scan every 0.5 s and a final one, so copies deleted after
  the run still count. Model weights: .safetensors/.pt/.pth/.bin/.ckpt files of the model (UNet, VAE or text
  encoder keys) or any file of 64 MiB or more; the trained adapter itself and the dataset cache are listed apart.
  A file counts for the node that was executing when it was first seen (its writer);
- peak memory: the ComfyUI process and the trainer processes (every process started under ComfyUI), as the
  kernel's high-water mark (VmHWM in /proc/<pid>/status, sampled every 0.25 s while the process lives, so
  growth in a process's last 0.25 s can be missed) and the largest sampled RSS. ComfyUI's VmHWM covers its
  whole life (so the second run's is cumulative);
- the trainer's peak while loading (its VmHWM when its `started` event arrives) against the weights it holds
  (the `started` event's base-weight byte count where the trainer reports one, else UNet parameters x the
  training precision's element size, marked "estimated");
- seconds per step: ours (median of the trainer's step_time_s past the first step) and ComfyUI's own
  TrainLoraNode on the same checkpoint, images, rank, batch size and precision, measured differentially
  ((node time of a 1+N step run - of a 1 step run) / N), as bench/vs_native.py does;
- the trainer's base-weight bytes with a bf16 base and an fp8 base (a 1-step train-only run each, with the
  Train node's base_precision input where it has one), read from the `started` event; n/a where absent.
The last lines hold the ratios (ours / ComfyUI's TrainLoraNode, trainer load peak / held weights).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from client.api import ComfyClient  # noqa: E402
from tools.comfy_server import ComfyServer, comfyui_available  # noqa: E402

CKPT = "realsize_sd15.safetensors"
IMAGES = "realsize_images"
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".partial", ".tmp")
LARGE_FILE = 64 * 2**20
GIB = 2**30


# ---------------------------------------------------------------- processes and memory

def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Monitor:
    """Samples memory of the ComfyUI process and every process under it, and scans the base directory for files,
    tagging what it sees with the node ComfyUI is executing at that moment."""

    def __init__(self, server_pid: int, base_dir: Path, interval_s: float = 0.25, scan_every: int = 2):
        import psutil
        self.server = psutil.Process(server_pid)
        self.base_dir = base_dir
        self.interval_s = interval_s
        self.scan_every = scan_every
        self.node = None  # the node executing now (set from websocket messages)
        self.phase = "start-up"
        self.procs: dict[int, dict] = {}  # pid -> cmd, hwm_kib, rss_kib, phases
        self.files: dict[str, dict] = {}  # path -> size (largest seen), first_seen, node, phase
        self.phase_peaks: dict[tuple, int] = {}  # (phase, "comfyui"|"trainer") -> largest sampled RSS (KiB)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()
        self.scan()

    def _loop(self):
        n = 0
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
                if n % self.scan_every == 0:
                    self.scan()
            except Exception as exc:  # a process or file vanishing mid-read must not end the sampling
                print(f"monitor: {exc!r}", file=sys.stderr)
            n += 1

    def descendants(self) -> list:
        import psutil
        try:
            return self.server.children(recursive=True)
        except psutil.Error:
            return []

    def sample(self) -> dict[int, int]:
        """Reads VmHWM/VmRSS of the server and its descendants; returns pid -> VmHWM (KiB) of the descendants."""
        import psutil
        hwms = {}
        rss_total = 0
        with self._lock:
            for proc in [self.server, *self.descendants()]:
                hwm, rss = _status_kib(proc.pid, "VmHWM"), _status_kib(proc.pid, "VmRSS")
                if hwm is None or rss is None:
                    continue
                entry = self.procs.get(proc.pid)
                if entry is None:
                    try:
                        cmd = " ".join(proc.cmdline())[:160]
                    except psutil.Error:
                        cmd = "?"
                    entry = self.procs[proc.pid] = {"cmd": cmd, "hwm_kib": 0, "rss_kib": 0, "phases": set(),
                                                    "nodes": set(), "server": proc.pid == self.server.pid}
                entry["hwm_kib"] = max(entry["hwm_kib"], hwm)
                entry["rss_kib"] = max(entry["rss_kib"], rss)
                entry["phases"].add(self.phase)
                entry["nodes"].add((self.phase, self.node))
                role = "comfyui" if entry["server"] else "trainer"
                if role == "trainer":
                    hwms[proc.pid] = hwm
                    rss_total += rss
                else:
                    key = (self.phase, "comfyui")
                    self.phase_peaks[key] = max(self.phase_peaks.get(key, 0), rss)
            key = (self.phase, "trainer")
            self.phase_peaks[key] = max(self.phase_peaks.get(key, 0), rss_total)
        return hwms

    def scan(self):
        now = time.time()
        seen = []
        for root, _dirs, names in os.walk(self.base_dir):
            for name in names:
                path = os.path.join(root, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not os.path.isfile(path) or os.path.islink(path):
                    continue
                seen.append((path, st.st_size, st.st_mtime))
        with self._lock:
            for path, size, mtime in seen:
                entry = self.files.get(path)
                if entry is None:
                    self.files[path] = {"size": size, "first_seen": now, "node": self.node, "phase": self.phase,
                                        "mtime": mtime}
                else:
                    entry["size"] = max(entry["size"], size)
                    entry["mtime"] = mtime

    def trainer_peak_kib(self, phase: str, node: str | None = None) -> int:
        """Largest VmHWM of a process under ComfyUI that lived during `phase` (while `node` executed, if given)."""
        with self._lock:
            return max((p["hwm_kib"] for p in self.procs.values() if not p["server"] and phase in p["phases"]
                        and (node is None or (phase, node) in p["nodes"])), default=0)


# ---------------------------------------------------------------- files

def classify(path: Path, size: int, base_dir: Path) -> str:
    """'weights:<what>', 'adapter', 'cache', or 'other'."""
    rel = path.relative_to(base_dir).as_posix()
    if "/ingraph_data/cache/" in f"/{rel}" or "/ingraph/cache/" in f"/{rel}":  # the latter: earlier versions
        return "cache"
    if path.name.endswith(WEIGHT_SUFFIXES) or size >= LARGE_FILE:
        keys = safetensors_keys(path)
        if keys:
            if all(re.search(r"lora|\.alpha$|dora_scale|hada_|lokr_|\.diff(_b)?$|oft_", k) for k in keys):
                return "adapter"
            part = model_part(keys)
            if part != "other":
                return f"weights:{part}"
            return "weights:unknown" if size >= LARGE_FILE else "other"  # e.g. encoded preview prompts
        if size >= LARGE_FILE:
            return "weights:unknown"
        if re.search(r"(^|/)models/loras/|(^|/)ingraph/runs/", rel):
            return "adapter"  # checkpoints of the run: adapter and optimizer state
        return "weights:unknown" if path.suffix in (".pt", ".pth", ".bin", ".ckpt") else "other"
    return "other"


def safetensors_keys(path: Path) -> list[str]:
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 100 * 2**20:
                return []
            header = json.loads(f.read(n))
        return [k for k in header if k != "__metadata__"]
    except (OSError, ValueError):
        return []


def model_part(keys: list[str]) -> str:
    parts = set()
    for k in keys:
        if re.search(r"(^|\.)(input_blocks|middle_block|output_blocks|diffusion_model|double_blocks|joint_blocks)\.", k):
            parts.add("unet")
        elif re.search(r"(^|\.)(encoder|decoder|first_stage_model|taesd_encoder|taesd_decoder)\.|quant_conv", k) \
                and "text_model" not in k:
            parts.add("vae")
        elif "text_model" in k or "cond_stage_model" in k or k.startswith(("clip_", "t5")):
            parts.add("text encoder")
    return "+".join(sorted(parts)) or "other"


def written_files(monitor: Monitor, run: "TimedRun") -> list[dict]:
    """Files first seen during the run, classified, each with the node that wrote it: the node executing at the
    file's last modification (its writer finishing), or for a file gone since, the node executing when first seen."""
    out = []
    for path, entry in list(monitor.files.items()):
        if entry["phase"] != run.phase:
            continue
        p = Path(path)
        exists = p.exists()
        node = run.node_at(entry["mtime"]) if exists else entry["node"]
        out.append({"path": p.relative_to(monitor.base_dir).as_posix(), "size": entry["size"], "node": node,
                    "kind": classify(p, entry["size"], monitor.base_dir) if exists else classify_gone(p, entry)})
    return out


def classify_gone(path: Path, entry: dict) -> str:
    """A file deleted before the final scan: its name and size are all that is known."""
    if path.name.endswith(WEIGHT_SUFFIXES) and entry["size"] >= 2**20 or entry["size"] >= LARGE_FILE:
        return "weights:deleted"
    return "other"


# ---------------------------------------------------------------- workflows

def load_workflow(name: str) -> dict:
    path = Path(name) if Path(name).is_file() else REPO / "workflows" / "api" / name
    return json.loads(path.read_text())


def node_of(wf: dict, class_prefix: str) -> str:
    ids = [k for k, v in wf.items() if v["class_type"].startswith(class_prefix)]
    if len(ids) != 1:
        raise SystemExit(f"workflow: expected one {class_prefix}* node, found {ids}")
    return ids[0]


def adapt_workflow(wf: dict, output_name: str, steps: int) -> dict:
    wf = json.loads(json.dumps(wf))
    for node in wf.values():
        inputs = node["inputs"]
        if node["class_type"] == "CheckpointLoaderSimple":
            inputs["ckpt_name"] = CKPT
        if node["class_type"] == "InGraphLoadTrainingImages":
            inputs["folder"] = IMAGES
        if node["class_type"] == "InGraphSamplePreviews" and isinstance(inputs.get("every"), int):
            inputs["every"] = min(inputs["every"], steps)  # previews are rendered at least once in a short run
    train = wf[node_of(wf, "InGraphTrain")]["inputs"]
    train.update(steps=steps, output_name=output_name)
    return wf


def train_only(wf: dict) -> dict:
    """The Train node and what it depends on, without previews or evaluation: a bare training run."""
    wf = json.loads(json.dumps(wf))
    train = node_of(wf, "InGraphTrain")
    for optional in ("previews", "eval_dataset"):
        if isinstance(wf[train]["inputs"].get(optional), list):
            del wf[train]["inputs"][optional]
    needed, todo = set(), [train]
    while todo:
        node = todo.pop()
        if node not in needed:
            needed.add(node)
            todo += [v[0] for v in wf[node]["inputs"].values() if isinstance(v, list) and len(v) == 2 and v[0] in wf]
    return {k: v for k, v in wf.items() if k in needed}


def native_workflow(steps: int, rank: int, batch: int, precision: str, seed: int, prefix: str) -> dict:
    from bench.vs_native import native_workflow as stock_trainer_workflow
    return stock_trainer_workflow(steps, rank, batch, precision, seed, checkpoint=CKPT, images=IMAGES, prefix=prefix)


# ---------------------------------------------------------------- running

class TimedRun:
    def __init__(self, client: ComfyClient, monitor: Monitor | None, phase: str, train_node: str | None):
        self.client, self.monitor, self.phase, self.train_node = client, monitor, phase, train_node
        self.node_starts: list[tuple[float, str | None]] = []  # (wall time received, node id)
        self.events: list[tuple[float, dict]] = []  # (wall time received, ingraph event)
        self.hwm_at_started: dict[int, int] = {}
        self.t_queue = 0.0
        self.outcome = None

    def on_message(self, message: dict):
        now = time.time()
        kind, data = message.get("type"), message.get("data") or {}
        if kind == "executing":
            self.node_starts.append((now, data.get("node")))
            if self.monitor is not None:
                self.monitor.node = data.get("node")
        elif kind in ("execution_success", "execution_error", "execution_interrupted"):
            self.node_starts.append((now, None))
            if self.monitor is not None:
                self.monitor.node = None
        elif kind == "ingraph.event":
            event = data.get("event") or {}
            self.events.append((now, event))
            if event.get("type") == "started" and self.monitor is not None and self.monitor.node == self.train_node \
                    and not self.hwm_at_started:
                self.hwm_at_started = self.monitor.sample()

    def run(self, wf: dict, timeout: float) -> "TimedRun":
        if self.monitor is not None:
            self.monitor.phase = self.phase
        self.t_queue = time.time()
        self.outcome = self.client.run(wf, timeout=timeout, on_message=self.on_message)
        if self.monitor is not None:
            self.monitor.node = None
            self.monitor.scan()
            self.monitor.phase = "between runs"
        if not self.outcome.ok:
            raise RuntimeError(f"{self.phase}: {self.outcome.status}: {json.dumps(self.outcome.error)[:3000]}")
        return self

    def node_start(self, node: str) -> float | None:
        return next((t for t, n in self.node_starts if n == node), None)

    def window(self, node: str) -> tuple[float, float] | None:
        """(start, end) wall times of the node's execution."""
        for (t0, n), (t1, _) in zip(self.node_starts, self.node_starts[1:]):
            if n == node:
                return t0, t1
        return None

    def node_at(self, t: float) -> str | None:
        """The node executing at wall time t (None outside the prompt)."""
        found = None
        for t0, n in self.node_starts:
            if t0 <= t:
                found = n
        return found

    def node_seconds(self, node: str) -> float:
        window = self.window(node)
        if window is None:
            raise RuntimeError(f"{self.phase}: node {node} did not run")
        return window[1] - window[0]

    def train_events(self, kind: str) -> list[tuple[float, dict]]:
        """The Train node's events of one type (received while it executed)."""
        window = self.window(self.train_node) if self.train_node else None
        return [(t, e) for t, e in self.events if e.get("type") == kind
                and (window is None or window[0] <= t <= window[1])]

    def started(self) -> dict | None:
        found = self.train_events("started")
        return found[0][1] if found else None

    def first_step_s(self) -> float | None:
        steps = self.train_events("step")
        return steps[0][0] - self.t_queue if steps else None

    def before_first_step(self, titles: dict) -> str:
        """Where queue -> first step went: each node's seconds until the first step ("title 1.2 s, ...")."""
        steps = self.train_events("step")
        end = steps[0][0] if steps else float("inf")
        parts, previous = [], (self.t_queue, "queued")
        for t, node in [*self.node_starts, (end, None)]:
            if t > end:
                t = end
            start, name = previous
            if t - start >= 0.05:
                # a node that ran the trainer: when its process started working (the started event's own clock)
                began = next((e["time"] for when, e in self.events if start <= when <= t
                              and e.get("type") == "started" and isinstance(e.get("time"), (int, float))), None)
                parts.append(f"{name} {t - start:.1f} s" + (f" (its trainer started at {began - start:.1f} s)"
                                                             if began is not None else ""))
            if t >= end:
                break
            previous = (t, titles.get(node, node))
        return ", ".join(parts)

    def hand_off_s(self) -> float | None:
        start, started = self.node_start(self.train_node), self.started()
        if start is None or not started or not isinstance(started.get("time"), (int, float)):
            return None
        return started["time"] - start

    def step_seconds(self) -> float | None:
        steps = [e for _, e in self.train_events("step") if e.get("step_time_s") is not None]
        later = [e["step_time_s"] for e in steps if e.get("step", 0) >= 2] or [e["step_time_s"] for e in steps]
        return statistics.median(later) if later else None


def base_weight_bytes(started: dict | None) -> tuple[str, int] | None:
    """(field, bytes) of the trainer's base-weight byte count in its `started` event, if it reports one."""
    if not started:
        return None
    candidates = []

    def walk(obj, path):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and re.search(r"byte", path, re.I):
            candidates.append((path, int(obj)))
    walk(started, "")
    base = [c for c in candidates if re.search(r"base|frozen", c[0], re.I)]  # not the adapter's or optimizer's
    return base[0] if base else None


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / GIB:.2f} GiB ({int(n):,} B)" if n >= 2**20 else f"{int(n):,} B"


def fmt_s(s: float | None) -> str:
    return "n/a" if s is None else f"{s:.1f} s"


def purpose(f: dict, wf: dict) -> str:
    """What a model-weight file was written for, in the issue's terms."""
    node = wf.get(f["node"] or "", {})
    cls = node.get("class_type", "")
    if f["kind"] == "weights:vae":
        return "the previews' VAE" if cls.startswith("InGraphTrain") else f"a VAE (node {f['node']} {cls})"
    if cls.startswith("InGraphTrain"):
        return "the Train node's hand-off"
    if cls.startswith("InGraphEvaluate"):
        source = node["inputs"].get("model")
        source_cls = wf.get(source[0], {}).get("class_type", "?") if isinstance(source, list) else "?"
        what = "the Train node's output MODEL" if source_cls.startswith("InGraphTrain") else f"a MODEL from {source_cls}"
        return f"Evaluate (node {f['node']}) on {what}"
    return f"node {f['node']} {cls}"


def report_files(run: TimedRun, monitor: Monitor, wf: dict) -> int:
    files = written_files(monitor, run)
    weights = [f for f in files if f["kind"].startswith("weights")]
    total = sum(f["size"] for f in weights)
    label = {k: f"{k} {v['class_type']}" for k, v in wf.items()}
    by_purpose: dict[str, int] = {}
    for f in weights:
        by_purpose[purpose(f, wf)] = by_purpose.get(purpose(f, wf), 0) + f["size"]
    print(f"  model weights written: {fmt_bytes(total)} in {len(weights)} file(s)")
    for what, size in sorted(by_purpose.items()):
        print(f"    for {what}: {fmt_bytes(size)}")
    for f in weights:
        print(f"    {f['kind']}: {f['path']} {fmt_bytes(f['size'])} (node {label.get(f['node'], f['node'])})")
    for kind in ("adapter", "cache"):
        chosen = [f for f in files if f["kind"] == kind]
        if chosen:
            print(f"  {kind} files written (not counted as model weights): {fmt_bytes(sum(f['size'] for f in chosen))} "
                  f"in {len(chosen)} file(s)")
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path,
                        help="the random-weight SD1.5 checkpoint (built there by tools/realsize_models.py if missing; "
                             "default <work>/realsize_sd15.safetensors)")
    parser.add_argument("--workflow", default="train_evaluate_compare_api.json",
                        help="API-format workflow from workflows/api/ (or a path) with one InGraphTrain* node")
    parser.add_argument("--steps", type=int, default=4, help="training steps of each run of ours")
    parser.add_argument("--images", type=int, default=8, help="training images (captioned, square)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--no-native", action="store_true", help="skip ComfyUI's TrainLoraNode baseline (slow)")
    parser.add_argument("--no-base-bytes", action="store_true",
                        help="skip the two 1-step runs that read the trainer's base-weight bytes in bf16 and fp8")
    parser.add_argument("--work", type=Path, help="server base directory (default: a temporary one, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary base directory")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed for each queued workflow")
    opts = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # figures appear as they are measured, also through a pipe
    if not comfyui_available():
        sys.exit("ComfyUI not found (set COMFYUI_PATH)")
    if opts.work:
        opts.work.mkdir(parents=True, exist_ok=True)
        bench(opts, opts.work)
    elif opts.keep:
        bench(opts, Path(tempfile.mkdtemp(prefix="ingraph-realsize-")))
    else:
        with tempfile.TemporaryDirectory(prefix="ingraph-realsize-") as tmp:
            bench(opts, Path(tmp))


def bench(opts, base: Path):
    from tools.embedded_default import build_images
    checkpoint = (opts.checkpoint or base / "realsize_sd15.safetensors").resolve()
    if not checkpoint.is_file():
        from tools.realsize_models import build_sd15
        t0 = time.monotonic()
        build_sd15(checkpoint)
        print(f"built {checkpoint} in {time.monotonic() - t0:.0f} s")
    server_base = base / "comfy"
    link = server_base / "models" / "checkpoints" / CKPT
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(checkpoint)
    build_images(server_base / "input" / IMAGES, count=opts.images, size=opts.size)
    (server_base / "tmp").mkdir(exist_ok=True)
    opts.checkpoint_path = checkpoint
    unet_params = unet_parameters(checkpoint)
    shipped = load_workflow(opts.workflow)
    train_node = node_of(shipped, "InGraphTrain")
    train_inputs = shipped[train_node]["inputs"]
    precision = train_inputs.get("precision", "bf16")
    adapter_inputs = shipped[train_inputs["adapter"][0]]["inputs"] if isinstance(train_inputs.get("adapter"), list) else {}
    rank, batch = int(adapter_inputs.get("rank", 8)), int(train_inputs.get("batch_size", 2))

    print(f"setup: {checkpoint.name} ({fmt_bytes(checkpoint.stat().st_size)}, UNet {unet_params / 1e6:.0f}M parameters), "
          f"workflow {opts.workflow}, {opts.steps} steps, {opts.images} images {opts.size}x{opts.size}, rank {rank}, "
          f"batch {batch}, {precision}, commit {git_head()}, {device_line()}")
    server = ComfyServer(server_base, extra_env={"TMPDIR": str(server_base / "tmp")})
    t0 = time.monotonic()
    server.start()
    monitor = None
    try:
        server.wait_ready(300)
        print(f"server ready in {time.monotonic() - t0:.1f} s")
        monitor = Monitor(server.proc.pid, server_base).start()
        client = ComfyClient(server.address)
        train_schema = client.get("/object_info/InGraphTrainLoRA").get("InGraphTrainLoRA", {}).get("input", {})
        results = {}
        for n in (1, 2):
            wf = adapt_workflow(shipped, f"realsize_run{n}", opts.steps)
            run = TimedRun(client, monitor, f"run {n}", train_node).run(wf, opts.timeout)
            results[n] = run
            started = run.started() or {}
            held = base_weight_bytes(started)
            hwm_loading = max(run.hwm_at_started.values(), default=0) * 1024 or None
            print(f"run {n}: queue -> first step {fmt_s(run.first_step_s())}; hand-off (Train node start -> started) "
                  f"{fmt_s(run.hand_off_s())}; ours {fmt_s(run.step_seconds())}/step; whole workflow "
                  f"{fmt_s(run.node_starts[-1][0] - run.t_queue)}")
            titles = {k: (v.get("_meta") or {}).get("title") or v["class_type"] for k, v in wf.items()}
            print(f"  until the first step: {run.before_first_step(titles)}")
            run.bytes_written = report_files(run, monitor, wf)
            comfy_peak = monitor.phase_peaks.get((run.phase, "comfyui"), 0) * 1024
            print(f"  ComfyUI process: peak RSS sampled {fmt_bytes(comfy_peak)}, VmHWM so far "
                  f"{fmt_bytes(monitor.procs[server.proc.pid]['hwm_kib'] * 1024)}")
            print(f"  trainer processes: the Train node's peak VmHWM "
                  f"{fmt_bytes(monitor.trainer_peak_kib(run.phase, train_node) * 1024)}; any process under ComfyUI "
                  f"(Evaluate nodes' included) {fmt_bytes(monitor.trainer_peak_kib(run.phase) * 1024)}; largest "
                  f"sampled RSS summed over them {fmt_bytes(monitor.phase_peaks.get((run.phase, 'trainer'), 0) * 1024)}")
            run.load_ratio = load_ratio_line(hwm_loading, held, precision, unet_params)
            print(f"  trainer while loading: {run.load_ratio[1]}")
            run.load_rise = load_rise_line(started.get("load_memory"), held)
            print(f"  the load itself: {run.load_rise[1]}")
            print(f"  started event: {json.dumps(started)[:600]}")

        base_bytes = {}
        if not opts.no_base_bytes:
            base_bytes = base_weight_runs(client, monitor, shipped, train_node, train_schema, opts)
        native = native_first = native_cold = None
        if not opts.no_native:
            native, native_first = native_seconds(client, monitor, opts, rank, batch, precision)
        client.close()
    except BaseException:
        print(f"ComfyUI log tail ({server.log_path}):\n{server.log_tail(80)}", file=sys.stderr)
        raise
    finally:
        if monitor is not None:
            monitor.stop()
        server.stop()
    if not opts.no_native:  # after ours' server is gone: the two never share the machine
        native_cold = native_cold_first_step(opts, server_base, rank, batch, precision)
        print(f"native TrainLoraNode, first run in a fresh server: queue -> end of its 1-step node {native_cold:.1f} s")

    print("processes seen under ComfyUI (VmHWM):")
    for pid, p in sorted(monitor.procs.items()):
        print(f"  {pid} {'comfyui' if p['server'] else 'child'} {fmt_bytes(p['hwm_kib'] * 1024)}: {p['cmd'][:120]}")
    print("summary:")
    for n, run in results.items():
        print(f"  run {n}: queue -> first step {fmt_s(run.first_step_s())}, hand-off {fmt_s(run.hand_off_s())}, "
              f"model weights written {fmt_bytes(run.bytes_written)}, trainer load peak/held {run.load_ratio[1]}")
    print(f"  ComfyUI process peak (VmHWM over the bench): {fmt_bytes(monitor.procs[server.proc.pid]['hwm_kib'] * 1024)}")
    print(f"  trainer peak (VmHWM of the Train node's processes): "
          + ", ".join(f"run {n} {fmt_bytes(monitor.trainer_peak_kib(r.phase, train_node) * 1024)}" for n, r in results.items()))
    for label in ("bf16", "fp8"):
        value = base_bytes.get(label)
        print(f"  trainer base-weight bytes, {label} base: "
              + (f"{fmt_bytes(value[1])} (started.{value[0]})" if value else "n/a"))
    ours = statistics.median([r.step_seconds() for r in results.values() if r.step_seconds() is not None] or [float("nan")])
    print(f"  s/step: ours {ours:.3f}, ComfyUI TrainLoraNode " + (f"{native:.3f}" if native else "n/a (skipped)"))
    if native_first is not None:
        print(f"  queue -> first step: TrainLoraNode at most {native_cold:.1f} s on its first run in a fresh server, "
              f"{native_first:.1f} s with the checkpoint loaded; ours "
              + ", ".join(f"run {n} {fmt_s(r.first_step_s())}" for n, r in results.items()))
    ratios = [f"ours/native s/step {ours / native:.3f}" if native else "ours/native s/step n/a"]
    for n, run in results.items():
        ratios.append(f"run {n} trainer load peak/held {run.load_ratio[0]:.2f}" if run.load_ratio[0] else
                      f"run {n} trainer load peak/held n/a")
        ratios.append(f"run {n} load rise/held {run.load_rise[0]:.2f}" if run.load_rise[0] else
                      f"run {n} load rise/held n/a")
    if base_bytes.get("bf16") and base_bytes.get("fp8"):
        ratios.append(f"fp8/bf16 base bytes {base_bytes['fp8'][1] / base_bytes['bf16'][1]:.3f}")
    print("ratios: " + "; ".join(ratios))


def unet_parameters(checkpoint: Path) -> int:
    """Elements of the checkpoint's UNet tensors, from its safetensors header."""
    import math
    with open(checkpoint, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k.startswith("model.diffusion_model."))


def load_rise_line(load_memory, held) -> tuple[float | None, str]:
    """What loading the model needed above what the trainer held before it (its `started` event's load_memory:
    VmHWM at the load's end, restarted at its start, minus VmRSS at its start) against the weights it holds.
    Whole-process figures also count the imports (torch's libraries alone are about 0.5 GiB resident)."""
    if not isinstance(load_memory, dict) or not held or not all(
            isinstance(load_memory.get(k), int) for k in ("rss_before", "peak")):
        return None, "n/a (the started event has no load_memory)"
    rise = load_memory["peak"] - load_memory["rss_before"]
    return rise / held[1], (f"peak {fmt_bytes(load_memory['peak'])} - before {fmt_bytes(load_memory['rss_before'])} "
                            f"= {fmt_bytes(rise)} for {fmt_bytes(held[1])} held: {rise / held[1]:.2f}x")


def load_ratio_line(hwm_loading: int | None, held, precision: str, unet_params: int) -> tuple[float | None, str]:
    if not hwm_loading:
        return None, "n/a (no trainer process sampled at its started event)"
    if held:
        held_bytes, source = held[1], f"started.{held[0]}"
    else:
        held_bytes, source = unet_params * (4 if precision == "fp32" else 2), f"estimated: UNet x {precision}"
    ratio = hwm_loading / held_bytes
    return ratio, f"{ratio:.2f} (VmHWM at started {fmt_bytes(hwm_loading)} / held {fmt_bytes(held_bytes)}, {source})"


def base_weight_runs(client, monitor, shipped, train_node, train_schema, opts) -> dict:
    """1-step train-only runs with a bf16 base and an fp8 base; the trainer's reported base-weight bytes."""
    schema_inputs = {**train_schema.get("required", {}), **train_schema.get("optional", {})}
    spec = schema_inputs.get("base_precision") or [None]
    # a combo is [options, {...}] in the classic object_info, ["COMBO", {"options": [...]}] for comfy_api nodes
    choices = spec[0] if isinstance(spec[0], list) else \
        (spec[1].get("options") if len(spec) > 1 and isinstance(spec[1], dict) else None)
    choices = choices if isinstance(choices, list) else []
    variants = [("bf16", next((c for c in choices if "fp8" not in str(c).lower()), None))]
    fp8 = next((c for c in choices if "fp8" in str(c).lower()), None)
    if fp8 is None:
        print("base-weight runs: the Train node has no base_precision input with an fp8 choice: fp8 n/a")
    else:
        variants.append(("fp8", fp8))
    found = {}
    for label, choice in variants:
        wf = train_only(adapt_workflow(shipped, f"realsize_base_{label}", 1))
        inputs = wf[train_node]["inputs"]
        inputs["precision"] = "bf16"
        if choice is not None:
            inputs["base_precision"] = choice
        run = TimedRun(client, monitor, f"base {label}", train_node).run(wf, opts.timeout)
        started = run.started()
        found[label] = base_weight_bytes(started)
        hwm = max(run.hwm_at_started.values(), default=0) * 1024 or None
        ratio = load_ratio_line(hwm, found[label], "bf16", unet_parameters(opts.checkpoint_path))[1]
        print(f"base {label} (precision bf16, base_precision {choice!r}): base-weight bytes "
              f"{fmt_bytes(found[label][1]) if found[label] else 'n/a (no byte count in started)'}; "
              f"hand-off {fmt_s(run.hand_off_s())}; trainer load peak/held {ratio}")
        report_files(run, monitor, wf)
    return found


def native_seconds(client, monitor, opts, rank, batch, precision) -> tuple[float, float]:
    """ComfyUI's TrainLoraNode: (s/step, differential: (node time at 1+N steps - at 1 step) / N; queue -> the end of
    its 1-step run's node). TrainLoraNode reports no step (0.3.64 draws no progress bar), so the second is an upper
    bound of its queue -> first step: it adds what the node does after its one step. It runs after ours, in the
    same server, so it finds the checkpoint loaded (ComfyUI's cache of the loader's output), as ours does in run 2."""
    times, first_step = {}, None
    for steps in (1, 1 + opts.steps):
        run = TimedRun(client, monitor, f"native {steps}", "4").run(
            native_workflow(steps, rank, batch, precision, seed=1, prefix=f"realsize_native_{steps}"), opts.timeout)
        times[steps] = run.node_seconds("4")
        if steps == 1:
            first_step = run.window("4")[1] - run.t_queue
        print(f"native TrainLoraNode, {steps} step(s): node {times[steps]:.1f} s")
    per_step = (times[1 + opts.steps] - times[1]) / opts.steps
    print(f"native TrainLoraNode: {per_step:.3f} s/step (LoRA rank {rank} on every weight, {precision}, batch {batch}); "
          f"queue -> end of its 1-step node {first_step:.1f} s (at most its queue -> first step)")
    return per_step, first_step


def native_cold_first_step(opts, server_base: Path, rank, batch, precision) -> float:
    """TrainLoraNode's first run in a server of its own, as a user's first queue meets it: queue -> the end of its
    1-step node (at most its queue -> first step), the checkpoint loaded cold by ComfyUI (the file itself is in
    the system's page cache, as it is for ours)."""
    base = server_base.parent / "comfy_native"
    link = base / "models" / "checkpoints" / CKPT
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(opts.checkpoint_path)
    images = base / "input" / IMAGES
    if not images.exists():  # a copy: ComfyUI's folder listing does not follow a linked folder
        import shutil
        shutil.copytree(server_base / "input" / IMAGES, images)
    server = ComfyServer(base, with_pack=False)
    server.start()
    try:
        server.wait_ready(300)
        client = ComfyClient(server.address)
        run = TimedRun(client, None, "native cold", "4").run(
            native_workflow(1, rank, batch, precision, seed=1, prefix="realsize_native_cold"), opts.timeout)
        client.close()
        return run.window("4")[1] - run.t_queue
    finally:
        server.stop()


def git_head() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "n/a"
    except OSError:
        return "n/a"


def device_line() -> str:
    return f"CPU ({os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
