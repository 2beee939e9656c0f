"""Unit tier: no ComfyUI, no model weights."""
from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if "ingraph_trainer" not in sys.modules:
    pkg = types.ModuleType("ingraph_trainer")
    pkg.__path__ = [str(REPO)]
    sys.modules["ingraph_trainer"] = pkg

config = importlib.import_module("ingraph_trainer.trainer.spec")
spec_sections = importlib.import_module("ingraph_trainer.trainer.spec.sections")  # where DistributedSpec asks for DeepSpeed
events = importlib.import_module("ingraph_trainer.trainer.run.events")
folder_scan_mod = importlib.import_module("ingraph_trainer.cache.folder_scan")
pixels_mod = importlib.import_module("ingraph_trainer.cache.pixels")
runs = importlib.import_module("ingraph_trainer.runner.runs")
chart = importlib.import_module("ingraph_trainer.runner.loss_chart")


def valid_spec_dict(**train):
    spec = config.RunSpec(run_dir="/tmp/r")
    spec.model.path, spec.data.manifest, spec.output.lora_path = "/m.safetensors", "/d.json", "/l.safetensors"
    data = dataclasses.asdict(spec)
    data["train"].update(train)
    return data


def test_spec_round_trips_through_toml(tmp_path):
    spec = config.spec_from_dict(valid_spec_dict(steps=7, learning_rate=3e-4, eval_quantiles=[0.2, 0.8]))
    path = tmp_path / "run.toml"
    path.write_text(config.dump_run_spec(spec))
    assert config.load_run_spec(path) == spec


@pytest.mark.parametrize("field,value,needle", [
    ("steps", 0, "train.steps: must be at least 1"),
    ("batch_size", 0, "train.batch_size"),
    ("optimizer", "sgd", "train.optimizer"),
    ("precision", "fp8", "train.precision"),
    ("steps", "ten", "train.steps: expected int"),
])
def test_spec_errors_name_the_field(field, value, needle):
    with pytest.raises(config.RunSpecError, match=needle.replace(".", r"\.")):
        config.spec_from_dict(valid_spec_dict(**{field: value}), "run.toml")


def test_spec_rejects_rank_below_one_and_unknown_fields():
    data = valid_spec_dict()
    data["adapter"]["rank"] = 0
    with pytest.raises(config.RunSpecError, match="adapter.rank"):
        config.spec_from_dict(data)
    data = valid_spec_dict()
    data["train"]["stepz"] = 3
    with pytest.raises(config.RunSpecError, match="unknown field.*stepz"):
        config.spec_from_dict(data)


def test_every_family_is_a_valid_model_family_in_a_spec():
    """model.family takes each family trainer/models has: the names are checked in one place, where the family is
    picked (the spec's own list once lacked five of them, so a hand-written run.toml for Chroma was refused);
    anything else is refused there naming them all."""
    models = importlib.import_module("ingraph_trainer.trainer.models")
    names = [cls.name for cls in models.FAMILIES]
    assert {"hunyuan_video", "ltxv", "qwen_image", "chroma", "lumina2"} <= set(names)
    for name in ["auto", *names]:
        data = valid_spec_dict()
        data["model"]["family"] = name
        assert config.spec_from_dict(data).model.family == name
        if name != "auto":
            assert models.family_class(None, name).name == name
    with pytest.raises(ValueError, match=r"model\.family: 'sdxl_turbo' is not one of auto, sd_unet, .*chroma"):
        models.family_class(None, "sdxl_turbo")
    with pytest.raises(ValueError, match=r"model\.family: 'unet3' is not one of auto"):  # before any file is read
        models.load_family(config.ModelSpec(path="/nowhere/model.safetensors", family="unet3"))


def test_load_run_spec_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("version = [")
    with pytest.raises(config.RunSpecError, match="bad.toml: not valid TOML"):
        config.load_run_spec(bad)


def test_event_reader_returns_only_complete_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = events.EventWriter(path)
    writer.emit("started", total=3)
    reader = events.EventReader(path)
    assert [e["type"] for e in reader.poll()] == ["started"]
    with open(path, "a") as f:
        f.write('{"v": 1, "type": "step", "step": 1')  # half-written line
        f.write("\nDeepSpeed noise that is not an event\n")
    assert reader.poll() == []
    writer.emit("finished", adapter="x")
    assert [e["type"] for e in reader.poll()] == ["finished"]
    assert all(e["v"] == events.EVENT_VERSION for e in events.read_events(path))
    with pytest.raises(ValueError):
        writer.emit("bogus")



def test_the_event_that_ends_a_run_is_the_files_last_line(tmp_path):
    """The parent watchdog writes the orphan error from its own thread while steps go on until os._exit."""
    path = tmp_path / "events.jsonl"
    writer = events.EventWriter(path)
    writer.emit("step", step=1)
    writer.emit("error", last=True, message="parent process 1 exited")
    writer.emit("step", step=2)  # the training thread, a moment later
    assert [e["type"] for e in events.read_events(path)] == ["step", "error"]

def _png(path, colour=(200, 10, 10)):
    from PIL import Image
    Image.new("RGB", (64, 64), colour).save(path)


def test_scan_reads_captions_prefix_and_skips_non_images(tmp_path, caplog):
    _png(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("a red square\n")
    _png(tmp_path / "b.png")
    (tmp_path / "b.txt").write_text("another")
    (tmp_path / "notes.md").write_text("x")
    (tmp_path / "data.csv").write_text("x")
    with caplog.at_level("INFO", logger="ingraph_trainer"):
        ds = folder_scan_mod.scan_image_folder(tmp_path, resolution=64, caption_prefix="ohwx, ", repeats=2)
    assert [i.caption for i in ds.items] == ["ohwx, a red square", "ohwx, another"]
    assert ds.repeats == 2 and sorted(ds.skipped_files) == ["data.csv", "notes.md"]
    assert "ignored 2 non-image file(s)" in caplog.text


def test_scan_errors_name_the_folder_or_file(tmp_path):
    with pytest.raises(pixels_mod.DatasetError, match="does not exist"):
        folder_scan_mod.scan_image_folder(tmp_path / "nope", resolution=64)
    (tmp_path / "readme.txt").write_text("x")
    with pytest.raises(pixels_mod.DatasetError, match="contains no images"):
        folder_scan_mod.scan_image_folder(tmp_path, resolution=64)
    _png(tmp_path / "ok.png")
    with pytest.raises(pixels_mod.DatasetError, match=r"ok\.png has no caption file ok\.txt"):
        folder_scan_mod.scan_image_folder(tmp_path, resolution=64)
    ds = folder_scan_mod.scan_image_folder(tmp_path, resolution=64, missing_caption="use default caption",
                                   default_caption="a photo")
    assert ds.items[0].caption == "a photo"
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    (tmp_path / "broken.txt").write_text("x")
    with pytest.raises(pixels_mod.DatasetError, match=r"cannot read image .*broken\.png"):
        folder_scan_mod.scan_image_folder(tmp_path, resolution=64)


def test_image_tensor_is_resized_and_centre_cropped(tmp_path):
    from PIL import Image
    Image.new("RGB", (200, 100), (255, 0, 0)).save(tmp_path / "wide.png")
    t = pixels_mod.load_image_tensor(str(tmp_path / "wide.png"), 64)
    assert tuple(t.shape) == (1, 64, 64, 3) and abs(t[0, 0, 0, 0].item() - 1.0) < 1e-6


@pytest.mark.parametrize("run_id,ok", [("20260101-000000-x-ab12", True), ("../x", False), ("a/b", False),
                                       ("..", False), ("", False), (".hidden", False)])
def test_run_ids_are_validated(run_id, ok, tmp_path):
    assert runs.valid_run_id(run_id) is ok
    assert (runs.run_dir_for(tmp_path, run_id) is not None) is False  # nothing exists yet


def test_run_dir_lookup_stays_inside_the_root(tmp_path):
    root = tmp_path / "runs"
    made = runs.create_run_dir(root, "my lora/../../etc")
    assert made.parent == root and ".." not in made.name
    assert runs.run_dir_for(root, made.name) == made.resolve()
    (tmp_path / "outside").mkdir()
    assert runs.run_dir_for(root, "../outside") is None


def test_loss_chart_renders_points():
    img = chart.render_loss_chart([1, 2, 3, 4], [1.0, 0.8, 0.9, 0.5], [(0, 1.1), (4, 0.6)])
    assert img.size == (640, 360)
    t = chart.chart_tensor(img)
    assert tuple(t.shape) == (1, 360, 640, 3) and 0.0 <= t.min() and t.max() <= 1.0
    assert chart.smooth([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])


def test_pack_import_is_light():
    """Loading the pack's modules outside the trainer never imports the heavy training stack."""
    code = ("import sys, types; p = types.ModuleType('ingraph_trainer'); p.__path__ = [%r]; "
            "sys.modules['ingraph_trainer'] = p; "
            "import ingraph_trainer.trainer.spec, ingraph_trainer.runner.session, ingraph_trainer.cache.encoding; "
            "heavy = [m for m in ('peft', 'diffusers', 'deepspeed', 'bitsandbytes', 'torch') if sys.modules.get(m) is not None]; "
            "print(heavy)") % str(REPO)
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_requirements_match_pyproject():
    import tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert sorted(deps) == sorted(reqs)


def test_evaluation_inputs_are_parsed_with_errors_that_name_the_input():
    evaluation_run = importlib.import_module("ingraph_trainer.runner.evaluation_run")
    compare = importlib.import_module("ingraph_trainer.runner.compare")
    assert evaluation_run.parse_quantiles("0.9, 0.1 0.5,0.5") == [0.1, 0.5, 0.9]
    for bad, words in (("", "at least one"), ("0.1, x", "'x' is not a number"), ("1.0", "between 0 and 1")):
        with pytest.raises(ValueError, match="quantiles") as err:
            evaluation_run.parse_quantiles(bad)
        assert words in str(err.value)
    assert compare.parse_seeds("0, 7 3") == [0, 7, 3]
    with pytest.raises(ValueError, match="seeds: '1.5'"):
        compare.parse_seeds("1.5")
    assert compare.parse_prompts("a\n\n  b \n") == ["a", "b"]
    with pytest.raises(ValueError, match="prompts"):
        compare.parse_prompts("  \n")


def test_quantile_table_and_chart():
    evaluation_run = importlib.import_module("ingraph_trainer.runner.evaluation_run")
    results = {"base": {"loss": 0.5, "quantiles": {"0.1": 0.4, "0.9": 0.6}},
               "trained": {"loss": 0.25, "quantiles": {"0.1": 0.2, "0.9": 0.3}}}
    table = evaluation_run.quantile_table(results).splitlines()
    assert table[0].split() == ["quantile", "base", "trained"]
    assert table[1].split() == ["0.1", "0.400000", "0.200000"]
    assert table[-1].split() == ["mean", "0.500000", "0.250000"]
    img = chart.render_quantile_chart(results)
    assert img.size == (640, 360) and len(img.getcolors(maxcolors=10_000) or []) > 3


def test_previews_are_due_every_n_steps_and_at_the_end_and_validated():
    sampling = importlib.import_module("ingraph_trainer.trainer.sampling")
    spec = config.SampleSpec(every=4)
    assert [s for s in range(0, 11) if sampling.sample_due(spec, s, 10)] == [4, 8, 10]
    assert not any(sampling.sample_due(config.SampleSpec(every=0), s, 10) for s in range(11))
    data = valid_spec_dict()
    data["samples"] = {"every": 5, "width": 60}
    with pytest.raises(config.RunSpecError) as err:
        config.spec_from_dict(data)
    for field in ("samples.conditioning", "samples.vae_path", "samples.prompts", "samples.width/height"):
        assert field in str(err.value)


def test_conditioning_survives_the_file_round_trip(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    sampling = importlib.import_module("ingraph_trainer.trainer.sampling")
    cond = [[torch.randn(1, 77, 8), {"pooled_output": torch.randn(1, 8), "note": "dropped"}]]
    save_file(sampling.conditioning_tensors(cond, "positive.0"), str(tmp_path / "c.safetensors"))
    back = sampling.conditioning_from(load_file(str(tmp_path / "c.safetensors")), "positive.0")
    assert torch.equal(back[0][0], cond[0][0]) and torch.equal(back[0][1]["pooled_output"], cond[0][1]["pooled_output"])
    assert set(back[0][1]) == {"pooled_output"}


@pytest.mark.parametrize("section,values", [
    ("adapter", {"kind": "full"}), ("distributed", {"zero_stage": 3}),
    ("distributed", {"processes": 2, "pipeline_stages": 2}), ("task", "distill"), (None, None)])
def test_block_swap_is_offered_exactly_where_a_spec_with_it_is_accepted(section, values, monkeypatch):
    """One rule: the memory plan and the out-of-memory suggestions offer block swap (memory.swap_allowed) where,
    and only where, the same spec with block_swap set passes validation."""
    from ingraph_trainer.trainer.parallel.memory import swap_allowed
    monkeypatch.setattr(spec_sections, "deepspeed_installed", lambda: True)  # the layouts' rules, not the install's
    data = valid_spec_dict()
    if section == "task":
        data["task"] = values
    elif section:
        data[section].update(values)
    offered = swap_allowed(config.spec_from_dict(data))
    data["distributed"]["block_swap"] = 2
    try:
        config.spec_from_dict(data)
        accepted = True
    except config.RunSpecError as e:
        assert "block_swap" in str(e)
        accepted = False
    assert offered == accepted == (section is None)


def test_a_distill_spec_refuses_what_distillation_does_not_keep_yet_when_it_is_read():
    """EMA and block swap are refused when a distill spec is read (before any model loads), naming the field;
    the same settings are a train spec's to use."""
    for field, section, value in (("train.ema_decay", "train", {"ema_decay": 0.5}),
                                  ("distributed.block_swap", "distributed", {"block_swap": 1})):
        data = valid_spec_dict()
        data[section].update(value)
        assert config.spec_from_dict(data).task == "train"
        data["task"] = "distill"
        with pytest.raises(config.RunSpecError, match=field.replace(".", r"\.")):
            config.spec_from_dict(data)


def test_evaluate_task_needs_no_output_file():
    data = valid_spec_dict()
    data["task"], data["output"]["lora_path"] = "evaluate", ""
    assert config.spec_from_dict(data).task == "evaluate"
    data["task"] = "train"
    with pytest.raises(config.RunSpecError, match="output.lora_path"):
        config.spec_from_dict(data)
    data["task"] = "sample"
    with pytest.raises(config.RunSpecError, match="task: must be one of"):
        config.spec_from_dict(data)


def test_export_formats_rename_and_refuse_what_they_cannot_hold():
    import torch
    export = importlib.import_module("ingraph_trainer.trainer.export")
    down, up = torch.randn(4, 16), torch.randn(32, 4)
    comfy = {"diffusion_model.input_blocks.1.1.proj.lora_down.weight": down,
             "diffusion_model.input_blocks.1.1.proj.lora_up.weight": up,
             "diffusion_model.input_blocks.1.1.proj.alpha": torch.tensor(8.0)}
    names = {"input_blocks.1.1.proj": "down_blocks.0.attentions.0.proj"}
    kohya = export.convert(comfy, "kohya", names)
    assert set(kohya) == {"lora_unet_down_blocks_0_attentions_0_proj." + p for p in ("lora_down.weight", "lora_up.weight", "alpha")}
    diffusers = export.convert(comfy, "diffusers", names)
    assert torch.equal(diffusers["unet.down_blocks.0.attentions.0.proj.lora_B.weight"], up * 2.0)  # alpha / rank
    back = export.comfyui_readable(diffusers, names)
    delta = lambda sd: sd["diffusion_model.input_blocks.1.1.proj.lora_up.weight"] @ \
        sd["diffusion_model.input_blocks.1.1.proj.lora_down.weight"] * \
        float(sd["diffusion_model.input_blocks.1.1.proj.alpha"]) / 4
    assert torch.allclose(delta(back), delta(comfy))
    assert export.comfyui_readable(kohya, names) is kohya  # ComfyUI reads kohya keys itself
    loha = {"diffusion_model.a.hada_w1_a": down, "diffusion_model.a.alpha": torch.tensor(1.0)}
    with pytest.raises(ValueError, match="plain LoRA only"):
        export.convert(loha, "diffusers", {"a": "b"})
    data = valid_spec_dict()
    data["adapter"]["kind"], data["output"]["format"] = "lokr", "diffusers"
    with pytest.raises(config.RunSpecError, match="output.format: the diffusers format holds plain LoRA only"):
        config.spec_from_dict(data)


def test_objectives_min_snr_and_huber():
    import torch
    objectives = importlib.import_module("ingraph_trainer.trainer.objectives")
    snr = torch.tensor([0.5, 5.0, 50.0])
    assert torch.allclose(objectives.min_snr_weight(snr, 5.0, "epsilon"), torch.tensor([1.0, 1.0, 0.1]))
    assert torch.allclose(objectives.min_snr_weight(snr, 5.0, "v_prediction"), torch.tensor([0.5 / 1.5, 5 / 6, 5 / 51]))
    pred, target = torch.zeros(2, 1, 2, 2), torch.tensor([0.05, 1.0]).view(2, 1, 1, 1).expand(2, 1, 2, 2)
    assert torch.allclose(objectives.per_sample_loss(pred, target), torch.tensor([0.0025, 1.0]))
    # Huber: quadratic (0.5 x^2) below delta, linear (delta * (|x| - delta / 2)) above
    assert torch.allclose(objectives.per_sample_loss(pred, target, "huber", 0.1), torch.tensor([0.00125, 0.095]))
    with pytest.raises(ValueError, match="train.loss"):
        objectives.per_sample_loss(pred, target, "l1")
    data = valid_spec_dict(loss="l1", min_snr_gamma=-1.0)
    with pytest.raises(config.RunSpecError) as err:
        config.spec_from_dict(data)
    assert "train.loss" in str(err.value) and "train.min_snr_gamma" in str(err.value)


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr", "dora"])
def test_an_adapter_goes_on_the_layers_named_and_no_layer_whose_name_ends_like_one(kind):
    """A target is a whole layer name: "blocks.0.attn" adapts that layer, not "refiner.blocks.0.attn" (peft matches
    a list of names by suffix too: MiniMax H3's text refiner took a LoRA its preset never named)."""
    import torch
    adapters = importlib.import_module("ingraph_trainer.trainer.adapters")
    blocks = torch.nn.ModuleList([torch.nn.ModuleDict({"attn": torch.nn.Linear(4, 4)})])
    model = torch.nn.ModuleDict({"blocks": blocks, "refiner": torch.nn.ModuleDict(
        {"blocks": torch.nn.ModuleList([torch.nn.ModuleDict({"attn": torch.nn.Linear(4, 4)})])})})
    adapters.inject_adapter(model, ["blocks.0.attn"], kind, 2, 2.0, 0.0)
    adapted = sorted(n for n, m in model.named_modules() if hasattr(m, "base_layer"))
    assert adapted == ["blocks.0.attn"], adapted
    assert not any(p.requires_grad for p in model["refiner"].parameters())


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr", "dora"])
def test_adapter_file_round_trip_restores_what_the_model_computes(kind, tmp_path):
    """export (comfy_adapter_state_dict) then load_adapter_weights into a fresh adapter: same outputs,
    also when the new run uses another alpha (the scale is carried over)."""
    import torch
    from safetensors.torch import save_file
    adapters = importlib.import_module("ingraph_trainer.trainer.adapters")

    def model(alpha):
        torch.manual_seed(0)
        m = torch.nn.Sequential()
        m.add_module("a", torch.nn.Linear(24, 40))
        m.add_module("b", torch.nn.Linear(40, 16))
        adapters.inject_adapter(m, ["a", "b"], kind, 4, alpha, 0.0)
        return m
    trained = model(4.0)
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    save_file(adapters.comfy_adapter_state_dict(trained, kind, 4.0), str(tmp_path / "a.safetensors"))
    resumed = model(2.0)
    adapters.load_adapter_weights(resumed, kind, str(tmp_path / "a.safetensors"))
    x = torch.randn(5, 24)
    with torch.no_grad():
        assert torch.allclose(resumed(x), trained(x), atol=1e-5)
    with pytest.raises(ValueError, match="adapter.init_from"):  # the file has a layer this model lacks
        bad = torch.nn.Sequential()
        bad.add_module("a", torch.nn.Linear(24, 40))
        adapters.inject_adapter(bad, ["a"], kind, 4, 4.0, 0.0)
        adapters.load_adapter_weights(bad, kind, str(tmp_path / "a.safetensors"))


def test_flow_matching_timesteps_shift_and_logit_normal():
    import torch
    objectives = importlib.import_module("ingraph_trainer.trainer.objectives")
    base = importlib.import_module("ingraph_trainer.trainer.models.base")
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(objectives.training_timesteps(u), u)
    t = objectives.training_timesteps(u, "logit_normal", mean=0.5, std=1.0)
    logit = torch.log(t / (1 - t))
    # the logit of a logit-normal sample is normal(mean, std); the same draws always give the same timesteps
    assert abs(logit.mean().item() - 0.5) < 0.03 and abs(logit.std().item() - 1.0) < 0.03
    assert torch.equal(t, objectives.training_timesteps(u, "logit_normal", mean=0.5, std=1.0))
    assert torch.all(t[1:][u[1:] > u[:-1]] > t[:-1][u[1:] > u[:-1]])  # monotone in u: quantiles stay quantiles
    with pytest.raises(ValueError, match="train.timestep_sampling"):
        objectives.training_timesteps(u, "beta")
    # SD3's shift: s*t / (1 + (s-1)*t); 1 leaves t alone, 3 moves mid-schedule to 0.75
    assert torch.equal(base.shifted(u, 1.0), u)
    assert base.shifted(torch.tensor([0.0, 0.5, 1.0]), 3.0).tolist() == [0.0, 0.75, 1.0]


@pytest.mark.parametrize("table,values,needle", [
    ("train", {"flow_shift": 0.0}, "train.flow_shift"),
    ("train", {"timestep_sampling": "beta"}, "train.timestep_sampling"),
    ("train", {"logit_std": 0.0}, "train.logit_std"),
    ("model", {"prediction": "x0"}, "model.prediction"),
    ("distributed", {"processes": 2, "pipeline_stages": 2, "zero_stage": 2}, "ZeRO stage 0 or 1"),
    ("distributed", {"pipeline_stages": 0}, "distributed.pipeline_stages"),
    ("distributed", {"pipeline_stages": 2, "block_swap": 2}, "block swap is for one pipeline stage"),
    ("distributed", {"block_swap": -1}, "distributed.block_swap"),
    ("distributed", {"block_swap": 4, "zero_stage": 3}, "ZeRO-3 partitions the weights"),
    ("adapter", {"kind": "dora", "targets": "all_layers"}, "DoRA trains linear layers only"),
])
def test_spec_validates_family_objective_and_layout_settings(table, values, needle):
    data = valid_spec_dict()
    data[table].update(values)
    with pytest.raises(config.RunSpecError, match=needle.replace(".", r"\.")):
        config.spec_from_dict(data, "run.toml")


def test_block_swap_refuses_full_fine_tuning_and_pipelines_refuse_previews():
    data = valid_spec_dict()
    data["adapter"]["kind"], data["distributed"]["block_swap"] = "full", 2
    with pytest.raises(config.RunSpecError, match="a full fine-tune has none"):
        config.spec_from_dict(data)
    data = valid_spec_dict()
    data["distributed"]["pipeline_stages"] = 2
    data["samples"].update(every=5, conditioning="/c.safetensors", vae_path="/v.safetensors", prompts=["a"])
    with pytest.raises(config.RunSpecError, match="samples.every: previews need the whole model"):
        config.spec_from_dict(data)
    flow = valid_spec_dict(flow_shift=3.0, timestep_sampling="logit_normal", guidance=3.5)
    flow["model"].update(family="flux", prediction="flow")
    assert config.spec_from_dict(flow).train.flow_shift == 3.0


def test_distributed_layout_problems_are_one_list_for_the_node_and_the_spec(tmp_path, monkeypatch):
    monkeypatch.setattr(spec_sections, "deepspeed_installed", lambda: True)  # the layout's own rules (DeepSpeed's below)
    layout = config.DistributedSpec(processes=3, pipeline_stages=2, zero_stage=2, offload_optimizer=False)
    assert layout.problems() == ["distributed.pipeline_stages: 2 stages do not divide 3 processes",
                                 "distributed.pipeline_stages: DeepSpeed pipelines take ZeRO stage 0 or 1 "
                                 "(zero_stage is 2)"]
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a slots=2\nb slots=2\n")  # with a hostfile the world size is the hostfile's, checked at start
    monkeypatch.setenv("INGRAPH_ALLOWED_HOSTS", "a b")
    assert config.DistributedSpec(processes=3, pipeline_stages=2, hostfile=str(hosts)).problems() == []
    assert config.DistributedSpec(processes=4, pipeline_stages=2, zero_stage=1).problems() == []
    assert config.DistributedSpec(processes=2, zero_stage=2, offload_params=True).problems() == [
        "distributed.offload_params: needs ZeRO stage 3 (the stage that partitions the weights)"]
    assert config.DistributedSpec(processes=2, zero_stage=3, offload_params=True).problems() == []
    assert config.DistributedSpec(offload_params=True, zero_stage=3).deepspeed_settings() == ["zero_stage",
                                                                                               "offload_params"]


def test_a_layout_that_needs_deepspeed_is_refused_with_its_install_command_where_it_is_missing(monkeypatch):
    """One GPU needs no DeepSpeed; every setting that does is refused, named, with the command that installs it
    (DistributedSpec.problems: the DeepSpeed Settings node, the Train node and the spec all ask it)."""
    monkeypatch.setattr(spec_sections, "deepspeed_installed", lambda: False)
    assert config.DistributedSpec().problems() == []
    assert config.DistributedSpec(processes=1, block_swap=2).problems() == []
    for kwargs, field in (({"processes": 2}, "processes"), ({"zero_stage": 2}, "zero_stage"),
                          ({"zero_stage": 1, "offload_optimizer": True}, "zero_stage"),
                          ({"processes": 2, "pipeline_stages": 2}, "processes")):
        problems = config.DistributedSpec(**kwargs).problems()
        assert len(problems) == 1 and problems[0].startswith(f"distributed.{field}: "), problems
        assert "needs DeepSpeed" in problems[0] and config.MULTI_GPU_INSTALL in problems[0]
    spec = config.RunSpec(distributed=config.DistributedSpec(zero_stage=2))
    with pytest.raises(config.RunSpecError, match="distributed.zero_stage: 2 needs DeepSpeed"):
        spec.validate("run.toml")
    monkeypatch.setattr(spec_sections, "deepspeed_installed", lambda: True)
    assert config.DistributedSpec(zero_stage=2).problems() == []


def test_zero3_across_machines_partitions_weights_again_within_each_machine(monkeypatch):
    """ZeRO++ hpZ (FSDP's hybrid sharding) where ZeRO-3 spans machines of several processes each; nowhere else.
    (Measured once by hand: 2 machines x 2 processes over loopback give 1 process's losses to 1e-7, and DeepSpeed
    holds each weight's second partition, `ds_secondary_tensor`, after a forward pass.)"""
    from trainer.spec import DistributedSpec, RunSpec
    from trainer.parallel.distributed import deepspeed_config

    def zero(stage, world, per_machine, variable="LOCAL_WORLD_SIZE"):
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv(variable, str(per_machine))
        return deepspeed_config(RunSpec(distributed=DistributedSpec(zero_stage=stage)))["zero_optimization"]
    assert zero(3, 4, 2).get("zero_hpz_partition_size") == 2  # torchrun's variable
    assert zero(3, 4, 2, "LOCAL_SIZE").get("zero_hpz_partition_size") == 2  # DeepSpeed's launcher's (hostfile runs)
    assert "zero_hpz_partition_size" not in zero(3, 2, 2)  # one machine: nothing to keep inside it
    assert "zero_hpz_partition_size" not in zero(3, 2, 1)  # one process per machine: no second partition
    assert "zero_hpz_partition_size" not in zero(2, 4, 2)  # ZeRO-2 keeps whole weights on every process


def test_zero3_loads_into_partitions_where_nothing_reads_the_whole_weights_first(monkeypatch):
    """trainer/parallel/partitioned_load.why_not_partitioned: ZeRO-3 adapter runs load each process's share straight from the
    file; a full fine-tune or DoRA (the optimizer's copies, the weight norms, taken at start) or LoRAs baked in
    upstream load whole first. Weight offload is DeepSpeed's offload_param, which zero.Init reads too."""
    import torch
    from trainer.spec import AdapterSpec, DistributedSpec, ModelSpec, RunSpec
    from trainer.parallel.distributed import deepspeed_config
    from trainer.parallel.partitioned_load import why_not_partitioned

    def spec(zero=3, kind="lora", loras=(), stages=1, offload=False):
        run = RunSpec(distributed=DistributedSpec(processes=2, zero_stage=zero, pipeline_stages=stages,
                                                  offload_params=offload),
                      adapter=AdapterSpec(kind=kind), model=ModelSpec(path="m.safetensors", lora_paths=list(loras)))
        run.train.precision = "fp32"
        return run
    assert why_not_partitioned(spec()) is None and why_not_partitioned(spec(kind="loha")) is None
    assert why_not_partitioned(spec(zero=2)) == "not ZeRO-3"
    assert "adapter.kind full" in why_not_partitioned(spec(kind="full"))
    assert "adapter.kind dora" in why_not_partitioned(spec(kind="dora"))
    assert "baked" in why_not_partitioned(spec(loras=["up.safetensors"]))
    bf16 = spec()
    bf16.train.precision = "bf16"  # DeepSpeed's cast, which it leaves out for a partitioned model, is done here
    assert why_not_partitioned(bf16) is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 machines of 2: ZeRO++'s second partition (hpZ)
    assert "second partition" in why_not_partitioned(spec())
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert deepspeed_config(spec(offload=True))["zero_optimization"]["offload_param"] == {"device": "cpu",
                                                                                          "pin_memory": True}
    assert "offload_param" not in deepspeed_config(spec())["zero_optimization"]


def test_a_refused_whole_load_after_a_partitioned_one_was_planned_says_why_it_loads_whole(monkeypatch):
    from trainer.parallel import memory_plan
    monkeypatch.setattr(memory_plan, "host_refusal",
                        lambda *a, **k: "not enough memory: loading m.safetensors needs 9 GiB")
    said = r"^ZeRO-3 .* loads whole \(input_blocks.1 .*\): not enough memory: .* needs 9 GiB"
    with pytest.raises(memory_plan.MemoryPlanRefused, match=said):
        memory_plan.refuse_unloadable(object(), "bf16",
                                      whole_because="input_blocks.1 (Linear) loads its weights its own way")


def test_a_bf16_partitioned_load_casts_what_deepspeed_would_and_leaves_unfilled_weights_unread():
    """deepspeed.initialize casts no parameter of a model zero.Init partitioned (is_zero_init_model), so the load
    does DeepSpeed's cast first: filled parameters (the adapter's) are cast, unfilled ones get new unfilled storage of
    the engine's dtype (the fill casts each slice from the file), fp8 ones stay; nothing is cast in an fp32 run."""
    import torch
    from trainer.parallel.distributed import deepspeed_config
    from trainer.parallel.memory_sizes import low_precision_dtype
    from trainer.parallel.partitioned_load import DeferredWeights, in_engine_dtype
    from trainer.spec import DistributedSpec, RunSpec
    module = torch.nn.Module()
    module.unfilled = torch.nn.Parameter(torch.empty(4, 4), requires_grad=False)
    module.adapter = torch.nn.Parameter(torch.full((2, 4), 0.5))
    module.fp8 = torch.nn.Parameter(torch.zeros(4, dtype=torch.float8_e4m3fn), requires_grad=False)
    weights = DeferredWeights("m.safetensors", {module.unfilled: torch.ones(4, 4)})
    unfilled_storage = module.unfilled.data.data_ptr()
    run = RunSpec(distributed=DistributedSpec(processes=2, zero_stage=3))
    run.train.precision = "fp32"  # the dtype the loop hands the load is the one DeepSpeed's config runs in
    assert low_precision_dtype(run.train.precision) is None and not deepspeed_config(run)["bf16"]["enabled"]
    run.train.precision = "bf16"
    dtype = low_precision_dtype(run.train.precision)
    assert dtype == torch.bfloat16 and deepspeed_config(run)["bf16"]["enabled"]
    in_engine_dtype(module, dtype, weights)
    assert module.unfilled.dtype == module.adapter.dtype == torch.bfloat16
    assert module.unfilled.data.data_ptr() != unfilled_storage and module.unfilled in weights.sources
    assert torch.equal(module.adapter.data, torch.full((2, 4), 0.5, dtype=torch.bfloat16))
    assert module.fp8.dtype == torch.float8_e4m3fn


def test_checkpoints_carry_the_cuda_generator_where_a_device_computes(monkeypatch):
    """Resume is exact on a GPU only if the device's generator comes back too (faked CUDA facts: this machine has
    no GPU). A CPU checkpoint, without it, still restores the CPU's."""
    import torch
    from ingraph_trainer.trainer.run import checkpoint
    device_state = {"now": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": device_state["now"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": device_state.update(now=state))
    saved = checkpoint.rng_state()
    assert torch.equal(saved["cuda"], torch.tensor([1, 2, 3], dtype=torch.uint8))
    device_state["now"] = torch.tensor([9, 9, 9], dtype=torch.uint8)  # draws after the checkpoint
    torch.rand(3)
    checkpoint.set_rng_state(saved)
    assert torch.equal(device_state["now"], saved["cuda"])
    assert torch.equal(torch.get_rng_state(), saved["torch"])
    checkpoint.set_rng_state({"torch": saved["torch"]})  # saved on a CPU
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert "cuda" not in checkpoint.rng_state()


@pytest.mark.parametrize("os_name", ["nt", "posix"])
def test_the_trainers_exit_flush_never_fails_a_finished_run(monkeypatch, os_name):
    """Windows: ctypes.CDLL(None) raises TypeError, which escaped the trainer's exit and made every successful
    run exit 1 (faked here: os.name and a CDLL that raises as CPython's does there)."""
    import ctypes
    from ingraph_trainer.trainer import os_support as process_state

    def windows_cdll(name, *args, **kwargs):
        if name is None:
            raise TypeError("LoadLibrary() argument 1 must be str, not None")
        return ctypes.CDLL(name, *args, **kwargs)
    monkeypatch.setattr(ctypes, "CDLL", windows_cdll)
    monkeypatch.setattr(process_state, "os", types.SimpleNamespace(name=os_name))  # that module's view alone
    process_state.flush_c_stdio()  # returns, whatever the platform


@pytest.mark.parametrize("local_rank,capability,tf32", [("1", (9, 0), True), ("0", (7, 5), False)])
def test_each_rank_computes_on_its_own_gpu_with_tf32_where_the_card_has_it(monkeypatch, local_rank, capability,
                                                                            tf32):
    """One decision for the device (faked CUDA facts: this machine has none): the rank's GPU becomes current before
    ComfyUI asks for "the" device (it was GPU 0 on every rank), TF32 on for Ampere and newer only."""
    import torch
    from ingraph_trainer.trainer import device
    chosen = []
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    precision = torch.get_float32_matmul_precision()
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    try:
        torch.set_float32_matmul_precision("highest")
        assert device.choose_device() == torch.device("cuda", int(local_rank))
        assert chosen == [int(local_rank)]
        assert (torch.get_float32_matmul_precision() == "high") is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    finally:
        torch.set_float32_matmul_precision(precision)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.choose_device() == torch.device("cpu") and chosen == [int(local_rank)]


@pytest.mark.parametrize("cuda,bf16,expected", [(True, True, "bf16"), (True, False, "fp16"), (False, False, "bf16")])
def test_auto_precision_is_bf16_where_the_device_computes_in_it_else_fp16(monkeypatch, cuda, bf16, expected):
    """A Turing or Pascal card (no bf16) trains in fp16 with loss scaling; Ampere and newer, and the CPU, in bf16;
    a precision chosen by name is kept (faked CUDA facts)."""
    import torch
    from ingraph_trainer.trainer import device
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: asked.append(including_emulation) or bf16)
    assert device.concrete_precision("auto") == expected
    assert asked == ([False] if cuda else [])  # emulated bf16 (Turing) is slower than fp16: not taken as bf16
    assert [device.concrete_precision(p) for p in ("fp32", "bf16", "fp16")] == ["fp32", "bf16", "fp16"]


def test_the_launch_keeps_to_the_gpus_comfyui_was_given(monkeypatch):
    """A server started with --cuda-device 4,5 (ComfyUI sets CUDA_VISIBLE_DEVICES) trains on GPUs 4 and 5:
    DeepSpeed's runner drops the variable when given --num_gpus, so the launch names them (--include)."""
    from ingraph_trainer.runner.launcher import deepspeed_launch_command
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    cmd = deepspeed_launch_command("python", 2, master_port=1234)
    assert "--num_gpus" not in cmd and cmd[cmd.index("--include") + 1] == "localhost:4,5"
    with pytest.raises(ValueError, match=r"distributed.processes: 4 processes, but this ComfyUI sees 3 GPU"):
        deepspeed_launch_command("python", 4, master_port=1234)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # a CPU machine, or every GPU: as before
    import torch
    from ingraph_trainer.runner import launcher
    monkeypatch.setattr(launcher, "usable_cpus", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cmd = deepspeed_launch_command("python", 2, master_port=1234)
    assert cmd[cmd.index("--num_gpus") + 1] == "2" and "--include" not in cmd
    # any client can queue a graph: no more ranks than the machine's GPUs, or its cores without one (finding 7)
    with pytest.raises(ValueError, match=r"distributed.processes: 5 processes, but this machine has 2 CPU cores "
                                         r"and no GPU; at most 2"):
        deepspeed_launch_command("python", 5, master_port=1234)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert deepspeed_launch_command("python", 8, master_port=1234)[-3] == "8"
    with pytest.raises(ValueError, match=r"9 processes, but this machine has 8 GPU\(s\); at most 8"):
        deepspeed_launch_command("python", 9, master_port=1234)
    cmd = deepspeed_launch_command("python", 64, "hosts", master_port=1234)  # several machines: the hostfile says
    assert cmd[cmd.index("--hostfile") + 1] == "hosts" and "--include" not in cmd


def test_block_swap_on_the_plain_engine_never_puts_the_swapped_weights_on_the_device(monkeypatch):
    """A model larger than the card trains with block swap only if the swapped blocks' frozen weights never reach
    the device whole: the plain engine's move leaves them in host memory (DeepSpeed's engine moved the whole module
    first, issue 30). "meta" stands in for the device: every move to it is recorded, the tensor left where it is."""
    import torch
    from ingraph_trainer.trainer import device
    from ingraph_trainer.trainer.parallel import memory, plain_engine
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    adapter = torch.nn.Parameter(torch.zeros(4))
    blocks[0].register_parameter("adapter", adapter)  # trained: stays with the optimizer, on the device
    blocks.requires_grad_(False)
    adapter.requires_grad_(True)
    meta = torch.device("meta")
    moved, real_to = [], torch.Tensor.to

    def to(self, *args, **kwargs):
        if meta in args or kwargs.get("device") == meta:
            moved.append(self.data_ptr())
            return self
        return real_to(self, *args, **kwargs)
    memory.enable_block_swap([blocks[0]], meta, torch.bfloat16)
    host_weights = {blocks[0].weight.data_ptr(), blocks[0].bias.data_ptr()}
    monkeypatch.setattr(device, "training_device", lambda: meta)
    monkeypatch.setattr(torch.Tensor, "to", to)
    engine, *_ = plain_engine.initialize(model=blocks, optimizer=torch.optim.AdamW([adapter]),
                                         config={"bf16": {"enabled": True}})
    monkeypatch.setattr(torch.Tensor, "to", real_to)
    assert engine.device == meta
    assert blocks[0].weight.dtype == blocks[0].adapter.dtype == torch.bfloat16  # cast by the swap, as by the engine
    expected = {p.data_ptr() for b in blocks for name, p in b.named_parameters()} - host_weights
    assert len(moved) == len(expected) == 5 and set(moved) == expected


def test_previews_keep_the_training_model_on_its_device_and_out_of_comfyuis_list(monkeypatch):
    """Issue 29, item 6: sampling hands the training model's patcher to ComfyUI's memory manager, which on a nearly
    full card offloads its smallest modules (the LoRA leaves) mid-run. While a preview samples, the patcher's offload
    device is the trainer's device; afterwards ComfyUI's list holds neither it nor the VAE, which is unloaded."""
    import types
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.model_management as mm
    from ingraph_trainer.trainer import sampling
    unloaded = []

    class Loaded:  # comfy.model_management.LoadedModel, as far as the previews use it
        def __init__(self, model):
            self.model = model

        def model_unload(self):
            unloaded.append(self.model)
    training, vae = types.SimpleNamespace(load_device="cuda:1", offload_device="cpu"), types.SimpleNamespace()
    other = Loaded(types.SimpleNamespace())
    monkeypatch.setattr(mm, "current_loaded_models", [other])
    with sampling.on_the_trainers_device(training):
        assert training.offload_device == "cuda:1"  # what free_memory would offload to: the device itself
        mm.current_loaded_models += [Loaded(training), Loaded(vae)]  # what ComfyUI's sampling and decode add
        sampling.forget_loaded(vae, unload=True)
    assert training.offload_device == "cpu"
    assert mm.current_loaded_models == [other] and unloaded == [vae]


@pytest.mark.parametrize("format_name, ratio, channels, side", [("SD15", None, 4, 8), ("Flux2", 16, 128, 4),
                                                                 ("ChromaRadiance", 1, 3, 64), ("Wan22", None, 48, 4),
                                                                 ("LTXV", None, 128, 2)])
def test_a_preview_samples_the_latent_comfyuis_empty_latent_nodes_make_for_its_size(monkeypatch, format_name, ratio,
                                                                                    channels, side):
    """A 64 px preview samples a latent of 64 / the model's pixels per latent cell (its latent format's
    spacial_downscale_ratio, as ComfyUI 0.33 states it): 16 for Flux.2's and Wan 2.2's latents (an 8-cell latent is
    a 128 px image), 1 for a pixel-space model's (Chroma Radiance). ComfyUI 0.3.64's formats state none: the ones
    it divides by another number in its empty-latent nodes (Wan 2.2's 16, LTX-Video's 32) are known by name, any
    other is its VAEs' 8."""
    from ingraph_trainer.trainer import comfy_compat, sampling
    latent_format = type(format_name, (), {"latent_channels": channels})()
    if ratio is not None:
        latent_format.spacial_downscale_ratio = ratio
    patcher = types.SimpleNamespace(get_model_object=lambda name: {"latent_format": latent_format}[name])
    sampled = []
    monkeypatch.setattr(comfy_compat, "sample", lambda patcher, latent, *args: sampled.append(latent.shape) or latent)
    sampling.sample_latent(patcher, [], [], 0, steps=1, cfg=1.0, sampler="euler", scheduler="simple", width=64,
                           height=64)
    assert sampled == [(1, channels, side, side)]


def test_the_out_of_memory_message_names_the_peak_and_only_settings_not_yet_used(monkeypatch):
    """On a GPU the message gives the run's peak against the card; suggestions already taken are left out."""
    from ingraph_trainer.trainer import device
    from ingraph_trainer.trainer.parallel import memory
    from ingraph_trainer.trainer.spec import RunSpec
    monkeypatch.setattr(device, "local_cuda_index", lambda: 0)
    monkeypatch.setattr(device, "device_memory", lambda dev: {"peak_allocated": 10 * 2**30, "total": 24 * 2**30})
    spec = RunSpec()
    spec.train.gradient_checkpointing, spec.train.batch_size, spec.model.base_precision = True, 1, "fp8"
    assert memory.out_of_memory_message(spec, 7) == (
        "out of GPU memory at step 7 (peak 10.0 GiB of 24.0 GiB): set block_swap (DeepSpeed Settings) to some of "
        "the model's blocks; or train at a lower resolution. The last complete checkpoint is intact.")
    assert memory.out_of_memory_message(spec, 0).startswith("out of GPU memory while loading the model (peak")
    spec.distributed.processes, spec.distributed.zero_stage = 2, 2  # block swap works under DeepSpeed up to ZeRO-2
    assert "set block_swap" in memory.out_of_memory_message(spec, 7)
    spec.distributed.zero_stage = 3  # which partitions the weights itself
    assert "block_swap" not in memory.out_of_memory_message(spec, 7)


def test_verified_shards_are_read_once_while_they_fit_their_memory_budget(monkeypatch):
    """The trainer reads and hashes each cached shard once per run while it fits (ShardMemo), not at every epoch
    (0.3 ms an item a step on the tiny SD1.5), one memo per process whatever the datasets; past the byte budget
    the least recently used shard goes, and the next read verifies it again."""
    import torch
    data = importlib.import_module("ingraph_trainer.trainer.data.loading")
    reads = []

    def load_checked(root, kind, key, sha):
        reads.append((kind, key))
        return {"latent": torch.zeros(256)}  # 1 KiB
    monkeypatch.setattr(data, "load_checked", load_checked)
    monkeypatch.setattr(data, "LATENT_MEMO", data.ShardMemo(512 << 20))
    monkeypatch.setattr(data, "TEXT_MEMO", data.ShardMemo(256 << 20))
    ds = data.CachedDataset(root="/c", latent_keys=["a", "b", "c"], latent_shas=["1", "2", "3"],
                            text_keys=["t"] * 3, text_shas=["9"] * 3, buckets=[(8, 8)] * 3,
                            sources=["a.png", "b.png", "c.png"], unique=[0, 1, 2])
    for epoch in range(3):
        for i in range(3):
            ds.latent(i)
            ds.text(i)
    assert reads == [("latent", "a"), ("text", "t"), ("latent", "b"), ("latent", "c")]
    memo, reads[:] = data.ShardMemo(2048), []  # room for two
    for key in ("a", "b", "a", "c", "b"):
        memo.get((key,), lambda key=key: load_checked("/c", "latent", key, ""))
    assert [key for _, key in reads] == ["a", "b", "c", "b"]  # "a" kept by its second use; "b" went for "c"


def test_the_clients_progress_line_leaves_nothing_of_a_longer_one_and_names_nodes_by_title():
    """On a terminal each step's line is written over the last: a shorter one is padded to the last one's length
    ("eta 10s" then "eta 0s" showed "eta 0ss"), and a message in between goes below it. Nodes are named by their
    titles."""
    import io
    from client.cli import TerminalProgress, node_titles

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    out = Terminal()
    progress = TerminalProgress(out, node_titles({"6": {"class_type": "InGraphTrainLoRA",
                                                        "_meta": {"title": "Train LoRA"}}}))
    step = {"type": "step", "total": 3, "loss": 0.5, "lr": 1e-4, "samples_per_s": 2.0}
    for n, eta in ((1, 10.0), (2, 0.0)):
        progress({"type": "ingraph.event", "data": {"event": {**step, "step": n, "eta_s": eta}}})
    progress({"type": "executing", "data": {"node": "6"}})
    empty, first, second = out.getvalue().split("\r")
    assert empty == ""
    assert first.endswith("eta 10s") and second.startswith(first[:10])
    line, below = second.split("\n", 1)
    assert len(line) == len(first) and line.rstrip().endswith("eta 0s"), (first, line)
    assert below == '"Train LoRA" (node 6) running\n'


def test_block_swap_keeps_the_swapped_blocks_frozen_weights_off_the_device():
    """Issue 30's guard, one process (the plain engine): with N blocks swapped, the bytes the engine's move puts
    on the device are the model's less those blocks' frozen weights (they stay in host memory and visit the
    device only while their block runs), and a forward and backward pass leave them there. The device here is
    "meta", which computes shapes only; the same calls run on a GPU."""
    import torch
    memory = importlib.import_module("ingraph_trainer.trainer.parallel.memory")
    plain_engine = importlib.import_module("ingraph_trainer.trainer.parallel.plain_engine")
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)]
    model = torch.nn.Sequential(*blocks)
    model.requires_grad_(False)
    for block in blocks:  # a trainable weight in every block
        block.register_parameter("adapter", torch.nn.Parameter(torch.zeros(64)))
        block.register_forward_pre_hook(lambda module, args: (args[0] + module.adapter,))

    def nbytes(params):
        return sum(p.numel() * p.element_size() for p in params)
    total = nbytes(model.parameters())
    swapped = nbytes(p for block in blocks[:2] for p in block.parameters() if not p.requires_grad)
    device = torch.device("meta")
    memory.enable_block_swap(blocks[:2], device)
    plain_engine.move_to_device(model, device)
    on_device = [p for p in model.parameters() if p.device == device]
    assert nbytes(on_device) == total - swapped > 0
    assert all(p.device.type == "cpu" for block in blocks[:2] for p in block.parameters() if not p.requires_grad)
    # the trainable weights are on the device (moving to "meta" makes new Parameter objects, where a GPU keeps them)
    assert all(block.adapter.device == device for block in blocks)
    model(torch.zeros(2, 64, device=device)).sum().backward()
    assert nbytes(p for p in model.parameters() if p.device == device) == total - swapped
    assert all(block.adapter.grad is not None and block.adapter.grad.device == device for block in blocks)


def test_a_stop_left_before_a_standby_took_the_run_is_stale(tmp_path, monkeypatch):
    """A STOP clicked during a run's export stays in its folder; the resume handed to a standby (whose process
    began before that click) must not stop at its first step. A STOP written after the hand-off is a request."""
    import os
    import time
    from ingraph_trainer.trainer.run import stop_requests
    monkeypatch.setattr(stop_requests, "_RUN_STARTED_AT", None)
    stop = tmp_path / "STOP"
    stop.touch()
    import psutil
    began = psutil.Process().create_time() + 0.5  # after this process began: a cold trainer keeps it
    assert began < time.time() - 0.5
    os.utime(stop, (began, began))
    requests = stop_requests.StopRequests(tmp_path, is_rank0=True)
    requests.drop_stale(time.time())
    assert stop.exists()  # a cold trainer: written during its start-up, so it is a request
    stop_requests.mark_run_start()  # a standby takes the run now
    requests.drop_stale(time.time())
    assert not stop.exists()
    stop.touch()
    os.utime(stop, (time.time() + 1, time.time() + 1))  # the user's Stop during the run (file clocks are coarse)
    requests.drop_stale(time.time())
    assert stop.exists()


def test_cpu_evaluation_runs_passes_side_by_side_with_one_threads_numbers_and_not_under_zero3_or_block_swap():
    """On a CPU, one process evaluates its passes in threads, each pass on one thread and every quantile of a chunk
    in one pass: the numbers equal one thread's in order (a model whose output depends on its batch's rows would show
    a wrong row), and the threads really ran; ZeRO-3's gathered weights and block swap's swapped ones keep it to one
    pass at a time."""
    import threading
    import types
    import torch
    from ingraph_trainer.trainer.tasks import evaluation

    class Family:
        threads: set = set()

        def loss(self, batch, reduce=False, weighted=False):
            self.threads.add(threading.get_ident())
            threading.Event().wait(0.02)  # long enough that a second worker takes the next pass
            return (batch.latents.flatten(1).sum(1) * (1 + batch.timesteps) + batch.noise.flatten(1).mean(1)).float()

    dataset = types.SimpleNamespace(
        buckets=[(8, 8)] * 5, reference_slots=0, text_masks=lambda chunk: None, text_extras=lambda chunk: None,
        batch=lambda chunk: (torch.stack([torch.full((1, 2, 2), float(i)) for i in chunk]),
                             torch.zeros(len(chunk), 3, 4), None))
    module = torch.nn.Linear(2, 2)
    module.family = Family()
    quantiles = [0.1, 0.5, 0.9]  # 5 items in batches of 3: chunks of 3 and 2
    one = evaluation._evaluate(module, dataset, list(range(5)), quantiles, 7, 3, "cpu", side_by_side=1)
    Family.threads = set()
    two = evaluation._evaluate(module, dataset, list(range(5)), quantiles, 7, 3, "cpu", side_by_side=2)
    assert one == two and one["items"] == 5 and len(one["quantiles"]) == 3
    # each item at each quantile, as the loss above gives it for that item's rows and that quantile's timestep
    for q in quantiles:
        expected = sum(4 * i * (1 + q) + evaluation.eval_noise((1, 2, 2), [i], 7).mean().item() for i in range(5)) / 5
        assert one["quantiles"][f"{q:g}"] == pytest.approx(expected, rel=1e-6), q
    assert len(Family.threads) == 2 and threading.get_ident() not in Family.threads
    for mark in ("ds_id", "host_resident"):
        setattr(module.weight, mark, True)
        assert not evaluation.passes_may_run_side_by_side(module), mark
        Family.threads = set()
        assert evaluation._evaluate(module, dataset, list(range(5)), quantiles, 7, 3, "cpu", side_by_side=2) == one
        assert Family.threads == {threading.get_ident()}
        delattr(module.weight, mark)


def test_pixart_is_refused_below_the_size_its_position_embedding_divides_by_zero_at():
    """ComfyUI's PixArt forward divides by round(((H + W) // 2) / 64) of the latent's sides: a cached dataset of
    256 px items (0.5, which Python rounds to 0) is refused at start-up naming the size; 272 x 256 px trains."""
    from ingraph_trainer.trainer.data.dataset_checks import check_dataset_for_family
    from ingraph_trainer.trainer.models.base import UnsupportedSetting
    from ingraph_trainer.trainer.models.generic import GenericFamily

    class PixArtMS:  # the attributes ComfyUI's PixArtMS computes its position embedding from
        pe_interpolation, pe_precision = None, None

    family = object.__new__(GenericFamily)
    family.diffusion_model, family.display_name = PixArtMS(), "generic (PixArtAlpha)"
    family.reference_input = None

    def cached(*sizes):
        return types.SimpleNamespace(buckets=list(sizes), reference_slots=0)
    with pytest.raises(UnsupportedSetting, match=r"data\.manifest: items of 256x256 px: .*264 px"):
        check_dataset_for_family(cached((512, 512), (256, 256)), family)
    check_dataset_for_family(cached((272, 256), (512, 512, 17)), family)
    PixArtMS.pe_interpolation = 1.0  # a fixed interpolation (no pe_precision): no division by the size
    check_dataset_for_family(cached((256, 256)), family)


def test_hunyuan_video_is_refused_at_sizes_its_unpadded_patches_do_not_divide():
    """ComfyUI's HunyuanVideo cuts the 8x latent into 2x2 patches without padding: 72 px items (a multiple of 8,
    which the dataset allows with buckets off) failed at the first step with a shape error; they are refused at
    start-up naming the size and 16 px, and by the node at queue time. The rule is HunyuanVideo 1's: 1.5's 1x1
    patches never refuse (its 16x VAE's own crop sets its sizes)."""
    from ingraph_trainer.trainer.data.dataset_checks import check_dataset_for_family
    from ingraph_trainer.trainer.models.base import UnsupportedSetting
    from ingraph_trainer.trainer.models.hunyuan_video import HunyuanVideo15Family, HunyuanVideoFamily

    def family(cls, patch):
        made = object.__new__(cls)
        made.diffusion_model, made.reference_input = types.SimpleNamespace(patch_size=[1, patch, patch]), None
        return made

    def cached(*sizes):
        return types.SimpleNamespace(buckets=list(sizes), reference_slots=0)
    with pytest.raises(UnsupportedSetting, match=r"data\.manifest: items of 72x64 px: .*multiples of 16 px"):
        check_dataset_for_family(cached((64, 64, 17), (72, 64)), family(HunyuanVideoFamily, 2))
    check_dataset_for_family(cached((64, 64, 17), (80, 96)), family(HunyuanVideoFamily, 2))
    check_dataset_for_family(cached((72, 64)), family(HunyuanVideo15Family, 1))
    # the graph's dataset, at queue time: its buckets are its settings, its items have their sizes
    items = [types.SimpleNamespace(bucket=(64, 64)), types.SimpleNamespace(bucket=(72, 64))]
    graph = types.SimpleNamespace(buckets=object(), reference_slots=0, items=items)
    with pytest.raises(UnsupportedSetting, match=r"^dataset: items of 72x64 px: .*multiples of 16 px"):
        check_dataset_for_family(graph, family(HunyuanVideoFamily, 2), "dataset")


def test_deepspeeds_engine_start_leaves_block_swaps_weights_in_host_memory():
    """Issue 30: DeepSpeed's engine moved its whole module to the device as it started, so block swap could not fit
    a model larger than the card under DeepSpeed. Started through the trainer's layout, the real engine (ZeRO-1, bf16,
    on this CPU) moves every weight but the swapped block's frozen ones, which stay the block's, in bf16; started by
    deepspeed.initialize alone (the control), it moves them too."""
    import json
    import subprocess
    probe = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "deepspeed_swap_probe.py")],
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    layout, control = seen["layout"], seen["control"]
    assert control["host_moved"] == ["0.bias", "0.weight"]  # what the engine does with a module as it is given
    assert layout["host_moved"] == [] and layout["others_moved"] == ["0.adapter", "1.bias", "1.weight", "2.bias",
                                                                     "2.weight"]
    assert layout["host_still_there"] == ["weight", "bias", "adapter"] and layout["dtype"] == "torch.bfloat16"
    assert layout["unnamed"] == control["unnamed"] == []


def test_ranks_whose_swapped_weights_differ_are_refused(monkeypatch):
    """The engine's start no longer broadcasts the swapped weights from rank 0: a rank that read another file (a
    machine of a hostfile with a different copy at the same path) is refused, naming the setting and the rank."""
    import torch
    from ingraph_trainer.trainer.parallel import distributed, memory
    block = torch.nn.Linear(4, 4)
    block.requires_grad_(False)
    memory.enable_block_swap([block], torch.device("cpu"))
    mine = float(block.weight.double().sum()), float(block.bias.double().sum())
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    for other, refused in ((list(mine), False), ([mine[0] + 1e-3, mine[1]], True)):
        monkeypatch.setattr(torch.distributed, "all_gather_object",
                            lambda every, sums, _other=other: every.__setitem__(slice(None), [sums, _other]))
        if refused:
            with pytest.raises(RuntimeError, match=r"model\.path: .* rank\(s\) \[1\]"):
                memory.check_swapped_weights_agree([block])
        else:
            memory.check_swapped_weights_agree([block])


def test_what_crosses_a_pipeline_stage_is_tensors_and_comes_back_as_it_was():
    """stages.packed: nested block inputs (as LTX-2's preparation steps give them) become tensors only, each tensor
    once however often it appears, the rest in a uint8 tensor; unpacked gives back the same structure, the same
    tensors (identical objects), an empty tensor as one of its shape, enums, dtypes and __slots__ objects (ComfyUI's
    CompressedTimestep is one; here Fraction); anything else is refused by name."""
    import http
    from fractions import Fraction

    import torch
    from ingraph_trainer.trainer.models.stages import packed, unpacked
    shared, other = torch.randn(2, 3), torch.arange(4)
    tree = ([shared, torch.zeros(2, 0, 5)], {"a_timestep": shared, "orig_shape": [2, 128, 3, 4, 8], "mask": None,
                                             "status": http.HTTPStatus.OK, "scale": 0.5},
            (Fraction(3, 4), other, torch.bfloat16, "x", True))
    carried = packed(tree)
    assert all(isinstance(t, torch.Tensor) for t in carried) and len(carried) == 3 and carried[-1].dtype == torch.uint8
    (streams, merged, (fraction, ints, dtype, text, flag)) = unpacked(carried)
    assert streams[0] is carried[0] and merged["a_timestep"] is carried[0] and ints is carried[1]
    assert streams[1].shape == (2, 0, 5) and streams[1].dtype == torch.float32
    assert merged["orig_shape"] == [2, 128, 3, 4, 8] and merged["mask"] is None and merged["scale"] == 0.5
    assert merged["status"] is http.HTTPStatus.OK and fraction == Fraction(3, 4) and type(fraction) is Fraction
    assert dtype is torch.bfloat16 and text == "x" and flag is True and isinstance(streams, list)
    with pytest.raises(TypeError, match="a object cannot cross a pipeline stage"):
        packed([object()])
    with pytest.raises(TypeError, match="a Size cannot cross a pipeline stage"):  # a tuple of another class
        packed([torch.Size([2, 3])])
