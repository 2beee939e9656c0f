from comfy_api.latest import io

from .preview_node import _sampler_options
from .types import CATEGORY


class Compare(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        samplers, schedulers = _sampler_options()
        return io.Schema(
            node_id="InGraphCompare",
            display_name="Compare Models",
            category=CATEGORY,
            description="Before and after: the same prompts and seeds through the base MODEL and the trained MODEL "
                        "(e.g. Train LoRA's model output), with ComfyUI's stock sampling, as one labelled grid.",
            inputs=[
                io.Model.Input("base_model", tooltip="The model before training."),
                io.Model.Input("trained_model", tooltip="The model with the trained adapter applied."),
                io.Clip.Input("clip", tooltip="Encodes the prompts."),
                io.Vae.Input("vae", tooltip="Decodes the images."),
                io.String.Input("prompts", multiline=True, default="a photo",
                                tooltip="One prompt per line; each is a row of the grid (per seed)."),
                io.String.Input("negative_prompt", multiline=True, default="", tooltip="Negative prompt for all."),
                io.String.Input("seeds", default="0", tooltip="Seeds, separated by commas; each prompt is rendered "
                                                             "with each seed."),
                io.Int.Input("steps", default=20, min=1, max=200, tooltip="Sampling steps."),
                io.Float.Input("cfg", default=7.0, min=0.0, max=100.0, step=0.1, tooltip="Classifier-free guidance."),
                io.Combo.Input("sampler_name", options=samplers, default="euler", tooltip="ComfyUI sampler."),
                io.Combo.Input("scheduler", options=schedulers, default="normal", tooltip="ComfyUI scheduler."),
                io.Int.Input("width", default=512, min=64, max=4096, step=8, tooltip="Image width in pixels."),
                io.Int.Input("height", default=512, min=64, max=4096, step=8, tooltip="Image height in pixels."),
                io.String.Input("labels", default="base, trained", tooltip="Column titles: base, then trained."),
            ],
            outputs=[io.Image.Output(display_name="grid", tooltip="Rows: prompt and seed; columns: base, trained.")],
        )

    @classmethod
    def validate_inputs(cls, seeds, prompts):
        from ..runner.compare import parse_prompts, parse_seeds
        try:
            parse_seeds(seeds)
            parse_prompts(prompts)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, base_model, trained_model, clip, vae, prompts, negative_prompt, seeds, steps, cfg, sampler_name,
                scheduler, width, height, labels) -> io.NodeOutput:
        from ..runner.compare import compare_grid, parse_prompts, parse_seeds
        from ..runner.loss_chart import chart_tensor
        names = [n.strip() for n in labels.split(",")] + ["base", "trained"]
        base_label, trained_label = names[0] or "base", names[1] or "trained"
        if base_label == trained_label:
            trained_label += " (2)"
        texts, seed_list = parse_prompts(prompts), parse_seeds(seeds)
        from ..trainer.comfy_compat import progress_bar
        bar = progress_bar(2 * len(texts) * len(seed_list))
        grid = compare_grid({base_label: base_model, trained_label: trained_model}, clip, vae, texts, negative_prompt,
                            seed_list, steps=steps, cfg=cfg, sampler=sampler_name, scheduler=scheduler, width=width,
                            height=height, on_image=lambda: bar.update(1))
        return io.NodeOutput(chart_tensor(grid))
