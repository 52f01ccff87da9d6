"""Write a GGUF holding the first N layers of another, every byte otherwise as it was: real
quantized weights, tokenizer and chat template small enough to carry to the GPU machine.

    python scripts/trim_gguf.py SRC.gguf DST.gguf --layers 6
"""
from __future__ import annotations

import argparse
import re

import gguf
from gguf import GGUFValueType as T


def trim(src: str, dst: str, layers: int) -> None:
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = layers if key == f"{arch}.block_count" else field.contents()
        kind = field.types[0]
        if kind == T.ARRAY:
            w.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, kind)
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m[1]) >= layers:
            continue
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--layers", type=int, required=True)
    a = p.parse_args()
    trim(a.src, a.dst, a.layers)
