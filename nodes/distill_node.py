from comfy_api.latest import io

from ..trainer.spec import DistillSpec, DistributedSpec, RunSpec
from .train_node import _resumable, progress_relay
from .inputs import output_file_inputs, precision_input
from .spec_inputs import input_names, spec_section
from .types import CATEGORY, Adapter, Dataset, Distributed, Previews

DEFAULTS = DistillSpec()  # the node's defaults are the run spec's


class Distill(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="InGraphDistill",
            display_name="Distill (few-step, DMD2)",
            category=CATEGORY,
            description="Distils the MODEL (the teacher) into a student that samples in 1 to 4 steps, with DMD2 "
                        "(distribution matching plus a fake score that follows the student), in a separate trainer "
                        "process streaming progress to this node. A LoRA student is written into models/loras (a "
                        "turbo LoRA for the teacher); sample it with KSampler at student_steps steps, sampler lcm, "
                        "scheduler sgm_uniform, cfg 1.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model", tooltip="The teacher, exactly as the graph gives it (LoRAs applied upstream "
                                                "are part of it). It stays frozen; the student starts as a copy."),
                Dataset.Input("dataset", tooltip="A dataset whose latents and text embeddings are cached. Its "
                                                 "captions are what the student learns to draw; its images are used "
                                                 "only by the regression warm-up and the GAN term."),
                Adapter.Input("adapter", tooltip="How the student trains, from the LoRA Adapter node: kind LoRA (a "
                                                 "turbo LoRA that loads onto the teacher) or Full fine-tune (a whole "
                                                 "diffusion model). Other kinds are refused."),
                io.Int.Input("steps", default=1000, min=1, max=1_000_000,
                             tooltip="Generator (student) updates to train for; each also makes fake_updates "
                                     "updates of the fake score."),
                io.Int.Input("batch_size", default=1, min=1, max=1024, tooltip="Captions per update on each process."),
                io.Float.Input("learning_rate", default=1e-4, min=1e-8, max=1.0, step=1e-6,
                               tooltip="The student's learning rate (1e-4 suits a LoRA; DMD2 trains whole models "
                                       "at 1e-5 or less)."),
                io.Int.Input("student_steps", default=DEFAULTS.student_steps, min=1, max=4,
                             tooltip="Sampling steps the student is made for (1 to 4); sample it with this many "
                                     "KSampler steps."),
                io.Float.Input("guidance_scale", default=DEFAULTS.guidance_scale, min=1.0, max=30.0, step=0.05,
                               tooltip="Classifier-free guidance of the teacher (the real score) against the empty "
                                       "caption; the student learns the guided result, so it samples at cfg 1 "
                                       "(1 = no guidance; DMD2 uses 1.75). Above 1 it takes the empty caption's "
                                       "embedding from the cache (Cache Text Embeddings writes it)."),
                io.Float.Input("fake_learning_rate", default=DEFAULTS.fake_learning_rate, min=1e-8, max=1.0,
                               step=1e-6, tooltip="Learning rate of the fake score, the copy of the teacher that "
                                                  "learns to denoise the student's outputs."),
                io.Int.Input("fake_updates", default=DEFAULTS.fake_updates, min=1, max=100,
                             tooltip="Fake-score updates per student update (DMD2's two time-scale rule: the fake "
                                     "score must keep up with the student; 5 is DMD2's)."),
                io.Float.Input("dmd_weight", default=DEFAULTS.dmd_weight, min=0.0, max=100.0, step=0.05,
                               tooltip="Weight of the distribution-matching loss of the student (the gradient from "
                                       "the real score minus the fake score)."),
                io.Float.Input("denoising_weight", default=DEFAULTS.denoising_weight, min=0.001, max=100.0,
                               step=0.05, tooltip="Weight of the fake score's denoising loss on the student's "
                                                  "outputs."),
                io.Float.Input("gan_weight", default=DEFAULTS.gan_weight, min=0.0, max=100.0, step=0.001,
                               tooltip="Weight of the GAN term: a classifier head on the fake score's features "
                                       "tells the dataset's latents from the student's outputs (0 = off; DMD2 uses "
                                       "it at 1e-3 for its best quality)."),
                io.Int.Input("regression_steps", default=DEFAULTS.regression_steps, min=0, max=1_000_000,
                             tooltip="Warm-up: the first N student updates regress on the dataset's latents "
                                     "instead of the distribution-matching loss (0 = none)."),
                io.Boolean.Input("backward_simulation", default=DEFAULTS.backward_simulation,
                                 tooltip="Students of 2 to 4 steps: each update starts from what the student's own "
                                         "earlier steps produce, as at sampling time (DMD2's backward simulation), "
                                         "instead of from noised dataset latents."),
                precision_input(),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=False,
                             tooltip="Seed for the student's initialisation, caption order, noise and timesteps."),
                io.Int.Input("save_every", default=0, min=0, max=1_000_000,
                             tooltip="Save a resumable checkpoint (student, fake score and both optimizers) every "
                                     "N updates (0 = only the final student)."),
                io.String.Input("output_name", default="ingraph_turbo_lora",
                                tooltip="File name in models/loras (a full fine-tune: models/diffusion_models); "
                                        "sub-folders allowed. A file of that name this pack wrote is replaced when "
                                        "the run finishes."),
                io.Combo.Input("resume", options=["off", "latest", *_resumable("distill")], default="off",
                               optional=True,
                               tooltip="off: a new run. latest: continue the newest distillation with this "
                                       "output_name from its last complete checkpoint (a new run if there is "
                                       "none). Or pick a checkpoint of a distillation. A resumed run uses the "
                                       "settings saved with it."),
                Distributed.Input("distributed", optional=True,
                                  tooltip="DeepSpeed settings (processes, ZeRO: stage 3 shards the student, the fake "
                                          "score and the frozen teacher; offload, hostfile); one process when not "
                                          "connected. Pipeline stages are refused."),
                Previews.Input("previews", optional=True,
                               tooltip="Sample Previews settings: images rendered with the current student during "
                                       "the run, shown in this node (its prompts, size and seed; the student is always "
                                       "rendered at student_steps with lcm, sgm_uniform and cfg 1, whatever its steps "
                                       "and cfg)."),
                io.String.Input("student_timesteps", default="", optional=True,
                                tooltip="Empty (usual): the noise levels KSampler's sgm_uniform scheduler visits "
                                        "at student_steps steps, so KSampler samples the student as trained. Or "
                                        "the student's own levels as t in (0, 1] along the model's schedule, one "
                                        "per student step, highest first, e.g. '1.0, 0.75, 0.5, 0.25' (then sample "
                                        "with SamplerCustom, sampler lcm, cfg 1, and those sigmas)."),
                io.Float.Input("min_t", default=DEFAULTS.min_t, min=0.0, max=1.0, step=0.01, optional=True,
                               tooltip="Lowest noise level (t in [0, 1]) at which the distribution-matching "
                                       "gradient and the fake score are trained."),
                io.Float.Input("max_t", default=DEFAULTS.max_t, min=0.0, max=1.0, step=0.01, optional=True,
                               tooltip="Highest noise level (t in [0, 1]) at which the distribution-matching "
                                       "gradient and the fake score are trained."),
                *output_file_inputs(),
                io.Int.Input("gradient_accumulation", default=1, min=1, max=1024, optional=True,
                             tooltip="Batches whose gradients are summed before each update (of the student and "
                                     "of the fake score): a larger batch in the same memory."),
                io.Boolean.Input("gradient_checkpointing", default=False, optional=True,
                                 tooltip="Recompute activations in the backward pass (student and fake score): less "
                                         "memory, slower updates."),
                io.Boolean.Input("fake_score_per_step", default=DEFAULTS.fake_score_per_step, optional=True,
                                 tooltip="Students of 2 to 4 steps: one fake score per student step, each following "
                                         "that step's outputs, so that every step (not only their mix) learns the "
                                         "teacher's images; better last-step samples, at one more copy of the model "
                                         "in memory per extra step and about three times the time per update. Off: one "
                                         "fake score (DMD2's). Not with the GAN term. Resume with it as it was."),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The teacher with the student applied: a KSampler "
                                                              "after it samples the student (student_steps steps, "
                                                              "lcm, sgm_uniform, cfg 1)."),
                io.String.Output(display_name="student_name",
                                 tooltip="The student's name as Load LoRA lists it (a full fine-tune: as Load "
                                         "Diffusion Model lists it)."),
            ],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, output_name, student_steps, student_timesteps=""):
        # no **kwargs: that would switch off ComfyUI's own min/max checks of every other input
        from ..runner.distill_run import parse_student_timesteps
        from ..runner.paths import lora_output_path
        try:
            lora_output_path(output_name)
            parse_student_timesteps(student_timesteps, student_steps)
        except ValueError as exc:
            return str(exc)
        return True

    # the run spec fields whose input has another name (None: the node's resume picks a run, not a checkpoint tag)
    SPEC_INPUTS = {"train.grad_accum": "gradient_accumulation", "train.resume": None}

    @classmethod
    def execute(cls, model, dataset, adapter, **inputs) -> io.NodeOutput:
        from ..trainer.comfy_compat import raise_if_interrupted

        from ..runner.distill_run import TASK, TITLE, parse_student_timesteps
        from ..runner.node_run import NodeCall, run_task
        from ..runner.session import RunDatasets

        dataset.require_cached("dataset")
        distill = spec_section(cls, "distill", inputs, read={"student_timesteps": str})
        distill.student_timesteps = parse_student_timesteps(distill.student_timesteps, distill.student_steps)
        draft = RunSpec(task=TASK, adapter=adapter, distributed=inputs.get("distributed") or DistributedSpec(),
                        train=spec_section(cls, "train", inputs), distill=distill,
                        output=spec_section(cls, "output", inputs))
        node_id = cls.hidden.unique_id
        node = NodeCall(TITLE, node_id, cls.hidden.prompt, progress_relay(node_id), raise_if_interrupted,
                        input_names(cls, "train", "distill", "output"))
        outcome = run_task(draft, model, RunDatasets(dataset), inputs.get("previews"), node, inputs["output_name"],
                           inputs.get("resume") or "off")
        return io.NodeOutput(outcome.model, outcome.lora_name)
