"""Writes a copy of a GGUF text model keeping only its first N decoder layers (`blk.0` ..
`blk.N-1`, `<arch>.block_count` = N), with llama.cpp's own gguf-py: the layer-count point of the
MoE side by side's extrapolation (two files that differ only in their layer count, run by both
engines). With N above the file's layer count, its layers are repeated in order (layer i is a
copy of layer i mod L, stored again, so every layer is its own pages): a file of the full depth
from a shallower one, e.g. the 30B-A3B's 48 layers from the 8-layer benchmark file.

    PYTHONPATH=target/llama.cpp/src/gguf-py python gguf_first_layers.py IN.gguf OUT.gguf N
"""
import os
import re
import sys

import gguf

src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
reader = gguf.GGUFReader(src)
arch = reader.get_field("general.architecture").contents()
tmp = dst + ".partial"  # renamed once complete: a failed write leaves no half file under dst
writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
for field in reader.fields.values():
    if field.name == "general.architecture" or field.name.startswith("GGUF."):
        continue
    value = n if field.name == f"{arch}.block_count" else field.contents()
    sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
layer = lambda t: int(m.group(1)) if (m := re.match(r"blk\.(\d+)\.", t.name)) else None
have = 1 + max(layer(t) for t in reader.tensors if layer(t) is not None)
# (name, tensor): every non-layer tensor, then layers 0..n-1, layer i from the file's i mod have.
keep = [(t.name, t) for t in reader.tensors if layer(t) is None]
for i in range(n):
    keep += [(f"blk.{i}." + t.name.split(".", 2)[2], t) for t in reader.tensors if layer(t) == i % have]
for name, t in keep:
    writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_ti_data_to_file()
for _, t in keep:
    writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
writer.close()
os.replace(tmp, dst)
print(f"{dst}: {len(keep)} tensors ({len(reader.tensors)} in the source), {n} layers from {have}")
