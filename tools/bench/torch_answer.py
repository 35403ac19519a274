"""One image answer (or a text one) with transformers on torch CUDA, timed as `vl run --json`
reports it: load, vision tower, prefill, decode. The torch side of tools/gpu-check.

    python torch_answer.py CHECKPOINT_DIR IMAGE_OR_EMPTY NEW_TOKENS

bf16 (the default dtype `vl` picks on a GPU), sdpa attention, greedy decoding of exactly
NEW_TOKENS tokens; CUDA is synchronized around each timed part. Prints one JSON line.
"""
import json
import sys
import time

import torch
from transformers import AutoProcessor, Qwen3VLForConditionalGeneration


def sync():
    torch.cuda.synchronize()
    return time.perf_counter()


def main():
    ck, image, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    t0 = sync()
    model = Qwen3VLForConditionalGeneration.from_pretrained(ck, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    processor = AutoProcessor.from_pretrained(ck)
    load_s = sync() - t0

    content = [{"type": "text", "text": "Describe this image." if image else "Write a short story about a lighthouse."}]
    if image:
        from PIL import Image
        content.insert(0, {"type": "image", "image": Image.open(image).convert("RGB")})
    inputs = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                           add_generation_prompt=True, return_dict=True, return_tensors="pt").to("cuda")
    prompt_tokens = inputs["input_ids"].shape[1]

    marks = {}
    if image:
        model.model.visual.register_forward_pre_hook(lambda *_: marks.__setitem__("v0", sync()))
        model.model.visual.register_forward_hook(lambda *_: marks.__setitem__("v1", sync()))
    with torch.inference_mode():
        # Warm-up: one token (CUDA context, cuBLAS handles, kernels loaded), not counted.
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        t1 = sync()
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        first_s = sync() - t1
        vision_s = marks["v1"] - marks["v0"] if image else 0.0
        t2 = sync()
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        total_s = sync() - t2
    generated = out.shape[1] - prompt_tokens
    prefill_s = max(first_s - vision_s, 1e-9)
    decode_s = max(total_s - first_s, 1e-9)
    print(json.dumps({
        "impl": "transformers", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
        "prompt_tokens": prompt_tokens, "generated_tokens": generated,
        "load_s": load_s, "vision_s": vision_s, "prefill_s": prefill_s,
        "prefill_tokens_per_s": prompt_tokens / prefill_s,
        "decode_tokens_per_s": (generated - 1) / decode_s,
    }))


if __name__ == "__main__":
    main()
