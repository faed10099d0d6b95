#!/usr/bin/env python3
"""Writes the .npy fixtures of tests/unit/npy_test.cc with NumPy, the reference implementation.

Run from anywhere with a Python that has numpy (Debian: python3-numpy):
    python3 tests/data/npy/make_fixtures.py
The files land next to this script. Their contents are formulas that npy_test.cc also states;
change both together.
"""
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def save(name, array, version=None):
    path = os.path.join(HERE, name)
    if version is None:
        np.save(path, array, allow_pickle=array.dtype.hasobject)
    else:
        with open(path, "wb") as f:
            np.lib.format.write_array(f, array, version=version)


def main():
    # Readable by fp8rt.
    save("f32_2d.npy", np.arange(12, dtype=np.float32).reshape(3, 4) * np.float32(0.5) - 1)
    save("f64_1d.npy", np.arange(5, dtype=np.float64) / 3)
    save("u8_2d.npy", (np.arange(6) * 40).astype(np.uint8).reshape(2, 3))
    save("u16_1d.npy", np.array([7, 1007, 2007, 65535], dtype=np.uint16))
    save("u32_1d.npy", np.array([0, 1, 70000, 4294967295], dtype=np.uint32))
    save("i32_1d.npy", np.arange(-3, 3, dtype=np.int32) * 100000)
    save("i64_scalar.npy", np.array(-1234567890123, dtype=np.int64))
    save("f32_3d.npy", np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    save("f32_empty.npy", np.zeros((0,), dtype=np.float32))
    save("f32_empty_2d.npy", np.zeros((3, 0), dtype=np.float32))
    save("v2_f32.npy", np.arange(6, dtype=np.float32).reshape(2, 3) + np.float32(0.25),
         version=(2, 0))
    save("v3_f64.npy", np.arange(4, dtype=np.float64) * -1.5, version=(3, 0))
    # Rejected by fp8rt, each for its own reason.
    save("f32_fortran.npy", np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)))
    save("f32_bigendian.npy", np.arange(4, dtype=">f4"))
    save("c64_1d.npy", np.arange(3, dtype=np.complex64))
    save("object_1d.npy", np.array([1, "a"], dtype=object))
    save("struct_1d.npy", np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")]))


if __name__ == "__main__":
    main()
