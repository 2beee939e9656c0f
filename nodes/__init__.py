"""The pack's nodes: thin wrappers that validate inputs and delegate to cache/, runner/ and trainer/."""
import functools

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


def titled_errors(node: type[io.ComfyNode]) -> type[io.ComfyNode]:
    """The node's errors start with its title ("Load Training Images: ..."): ComfyUI's error dialog and its log head
    them with the class id (InGraphLoadTrainingImages), which is not what the graph shows. A message that names the
    node already ("Distill: ...", "Train LoRA (Flux model): ...") is left as it is. The exception itself is kept (its
    type, traceback and cause): ComfyUI tells interrupts and out-of-memory errors apart by type, and those two carry
    no message of ours, so they pass untouched."""
    execute = node.execute.__func__

    @functools.wraps(execute)
    def titled(cls, *args, **kwargs):
        try:
            return execute(cls, *args, **kwargs)
        except Exception as error:
            first = error.args[0] if error.args else None
            if isinstance(first, str) and first:
                try:
                    title = node.define_schema().display_name  # asked only now: a schema lists files
                except Exception:  # the error being raised is the one to show, as it is
                    title = None
                if title and not first.startswith((title, title.split(" (")[0])):
                    error.args = (f"{title}: {first}", *error.args[1:])
            raise

    node.execute = classmethod(titled)
    return node


NODES: list[type[io.ComfyNode]] = [LoadTrainingImages, CacheLatents, CacheTextEmbeddings, LoRAAdapter,
                                   DeepSpeedSettings, SamplePreviews, NewModel, TrainLoRA, Distill, Evaluate, Compare]
for _node in NODES:
    titled_errors(_node)


class InGraphTrainerExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES


async def comfy_entrypoint() -> InGraphTrainerExtension:
    return InGraphTrainerExtension()
