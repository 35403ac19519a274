"""goldens/tiny-q35-mlx4: a tiny random Qwen3.5 checkpoint as mlx-vlm converts it (4-bit affine,
group 64), and the reference's logits on its exactly dequantized weights. Run by
tools/hf-reference/generate-mlx-q35, in three steps across the two environments:

    python qwen35_mlx.py source CACHE/tiny-q35-mlx-src        (this venv: the float source)
    tools/mlx-reference/convert_q35.py CACHE/tiny-q35-mlx-src goldens CACHE   (mlx_vlm convert, dequantize)
    python qwen35_mlx.py goldens CACHE goldens                (this venv: the reference run)

The source: Qwen3.5's layers with widths that fill mlx-vlm's 64-value groups (hidden 64, attention
and value widths of 128 and 64), the default layer pattern (every 4th layer full: mlx-vlm 0.7.10
ignores `layer_types` and places full-attention layers by `full_attention_interval`), 2 key heads
serving 4 value heads, every parameter random as tiny-q35's (qwen35.randomize), Qwen3.5's
tokenizer, template and processors. An MTP head is added (mlx-vlm drops it).

`--moe` before the step makes goldens/tiny-q35-moe-mlx4 the same way from a qwen3_5_moe source
(4 routed experts of 64, top-2, and a gated shared expert of 64 in every layer; mlx-vlm stacks the
experts as `switch_mlp` and quantizes them and the routers too).
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

import qwen35

HERE = Path(__file__).resolve().parent
NAME = "tiny-q35-mlx4"
SEED = 20271205
STEPS = 8
TEXT = dict(qwen35.GEOMETRY["text"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=4)
TEXT.pop("layer_types")
VISION = dict(qwen35.GEOMETRY["vision"], out_hidden_size=64)
CASES = {
    "no_think": ([{"role": "user", "content": [{"type": "text", "text": "Write a haiku about the sea."}]}],
                 {"enable_thinking": False}),
    "one_image": ([{"role": "user", "content": [{"type": "image", "image": "square"},
                                                {"type": "text", "text": "Describe this image."}]}], {}),
}


# The MoE variant (`--moe`): every width a multiple of 64, as mlx-vlm's groups need.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
MOE_NAME, MOE_SEED = "tiny-q35-moe-mlx4", 20271206
VARIANT = {"moe": False}


def fixture():
    return MOE_NAME if VARIANT["moe"] else NAME


def text():
    t = dict(TEXT)
    if VARIANT["moe"]:
        t.pop("intermediate_size")
        t.update(MOE)
    return t


def config():
    cls = Qwen3_5MoeConfig if VARIANT["moe"] else Qwen3_5Config
    return cls(text_config=text(), vision_config=dict(VISION), tie_word_embeddings=True,
               image_token_id=qwen35.IMAGE_PAD, video_token_id=qwen35.VIDEO_PAD,
               vision_start_token_id=qwen35.VISION_START, vision_end_token_id=qwen35.VISION_END)


def model_class():
    return Qwen3_5MoeForConditionalGeneration if VARIANT["moe"] else Qwen3_5ForConditionalGeneration


@torch.no_grad()
def source(dest):
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    seed = MOE_SEED if VARIANT["moe"] else SEED
    torch.manual_seed(seed)
    model = model_class()(config()).eval()
    qwen35.randomize(model, torch.Generator().manual_seed(seed))
    model.to(torch.bfloat16).save_pretrained(dest)
    goldens = HERE.parent.parent / "goldens"
    ck = goldens / qwen35.NAME / "checkpoint"
    for f in ("tokenizer_config.json", "generation_config.json", "preprocessor_config.json", "chat_template.jinja"):
        shutil.copyfile(ck / f, dest / f)
    shutil.copyfile(goldens / qwen35.TOKENIZER_DIR / "tokenizer.json", dest / "tokenizer.json")
    from generate import VIDEO_PREPROCESSOR_CONFIG
    (dest / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG, indent=2) + "\n")
    # An MTP head as the releases carry one (mlx-vlm drops `mtp.*`).
    path = dest / "model.safetensors"
    t = load_file(path)
    gen = torch.Generator().manual_seed(seed + 1)
    d = TEXT["hidden_size"]
    for k, shape in {"mtp.fc.weight": (d, 2 * d), "mtp.norm.weight": (d,)}.items():
        t[k] = (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16)
    save_file(t, path, metadata={"format": "pt"})
    print(f"wrote {dest}")


@torch.no_grad()
def goldens(cache, out):
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from generate import write_provenance
    cache, out = Path(cache), Path(out)
    src = cache / ("tiny-q35-moe-mlx-src" if VARIANT["moe"] else "tiny-q35-mlx-src")
    cfg = config()
    if VARIANT["moe"]:
        for c in (cfg, cfg.text_config):
            c._experts_implementation = "eager"
    model = model_class()(cfg).eval()
    state = load_file(cache / f"{fixture()}-dequantized.safetensors")
    state.setdefault("lm_head.weight", state["model.language_model.embed_tokens.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.config._attn_implementation = "eager"
    for sub in (model.model.visual.config, model.model.language_model.config):
        sub._attn_implementation = "eager"
    template = (src / "chat_template.jinja").read_text()
    from transformers import Qwen3VLVideoProcessor
    proc = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(src),
                            tokenizer=AutoTokenizer.from_pretrained(src), chat_template=template,
                            video_processor=Qwen3VLVideoProcessor.from_pretrained(src))
    cdir = out / fixture() / "cases"
    if cdir.exists():
        shutil.rmtree(cdir)
    cdir.mkdir(parents=True)
    for name, (messages, kwargs) in CASES.items():
        prompt = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        imgs = [Image.open(out / "images" / f"{c['image']}.png") for m in messages for c in m["content"]
                if c.get("type") == "image"] or None
        batch = proc(text=[prompt], images=imgs, return_tensors="pt")
        inputs = {k: v for k, v in batch.items() if k != "attention_mask"}
        logits = model(**inputs, use_cache=False).logits[0]
        gen = model.generate(**inputs, do_sample=False, max_new_tokens=STEPS, min_new_tokens=STEPS,
                             output_logits=True, return_dict_in_generate=True)
        steps = torch.stack([l[0] for l in gen.logits]).float()
        top2 = steps.topk(2, dim=-1).values
        ids = gen.sequences[0, batch["input_ids"].shape[1]:]
        t = {"input_ids": batch["input_ids"][0].to(torch.int64).contiguous(), "logits.last": logits[-1].contiguous()}
        if imgs:
            t["pixel_values"] = batch["pixel_values"].float().contiguous()
            t["image_grid_thw"] = batch["image_grid_thw"].to(torch.int64).contiguous()
        save_file(t, cdir / f"{name}.safetensors")
        (cdir / f"{name}.json").write_text(json.dumps({
            "case": name, "messages": messages, "template_kwargs": kwargs, "prompt": prompt,
            "num_tokens": int(batch["input_ids"].shape[1]), "greedy": {"ids": ids.tolist()},
            "greedy_min_margin": float((top2[:, 0] - top2[:, 1]).min())}, indent=1, ensure_ascii=False) + "\n")
        print(f"{name}: {batch['input_ids'].shape[1]} tokens, greedy margin {float((top2[:, 0] - top2[:, 1]).min()):.4f}")
    import subprocess
    versions = json.loads(subprocess.run(
        [str(HERE.parent / "mlx-reference/.venv/bin/python"), "-c",
         "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in ['mlx', 'mlx-vlm']}))"],
        capture_output=True, text=True, check=True).stdout)
    section = "qwen35_moe_mlx" if VARIANT["moe"] else "qwen35_mlx"
    write_provenance(out, {section: {
        "generator": "tools/hf-reference/generate-mlx-q35", "geometry": {"text": text(), "vision": VISION},
        "seed": MOE_SEED if VARIANT["moe"] else SEED,
        "conversion": "mlx_vlm convert -q --q-bits 4 --q-group-size 64 (the CLI; the vision tower stays float)",
        "versions": versions,
        "reference": f"{model_class().__name__} on the exactly dequantized weights (mx.dequantize), "
                     "mlx-vlm's sanitize undone (norms -1, conv1d and patch embedding back to channels-first"
                     + ("; switch_mlp experts fused back into gate_up_proj / down_proj), eager experts" if VARIANT["moe"] else ")")
                     + ", float32, eager attention",
        "cases": "cases/<case>.json: messages, prompt, greedy ids; .safetensors: input ids, last logits, pixels"}})


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    if sys.argv[1] == "--moe":
        VARIANT["moe"] = True
        del sys.argv[1]
    {"source": lambda: source(sys.argv[2]), "goldens": lambda: goldens(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
