#!/usr/bin/python3
"""Writes the example tensors used by scripts/demo and the docs (deterministic, numpy only).

activations.npy  128 x 1024 float32: hidden states of the shape LLMs show (LLM.int8(), Dettmers
                 et al. 2022): mostly N(0, 1) with a few outlier channels about 60x larger, and a
                 band of small values. One tensor-wide scale must fit the outliers, so the small
                 values underflow in FP8; 1x128 tiles or MX blocks keep them.
"""
import pathlib

import numpy as np

rng = np.random.default_rng(20221212)
x = rng.standard_normal((128, 1024)).astype(np.float32)
outlier_channels = rng.choice(1024, size=6, replace=False)
x[:, outlier_channels] *= 60.0
x[:, 512:640] *= 1e-3  # a block of small activations
out = pathlib.Path(__file__).with_name("activations.npy")
np.save(out, x)
print(f"wrote {out} {x.shape} {x.dtype}, amax {np.abs(x).max():.3f}")
