from comfy_api.latest import io

from .types import CATEGORY, Previews


def _sampler_options():
    from ..trainer.comfy_compat import sampler_and_scheduler_names
    return sampler_and_scheduler_names()


class SamplePreviews(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        samplers, schedulers = _sampler_options()
        return io.Schema(
            node_id="InGraphSamplePreviews",
            display_name="Sample Previews",
            category=CATEGORY,
            description="Preview images during training: every N steps the trainer renders these prompts with "
                        "ComfyUI's own sampler on the current weights. They appear in the Train LoRA panel and in "
                        "the run's samples folder.",
            inputs=[
                io.Clip.Input("clip", tooltip="Encodes the prompts (once, before the run)."),
                io.Vae.Input("vae", tooltip="Decodes the previews."),
                io.String.Input("prompts", multiline=True, default="a photo",
                                tooltip="One prompt per line; each gives one preview image."),
                io.String.Input("negative_prompt", multiline=True, default="",
                                tooltip="Negative prompt for every preview."),
                io.Int.Input("every", default=100, min=1, max=1_000_000,
                             tooltip="Render previews every N steps (and after the last step)."),
                io.Int.Input("steps", default=20, min=1, max=200, tooltip="Sampling steps per preview."),
                io.Float.Input("cfg", default=7.0, min=0.0, max=100.0, step=0.1, tooltip="Classifier-free guidance."),
                io.Combo.Input("sampler_name", options=samplers, default="euler", tooltip="ComfyUI sampler."),
                io.Combo.Input("scheduler", options=schedulers, default="normal", tooltip="ComfyUI scheduler."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=False,
                             tooltip="Seed of the first prompt's noise (the n-th prompt uses seed + n); fixed, so "
                                     "previews of different steps are comparable."),
                io.Int.Input("width", default=512, min=64, max=4096, step=8, tooltip="Preview width in pixels."),
                io.Int.Input("height", default=512, min=64, max=4096, step=8, tooltip="Preview height in pixels."),
            ],
            outputs=[Previews.Output(display_name="previews", tooltip="Connect to Train LoRA's previews input.")],
        )

    @classmethod
    def execute(cls, clip, vae, prompts, negative_prompt, every, steps, cfg, sampler_name, scheduler, seed, width,
                height) -> io.NodeOutput:
        from ..runner.compare import parse_prompts
        from ..runner.previews import PreviewSettings, encode_prompts
        from ..trainer.spec import SampleSpec
        texts = parse_prompts(prompts)
        if width % 8 or height % 8:
            raise ValueError(f"width and height must be multiples of 8 (got {width}x{height})")
        spec = SampleSpec(every=every, prompts=texts, steps=steps, cfg=float(cfg), sampler=sampler_name,
                          scheduler=scheduler, seed=seed, width=width, height=height)
        return io.NodeOutput(PreviewSettings(spec, encode_prompts(clip, texts, negative_prompt), vae))
