"""Socket types this pack adds to ComfyUI."""
from comfy_api.latest import io

Dataset = io.Custom("INGRAPH_DATASET")
Adapter = io.Custom("INGRAPH_ADAPTER")
Distributed = io.Custom("INGRAPH_DISTRIBUTED")
Previews = io.Custom("INGRAPH_PREVIEWS")

CATEGORY = "InGraph Trainer"
