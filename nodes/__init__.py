"""The pack's nodes: thin wrappers that validate inputs and delegate to cache/, runner/ and trainer/."""
from comfy_api.latest import ComfyExtension, io

from .adapter_node import LoRAAdapter
from .cache_nodes import CacheLatents, CacheTextEmbeddings
from .dataset_node import LoadTrainingImages
from .distill_node import Distill
from .distributed_node import DeepSpeedSettings
from .compare_node import Compare
from .evaluate_node import Evaluate
from .new_model_node import NewModel
from .preview_node import SamplePreviews
from .train_node import TrainLoRA

NODES: list[type[io.ComfyNode]] = [LoadTrainingImages, CacheLatents, CacheTextEmbeddings, LoRAAdapter, DeepSpeedSettings,
                                   SamplePreviews, NewModel, TrainLoRA, Distill, Evaluate, Compare]


class InGraphTrainerExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES


async def comfy_entrypoint() -> InGraphTrainerExtension:
    return InGraphTrainerExtension()
