import logging

from comfy_api.latest import io

from ..cache.encoding import encode_latents, encode_text, record_usage
from ..cache.store import CacheStore
from ..runner.paths import cache_root
from .types import CATEGORY, Dataset

log = logging.getLogger("ingraph_trainer")


def _encode(encode, label: str, dataset, encoder, **options) -> io.NodeOutput:
    """Runs one encoder over the dataset into the cache, with ComfyUI's progress bar (and its interrupt)."""
    from ..trainer.comfy_compat import progress_bar
    bar = progress_bar(len(dataset))
    store = CacheStore(cache_root())
    try:
        with store.caching_pass():  # a prune meanwhile keeps what this pass reads and writes until it is recorded
            dataset, encoded, reused = encode(dataset, encoder, store,
                                              lambda done, total: bar.update_absolute(done, total), **options)
            record_usage(dataset, store)
    finally:
        store.close()
    log.info("InGraph Trainer: %s: %d encoded, %d reused", label, encoded, reused)
    return io.NodeOutput(dataset, encoded, reused, ui={"text": [f"{label}: {encoded} encoded, {reused} reused"]})


class CacheLatents(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="InGraphCacheLatents",
            display_name="Cache Latents",
            category=CATEGORY,
            is_output_node=True,  # a graph that only fills the cache runs without a Train node
            description="Encodes each image once with the graph's VAE into the on-disk cache the trainer reads "
                        "(with its loss mask, if it has one, on the latent grid, and its reference images beside "
                        "it). Clips are encoded with a video VAE (Wan, HunyuanVideo, LTX-Video) into one video "
                        "latent per item, and with LTX-2's or MiniMax H3's audio VAE their sound into an audio latent "
                        "beside it. Unchanged images and clips are reused from the cache.",
            inputs=[
                Dataset.Input("dataset", tooltip="Images from Load Training Images."),
                io.Vae.Input("vae", tooltip="The VAE of the model you train (e.g. from Load Checkpoint); a video "
                                            "model's VAE for clips of more than one frame."),
                io.Vae.Input("audio_vae", optional=True,
                             tooltip="LTX-2 and MiniMax H3 only: the model's audio VAE (LTX-2's from Load LTXV "
                                     "Audio VAE, MiniMax H3's from Load VAE), to train the model's audio stream on "
                                     "the clips' sound. Each clip item's sound over its frames is encoded beside "
                                     "them; every item must then be a video file with an audio track, read at a set "
                                     "fps (Load Training Images). Leave unconnected to train LTX-2 on video alone; "
                                     "MiniMax H3 always generates sound and needs it."),
            ],
            outputs=[Dataset.Output(display_name="dataset", tooltip="The dataset with its latents cached."),
                     io.Int.Output(display_name="encoded", tooltip="Images encoded in this run."),
                     io.Int.Output(display_name="reused", tooltip="Images taken from the cache.")],
        )

    @classmethod
    def execute(cls, dataset, vae, audio_vae=None) -> io.NodeOutput:
        return _encode(encode_latents, "latents", dataset, vae, audio_vae=audio_vae)


class CacheTextEmbeddings(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="InGraphCacheTextEmbeddings",
            display_name="Cache Text Embeddings",
            category=CATEGORY,
            is_output_node=True,
            description="Encodes each caption once with the graph's CLIP into the on-disk cache the trainer reads, "
                        "with its tag-shuffled variants and, for caption dropout, the empty caption. Qwen-Image's text "
                        "encoder reads an edit pair's source images beside its caption, as "
                        "TextEncodeQwenImageEditPlus does at inference.",
            inputs=[
                Dataset.Input("dataset", tooltip="Images and captions from Load Training Images or Cache Latents."),
                io.Clip.Input("clip", tooltip="The text encoder of the model you train (e.g. from Load Checkpoint)."),
            ],
            outputs=[Dataset.Output(display_name="dataset", tooltip="The dataset with its caption embeddings cached."),
                     io.Int.Output(display_name="encoded", tooltip="Distinct texts (captions, shuffled variants, "
                                                                   "the empty caption) encoded in this run."),
                     io.Int.Output(display_name="reused", tooltip="Distinct texts taken from the cache.")],
        )

    @classmethod
    def execute(cls, dataset, clip) -> io.NodeOutput:
        return _encode(encode_text, "text", dataset, clip)
