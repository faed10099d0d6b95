#!/usr/bin/env python3
"""scripts/bench-torch's torch.nn models are fp8rt's: the same weights give the same FP32 loss.

For each family (gpt2 and llama, tiny shapes with non-default eps, theta, max_positions and
grouped-query heads, so that a field bench-torch did not take over would show):
  1. random weights, written here as a Hugging Face safetensors file (the names and layouts of
     GPT2LMHeadModel and LlamaForCausalLM, from their definitions: an independent statement of
     the layout that fp8rt's importer and bench-torch's loader must both read the same way);
     their scale makes every part of the model matter to the loss (std 1/sqrt(fan-in) matrices,
     gains 1 +- 0.2, nonzero biases, logits of order 1; an N(0, 0.02) model is near the uniform
     loss ln(vocab) whatever its attention does);
  2. `fp8rt eval --weights W --spec S --json` (FP32 GEMMs) and `bench-torch --loss-of W` (torch
     float32) over the same windows of a random token file must agree within 1e-5 relative
     (about 1e-7 is seen: FP32 summation orders);
  3. the check can fail: the same weights with one layout detail of the first block wrong (GPT-2:
     k and v swapped in c_attn; Llama: its two kv heads swapped in v_proj, the wrong grouping of
     query heads) must miss fp8rt's loss by more than that bound.
Usage: torch_peer_test.py BIN_DIR BENCH_TORCH. Exits 77 (ctest: skipped) with bench-torch's
"SKIP: ..." reason when PyTorch is not importable; needs no PyTorch itself.
"""
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

BIN, BENCH_TORCH = sys.argv[1], sys.argv[2]
BOUND = 1e-5
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def run(args):
    r = subprocess.run(args, capture_output=True, text=True, errors="replace")
    if r.returncode == 77 and args[0] == BENCH_TORCH:
        print(r.stdout.strip() or "SKIP: bench-torch exited 77")
        sys.exit(77)
    if r.returncode != 0:
        print("command failed (exit %d): %s\n%s\n%s" % (r.returncode, " ".join(args),
                                                       r.stdout[-3000:], r.stderr[-3000:]))
        sys.exit(1)
    return r.stdout


def write_safetensors(path, tensors):
    """tensors: [(name, shape, list of floats)] as F32, packed in order."""
    header, offset = {}, 0
    for name, shape, values in tensors:
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * len(values)]}
        offset += 4 * len(values)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, _, values in tensors:
            f.write(struct.pack("<%df" % len(values), *values))


def random_weights(family, m, rng):
    """Hugging Face tensors of a model of shape m, with random values of order-1 effect."""
    c, h, kv, f, v = m["d_model"], m["heads"], m["kv_heads"], m["d_ff"], m["vocab"]
    dh = c // h
    out = []

    def matrix(name, shape, fan_in):
        out.append((name, shape, [rng.gauss(0.0, 1.0 / math.sqrt(fan_in))
                                  for _ in range(shape[0] * shape[1])]))

    def vector(name, n, mean, std):
        out.append((name, [n], [mean + rng.gauss(0.0, std) for _ in range(n)]))

    if family == "gpt2":  # Conv1D linears: [in, out]; c_attn is q | k | v along out
        matrix("transformer.wte.weight", [v, c], 16)  # tied: logits of std ~2
        matrix("transformer.wpe.weight", [m["max_positions"], c], 4)
        for l in range(m["layers"]):
            p = "transformer.h.%d." % l
            for ln in ("ln_1", "ln_2"):
                vector(p + ln + ".weight", c, 1.0, 0.2)
                vector(p + ln + ".bias", c, 0.0, 0.1)
            matrix(p + "attn.c_attn.weight", [c, 3 * c], c / 4)  # sharper attention
            vector(p + "attn.c_attn.bias", 3 * c, 0.0, 0.1)
            matrix(p + "attn.c_proj.weight", [c, c], c)
            vector(p + "attn.c_proj.bias", c, 0.0, 0.1)
            matrix(p + "mlp.c_fc.weight", [c, f], c)
            vector(p + "mlp.c_fc.bias", f, 0.0, 0.1)
            matrix(p + "mlp.c_proj.weight", [f, c], f)
            vector(p + "mlp.c_proj.bias", c, 0.0, 0.1)
        vector("transformer.ln_f.weight", c, 1.0, 0.2)
        vector("transformer.ln_f.bias", c, 0.0, 0.1)
    else:  # [out, in] linears; q_proj [h * dh, c], k_proj and v_proj [kv * dh, c]
        matrix("model.embed_tokens.weight", [v, c], 1)
        for l in range(m["layers"]):
            p = "model.layers.%d." % l
            vector(p + "input_layernorm.weight", c, 1.0, 0.2)
            matrix(p + "self_attn.q_proj.weight", [h * dh, c], c / 4)
            matrix(p + "self_attn.k_proj.weight", [kv * dh, c], c / 4)
            matrix(p + "self_attn.v_proj.weight", [kv * dh, c], c)
            matrix(p + "self_attn.o_proj.weight", [c, c], c)
            vector(p + "post_attention_layernorm.weight", c, 1.0, 0.2)
            matrix(p + "mlp.gate_proj.weight", [f, c], c)
            matrix(p + "mlp.up_proj.weight", [f, c], c)
            matrix(p + "mlp.down_proj.weight", [c, f], f)
        vector("model.norm.weight", c, 1.0, 0.2)
        matrix("lm_head.weight", [v, c], c / 4)
    return out


def misplace(family, tensors, m):
    """A copy with one layout detail of block 0 wrong, the kind of mistake a loader makes: GPT-2's
    k and v swapped in c_attn; Llama's two kv heads swapped in v_proj (query heads reading the
    wrong group)."""
    c, dh = m["d_model"], m["d_model"] // m["heads"]
    out = []
    for name, shape, values in tensors:
        if family == "gpt2" and name == "transformer.h.0.attn.c_attn.weight":
            rows = [values[i:i + 3 * c] for i in range(0, len(values), 3 * c)]  # [in][q | k | v]
            values = [x for r in rows for x in r[:c] + r[2 * c:] + r[c:2 * c]]
        elif family == "llama" and name == "model.layers.0.self_attn.v_proj.weight":
            head = dh * c  # one kv head's rows
            values = values[head:2 * head] + values[:head] + values[2 * head:]
        out.append((name, shape, values))
    return out


CASES = [
    ("gpt2", dict(layers=2, d_model=64, heads=4, kv_heads=4, d_ff=128, seq_len=32, vocab=256,
                  max_positions=40, norm_eps=1e-5, rope_theta=10000.0), "max_positions: 40"),
    ("llama", dict(layers=2, d_model=64, heads=4, kv_heads=2, d_ff=96, seq_len=32, vocab=256,
                   max_positions=32, norm_eps=1e-6, rope_theta=500000.0),
     "kv_heads: 2\n  norm_eps: 1.0e-6\n  rope_theta: 500000"),
]

SPEC = """model:
  family: {family}
  layers: {layers}
  d_model: {d_model}
  heads: {heads}
  d_ff: {d_ff}
  seq_len: {seq_len}
  vocab: {vocab}
  {extra}
train:
  steps: 1
  micro_batch: 4
data:
  path: {data}
  format: text
"""


def main():
    tmp = tempfile.mkdtemp(prefix="fp8rt-torch-peer-")
    try:
        rng = random.Random(18)
        data = os.path.join(tmp, "tokens.bin")  # random bytes: text format, vocab 256
        with open(data, "wb") as f:
            f.write(bytes(rng.randrange(256) for _ in range(12 * 33)))
        for family, m, extra in CASES:
            spec = os.path.join(tmp, family + ".yaml")
            with open(spec, "w") as f:
                f.write(SPEC.format(family=family, extra=extra, data=data, **m))
            weights = random_weights(family, m, rng)
            w, w_off = os.path.join(tmp, family + ".safetensors"), os.path.join(tmp, family + "-off.safetensors")
            write_safetensors(w, weights)
            write_safetensors(w_off, misplace(family, weights, m))
            ev = json.loads(run([os.path.join(BIN, "fp8rt"), "eval", "--weights", w, "--spec", spec,
                                 "--batches", "2", "--json"]))
            shape = ["--family", family, "--layers", str(m["layers"]), "--d-model", str(m["d_model"]),
                     "--heads", str(m["heads"]), "--kv-heads", str(m["kv_heads"]), "--d-ff",
                     str(m["d_ff"]), "--seq-len", str(m["seq_len"]), "--vocab", str(m["vocab"]),
                     "--max-positions", str(m["max_positions"]), "--norm-eps", repr(m["norm_eps"]),
                     "--rope-theta", repr(m["rope_theta"])]
            lines = run([BENCH_TORCH, "--loss-of", w, w_off, "--tokens", data, "--format", "text",
                         "--windows", str(ev["windows"]), "--micro-batch", "4", "--threads", "1"]
                        + shape).splitlines()
            same, off = (json.loads(x) for x in lines[-2:])
            check(same["windows"] == ev["windows"] == 8, "%s: both over %d windows" %
                  (family, ev["windows"]))
            # Far from the uniform loss: the weights make the model's parts matter.
            check(abs(ev["loss"] - math.log(m["vocab"])) > 0.1,
                  "%s: the loss %.4f is not the uniform ln(%d) = %.4f" %
                  (family, ev["loss"], m["vocab"], math.log(m["vocab"])))
            rel = abs(same["loss"] - ev["loss"]) / ev["loss"]
            check(rel <= BOUND, "%s: fp8rt eval %.7f, bench-torch float32 %.7f (rel %.1e <= %.0e)" %
                  (family, ev["loss"], same["loss"], rel, BOUND))
            rel_off = abs(off["loss"] - ev["loss"]) / ev["loss"]
            check(rel_off > BOUND, "%s: block 0 with a layout detail wrong misses by %.1e > %.0e" %
                  (family, rel_off, BOUND))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("%d failure(s)" % len(FAILURES))
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
