from comfy_api.latest import io

from ..trainer.spec import DEFAULT_EVAL_QUANTILES_TEXT
from .spec_inputs import input_names, spec_section
from .types import CATEGORY, Dataset, Distributed


class Evaluate(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="InGraphEvaluate",
            display_name="Evaluate",
            category=CATEGORY,
            description="Held-out loss of a MODEL (with or without a LoRA applied) on a cached dataset, at fixed "
                        "timestep quantiles with fixed noise: the same inputs always give the same numbers, on any "
                        "number of processes. Lower is better; compare models on the same dataset and seed.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model", tooltip="The model to evaluate, e.g. a checkpoint, or it with a LoRA loaded."),
                Dataset.Input("dataset", tooltip="Evaluation images, cached through Cache Latents and Cache Text "
                                                 "Embeddings (ideally images not trained on)."),
                io.String.Input("quantiles", default=DEFAULT_EVAL_QUANTILES_TEXT,
                                tooltip="Points of the noise schedule to measure at (0 = clean, 1 = pure noise)."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=False,
                             tooltip="Seed of the fixed noise; keep it the same to compare models."),
                io.Int.Input("batch_size", default=4, min=1, max=1024,
                             tooltip="Images per forward pass (memory only; the numbers do not change)."),
                io.Combo.Input("precision", options=["fp32", "bf16"], default="fp32",
                               tooltip="fp32: exact, comparable across machines; bf16: half the memory."),
                Distributed.Input("distributed", optional=True,
                                  tooltip="DeepSpeed settings: evaluate on several processes (GPUs)."),
                io.Int.Input("items", default=8, min=1, max=1_000_000, optional=True,
                             tooltip="How many of the dataset's items are evaluated: a fixed subset drawn with the "
                                     "seed, the same items a Train node with the same seed and eval_items "
                                     "evaluates on this dataset. Each costs a forward pass per quantile."),
                io.Model.Input("baseline", optional=True,
                               tooltip="Optional: a model to compare with, e.g. the checkpoint before training. It is "
                                       "evaluated just before `model`, on the same items, quantiles and noise; the "
                                       "table and chart show both, mean_loss stays `model`'s. Its result is "
                                       "remembered: queued again with the same baseline, dataset and settings "
                                       "(another trained model), only `model` is evaluated. Wire the base model "
                                       "here rather than into an Evaluate node of its own: ComfyUI may run that "
                                       "node before the Train node, and its evaluation then delays the first "
                                       "training step."),
            ],
            outputs=[
                io.Float.Output(display_name="mean_loss", tooltip="Mean of the per-quantile losses."),
                io.String.Output(display_name="table", tooltip="Loss at each quantile and the mean, as text."),
                io.Image.Output(display_name="chart", tooltip="Loss by timestep quantile."),
            ],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, quantiles):
        from ..runner.evaluation_run import parse_quantiles
        try:
            parse_quantiles(quantiles)
        except ValueError as exc:
            return str(exc)
        return True

    # the run spec fields whose input has another name; seed, batch_size and precision fill the train section's own
    SPEC_INPUTS = {"train.eval_quantiles": "quantiles", "train.eval_items": "items"}

    @classmethod
    def execute(cls, model, dataset, **inputs) -> io.NodeOutput:
        import dataclasses
        from ..trainer.comfy_compat import raise_if_interrupted
        from ..trainer.spec import DistributedSpec, RunSpec
        from ..runner.evaluation_run import parse_quantiles, quantile_table
        from ..runner.loss_chart import chart_tensor, render_quantile_chart
        from ..runner.node_run import NodeCall, run_task
        from ..runner.session import RunDatasets
        dataset.require_cached("dataset")
        train = spec_section(cls, "train", inputs, read={"eval_quantiles": parse_quantiles})
        draft = RunSpec(task="evaluate", train=dataclasses.replace(train, steps=1),  # an evaluation is one step
                        distributed=inputs.get("distributed") or DistributedSpec())
        node = NodeCall("Evaluate", cls.hidden.unique_id, cls.hidden.prompt, lambda run_id, steps: lambda event: None,
                        raise_if_interrupted, input_names(cls, "train"))
        baseline, results = inputs.get("baseline"), {}
        for name, evaluated in (("baseline", baseline), ("model", model)):
            if evaluated is not None:  # the baseline's result is remembered: asked again, it is not run again
                results[name] = run_task(draft, evaluated, RunDatasets(dataset), None, node, model_input=name,
                                         remember=name == "baseline").result.finished["evaluation"]
        result = results["model"]
        table = quantile_table(results if baseline is not None else {"loss": result})
        chart = chart_tensor(render_quantile_chart(results))
        ui = {"text": [table], "evaluation": [result]}
        if baseline is not None:
            ui["baseline_evaluation"] = [results["baseline"]]
        return io.NodeOutput(result["loss"], table, chart, ui=ui)
