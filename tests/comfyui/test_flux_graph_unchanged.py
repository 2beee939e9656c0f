"""Queueing Flux training leaves the graph's MODEL as it was (issue 13): the trainer patches its own copy of the
model (Flux's in-place residual shim, checkpointing, adapters), never the ComfyUI process's live one.

On the real server, with the tiny Flux model and the stock nodes of tests/comfyui/test_model_families.py: ComfyUI's
KSampler samples the loader's MODEL, Train LoRA trains on that same loader node's MODEL (2 steps, fp32), and the
KSampler samples it again: the same latent to the bit, and no module of the live model carries a wrapped forward
(the test-only Model Forwards node looks at the very object, in the ComfyUI process).
"""
from __future__ import annotations

import pytest
import torch

from conftest import IMAGE_FOLDER, evaluate_on_one_image, tiny_models
from family_graphs import FAMILIES, FAMILY_FOLDER, run_events, sampling_graph, saved_latent, training_graph

TINY_MODELS = dict(families={"flux": FAMILIES["flux"][1]}, vae16=FAMILIES["flux"][0])  # conftest.tiny_models
pytestmark = [pytest.mark.comfyui, pytest.mark.tiny_models(**TINY_MODELS)]


@pytest.fixture(scope="module")
def flux_model(comfy, tools):
    """The tiny Flux in models/diffusion_models and its VAE (conftest.tiny_models: built once a session, in the
    background from its start), two captioned images."""
    images = comfy.dir("input", FAMILY_FOLDER)
    for source in sorted(comfy.dir("input", IMAGE_FOLDER).iterdir())[:4]:
        (images / source.name).write_bytes(source.read_bytes())
    tiny_models(tools, comfy, **TINY_MODELS)
    return comfy


def sample_and_inspect(client, label: str) -> dict:
    """KSampler on the loader's MODEL (seed fixed, latent saved under `label`), and Model Forwards on that MODEL."""
    graph = sampling_graph("flux", None, f"flux_unchanged_{label}")
    graph["20"] = {"class_type": "InGraphTestModelForwards", "inputs": {"model": ["1", 0], "label": label}}
    outcome = client.run(graph, timeout=600)
    assert outcome.ok, outcome.error
    cached = {node for d in outcome.of_type("execution_cached") for node in d.get("nodes", [])}
    assert "13" not in cached  # KSampler really sampled (ComfyUI caches a node whose inputs are unchanged)
    return next(d["output"] for d in outcome.of_type("executed") if d["node"] == "20")


def test_flux_training_leaves_the_graphs_model_unchanged(flux_model, client):
    before = sample_and_inspect(client, "before")
    assert before["wrapped"] == []

    graph = training_graph("flux", "flux_unchanged", precision="fp32")
    evaluate_on_one_image(graph, train="8", dataset="4")  # the run's evaluations: not this test's point
    outcome = client.run(graph, timeout=900)
    assert outcome.ok, outcome.error
    senders = {m["data"]["node"] for m in outcome.messages if m.get("type") == "ingraph.event"}
    assert senders == {"8"}  # the Train LoRA node's run reported them
    events = run_events(outcome)
    assert next(e for e in events if e["type"] == "started")["family"] == "flux"
    assert len([e for e in events if e["type"] == "step"]) == 2 and any(e["type"] == "finished" for e in events)
    cached = {node for d in outcome.of_type("execution_cached") for node in d.get("nodes", [])}
    assert "1" in cached  # the loader's MODEL is the very object sampled above, not a fresh load

    after = sample_and_inspect(client, "after")
    assert after["model_id"] == before["model_id"]  # the same live model
    assert after["wrapped"] == [], f"training left wrapped forwards on the graph's model: {after['wrapped'][:5]}"
    first, second = saved_latent(flux_model, "flux_unchanged_before"), saved_latent(flux_model, "flux_unchanged_after")
    assert torch.equal(first, second), f"sampling changed by {(first - second).abs().max().item():.3e}"
