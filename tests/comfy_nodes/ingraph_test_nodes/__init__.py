"""Test-only ComfyUI nodes, installed into the test server beside the pack (never shipped to users).

SDXL, SD3, Flux and Wan text encoders (CLIP-G, T5-XXL, umT5) are far too large to build in tests, so
`Synthetic Text Encoder` stands in for them: a CLIP-shaped object that ComfyUI's stock CLIPTextEncode and
the pack's Cache Text Embeddings both accept, giving each text a fixed pseudo-random embedding (and pooled
vector) of the family's width. Everything downstream (cache, trainer, LoraLoader, KSampler) is the real code.
"""
import hashlib

import torch

# tokens, width of the text embedding, width of the pooled vector (None: the family takes none)
FAMILY_TEXT = {
    "sdxl": (77, 2048, 1280),
    "sd3": (16, 64, 32),  # the tiny SD3 (tools/tiny_models.py) embeds 64-wide text, 32-wide pooled
    "flux": (16, 4096, 64),  # the tiny Flux's vector input is 64 wide
    "wan": (16, 4096, None),
    "qwen_image": (16, 3584, None),  # Qwen2.5-VL 7B's width, fixed by ComfyUI
    "chroma": (16, 4096, None),  # T5-XXL alone
    "lumina2": (16, 2304, None),  # Gemma-2 2B's width (the tiny Lumina 2 is built for it)
    "hunyuan_video": (16, 4096, 768),  # LLaMA hidden states, CLIP-L pooled
    "ltxv": (16, 4096, None),
    "flux2": (16, 64, None),  # the tiny Flux.2 reads 64-wide text (the real ones 7680, 12288 or 15360)
    "z_image": (16, 2560, None),  # Qwen3-4B's width, fixed by ComfyUI's Z-Image
    "ltxav": (16, 32, None),  # the tiny LTX-2's connectors' width (tools/family_coverage.py LTXAV_TINY)
    "minimax_h3": (16, 32, None),  # the tiny MiniMax H3's text width (tools/family_coverage.py MINIMAX_H3_TINY)
}
# conditioning values a family's model requires beside the embedding (LTXVModel takes T5's attention mask)
FAMILY_EXTRAS = {"ltxv": lambda tokens: {"attention_mask": torch.ones((1, tokens), dtype=torch.long)},
                 # Gemma's mask gives Lumina 2 its token count; T5-only encoders hand a pooled_output of None
                 "lumina2": lambda tokens: {"attention_mask": torch.ones((1, tokens), dtype=torch.long)},
                 "z_image": lambda tokens: {"attention_mask": torch.ones((1, tokens), dtype=torch.long)},
                 "chroma": lambda tokens: {"pooled_output": None},
                 # ComfyUI's LTX-2 text encoders mark their projected Gemma layers for the model's connectors
                 "ltxav": lambda tokens: {"unprocessed_ltxav_embeds": True}}


class SyntheticClip:
    def __init__(self, family: str):
        self.family = family
        self.tokens, self.width, self.pooled_width = FAMILY_TEXT[family]
        self.layer_idx = None

    def _generator(self, text: str, salt: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.family}|{salt}|{text}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % (2**63))

    def get_sd(self):
        return {f"synthetic.{self.family}": torch.tensor([self.tokens, self.width, self.pooled_width or 0])}

    def tokenize(self, text, return_word_ids=False, **kwargs):
        return {"text": text}

    def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False):
        text = tokens["text"]
        cond = torch.randn((1, self.tokens, self.width), generator=self._generator(text, "cond"))
        pooled = None
        if self.pooled_width:
            pooled = torch.randn((1, self.pooled_width), generator=self._generator(text, "pooled"))
        if return_dict:
            return {"cond": cond, "pooled_output": pooled}
        return (cond, pooled) if return_pooled else cond

    def encode_from_tokens_scheduled(self, tokens, unprojected=False, add_dict={}, show_pbar=True):
        out = self.encode_from_tokens(tokens, return_dict=True)
        extras = {"pooled_output": out["pooled_output"]} if out["pooled_output"] is not None else {}
        extras.update(FAMILY_EXTRAS.get(self.family, lambda tokens: {})(self.tokens))
        return [[out["cond"], {**extras, **add_dict}]]


class SyntheticTextEncoder:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"family": (list(FAMILY_TEXT),)}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, family):
        return (SyntheticClip(family),)


class ModelForwards:
    """Reports, in the ComfyUI process, which modules of a MODEL's diffusion model carry an instance-level `forward`
    (a wrapper set on the object, not the class's own method), and the diffusion model's id: that training left
    the graph's live model as it was (tests/comfyui/test_flux_graph_unchanged.py)."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL", {"tooltip": "the MODEL whose modules are inspected"}),
                             "label": ("STRING", {"default": "", "tooltip": "differs per prompt: never cached"})}}

    RETURN_TYPES = ()
    FUNCTION = "report"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    def report(self, model, label):
        diffusion_model = model.model.diffusion_model
        wrapped = [name for name, module in diffusion_model.named_modules() if "forward" in vars(module)]
        return {"ui": {"model_id": [id(diffusion_model)], "wrapped": wrapped, "label": [label]}}


class StandInAudioVAELoader:
    """LTX-2's audio VAE stand-in (tests/helpers/media_files.StandInAudioVAE): ComfyUI's own needs torchaudio."""
    STAND_IN = "StandInAudioVAE"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ("VAE",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self):
        import sys
        from pathlib import Path
        helpers = str(Path(__file__).resolve().parents[2] / "helpers")
        if helpers not in sys.path:
            sys.path.append(helpers)
        import media_files
        return (getattr(media_files, self.STAND_IN)(),)


class StandInMiniMaxAudioVAELoader(StandInAudioVAELoader):
    """MiniMax H3's audio VAE stand-in (tests/helpers/media_files.StandInMiniMaxAudioVAE): ComfyUI's own is too
    large to build here."""
    STAND_IN = "StandInMiniMaxAudioVAE"


class StandInMiniMaxVideoVAELoader(StandInAudioVAELoader):
    """MiniMax H3's video VAE stand-in (tests/helpers/media_files.StandInMiniMaxVideoVAE), for the same reason."""
    STAND_IN = "StandInMiniMaxVideoVAE"


NODE_CLASS_MAPPINGS = {"InGraphTestSyntheticTextEncoder": SyntheticTextEncoder,
                       "InGraphTestModelForwards": ModelForwards,
                       "InGraphTestStandInAudioVAE": StandInAudioVAELoader,
                       "InGraphTestStandInMiniMaxAudioVAE": StandInMiniMaxAudioVAELoader,
                       "InGraphTestStandInMiniMaxVideoVAE": StandInMiniMaxVideoVAELoader}
