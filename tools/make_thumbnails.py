"""Thumbnails for ComfyUI's template browser: each UI graph in example_workflows/ drawn as the canvas lays it out
(its nodes at their positions and sizes, titled, the links between them coloured by type), as <name>.jpg beside it.

    python tools/make_thumbnails.py [example_workflows/train_lora.json ...]

Run after a graph's layout changes (tools/make_ui_workflow.py); no server or browser needed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZE = (512, 384)  # what the browser's cards show, 4:3
LINK_COLOURS = {"MODEL": (180, 160, 255), "CLIP": (255, 210, 90), "VAE": (255, 110, 110), "IMAGE": (100, 180, 255),
                "CONDITIONING": (255, 170, 60), "LATENT": (255, 140, 200)}
PACK_NODE = (60, 110, 90)  # the pack's nodes stand out in green; ComfyUI's own are grey


def draw(graph: dict):
    from PIL import Image, ImageDraw, ImageFont
    nodes = {n["id"]: n for n in graph["nodes"]}
    left = min(n["pos"][0] for n in nodes.values()) - 30
    top = min(n["pos"][1] for n in nodes.values()) - 50
    right = max(n["pos"][0] + n["size"][0] for n in nodes.values()) + 30
    bottom = max(n["pos"][1] + n["size"][1] for n in nodes.values()) + 30
    scale = min(SIZE[0] / (right - left), SIZE[1] / (bottom - top))
    off_x = (SIZE[0] - (right - left) * scale) / 2
    off_y = (SIZE[1] - (bottom - top) * scale) / 2

    def at(x, y):
        return off_x + (x - left) * scale, off_y + (y - top) * scale

    image = Image.new("RGB", SIZE, (32, 32, 36))
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    for link in graph["links"]:
        _, source, slot, target, target_slot, kind = link[:6]
        x0, y0 = at(nodes[source]["pos"][0] + nodes[source]["size"][0], nodes[source]["pos"][1] + 14 + 20 * slot)
        x1, y1 = at(nodes[target]["pos"][0], nodes[target]["pos"][1] + 14 + 20 * target_slot)
        pen.line([(x0, y0), (x1, y1)], fill=LINK_COLOURS.get(kind, (170, 170, 170)), width=2)
    for node in nodes.values():
        x0, y0 = at(*node["pos"])
        x1, y1 = at(node["pos"][0] + node["size"][0], node["pos"][1] + node["size"][1])
        ours = node["type"].startswith("InGraph")
        pen.rectangle([x0, y0, x1, y1], fill=(53, 53, 58), outline=(90, 90, 96))
        pen.rectangle([x0, y0 - 12, x1, y0], fill=PACK_NODE if ours else (70, 70, 76))
        title = node.get("title") or node["type"]
        width = max(int((x1 - x0) / 6), 4)
        pen.text((x0 + 3, y0 - 12), title if len(title) <= width else title[:width - 1] + "…", fill=(235, 235, 235),
                 font=font)
    return image


def main(argv=None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])] or \
        sorted((REPO / "example_workflows").glob("*.json"))
    for path in paths:
        out = path.with_suffix(".jpg")
        draw(json.loads(path.read_text())).save(out, quality=88)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
