import logging

from comfy_api.latest import io

from ..trainer.spec import (ADAPTER_FORMAT_CHOICES, BASE_PRECISION_CHOICES, DEFAULT_EVAL_QUANTILES_TEXT,
                               LOSS_CHOICES, MEMORY_CHOICES, OPTIMIZER_CHOICES, SCHEDULE_CHOICES,
                               TIMESTEP_SAMPLING_CHOICES, DistributedSpec, RunSpec, TrainSpec, choice_labels,
                               choices_tooltip)
from .inputs import output_file_inputs, precision_input
from .spec_inputs import input_names, spec_section
from .types import CATEGORY, Adapter, Dataset, Distributed, Previews

log = logging.getLogger("ingraph_trainer")

EVENT_NAME = "ingraph.event"


def _send(event: dict, node_id: str, run_id: str):
    from server import PromptServer
    server = PromptServer.instance
    # to every client: a reloaded page or a second browser follows the run too (prompt_id lets API clients filter)
    server.send_sync(EVENT_NAME, {"node": node_id, "run_id": run_id,
                                  "prompt_id": getattr(server, "last_prompt_id", None), "event": event}, None)


def progress_relay(node_id: str):
    """The `on_run(run id, steps)` of runner.train_run for node `node_id`: each event moves ComfyUI's progress bar
    (a step event) and goes to the browser as an ingraph.event (the panel in web/ follows it)."""
    from ..trainer.comfy_compat import progress_bar

    def on_run(run_id: str, total_steps: int):
        bar = progress_bar(total_steps, node_id=node_id)

        def on_event(event):
            if event["type"] == "step":
                bar.update_absolute(int(event["step"]), total_steps)
            _send(event, node_id, run_id)
        return on_event
    return on_run


def _resumable(task: str = "train") -> list[str]:
    """The checkpoints a node running `task` (the run spec's task) may resume."""
    from ..runner import paths
    from ..runner.runs import resumable_checkpoints
    try:
        return resumable_checkpoints(paths.runs_root(), task=task)
    except Exception:  # never break the node list over a damaged runs folder
        return []


class TrainLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="InGraphTrainLoRA",
            display_name="Train LoRA",
            category=CATEGORY,
            description="Trains a LoRA on the MODEL in a separate trainer process (DeepSpeed), streaming progress "
                        "to this node. The LoRA is written into models/loras.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model", tooltip="The model to train on, exactly as the graph gives it "
                                                "(LoRAs applied upstream are part of what is trained on)."),
                Dataset.Input("dataset", tooltip="A dataset whose latents and text embeddings are cached."),
                Adapter.Input("adapter", tooltip="LoRA settings from the LoRA Adapter node."),
                io.Int.Input("steps", default=500, min=1, max=1_000_000,
                             tooltip="Optimizer steps to train for."),
                io.Int.Input("batch_size", default=1, min=1, max=1024, tooltip="Images per step on each process."),
                io.Int.Input("gradient_accumulation", default=1, min=1, max=1024,
                             tooltip="Batches whose gradients are summed before each optimizer step."),
                io.Float.Input("learning_rate", default=1e-4, min=1e-8, max=1.0, step=1e-6,
                               tooltip="Peak learning rate."),
                io.Combo.Input("optimizer", options=choice_labels(OPTIMIZER_CHOICES), default="AdamW",
                               tooltip=choices_tooltip(OPTIMIZER_CHOICES)),
                io.Combo.Input("lr_schedule", options=choice_labels(SCHEDULE_CHOICES), default="constant",
                               tooltip="How the learning rate changes after warm-up."),
                io.Int.Input("warmup_steps", default=0, min=0, max=100_000,
                             tooltip="Steps over which the learning rate rises linearly from 0 to its peak."),
                precision_input(),
                io.Boolean.Input("gradient_checkpointing", default=False,
                                 tooltip="Recompute activations in the backward pass: less memory, slower steps."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=False,
                             tooltip="Seed for the LoRA initialisation, data order, noise and timesteps."),
                io.Int.Input("save_every", default=0, min=0, max=1_000_000,
                             tooltip="Save a resumable checkpoint every N steps (0 = only the final LoRA)."),
                io.String.Input("output_name", default="ingraph_lora",
                                tooltip="File name in models/loras (a full fine-tune: models/diffusion_models); "
                                        "sub-folders allowed. An existing file of that name is replaced when the "
                                        "run finishes."),
                Distributed.Input("distributed", optional=True,
                                  tooltip="DeepSpeed settings (processes, ZeRO, offload, hostfile); one process "
                                          "when not connected."),
                Dataset.Input("eval_dataset", optional=True,
                              tooltip="Held-out images (cached like the training set) whose loss at fixed timestep "
                                      "quantiles is measured after the last step (every eval_every steps, and "
                                      "before the first with eval_before): eval_items of them, the same ones every "
                                      "time. Not connected: the training images are evaluated."),
                io.Int.Input("eval_every", default=0, min=0, max=1_000_000, optional=True,
                             tooltip="Evaluate every N steps (0 = after the last step only). The best step by "
                                     "evaluation loss is kept in the run record."),
                Previews.Input("previews", optional=True,
                               tooltip="Sample Previews settings: images rendered on the current weights during "
                                       "training, shown in this node."),
                io.Combo.Input("loss", options=choice_labels(LOSS_CHOICES), default="MSE", optional=True,
                               tooltip="Training loss: MSE, or Huber (less pulled by outlier images and noisy "
                                       "captions). Evaluation always reports MSE, so runs stay comparable."),
                io.Float.Input("min_snr_gamma", default=0.0, min=0.0, max=100.0, step=0.5, optional=True,
                               tooltip="Min-SNR weighting of the training loss (faster convergence; 5 is usual, "
                                       "0 = off)."),
                io.Combo.Input("file_format", options=choice_labels(ADAPTER_FORMAT_CHOICES), default="ComfyUI",
                               optional=True,
                               tooltip="Key layout of the saved file. ComfyUI: what Load LoRA reads natively. kohya: "
                                       "lora_unet_* keys for kohya-based tools (ComfyUI reads these too). diffusers: "
                                       "the peft layout diffusers' load_lora_weights reads (plain LoRA only; "
                                       "alpha / rank folded into the weights)."),
                io.Combo.Input("resume", options=["off", "latest", *_resumable()], default="off", optional=True,
                               tooltip="off: a new run. latest: continue the newest run with this output_name "
                                       "from its last complete checkpoint (a new run if there is none). Or pick a "
                                       "checkpoint. A resumed run uses the settings saved with it."),
                # appended last: saved workflows map widget values by position
                io.Combo.Input("timestep_sampling", options=choice_labels(TIMESTEP_SAMPLING_CHOICES),
                               default="uniform", optional=True,
                               tooltip="Where on the noise schedule training samples fall. uniform: evenly. "
                                       "logit-normal: concentrated at mid noise (SD3's recipe; usual for "
                                       "flow-matching models)."),
                io.Float.Input("flow_shift", default=1.0, min=0.01, max=100.0, step=0.05, optional=True,
                               tooltip="Flow-matching models (SD3, Flux, Wan): shifts training towards high noise, "
                                       "sigma = s*t / (1 + (s-1)*t). 1 = no shift; 3 is SD3's value at 1024px. "
                                       "Epsilon and v-prediction models reject any other value than 1."),
                io.Float.Input("guidance", default=1.0, min=0.0, max=100.0, step=0.1, optional=True,
                               tooltip="Guidance-distilled models (Flux dev): the guidance value given to the model "
                                       "while training (1 is usual for LoRAs). Other models reject any other value "
                                       "than 1."),
                *output_file_inputs(
                    overwrite_note=" Files this pack wrote are always replaced when the run finishes.",
                    checkpoint_note=" Each holds the trained weights and optimizer state."),
                io.Float.Input("ema_decay", default=0.0, min=0.0, max=0.99999, step=0.0001, optional=True,
                               tooltip="Keep an exponential moving average (EMA) of the trained weights, in fp32: "
                                       "each step it moves 1 - decay of the way to the weights (0 = off; 0.999 "
                                       "is usual, closer to 1 averages over more steps). Evaluation reports its "
                                       "loss too (ema_loss); checkpoints keep it. Not with ZeRO-3 or pipeline "
                                       "stages."),
                io.Int.Input("ema_start_step", default=0, min=0, max=1_000_000, optional=True,
                             tooltip="Until this step the EMA copies the weights; it averages from the next step "
                                     "on (skips the first, fast-moving steps)."),
                io.Boolean.Input("save_ema", default=False, optional=True,
                                 tooltip="Save the EMA weights as the LoRA file (and the output MODEL) instead of "
                                         "the weights of the last step. Needs ema_decay above 0."),
                Dataset.Input("prior_dataset", optional=True,
                              tooltip="Prior (regularisation) images: a second cached dataset, cached with the same "
                                      "VAE and text encoder, mixed into every batch (prior_fraction of it) so the "
                                      "model keeps what it knew of their class. The events report their loss "
                                      "(prior_loss) apart from the training images' (main_loss). Not with "
                                      "pipeline stages."),
                io.Float.Input("prior_weight", default=1.0, min=0.0, max=10.0, step=0.05, optional=True,
                               tooltip="Loss weight of the prior images against 1 for the training images "
                                       "(kohya's prior_loss_weight). Used only with a prior_dataset."),
                io.Float.Input("prior_fraction", default=0.5, min=0.01, max=0.99, step=0.01, optional=True,
                               tooltip="Share of each batch (batch_size x gradient_accumulation x processes) that "
                                       "holds prior images, rounded; at least one slot each for prior and training "
                                       "images. Used only with a prior_dataset."),
                io.Combo.Input("base_precision", options=choice_labels(BASE_PRECISION_CHOICES), default="as loaded",
                               optional=True, tooltip="How the trainer holds the frozen base weights. "
                                                      + choices_tooltip(BASE_PRECISION_CHOICES)),
                io.String.Input("eval_quantiles", default=DEFAULT_EVAL_QUANTILES_TEXT, optional=True,
                                tooltip="Points of the noise schedule (0 = clean, 1 = pure noise) where evaluation "
                                        "measures the loss, with fixed noise. Each costs a forward pass per "
                                        "evaluated image at every evaluation: on a large model, fewer (e.g. 0.5) "
                                        "is faster. An Evaluate node given the same values measures the same. "
                                        "Empty: no evaluation."),
                io.Int.Input("eval_items", default=8, min=0, max=1_000_000, optional=True,
                             tooltip="How many items are evaluated: a fixed subset of the eval dataset (or of the "
                                     "training images), drawn with the seed, the same at every evaluation and on "
                                     "a resume. Each evaluation costs one forward pass per item and quantile. "
                                     "0: no evaluation (no eval points on the chart)."),
                io.Boolean.Input("eval_before", default=False, optional=True,
                                 tooltip="Also evaluate before the first step (a baseline for the chart). An "
                                         "Evaluate node after this one, with the input MODEL as its baseline, "
                                         "measures the same without delaying the first step."),
                io.Boolean.Input("eval_after_stop", default=False, optional=True,
                                 tooltip="Evaluate after a run ended by Stop too. Off: Stop ends the run as soon as "
                                         "the step in flight, the checkpoint and the LoRA are written."),
                io.Combo.Input("memory", options=choice_labels(MEMORY_CHOICES), default="auto", optional=True,
                               tooltip="Before anything reaches the GPU the trainer plans the run's peak memory "
                                       "(shown on the node) against the card's free memory. "
                                       + choices_tooltip(MEMORY_CHOICES)),
                io.Float.Input("memory_budget_gb", default=0.0, min=0.0, max=4096.0, step=0.5, optional=True,
                               tooltip="GiB of device memory the run may fill (to leave room for other work on "
                                       "the card); 0 = the card's free memory when the run starts."),
                io.Float.Input("weight_decay", default=TrainSpec.weight_decay, min=0.0, max=1.0, step=0.001,
                               optional=True,
                               tooltip="Decoupled weight decay (as AdamW applies it): each step multiplies the "
                                       "trained weights by 1 - learning rate x this. 0 = off."),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The input MODEL with the trained LoRA applied."),
                io.String.Output(display_name="lora_name", tooltip="The LoRA's name as Load LoRA lists it (a full "
                                                                   "fine-tune: the model's name as Load Diffusion "
                                                                   "Model lists it)."),
                io.Image.Output(display_name="loss_chart", tooltip="Training loss (raw and smoothed) and "
                                                                   "evaluation loss over the run."),
            ],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, output_name, eval_quantiles=None):
        # no **kwargs: that would switch off ComfyUI's own min/max checks of every other input
        from ..runner.evaluation_run import parse_quantiles
        from ..runner.paths import lora_output_path
        try:
            lora_output_path(output_name)
            if eval_quantiles is not None:  # None: not given (a workflow saved before it), or linked
                parse_quantiles(eval_quantiles, "eval_quantiles", allow_empty=True)
        except ValueError as exc:
            return str(exc)
        return True

    # the run spec fields whose input has another name (None: the node's input of that name is not the field; its
    # resume picks a run, the spec's names a checkpoint of it); every other field takes the input of its own name
    SPEC_INPUTS = {"train.grad_accum": "gradient_accumulation", "train.resume": None, "output.format": "file_format",
                   "output.weights": "save_ema"}

    @classmethod
    def execute(cls, model, dataset, adapter, **inputs) -> io.NodeOutput:
        from ..trainer.comfy_compat import raise_if_interrupted

        from ..runner.evaluation_run import parse_quantiles
        from ..runner.loss_chart import chart_tensor, render_loss_chart, save_loss_chart
        from ..runner.node_run import NodeCall, run_task
        from ..runner.session import RunDatasets

        datasets = RunDatasets(dataset, inputs.get("eval_dataset"), inputs.get("prior_dataset"))
        for name, cached in (("dataset", datasets.train), ("eval_dataset", datasets.eval),
                             ("prior_dataset", datasets.prior)):
            if cached is not None:
                cached.require_cached(name)
        draft = RunSpec(task="train", adapter=adapter, distributed=inputs.get("distributed") or DistributedSpec(),
                        model=spec_section(cls, "model", inputs),
                        data=spec_section(cls, "data", inputs),
                        train=spec_section(cls, "train", inputs, read={
                            "eval_quantiles": lambda text: parse_quantiles(text, "eval_quantiles", allow_empty=True)}),
                        output=spec_section(cls, "output", inputs,
                                            read={"weights": lambda save_ema: "ema" if save_ema else "trained"}))
        node_id = cls.hidden.unique_id
        node = NodeCall("Train LoRA", node_id, cls.hidden.prompt, progress_relay(node_id), raise_if_interrupted,
                        input_names(cls, "model", "data", "train", "output"))
        outcome = run_task(draft, model, datasets, inputs.get("previews"), node, inputs["output_name"],
                           inputs.get("resume") or "off")
        result = outcome.result
        chart = render_loss_chart(result.steps, result.losses, result.evals)
        try:
            save_loss_chart(chart, result.run_dir)
        except OSError as exc:  # the LoRA is written: a chart that cannot be kept does not fail the run
            logging.warning("InGraph Trainer: the loss chart was not kept in %s: %s", result.run_dir, exc)
        return io.NodeOutput(outcome.model, outcome.lora_name, chart_tensor(chart))
