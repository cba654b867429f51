"""test_safetensors.py — luazero's safetensors reader refuses the files the
`safetensors` library refuses, and reads the ones it reads.

Writes crafted files (two tensors sharing their data_offsets, overlapping,
a gap, bytes after the last tensor, offsets before the data or backwards, a
span that is not the shape's bytes, a truncated file, a shape whose product
overflows 64 bits, a negative dimension, three offsets, a shape that is an
object, metadata that is not strings, a header that is not UTF-8, an array,
one followed by NUL bytes, a header length past the file or over 100 MB, a
file shorter than 8 bytes) and right ones (zero-size tensors, metadata,
spaces around the object); opens each with safetensors.safe_open and with
luazero (tests/ref/safetensors_open.lua). Checks: both refuse or both
accept, and luazero's refusal is one line naming the file (and the tensor
where one is at fault).

Where luazero is knowingly other than the library: it reads only F32, BF16
and F16 (an I8 tensor is refused naming the dtypes it reads), and cjson
hands it `2.0` as 2 and `{}` as `[]`, so such shapes are read (the library
refuses them); none of those is among the cases.

The library comes from build/ref-venv (tools/setup) or LZ_REF_VENV; without
it this file says it skipped.
    /usr/bin/python3 tests/ref/test_safetensors.py     # ends with "N passed, N failed"
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_tokenizer as tt  # noqa: E402  (the venv, the shared start)


def f32(n, a, b):
    return {"dtype": "F32", "shape": [n], "data_offsets": [a, b]}


A = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'

# name: (header: a dict, JSON text or bytes; data bytes after it; refused?; tensor named)
CASES = {
    "borrowed": ({"a": f32(2, 0, 8), "b": f32(2, 0, 8)}, 8, True, "tensor "),
    "shifted": ({"a": f32(2, 0, 8), "b": f32(2, 7, 15)}, 15, True, "tensor b"),
    "gap": ({"a": f32(2, 0, 8), "b": f32(2, 16, 24)}, 24, True, "tensor b"),
    "trailing": ({"a": f32(2, 0, 8)}, 12, True, None),
    "backwards": ({"a": f32(0, 8, 0)}, 8, True, "tensor a"),
    "span": ({"a": f32(3, 0, 8)}, 8, True, "tensor a"),
    "truncated": ({"a": f32(2, 0, 8)}, 4, True, "tensor a"),
    "overflow": ({"a": {"dtype": "F32", "shape": [2 ** 32, 2 ** 32, 0], "data_offsets": [0, 0]}},
                 0, True, "tensor a"),
    "negative-dim": ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8, True,
                     "tensor a"),
    "triple": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}, 8, True,
               "tensor a"),
    "shape-object": ({"a": {"dtype": "F32", "shape": {"n": 2}, "data_offsets": [0, 8]}}, 8, True,
                     "tensor a"),
    "no-offsets": ({"a": {"dtype": "F32", "shape": [2]}}, 8, True, "tensor a"),
    "metadata": ('{"__metadata__":{"step":3},' + A + '}', 8, True, None),
    "utf8": (b'{"a\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8, True, None),
    "array": ("[]", 0, True, None),
    "nul": (("{" + A + "}").encode() + b"\0\0", 8, True, None),
    "huge-end": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551616]}}', 8,
                 True, "tensor a"),
    "right": ({"a": f32(2, 0, 8), "b": f32(2, 8, 16)}, 16, False, None),
    "empty-tensors": ({"z": f32(0, 0, 0), "a": f32(2, 0, 8), "y": f32(0, 8, 8)}, 8, False, None),
    "metadata-strings": ('{"__metadata__":{"format":"pt"},' + A + '}', 8, False, None),
    "metadata-null": ('{"__metadata__":null,' + A + '}', 8, False, None),
    "spaces": (" {" + A + "}   ", 8, False, None),
    "no-tensors": ("{}", 0, False, None),
}


def write(path, header, data_bytes):
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0" * data_bytes)


def main():
    check = tt.Checks("safetensors")
    _, why = tt.import_tokenizers()  # puts the venv's packages on the path
    try:
        from safetensors import safe_open
    except ImportError:
        why = why or f"cannot import safetensors (pip install safetensors into {tt.VENV})"
        safe_open = None
    code = tt.preflight(check, why)
    if code is not None:
        return code

    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, (header, data_bytes, _, _) in CASES.items():
            paths[name] = os.path.join(tmp, name + ".safetensors")
            write(paths[name], header, data_bytes)
        # raw files: a length past the file, over 100 MB, shorter than 8 bytes
        raw = {"length-past-end": struct.pack("<Q", 64) + b"{}",
               "length-huge": struct.pack("<Q", 2 ** 40) + b"{}" + b" " * 6,
               "short": b"\x02\x00\x00"}
        for name, body in raw.items():
            paths[name] = os.path.join(tmp, name + ".safetensors")
            with open(paths[name], "wb") as f:
                f.write(body)
        names = list(CASES) + list(raw)
        r = subprocess.run([tt.LUAZERO, os.path.join(tt.REPO, "tests", "ref", "safetensors_open.lua"),
                            *[paths[n] for n in names]], capture_output=True, text=True)
        lines = r.stdout.splitlines()
        if r.returncode != 0 or len(lines) != len(names):
            check("luazero", False, f"exit {r.returncode}: {r.stdout}{r.stderr}")
            return check.summary()
        for name, line in zip(names, lines):
            refused, tensor = (CASES[name][2], CASES[name][3]) if name in CASES else (True, None)
            try:
                with safe_open(paths[name], framework="pt") as f:
                    list(f.keys())
                lib = "ok"
            except Exception as e:  # the library's SafetensorError, or an OSError
                lib = f"refused ({type(e).__name__}: {e})"
            ours = line.split(" ", 1)[0]
            check(f"{name}.library", lib.startswith("refused" if refused else "ok"), lib)
            check(f"{name}.luazero", ours == ("refused" if refused else "ok"), line)
            if refused and ours == "refused":
                named = line.startswith(f"refused safetensors {paths[name]}: ")
                check(f"{name}.message", named and (tensor is None or tensor in line), line)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
