#!/usr/bin/env python3
"""fp8rt's GPT-2 and Llama families, and Llama with MoE as Mixtral, against PyTorch, through
Hugging Face's checkpoint format.

For each: a real training run on 2 MPI ranks (`fp8rt launch`, FP32 GEMMs, a layout with the
family's tensor-parallel or FSDP split; Mixtral's experts over ep 2), `fp8rt export` of its
checkpoint, and then:
  1. PyTorch, in float64, computes the loss of the exported model.safetensors / config.json on
     the first windows of the data, with the models written here from Hugging Face's definitions
     (GPT2LMHeadModel: Conv1D linears, fused c_attn with q|k|v along out, gelu_new, tied wte;
     LlamaForCausalLM: RMSNorm, rotate-half RoPE, repeat_kv for grouped-query attention, SwiGLU,
     untied lm_head; MixtralForCausalLM: Llama with MixtralSparseMoeBlock, top-k of the router's
     softmax renormalised, no token dropped). It must equal `fp8rt eval --run-dir` within FP32
     rounding (5e-6 relative; about 1e-7 is seen), and a model with one layout detail wrong
     (Llama: interleaved RoPE pairs; GPT-2: k and v swapped in c_attn; Mixtral: the experts' w1
     and w3 swapped) must miss by more than 2e-5 (1.4e-4 and 1.5e-3 are seen for the first two:
     12 steps leave attention a small part of the loss), so the check can fail.
  2. init.from: a second run starts from that file at the other layout, with a learning rate too
     small to move any FP32 weight (1e-30, no weight decay), and its export must be byte for byte
     the first one (export -> init.from -> export is the identity across layouts). Llama: a run
     whose model.rope_theta differs from the exported config.json's is refused, naming both,
     and starts with init.ignore_config: true.
  3. `fp8rt eval --weights` equals `fp8rt eval --run-dir`, also from the same weights split in
     two shards with transformers' index (written here; Llama's with the rotary_emb.inv_freq
     buffers older transformers saved), which step 2 starts Llama's second run from; and
     `fp8rt generate` with one seed gives one text.
Usage: hf_torch_test.py BIN_DIR. Exits 77 (ctest: skipped) naming the reason when PyTorch is not
importable (scripts/bootstrap installs Debian's python3-torch).
"""
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile


def reexec_with_system_python():
    # The interpreter CMake found may not be Debian's (which has python3-torch).
    if os.path.exists("/usr/bin/python3") and os.path.realpath(sys.executable) != "/usr/bin/python3" \
            and not os.environ.get("FP8RT_HF_TEST_REEXEC"):
        os.environ["FP8RT_HF_TEST_REEXEC"] = "1"
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)


try:
    import torch
except ImportError:
    reexec_with_system_python()
    print("SKIP: PyTorch is not importable by %s (scripts/bootstrap installs python3-torch)" %
          sys.executable)
    sys.exit(77)

torch.set_default_dtype(torch.float64)
BIN = sys.argv[1]
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def run(args, binary=False, **kw):
    """args' standard output: text (undecodable bytes replaced), or with `binary` the bytes."""
    r = subprocess.run(args, capture_output=True, **kw)
    if r.returncode != 0:
        print("command failed:", " ".join(args), "\n",
              r.stdout[-3000:].decode(errors="replace"), r.stderr[-3000:].decode(errors="replace"))
        sys.exit(1)
    return r.stdout if binary else r.stdout.decode(errors="replace")


def run_rc(args):
    """args' exit status and its standard output and error together (text)."""
    r = subprocess.run(args, capture_output=True)
    return r.returncode, (r.stdout + r.stderr).decode(errors="replace")


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", t
        a, b = t["data_offsets"]
        v = torch.frombuffer(bytearray(body[a:b]), dtype=torch.float32).to(torch.float64)
        out[name] = v.reshape(t["shape"])
    return out


def shard_safetensors(src, out_dir, extra=None):
    """src split in two files with transformers' index (save_pretrained's sharded layout:
    model-0000K-of-00002.safetensors and model.safetensors.index.json in out_dir), written here
    from the format's definition; `extra` maps more F32 tensors (name -> torch tensor) into the
    second file."""
    with open(src, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    parts = [names[:len(names) // 2], names[len(names) // 2:]]
    os.makedirs(out_dir, exist_ok=True)
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, len(parts))
        head, chunks, at = {"__metadata__": {"format": "pt"}}, [], 0
        tensors = [(k, header[k]["dtype"], header[k]["shape"],
                    body[header[k]["data_offsets"][0]:header[k]["data_offsets"][1]]) for k in part]
        if i == 1 and extra:
            tensors += [(k, "F32", list(v.shape), v.to(torch.float32).contiguous().numpy().tobytes())
                        for k, v in extra.items()]
        for k, dtype, shape, raw in tensors:
            head[k] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
            chunks.append(raw)
            at += len(raw)
            weight_map[k] = fname
        total += at
        text = json.dumps(head).encode()
        text += b" " * ((8 - len(text) % 8) % 8)
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def attention(q, k, v):  # [H, T, Dh]
    t = q.shape[1]
    s = q @ k.transpose(1, 2) / math.sqrt(q.shape[2])
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return torch.softmax(s, -1) @ v


def gpt2_logits(w, cfg, ids, wrong=False):
    c, h = cfg["n_embd"], cfg["n_head"]
    t = len(ids)
    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][:t]
    ln = lambda x, p: torch.nn.functional.layer_norm(x, (c,), w[p + ".weight"], w[p + ".bias"],
                                                     cfg["layer_norm_epsilon"])
    for l in range(cfg["n_layer"]):
        p = "transformer.h.%d." % l
        qkv = ln(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = qkv.split(c, -1)
        if wrong:
            k, v = v, k
        heads = lambda y: y.reshape(t, h, c // h).transpose(0, 1)
        a = attention(heads(q), heads(k), heads(v)).transpose(0, 1).reshape(t, c)
        x = x + a @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        m = ln(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]
        m = 0.5 * m * (1 + torch.tanh(math.sqrt(2 / math.pi) * (m + 0.044715 * m ** 3)))
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    return ln(x, "transformer.ln_f") @ w["transformer.wte.weight"].T


def e4m3(y):
    """y (float64, |y| <= 448) rounded to the nearest OCP E4M3 value, ties to even: 3 mantissa
    bits, exponents from -6 (below 2^-6 the subnormals' step 2^-9)."""
    e = torch.floor(torch.log2(y.abs().clamp(min=2.0 ** -6))).clamp(min=-6)
    step = 2.0 ** (e - 3)
    return (torch.round(y / step) * step).clamp(-448.0, 448.0)  # torch.round: half to even


def fp8_tiles(x):
    """fp8rt's MoE dispatch of token rows x: each 1x128 tile of a row quantized to E4M3 with the
    scale 448 / amax (FP32; 1 for a zero tile) and dequantized by the FP32 1 / scale
    (kernels/quantize.h, parallel/fp8_collectives.h AllToAllFp8Tokens)."""
    out = torch.empty_like(x)
    for c0 in range(0, x.shape[1], 128):
        t = x[:, c0:c0 + 128].to(torch.float32)
        amax = t.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, torch.tensor(448.0, dtype=torch.float32) / amax,
                            torch.ones_like(amax))
        codes = e4m3((t * scale).to(torch.float64)).to(torch.float32)
        out[:, c0:c0 + 128] = (codes * (1.0 / scale)).to(torch.float64)
    return out


def sparse_moe(w, cfg, p, m, wrong=False, wire=True):
    """MixtralSparseMoeBlock (modeling_mixtral.py): the softmax of the router's logits over every
    expert, the top num_experts_per_tok of it renormalised to sum to 1, and the sum of those
    experts' SwiGLU MLPs (w2(silu(w1 x) * w3 x)) weighted by them; no token is dropped. With
    `wire`, the experts see their rows as fp8rt's dispatch delivers them (fp8_tiles) and their
    outputs come back as its combine does (rounded to BF16). `wrong` swaps w1 and w3."""
    probs = torch.softmax(m @ w[p + "gate.weight"].T, -1)
    top, which = probs.topk(cfg["num_experts_per_tok"], -1)
    top = top / top.sum(-1, keepdim=True)
    xe = fp8_tiles(m) if wire else m
    out = torch.zeros_like(m)
    for e in range(cfg["num_local_experts"]):
        q = p + "experts.%d." % e
        w1, w3 = w[q + "w1.weight"], w[q + "w3.weight"]
        if wrong:
            w1, w3 = w3, w1
        y = (torch.nn.functional.silu(xe @ w1.T) * (xe @ w3.T)) @ w[q + "w2.weight"].T
        if wire:
            y = y.to(torch.float32).to(torch.bfloat16).to(torch.float64)
        out += (top * (which == e)).sum(-1, keepdim=True) * y
    return out


def llama_logits(w, cfg, ids, wrong=False, wire=True):
    """LlamaForCausalLM, or MixtralForCausalLM (its MLPs sparse_moe, `wire` as there); `wrong`
    pairs RoPE's dimensions as GPT-J does (Llama) or swaps the experts' w1 and w3 (Mixtral)."""
    mixtral = cfg["model_type"] == "mixtral"
    c, h, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh, t = c // h, len(ids)
    rms = lambda x, p: w[p] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh))
    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()

    def rope(y):  # [heads, T, Dh]
        if wrong and not mixtral:  # the interleaved (GPT-J) pairing instead of rotate-half
            y2 = torch.stack((-y[..., 1::2], y[..., 0::2]), -1).flatten(-2)
            c2 = freqs.cos().repeat_interleave(2, -1)
            s2 = freqs.sin().repeat_interleave(2, -1)
            return y * c2 + y2 * s2
        half = torch.cat((-y[..., dh // 2:], y[..., :dh // 2]), -1)
        return y * cos + half * sin

    x = w["model.embed_tokens.weight"][ids]
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        a = rms(x, p + "input_layernorm.weight")
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(t, h, dh).transpose(0, 1)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kv, dh).transpose(0, 1)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kv, dh).transpose(0, 1)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(h // kv, 0)  # repeat_kv
        v = v.repeat_interleave(h // kv, 0)
        o = attention(q, k, v).transpose(0, 1).reshape(t, c)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, p + "post_attention_layernorm.weight")
        if mixtral:
            x = x + sparse_moe(w, cfg, p + "block_sparse_moe.", m, wrong, wire)
            continue
        g = m @ w[p + "mlp.gate_proj.weight"].T
        u = m @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return rms(x, "model.norm.weight") @ head.T


def torch_loss(out_dir, data, windows, seq_len, wrong=False, wire=True):
    cfg = json.load(open(os.path.join(out_dir, "config.json")))
    w = read_safetensors(os.path.join(out_dir, "model.safetensors"))
    total = 0.0
    for i in range(windows):
        seq = list(data[i * (seq_len + 1):(i + 1) * (seq_len + 1)])
        if cfg["model_type"] == "gpt2":
            logits = gpt2_logits(w, cfg, seq[:-1], wrong)
        else:
            logits = llama_logits(w, cfg, seq[:-1], wrong, wire)
        total += torch.nn.functional.cross_entropy(logits, torch.tensor(seq[1:])).item()
    return total / windows


SPEC = """model:
  family: {family}
  layers: 2
  d_model: 64
  heads: 4
  {extra}
  d_ff: 96
  seq_len: 32
  vocab: 256
{more}
parallel:
  dp: 1
  tp: 1
precision:
  mode: fp32
train:
  steps: 12
  micro_batch: 4
  lr: 1.0e-2
  warmup: 0
  min_lr: 0
  weight_decay: 0
data:
  path: {data}
  format: text
  shuffle: false
checkpoint:
  every: 12
  keep: 1
"""


def main():
    tmp = tempfile.mkdtemp(prefix="fp8rt-hf-")
    try:
        words = ["the", "lord", "said", "unto", "moses", "and", "behold", "light", "was", "good",
                 "in", "beginning", "god", "created", "heaven", "earth"]
        text, state = [], 12345
        while sum(len(x) + 1 for x in text) < 60000:
            state = (state * 1103515245 + 12345) % (1 << 31)
            text.append(words[state % len(words)])
        data = os.path.join(tmp, "text.txt")
        with open(data, "w") as f:
            f.write(" ".join(text))
        data_bytes = open(data, "rb").read()
        fp8rt = os.path.join(BIN, "fp8rt")
        # (name, family, model keys, more sections, the first run's layout, the second's). Mixtral:
        # llama with 4 experts (top 2) in every block, no token dropped (as Hugging Face's
        # Mixtral never drops), experts over ep 2 and then ep 1.
        moe = "moe:\n  experts: 4\n  top_k: 2\n  every: 1\n  drop_tokens: false"
        cases = [("llama", "llama", "kv_heads: 2", "", ["parallel.tp=2"], ["parallel.dp=2"]),
                 ("gpt2", "gpt2", "max_positions: 40", "", ["parallel.dp=2"], ["parallel.tp=2"]),
                 ("mixtral", "llama", "kv_heads: 2", moe, ["parallel.dp=2", "parallel.ep=2"],
                  ["parallel.dp=2"])]
        for family, fam, extra, more, layout_sets, other_sets in cases:
            layout, other = " ".join(layout_sets), " ".join(other_sets)
            spec = os.path.join(tmp, family + ".yaml")
            with open(spec, "w") as f:
                f.write(SPEC.format(family=fam, extra=extra, more=more, data=data))
            run_a, out_a = os.path.join(tmp, family + "-a"), os.path.join(tmp, family + "-a-hf")
            run([fp8rt, "launch", spec, "--np", "2", "--run-dir", run_a, "--quiet"] +
                sum([["--set", x] for x in layout_sets], []))
            run([fp8rt, "export", run_a, "--out", out_a])
            ev = json.loads(run([fp8rt, "eval", "--run-dir", run_a, "--batches", "2", "--json"]))
            windows = ev["windows"]
            ref = torch_loss(out_a, data_bytes, windows, 32)
            rel = abs(ev["loss"] - ref) / ref
            check(rel < 5e-6, "%s (%s): fp8rt eval %.7f, PyTorch float64 %.7f (rel %.1e)" %
                  (family, layout, ev["loss"], ref, rel))
            wrong = torch_loss(out_a, data_bytes, windows, 32, wrong=True)
            check(abs(wrong - ref) / ref > 2e-5,
                  "%s: a layout detail changed moves the loss (%.7f -> %.7f)" % (family, ref, wrong))
            if family == "mixtral":
                # The reference above sends the experts' rows through fp8rt's FP8 dispatch and
                # BF16 combine; Hugging Face's Mixtral keeps them in full precision. How far apart
                # that puts the two: a small, bounded effect of fp8rt's MoE wire formats.
                plain = torch_loss(out_a, data_bytes, windows, 32, wire=False)
                rel = abs(ev["loss"] - plain) / plain
                check(rel < 1e-4, "mixtral: Hugging Face's Mixtral in float64 without fp8rt's "
                      "wire formats %.7f, fp8rt %.7f (rel %.1e)" % (plain, ev["loss"], rel))
            ev_w = json.loads(run([fp8rt, "eval", "--weights", os.path.join(out_a, "model.safetensors"),
                                   "--spec", spec, "--batches", "2", "--json"]))
            check(ev_w["loss"] == ev["loss"], "%s: eval --weights %.9f == eval --run-dir %.9f" %
                  (family, ev_w["loss"], ev["loss"]))
            # The same weights in two shards with transformers' index, as save_pretrained writes
            # a large model; for Llama with the rotary_emb.inv_freq buffers older transformers
            # saved (torch's FP32 1 / theta^(2i / head_dim), theta 10000 here).
            sharded = os.path.join(tmp, family + "-a-sharded")
            extra = None
            if fam == "llama":
                dh = 64 // 4  # d_model / heads of SPEC
                inv = 1.0 / (10000.0 ** (torch.arange(0, dh, 2).float() / dh))
                extra = {"model.layers.%d.self_attn.rotary_emb.inv_freq" % l: inv for l in range(2)}
            shard_safetensors(os.path.join(out_a, "model.safetensors"), sharded, extra)
            ev_s = json.loads(run([fp8rt, "eval", "--weights", sharded, "--spec", spec,
                                   "--batches", "2", "--json"]))
            check(ev_s["loss"] == ev["loss"], "%s: eval --weights of the sharded folder %.9f == "
                  "eval --run-dir %.9f" % (family, ev_s["loss"], ev["loss"]))
            # export -> init.from (at the other layout; Llama from the shards) -> export.
            run_b, out_b = os.path.join(tmp, family + "-b"), os.path.join(tmp, family + "-b-hf")
            start = sharded if fam == "llama" else os.path.join(out_a, "model.safetensors")
            run([fp8rt, "launch", spec, "--np", "2", "--run-dir", run_b, "--quiet"] +
                sum([["--set", x] for x in other_sets], []) +
                ["--set", "init.from=" + start,
                 "--set", "train.lr=1e-30", "--set", "train.steps=1", "--set", "checkpoint.every=1"])
            run([fp8rt, "export", run_b, "--out", out_b])
            same = open(os.path.join(out_a, "model.safetensors"), "rb").read() == \
                open(os.path.join(out_b, "model.safetensors"), "rb").read()
            check(same, "%s: export (%s) -> init.from (%s) -> export is byte for byte" %
                  (family, layout, other))
            if family == "llama":
                # config.json beside the weights must describe the spec's model: another
                # rope_theta is refused, naming the file and the field, unless the spec says
                # init.ignore_config.
                run_c = os.path.join(tmp, "llama-c")
                base = [fp8rt, "launch", spec, "--np", "2", "--run-dir", run_c, "--quiet",
                        "--set", "parallel.dp=2", "--set", "init.from=" + out_a,
                        "--set", "model.rope_theta=500000",
                        "--set", "train.steps=1", "--set", "checkpoint.every=0"]
                rc, out = run_rc(base)
                check(rc != 0 and "config.json: rope_theta is 10000.0" in out and
                      "model.rope_theta is 500000.0" in out,
                      "llama: init.from with another model.rope_theta than config.json's is "
                      "refused (exit %d): %s" % (rc, [l for l in out.splitlines()
                                                      if "rope_theta" in l][:1]))
                shutil.rmtree(run_c, ignore_errors=True)
                rc, out = run_rc(base + ["--set", "init.ignore_config=true"])
                check(rc == 0, "llama: ... and loaded with init.ignore_config: true (exit %d)" % rc)
            # Bytes, not text: the tokens are bytes, and a decoder would fold some into one
            # replacement character.
            g1 = run([fp8rt, "generate", "--run-dir", run_a, "--prompt", "the lord", "--tokens", "24",
                      "--seed", "5"], binary=True)
            g2 = run([fp8rt, "generate", "--run-dir", run_a, "--prompt", "the lord", "--tokens", "24",
                      "--seed", "5"], binary=True)
            check(g1 == g2 and g1.startswith(b"the lord") and len(g1) >= len(b"the lord") + 24,
                  "%s: generate with seed 5 twice: %r (%d bytes)" % (family, g1, len(g1)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("%d failure(s)" % len(FAILURES))
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
