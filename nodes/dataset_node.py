from comfy_api.latest import io

from ..cache.buckets import BucketSettings
from ..cache.captions import MISSING_CAPTION_ACTIONS
from ..cache.folder_scan import MASK_SOURCES, scan_image_folder
from ..cache.pixels import parse_background
from ..cache.video import CLIP_MODES, DEFAULT_FRAME_BUCKETS
from ..runner.paths import resolve_input_folder
from .types import CATEGORY, Dataset


class LoadTrainingImages(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="InGraphLoadTrainingImages",
            display_name="Load Training Images",
            category=CATEGORY,
            description="A folder of images with captions in .txt files beside them. Only paths and captions "
                        "are kept; pixels are read when the latents are cached.",
            inputs=[
                io.String.Input("folder", default="training_images",
                                tooltip="Folder of images: a sub-folder of ComfyUI's input directory (or an "
                                        "absolute path inside a folder the server's operator allows with "
                                        "INGRAPH_DATASET_ROOTS)."),
                io.Int.Input("resolution", default=512, min=64, max=4096, step=8,
                             tooltip="Training size: with bucketing, images keep their aspect ratio at about "
                                     "this many pixels squared; without, they are cropped to this square."),
                io.Boolean.Input("bucketing", default=True,
                                 tooltip="Aspect-ratio buckets (sides in steps of 64): every batch comes from one "
                                         "bucket, so nothing is squashed or cropped away more than needed."),
                io.Int.Input("min_side", default=256, min=64, max=4096, step=64,
                             tooltip="Smallest bucket side in pixels (bucketing only)."),
                io.Int.Input("max_side", default=1024, min=64, max=8192, step=64,
                             tooltip="Largest bucket side in pixels (bucketing only)."),
                io.Float.Input("max_upscale", default=1.0, min=1.0, max=8.0, step=0.1,
                               tooltip="Images are never enlarged more than this factor; small images get a "
                                       "smaller bucket instead."),
                io.Combo.Input("crop", options=["center", "random"], default="center",
                               tooltip="Which part is kept when an image is cropped to its bucket: the centre, or a "
                                       "random box (fixed per image, so its cache entry stays valid)."),
                io.Boolean.Input("flip", default=False,
                                 tooltip="Also train on the horizontally mirrored images (doubles the items)."),
                io.Int.Input("repeats", default=1, min=1, max=1000,
                             tooltip="How many times each image appears in one epoch."),
                io.String.Input("caption_prefix", default="",
                                tooltip="Text put in front of every caption, e.g. a trigger word followed by ', '."),
                io.Combo.Input("missing_caption", options=list(MISSING_CAPTION_ACTIONS), default="error",
                               tooltip="What to do with an image that has no .txt caption: stop with an error "
                                       "naming it, or use the default caption."),
                io.String.Input("default_caption", default="",
                                tooltip="Caption for images without a .txt file when missing_caption allows it."),
                io.String.Input("transparent_background", default="#ffffff", optional=True,
                                tooltip="Colour that transparent pixels (PNG alpha, palette or colour-key "
                                        "transparency) are composited on before encoding: #rrggbb or a name such "
                                        "as white. Changing it re-encodes only images with transparency."),
                io.Combo.Input("masks", options=list(MASK_SOURCES), default="mask files", optional=True,
                               tooltip="Masked loss: where each image's loss mask comes from. 'mask files': a "
                                       "greyscale image name.mask.png beside name.png (white trains, black is "
                                       "ignored, grey in between). 'alpha channel': the image's transparency. "
                                       "Masks follow the image's crop and flip and are cached with its latent; "
                                       "images without a mask train everywhere. *.mask.* files are never "
                                       "training images. A clip's mask file (name.mask.png beside name.mp4 or "
                                       "a frame folder) weighs every frame alike."),
                io.Float.Input("caption_dropout", default=0.0, min=0.0, max=0.99, step=0.01, optional=True,
                               tooltip="Share of training samples that see no caption (the text encoder's "
                                       "encoding of an empty prompt, cached once), so the model also learns the "
                                       "images unconditioned. 0.05-0.1 is usual; 0 = off."),
                io.Int.Input("caption_variants", default=0, min=0, max=64, optional=True,
                             tooltip="Tag shuffling: this many copies of each comma-separated caption with its "
                                     "tags in a shuffled order are encoded and cached; training picks one per "
                                     "sample. 0 = captions as written."),
                io.Int.Input("keep_tags", default=1, min=0, max=64, optional=True,
                             tooltip="Tag shuffling: this many leading tags stay in place (a trigger word "
                                     "first, for example)."),
                io.String.Input("frame_buckets", default=DEFAULT_FRAME_BUCKETS, optional=True,
                                tooltip="Videos (mp4, webm, mov, gif, mkv) and folders of frames in the folder are "
                                        "clips: each becomes items of the longest of these frame counts that fits "
                                        "it (at fps), combined with the aspect buckets; every batch holds one "
                                        "frame count. Wan's and HunyuanVideo's VAEs want 4k+1 frames (1, 17, "
                                        "33 ...), LTX-Video's and LTX-2's 8k+1 (1, 9, 17, 25 ...). Images are "
                                        "1-frame items. A subfolder is a folder of "
                                        "frames when its images are one numbered sequence (0001.png, 0002.png "
                                        "... without gaps or captions of their own); any other subfolder is read "
                                        "as images (the log says which was which)."),
                io.Float.Input("fps", default=16.0, min=0.0, max=240.0, step=0.5, optional=True,
                               tooltip="Frame rate clips are resampled to before they are cut into items (frames "
                                       "repeat or drop); 0 = each video's own frames. A folder of frames is "
                                       "taken as already at this rate."),
                io.Combo.Input("clip_mode", options=list(CLIP_MODES), default="single_beginning", optional=True,
                               tooltip="How a clip longer than its frame bucket becomes items: one from its start, "
                                       "one from its middle, or several evenly spaced (possibly overlapping) "
                                       "windows covering the whole clip."),
                io.String.Input("reference_folder", default="", optional=True,
                                tooltip="Reference images (edit models' source image, image-to-video's start "
                                        "image) from a second folder, matched by name: name.png there for "
                                        "name.png or name.mp4 here (name.ref2.png for a second slot). Without it, "
                                        "name.ref.png (name.ref2.png ...) beside the item is its reference. Every "
                                        "item needs the same number of references. Empty: only the files beside."),
            ],
            outputs=[Dataset.Output(display_name="dataset", tooltip="Image paths and captions.")],
        )

    @classmethod
    def execute(cls, folder, resolution, bucketing, min_side, max_side, max_upscale, crop, flip, repeats,
                caption_prefix, missing_caption, default_caption,
                transparent_background="#ffffff", masks="mask files", caption_dropout=0.0, caption_variants=0,
                keep_tags=1, frame_buckets=DEFAULT_FRAME_BUCKETS, fps=16.0, clip_mode="single_beginning",
                reference_folder="") -> io.NodeOutput:
        buckets = BucketSettings(resolution=resolution, enabled=bucketing, min_side=min_side, max_side=max_side,
                                 max_upscale=max_upscale, crop=crop, flip=flip)
        dataset = scan_image_folder(resolve_input_folder(folder), buckets=buckets, repeats=repeats,
                                    caption_prefix=caption_prefix, missing_caption=missing_caption,
                                    default_caption=default_caption,
                                    background=parse_background(transparent_background or "#ffffff"),
                                    masks=masks, caption_dropout=caption_dropout, caption_variants=caption_variants,
                                    keep_tags=keep_tags, frame_buckets=frame_buckets, fps=fps, clip_mode=clip_mode,
                                    reference_folder=resolve_input_folder(reference_folder, "reference_folder")
                                    if reference_folder
                                    else None)
        return io.NodeOutput(dataset)

    @classmethod
    def fingerprint_inputs(cls, folder, reference_folder="", **kwargs):
        # re-scan when files in the folder (a frame folder's frames, the reference folder) change, even if the
        # inputs did not
        import os

        def listing(path, depth=1):
            return tuple(sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size,
                                 listing(e.path, depth - 1) if depth and e.is_dir() else ())
                                for e in os.scandir(path)))
        try:
            refs = listing(resolve_input_folder(reference_folder, "reference_folder")) if reference_folder else ()
            return listing(resolve_input_folder(folder)), refs
        except (OSError, ValueError):  # execute names the problem
            return float("nan")
