#!/usr/bin/env python3
"""Writes the .npy seeds of tests/fuzz/corpus/npy_fuzzer with NumPy (an independent writer of the
format npy.cc reads): every dtype fp8rt reads, 0-d to 3-d, empty arrays, versions 1.0, 2.0 and
3.0, and a few one-step-from-valid files. Usage: make_npy_corpus.py CORPUS_DIR/npy_fuzzer"""
import io
import os
import sys

import numpy as np
from numpy.lib import format as npy_format


def to_bytes(array, version=None):
    buf = io.BytesIO()
    if version is None:
        np.save(buf, array)
    else:
        npy_format.write_array(buf, array, version=version)
    return buf.getvalue()


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    seeds = {
        "f32-2x3.npy": to_bytes(np.arange(6, dtype="<f4").reshape(2, 3) / 4),
        "f64-vector.npy": to_bytes(np.array([1.5, -2.25, np.inf, np.nan], dtype="<f8")),
        "u8-scalar.npy": to_bytes(np.array(7, dtype="|u1")),
        "u16-tokens.npy": to_bytes(np.array([1, 2, 65535], dtype="<u2")),
        "u32-2x2x2.npy": to_bytes(np.arange(8, dtype="<u4").reshape(2, 2, 2)),
        "i32-empty.npy": to_bytes(np.zeros((0, 5), dtype="<i4")),
        "i64-1x1.npy": to_bytes(np.array([[-(2**62)]], dtype="<i8")),
        "f32-v2.npy": to_bytes(np.ones((2, 2), dtype="<f4"), version=(2, 0)),
        "f32-v3.npy": to_bytes(np.ones(3, dtype="<f4"), version=(3, 0)),
        # One step from valid: dtypes and layouts fp8rt refuses, a short file, extra bytes.
        "fortran.npy": to_bytes(np.asfortranarray(np.ones((2, 3), dtype="<f4"))),
        "big-endian.npy": to_bytes(np.ones(2, dtype=">f4")),
        "complex.npy": to_bytes(np.ones(2, dtype="<c8")),
        "structured.npy": to_bytes(np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")])),
    }
    good = seeds["f32-2x3.npy"]
    seeds["truncated.npy"] = good[:-5]
    seeds["trailing.npy"] = good + b"\0"
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
