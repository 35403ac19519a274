"""The gated delta rule at a real head size, from transformers' own functions.

Writes goldens/delta-rule/rule.safetensors: seeded inputs for one sequence of 100 positions
(two of the reference's 64-position chunks, the second padded), one key head of 128 serving two
value heads of 128 (the grouped order), q and k L2-normalised by transformers' `l2norm`, decays
g = -A softplus(a + dt_bias) in a trained layer's range, beta = sigmoid(b), a random initial state;
and what the pinned transformers' `models/qwen3_5` computes from them in float32:
- `torch_recurrent_gated_delta_rule` (the decoding path): `out_recurrent`, `state_recurrent`;
- `torch_chunk_gated_delta_rule` (the prompt path, chunk 64): `out_chunked`, `state_chunked`.
The tiny checkpoints' value heads (10 wide) never reach the kernel's 32-column blocks; this does.
Run with the reference venv: tools/hf-reference/.venv/bin/python tools/hf-reference/delta_rule.py
"""
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.models.qwen3_5 import modeling_qwen3_5 as m

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "goldens" / "delta-rule" / "rule.safetensors"
T, KH, VH, D = 100, 1, 2, 128


def main():
    gen = torch.Generator().manual_seed(20271207)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32)
    q = m.l2norm(rn(1, T, KH, D))
    k = m.l2norm(rn(1, T, KH, D))
    v = rn(1, T, VH, D)
    # As a trained layer's: A = exp(A_log) from 1 to 16 per value head, softplus(a + dt_bias) from
    # 0.001 to 0.1 (log-uniform) per position: decays from 0.2 to 0.999, a long memory.
    lg = lambda lo, hi, *s: torch.exp(torch.rand(*s, generator=gen) * (torch.log(torch.tensor(hi)) - torch.log(torch.tensor(lo))) + torch.log(torch.tensor(lo)))
    a_coef = 1.0 + 15.0 * torch.rand(1, 1, VH, generator=gen)
    g = -a_coef * lg(0.001, 0.1, 1, T, VH)
    beta = torch.sigmoid(rn(1, T, VH))
    s0 = rn(1, VH, D, D) * 0.1
    with torch.no_grad():
        rec = getattr(m.torch_recurrent_gated_delta_rule, "__wrapped__", m.torch_recurrent_gated_delta_rule)
        chk = getattr(m.torch_chunk_gated_delta_rule, "__wrapped__", m.torch_chunk_gated_delta_rule)
        o_r, s_r = rec(q, k, v, g, beta, initial_state=s0.clone(), output_final_state=True)
        o_c, s_c = chk(q, k, v, g, beta, chunk_size=64, initial_state=s0.clone(), output_final_state=True)
    t = {"q": q[0], "k": k[0], "v": v[0], "g": g[0], "beta": beta[0], "initial_state": s0[0],
         "out_recurrent": o_r[0], "state_recurrent": s_r[0], "out_chunked": o_c[0], "state_chunked": s_c[0]}
    t = {n: x.contiguous().float() for n, x in t.items()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_name(OUT.name + ".tmp")
    # One metadata key: safetensors writes several in no fixed order.
    made = "transformers %s, torch %s, seed 20271207, chunk 64" % (__import__("transformers").__version__, torch.__version__)
    save_file(t, str(tmp), metadata={"made_by": made})
    tmp.chmod(0o644)
    tmp.replace(OUT)
    print(OUT, {n: list(x.shape) for n, x in t.items()},
          "chunked vs recurrent: out %.3g, state %.3g" % ((o_c - o_r).abs().max(), (s_c - s_r).abs().max()))


if __name__ == "__main__":
    main()
