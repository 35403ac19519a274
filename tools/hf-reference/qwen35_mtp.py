"""goldens/tiny-q35/mtp: the reference for Qwen3.5's multi-token-prediction head (`mtp.*`) on the
committed tiny-q35 checkpoint (its weights are read, nothing of it is regenerated).

transformers skips the head, so the reference is built from transformers' own modules the way
vLLM's `qwen3_5_mtp.py` (`Qwen3_5MultiTokenPredictor`) runs it:
- h = the model's final normed hidden rows of the prompt (the output of the text model's `norm`);
- for each position p: x_p = fc(concat(pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)))
  where t_{p+1} is the token after p (the prompt's, then the model's greedy first token);
- one `Qwen3_5DecoderLayer` of the full-attention kind loaded from `mtp.layers.0.*`, causal over
  the rows, rotated at the text model's own (M-RoPE) positions; then `mtp.norm`; logits by the
  model's lm_head;
- the second draft: the head's normed output at the last position as h, with the first draft's
  token, one position on (every axis + 1).

Writes goldens/tiny-q35/mtp/<case>.safetensors: `logits.sampled` (every position, the sampled
vocabulary ids), `logits.last` (the last position, whole vocabulary), `chain.logits` (the second
draft's row), `tokens` (the model's first greedy token, the head's two drafts)."""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

CASES = ("long_text", "one_image")


def head(model, ck):
    tc = model.config.text_config
    full = tc.layer_types.index("full_attention")
    state = {k[len("mtp."):]: v.float() for k, v in load_file(ck / "model.safetensors").items() if k.startswith("mtp.")}
    layer = Qwen3_5DecoderLayer(tc, full).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in state.items() if k.startswith("layers.0.")})
    d, eps = tc.hidden_size, tc.rms_norm_eps
    norms = {}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[n] = Qwen3_5RMSNorm(d, eps=eps).eval()
        norms[n].load_state_dict({"weight": state[f"{n}.weight"]})
    fc = torch.nn.Linear(2 * d, d, bias=False)
    fc.load_state_dict({"weight": state["fc.weight"]})
    return layer, norms, fc


def main(out):
    out = Path(out)
    ck = out / "tiny-q35" / "checkpoint"
    model = Qwen3_5ForConditionalGeneration.from_pretrained(ck, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    for sub in (model.model.visual.config, model.model.language_model.config):
        sub._attn_implementation = "eager"
    layer, norms, fc = head(model, ck)
    lm = model.model.language_model
    sampled = load_file(out / "sampled_vocab_ids.safetensors")["vocab_ids"]
    seen = {}
    lm.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("hidden", o))
    lm.rotary_emb.register_forward_pre_hook(lambda m, a: seen.__setitem__("positions", a[1]))
    dest = out / "tiny-q35" / "mtp"
    dest.mkdir(exist_ok=True)

    def run_head(tokens, hidden, positions):
        x = fc(torch.cat([norms["pre_fc_norm_embedding"](lm.embed_tokens(tokens)),
                          norms["pre_fc_norm_hidden"](hidden)], dim=-1))
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = layer(x, position_embeddings=lm.rotary_emb(x, positions), attention_mask=mask)
        return norms["norm"](y)

    with torch.no_grad():
        for name in CASES:
            case = load_file(out / "tiny-q35" / "cases" / f"{name}.safetensors")
            ids = case["input_ids"][None]
            kw = {}
            if "pixel_values" in case:
                types = (ids == model.config.image_token_id).to(torch.int32)
                kw = {"pixel_values": case["pixel_values"], "image_grid_thw": case["image_grid_thw"],
                      "mm_token_type_ids": types}
            logits = model(input_ids=ids, use_cache=False, **kw).logits[0]
            assert torch.allclose(logits[-1], case["logits.last"], atol=1e-4), f"{name}: not the case's logits"
            hidden, positions = seen["hidden"], seen["positions"]
            first = logits[-1].argmax()
            tokens = torch.cat([ids[0, 1:], first[None]])[None]
            o = run_head(tokens, hidden, positions)
            mtp_logits = model.lm_head(o)[0]
            d1 = mtp_logits[-1].argmax()
            # The second draft: the head's own last output row as h, one position on.
            tokens2 = torch.cat([tokens, d1[None, None]], dim=1)
            hidden2 = torch.cat([hidden, o[:, -1:]], dim=1)
            positions2 = torch.cat([positions, positions[..., -1:] + 1], dim=-1)
            o2 = run_head(tokens2, hidden2, positions2)
            assert torch.allclose(o2[:, :-1], o, atol=1e-5), "causal rows changed"
            chain = model.lm_head(o2[:, -1])[0]
            d2 = chain.argmax()
            save_file({"logits.sampled": mtp_logits[:, sampled].contiguous(), "logits.last": mtp_logits[-1].contiguous(),
                       "chain.logits": chain.contiguous(), "tokens": torch.stack([first, d1, d2]).to(torch.int64)},
                      dest / f"{name}.safetensors")
            print(f"{name}: {ids.shape[1]} positions; first {first.item()}, drafts {d1.item()} {d2.item()}")
    sys.path.insert(0, str(Path(__file__).parent))
    from generate import write_provenance
    write_provenance(out, {"qwen35_mtp": {
        "generator": "tools/hf-reference/generate-mtp-q35",
        "reference": "tiny-q35's mtp.* weights in transformers modules (Qwen3_5DecoderLayer, full attention; "
                     "Qwen3_5RMSNorm; nn.Linear fc) wired as vLLM's Qwen3_5MultiTokenPredictor, float32, eager "
                     "attention with a causal mask, the text model's M-RoPE positions",
        "cases": "mtp/<case>.safetensors: logits.sampled (every position), logits.last, chain.logits "
                 "(second draft), tokens (first greedy token, drafts 1 and 2); the prompts of cases/<case>"}})


if __name__ == "__main__":
    main(sys.argv[1])
