"""The distillation quality check (issue 16): a tiny teacher trained from scratch, distilled into a few-step student,
and the Fréchet distance of each few-step sample set to the teacher's 25-step samples.

    python tools/distill_quality.py --work DIR [--samples 512 --teacher-steps 800 --reuse-teacher
        --set train.steps=300 --set distill.fake_score_per_step=false ... | --student-is-teacher | --no-distill]

Everything is the pack's own: the dataset is a folder of captioned 64x64 images with visible structure (four
captions, each a pattern in four variants over a fine random texture, 64 images each), cached through the cache
code with a 16-channel TAESD (tools/tiny_models.py, at vae_scale 0.25) and a synthetic text encoder
(tests/comfy_nodes: a fixed pseudo-random embedding per caption, the tiny SD3's widths). The teacher is the New
Model builder's SD3 (trainer/models SCRATCH_FAMILIES) at one joint block, trained from scratch by the trainer
program (adapter kind "full", 20% of samples on the empty caption), then distilled by the trainer program (task
"distill", DISTILL_SETTINGS, each overridable with --set). Samples come from ComfyUI's own KSampler path
(comfy.sample.sample): the teacher with euler / normal at TEACHER_CFG, the student with lcm / sgm_uniform at CFG 1.
The teacher's sets are sampled in a child while the student distils (two cores).

The distance is on latents: each 16x8x8 sample latent (flattened, 1024 values) is mapped by one fixed Gaussian
random projection (seed 0) to FEATURE_DIM = 8 dimensions; the Fréchet distance of the two Gaussians fitted to the
features is computed in float64 with the matrix square root taken by eigen-decomposition. "fd_teacher25_floor" is
the distance between two 25-step sets from different noise: what finite sampling alone leaves. The last line
printed is a JSON object with every figure; the sample sets are kept in DIR/sample_sets.pt.

Figures (512 samples, 8 features; the same on every run here, all seeded): the 25-step floor 0.022, noise 16.2;
the teacher's 1 step 0.230 and 4 steps 0.103; the student (DISTILL_SETTINGS: a fake score per student step, 200
updates) 1 step 0.030 (0.13x) and 4 steps 0.047 (0.46x); with the distillation's seed 1: 0.030 / 0.035 (0.13x /
0.34x), seed 2: 0.026 / 0.043 (0.11x / 0.41x). The teacher sampled as the student (--student-is-teacher) is 1.0x
and 2.5x: the rule tells a distilled student from an undistilled one.

With one fake score (DMD2's; distill.fake_score_per_step false) the 4-step rule failed at every setting tried:
seed 0, 300 updates gave 0.059 / 0.080 (0.26x / 0.78x); seeds 1 and 2 gave 0.228 / 0.068 and 0.097 / 0.203 (0.99x
/ 0.66x, 0.42x / 1.97x); 600 updates, cosine decay, an EMA of the student, CFG 2, other learning rates, 2 or 10
fake updates, the GAN term, more texture: each within that spread or worse. Most of the distance was the mean term,
and logging the DMD step showed why: the student's x0 at each of its 4 steps had latent channel means 0.1-0.3 off
the reference's, in directions that cancelled over the steps (their mean over the steps 0.006 off). One fake score
learns the mix of every step's outputs, so the gradient it gives matches only the mix to the teacher; the last
step's output, which the 4-step sampler returns, kept its drift. A fake score per step learns each step's own
outputs. (Sharing one backward-simulated chain among the steps' fake scores, which is cheaper, gave 0.52x / 0.39x
/ 0.47x at 4 steps; cosine decay on top, 0.53x / 0.54x; 3 fake updates, 0.66x / 0.40x / 0.42x.)

Trainer runs are children forked from this process after one import of the trainer program (as
tests/helpers/train_forked.py does), so the check pays ComfyUI's and the trainer's imports once.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.bootstrap import bootstrap  # noqa: E402

# 8 random features: the bias of a Fréchet distance between two finite sets of one distribution grows as
# FEATURE_DIM^2 / samples, while a spread the few-step samples lack adds about FEATURE_DIM times its share; at 512
# samples the 25-step floor is ~0.02 here at 8 features (2.1 at 64)
FEATURE_DIM = 8
RESOLUTION = 64  # 64x64 images: 16x8x8 latents
# four captions, each a pattern in four variants (_pattern) at CONTRAST, over a fine TEXTURE: one random level per
# 8x8 block (one latent pixel) and colour channel, a spread that a 4-step Euler sampler averages away (it keeps
# ~55% of the 25-step samples' within-caption variance here, its 1 step ~40%)
CAPTIONS = ("a red square", "blue stripes", "a green cross", "a yellow gradient")
CONTRAST, TEXTURE, TEXTURE_BLOCK = 0.6, 0.5, 8
# no guidance: the distribution the 25-step reference samples is then the one DMD's real score describes (with CFG 2
# the student's per-caption means drifted from the reference's by 3 to 5 times the floor's)
TEACHER_CFG = 1.0
REFERENCE_STEPS = 25
# the distillation: a full-weight 4-step student (sampled at 1 and 4 steps) with a fake score per step; 30
# regression updates first (its per-caption means start near the data's); see the module docstring for the figures
DISTILL_SETTINGS = {"adapter.kind": "full", "train.steps": 200, "distill.fake_score_per_step": True,
                    "train.batch_size": 16, "train.learning_rate": 5e-4, "train.lr_schedule": "constant",
                    "train.weight_decay": 0.0, "distill.student_steps": 4, "distill.guidance_scale": TEACHER_CFG,
                    "distill.fake_learning_rate": 5e-4, "distill.fake_updates": 5, "distill.regression_steps": 30}


def _pattern(caption_index: int, rng) -> "np.ndarray":
    """An image of a caption: its pattern in one of four variants, neighbours 8 pixels (one latent pixel) apart:
    modes that noise hides until late in sampling, so that few-step sampling averages them into a blur."""
    import numpy as np
    img = np.zeros((RESOLUTION, RESOLUTION, 3), dtype=np.float32)
    a, b = (int(v) for v in rng.integers(0, 2, size=2))
    if caption_index == 0:  # a square at one of 2 x 2 places
        img[16 + 8 * a:40 + 8 * a, 16 + 8 * b:40 + 8 * b, 0] = 1.0
    elif caption_index == 1:  # vertical or horizontal stripes at one of 2 phases
        for x in range(8 * a, RESOLUTION, 16):
            if b:
                img[:, x:x + 8, 2] = 1.0
            else:
                img[x:x + 8, :, 2] = 1.0
    elif caption_index == 2:  # a cross centred at one of 2 x 2 places
        cx, cy = 24 + 8 * a, 24 + 8 * b
        img[cy - 4:cy + 4, cx - 16:cx + 16, 1] = 1.0
        img[cy - 16:cy + 16, cx - 4:cx + 4, 1] = 1.0
    else:  # a yellow ramp in one of 4 directions
        ramp = np.linspace(0.0, 1.0, RESOLUTION, dtype=np.float32)
        ramp = ramp if a else ramp[::-1]
        img[:, :, 0] = ramp[None, :] if b else ramp[:, None]
        img[:, :, 1] = img[:, :, 0]
    blocks = rng.standard_normal((RESOLUTION // TEXTURE_BLOCK, RESOLUTION // TEXTURE_BLOCK, 3)).astype(np.float32)
    img = np.clip(0.5 + CONTRAST * (img - 0.5) + TEXTURE * blocks.repeat(TEXTURE_BLOCK, 0).repeat(TEXTURE_BLOCK, 1), 0, 1)
    return img


def write_images(folder: Path, per_caption: int, seed: int = 0) -> Path:
    """A folder of `per_caption` captioned PNGs for each caption."""
    import numpy as np
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for c, caption in enumerate(CAPTIONS):
        for n in range(per_caption):
            stem = folder / f"c{c}_{n:03d}"
            Image.fromarray((_pattern(c, rng) * 255).round().astype(np.uint8)).save(stem.with_suffix(".png"))
            stem.with_suffix(".txt").write_text(caption)
    return folder


def synthetic_sd3_clip():
    """The test suite's synthetic text encoder at the tiny SD3's widths (64-wide text, 32-wide pooled)."""
    import importlib.util
    path = REPO / "tests" / "comfy_nodes" / "ingraph_test_nodes" / "__init__.py"
    spec = importlib.util.spec_from_file_location("ingraph_test_nodes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SyntheticClip("sd3")


def build_vae(path: Path) -> Path:
    """tools/tiny_models.py's random 16-channel TAESD with TAESD's own latent scale set (vae_scale 0.25): its
    latents of these images have a standard deviation near 0.6, about 1 once SD3's latent format scales them, as
    a real VAE's have (at its raw 0.15 the noise swamps the images and a tiny model learns them far more slowly)."""
    import comfy.utils
    import torch
    from tools.tiny_models import _save, build_vae16
    state = comfy.utils.load_torch_file(str(build_vae16(path)))
    _save({**state, "vae_scale": torch.tensor(0.25), "vae_shift": torch.tensor(0.0)}, path)
    return path


def build_dataset(work: Path, per_caption: int, caption_dropout: float):
    """The synthetic images, cached (a TrainingDataset with its cache entries)."""
    import comfy.sd
    import comfy.utils
    from tools.cache_dataset import encode_folder
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(build_vae(work / "tiny_taesd16.safetensors"))))
    clip = synthetic_sd3_clip()
    images = write_images(work / "images", per_caption)
    dataset, _ = encode_folder(images, work / "cache", clip, vae, RESOLUTION, caption_dropout=caption_dropout,
                               masks="off")
    return dataset


# the New Model builder's SD3 below its "tiny" size (depth 2): one joint block, 64 wide, which ComfyUI still detects
# as SD3; a quarter of tiny's compute a step, so teacher and student train in seconds on a CPU
TEACHER_SIZE = dict(depth=1, context_dim=64, pooled_dim=32, pos_embed_max_size=8)


def new_model(path: Path, seed: int = 0, depth: int = TEACHER_SIZE["depth"]) -> Path:
    """A freshly initialised SD3 from the New Model node's builder (SCRATCH_FAMILIES), as a diffusion-model file."""
    from ingraph_trainer.trainer.models import SCRATCH_FAMILIES
    from tools.tiny_models import _save
    _save(SCRATCH_FAMILIES["sd3"].scratch_state_dict(seed, **{**TEACHER_SIZE, "depth": depth}), path)
    return path


def write_run(work: Path, name: str, model_path: Path, dataset, overrides: dict, task: str = "train") -> Path:
    """A run spec written by the Train node's own runner.session.prepare_run; `overrides`: {"table.key": value}."""
    import dataclasses
    from ingraph_trainer.runner.session import RunDatasets, prepare_run
    from ingraph_trainer.trainer.spec import ModelSpec, RunSpec, spec_from_dict

    def adjust(spec):
        data = dataclasses.asdict(spec)
        for dotted, value in overrides.items():
            table, _, key = dotted.rpartition(".")
            (data[table] if table else data)[key] = value
        return spec_from_dict(data, "overrides")
    out_file = work / name / f"{name}.safetensors"
    _, spec_path = prepare_run(RunSpec(task=task, model=ModelSpec(path=str(model_path))), runs_root=work,
                               run_dir=work / name, name=name, datasets=RunDatasets(dataset),
                               cache_root=work / "cache", lora_path=out_file, adjust=adjust)
    return spec_path


def start_child(fn, *args, log: Path | None = None):
    """fn(*args) in a child forked from this process, running while the caller goes on; finish_child(handle)
    returns what it returned (pickled through a pipe). Every step that computes with torch runs in a child: a
    process whose OpenMP threads have run cannot fork a child that computes (libgomp's pool hangs in it), so the
    parent only imports and forks."""
    import pickle
    import traceback
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            if log is not None:
                out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(out, 1)
                os.dup2(out, 2)
            try:
                answer = (True, fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the parent raises it with the child's traceback
                answer = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            with os.fdopen(write_fd, "wb") as pipe:
                pickle.dump(answer, pipe)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    os.close(write_fd)
    return fn.__name__, pid, read_fd


def finish_child(handle):
    import pickle
    name, pid, read_fd = handle
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if not data:
        raise RuntimeError(f"{name} died in its child (exit status {status})")
    ok, value = pickle.loads(data)
    if not ok:
        raise RuntimeError(f"{name} failed in its child: {value}")
    return value


def in_child(fn, *args, log: Path | None = None):
    """fn(*args) in a forked child (start_child), waited for."""
    return finish_child(start_child(fn, *args, log=log))


def _trainer_program(spec_path: Path) -> int:
    from ingraph_trainer.trainer import main as trainer_main
    os.chdir(spec_path.parent)  # where the Train node starts the program
    return trainer_main.main(["--config", str(spec_path)])


def run_trainer(spec_path: Path) -> float:
    """The trainer program on a spec, in a forked child (its output in the run's trainer.log); its wall seconds."""
    t0 = time.perf_counter()
    rc = in_child(_trainer_program, spec_path, log=spec_path.parent / "trainer.log")
    if rc != 0:
        log = (spec_path.parent / "trainer.log").read_text(errors="replace")
        raise RuntimeError(f"trainer run {spec_path} exited {rc}; its log ends:\n{log[-4000:]}")
    return time.perf_counter() - t0


def import_trainer():
    """The trainer program's imports, once, before any fork (tests/helpers/train_forked.py's)."""
    from ingraph_trainer.trainer import main as trainer_main
    trainer_main.hide_optional_modules()
    import ingraph_trainer.trainer.tasks.loop  # noqa: F401


def run_events(spec_path: Path) -> list[dict]:
    path = spec_path.parent / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def encode_condition(clip, caption: str):
    out = clip.encode_from_tokens(clip.tokenize(caption), return_pooled=True, return_dict=True)
    return [[out["cond"], {"pooled_output": out["pooled_output"]}]]


def sample_latents(model_path: Path, clip, count: int, steps: int, cfg: float, sampler: str, scheduler: str,
                   seed: int, lora_path: Path | None = None):
    """`count` latents from ComfyUI's KSampler path, the captions in turn (count / 4 each), from seeded noise."""
    import comfy.sample
    import comfy.sd
    import comfy.utils
    import torch
    model = comfy.sd.load_diffusion_model(str(model_path))
    if lora_path is not None:
        model, _ = comfy.sd.load_lora_for_models(model, None, comfy.utils.load_torch_file(str(lora_path)), 1.0, 0.0)
    negative = encode_condition(clip, "")
    per_caption = count // len(CAPTIONS)
    out = []
    for c, caption in enumerate(CAPTIONS):
        latent = torch.zeros((per_caption, 16, RESOLUTION // 8, RESOLUTION // 8))
        noise = comfy.sample.prepare_noise(latent, seed + c)
        out.append(comfy.sample.sample(model, noise, steps, cfg, sampler, scheduler, encode_condition(clip, caption),
                                       negative, latent, seed=seed + c, disable_pbar=True))
    return torch.cat(out).float()


def sample_teacher_sets(teacher: Path, n: int) -> dict:
    """The teacher's sample sets, euler / normal at its CFG: the 25-step reference, a second 25-step set from other
    noise (the floor: what sampling alone leaves), and its own 1-step and 4-step sets."""
    t0 = time.perf_counter()
    clip = synthetic_sd3_clip()
    sets = {name: sample_latents(teacher, clip, n, steps, TEACHER_CFG, "euler", "normal", seed=seed)
            for name, steps, seed in (("reference", REFERENCE_STEPS, 1000), ("teacher25_floor", REFERENCE_STEPS, 5000),
                                      ("teacher1", 1, 2000), ("teacher4", 4, 2000))}
    return {**sets, "sampling_s": time.perf_counter() - t0}


def sample_student_sets(student: Path, n: int) -> dict:
    """The student's 1-step and 4-step sets, lcm / sgm_uniform at CFG 1 (as it was distilled to be sampled)."""
    t0 = time.perf_counter()
    clip = synthetic_sd3_clip()
    sets = {f"student{steps}": sample_latents(student, clip, n, steps, 1.0, "lcm", "sgm_uniform", seed=2000)
            for steps in (1, 4)}
    return {**sets, "student_sampling_s": time.perf_counter() - t0}


def features(latents):
    """The fixed random projection of flattened latents to FEATURE_DIM dimensions (float64 numpy)."""
    import numpy as np
    flat = latents.reshape(latents.shape[0], -1).double().numpy()
    projection = np.random.default_rng(0).standard_normal((flat.shape[1], FEATURE_DIM)) / math.sqrt(flat.shape[1])
    return flat @ projection


def frechet_distance(a, b) -> float:
    """Fréchet distance of the Gaussians fitted to two feature sets (rows are samples):
    |mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a^1/2 S_b S_a^1/2)^1/2), square roots by eigen-decomposition."""
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(s_a)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    cross = np.linalg.eigvalsh(root_a @ s_b @ root_a)
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a) + np.trace(s_b) - 2 * np.sqrt(np.clip(cross, 0, None)).sum())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=512, help="samples per set (the 25-step floor halves from 256)")
    parser.add_argument("--per-caption", type=int, default=64, help="training images per caption")
    parser.add_argument("--teacher-steps", type=int, default=800)
    parser.add_argument("--teacher-lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=32, help="the teacher's batch size")
    parser.add_argument("--depth", type=int, default=TEACHER_SIZE["depth"], help="the SD3's joint blocks (64 wide each)")
    parser.add_argument("--reuse-teacher", action="store_true", help="keep a teacher trained before in --work")
    parser.add_argument("--no-distill", action="store_true", help="the teacher's figures only")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=JSON",
                        help="a distillation spec field (e.g. distill.fake_updates=5, train.steps=300)")
    parser.add_argument("--cfg", type=float, default=TEACHER_CFG, help="the teacher's guidance (sampling, real score)")
    parser.add_argument("--student-is-teacher", action="store_true",
                        help="no distillation: the teacher sampled as the student is (the check must fail then)")
    parser.add_argument("--feature-dim", type=int, default=FEATURE_DIM)
    parser.add_argument("--contrast", type=float, default=CONTRAST, help="the patterns' contrast in the images")
    parser.add_argument("--texture", type=float, default=TEXTURE, help="the fine texture's standard deviation")
    opts = parser.parse_args(argv)
    globals().update(TEACHER_CFG=opts.cfg, FEATURE_DIM=opts.feature_dim, CONTRAST=opts.contrast, TEXTURE=opts.texture)
    t_start = time.perf_counter()
    # one thread: this model's tensors are too small to share, and two threads' synchronisation per operation
    # costs more than the operation (many times more on a machine that is busy with other work)
    os.environ["OMP_NUM_THREADS"] = "1"
    bootstrap()
    import torch
    torch.set_num_threads(1)
    import_trainer()
    work = opts.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    figures: dict = {}
    dataset = in_child(build_dataset, work, opts.per_caption, 0.2)
    base = in_child(new_model, work / "new_sd3.safetensors", 0, opts.depth)
    common = {"train.precision": "fp32", "train.eval_quantiles": [0.5], "train.batch_size": opts.batch,
              "train.seed": 0}
    teacher_spec = work / "teacher" / "run.toml"
    reuse = opts.reuse_teacher and (work / "teacher" / "teacher.safetensors").exists()
    teacher_spec = teacher_spec if reuse else write_run(work, "teacher", base, dataset, {
        **common, "adapter.kind": "full", "train.steps": opts.teacher_steps,
        "train.learning_rate": opts.teacher_lr, "train.lr_schedule": "cosine", "train.warmup_steps": 20,
        "train.weight_decay": 0.0, "train.flow_shift": 3.0})
    figures["teacher_train_s"] = 0.0 if reuse else run_trainer(teacher_spec)
    evals = [e["loss"] for e in run_events(teacher_spec) if e["type"] == "eval"]
    figures["teacher_eval_loss"] = [evals[0], evals[-1]]
    teacher = teacher_spec.parent / "teacher.safetensors"

    n = opts.samples
    teacher_sampling = start_child(sample_teacher_sets, teacher, n)
    student = None
    if opts.student_is_teacher:
        student = teacher
    elif not opts.no_distill:
        settings = {**DISTILL_SETTINGS, "distill.guidance_scale": TEACHER_CFG,
                    **{k: json.loads(v) for k, v in (item.split("=", 1) for item in opts.set)}}
        import shutil
        shutil.rmtree(work / "student", ignore_errors=True)
        distill_spec = write_run(work, "student", teacher, dataset, {**common, **settings}, task="distill")
        figures["distill_s"] = run_trainer(distill_spec)
        steps = [e for e in run_events(distill_spec) if e["type"] == "step"]
        figures["distill_settings"] = settings
        figures["distill_losses"] = {k: [steps[0].get(k), steps[-1].get(k)] for k in ("dmd_loss", "fake_loss")}
        student = distill_spec.parent / "student.safetensors"

    # the teacher's sets are sampled in a child while the student distils (a second core), the student's after
    sets = finish_child(teacher_sampling)
    if student is not None:
        sets.update(in_child(sample_student_sets, student, n))
    figures["sampling_s"] = sets.pop("sampling_s") + sets.pop("student_sampling_s", 0.0)
    sets["noise"] = torch.randn((n, 16, RESOLUTION // 8, RESOLUTION // 8), generator=torch.Generator().manual_seed(7))
    torch.save(sets, work / "sample_sets.pt")
    reference = features(sets["reference"])
    for name, latents in sets.items():
        if name != "reference":
            figures[f"fd_{name}"] = frechet_distance(features(latents), reference)
    figures["feature_dim"], figures["samples"] = FEATURE_DIM, n
    figures["total_s"] = time.perf_counter() - t_start
    import resource
    figures["cpu_s"] = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF,
                           resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
