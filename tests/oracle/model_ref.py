#!/usr/bin/python3
"""Independent reference for strata's transformer: a plain PyTorch (float64, autograd)
implementation of Llama / Qwen2 / Mistral and GPT-2 as Hugging Face defines them.

Usage: model_ref.py [--bf16-gemm] [--batch FILE] [--out FILE] DIR
       model_ref.py --greedy N --prompt-ids "ID ID ..." DIR
  --bf16-gemm: every matrix product's operands rounded to bf16 as strata's bf16 compute reads
               them (activations and weights; attention's q, k, v and probabilities; in backward
               also the incoming gradient, which strata's kernels write in bf16); the products,
               their sums and everything else in float64.
  reads  DIR as Hugging Face's from_pretrained finds a model in it: DIR/config.json, and
         DIR/model.safetensors or, without it, the shards DIR/model.safetensors.index.json's
         weight_map names (F32, BF16 or F16 weights, HF names; GPT-2's also without the
         "transformer." prefix, as on the Hub; a tied head needs no lm_head.weight);
         FILE of --batch (default DIR/batch.safetensors): "tokens", "targets", [B, T] ids as F32
         (a target -100 does not count: F.cross_entropy's ignore_index), and optionally
         "positions" [B, T] (packed rows: each token's position in its document, 0 at a
         document's start): rotary / learned positions are looked up at them (Hugging Face's
         position_ids) and a query attends only to keys of its own document (the block-diagonal
         causal mask Hugging Face's flash-attention path derives from position_ids)
  writes FILE of --out (default DIR/ref.safetensors), F64: "logits" [B*T, V], "loss" [1],
         "grad.<name>" per parameter. With --batch and --out outside DIR, DIR is only read.
--greedy: Hugging Face's greedy decode (do_sample false) of N new tokens after the prompt,
  the whole sequence run through the model again for every token (no key/value cache), in
  float64; prints the new ids, space-separated, on one line. Reads DIR as above, nothing else.
It shares no code with strata: safetensors is parsed here by hand, the model written out.
"""
import os
import json
import math
import struct
import sys

import numpy as np
import torch


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    base = 8 + hlen
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        buf = raw[base + b:base + e]
        if t["dtype"] == "F32":
            a = np.frombuffer(buf, dtype="<f4").astype(np.float64)
        elif t["dtype"] == "F64":
            a = np.frombuffer(buf, dtype="<f8").copy()
        elif t["dtype"] == "BF16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        elif t["dtype"] == "F16":
            a = np.frombuffer(buf, dtype="<f2").astype(np.float64)
        else:
            raise SystemExit(f"{path}: unsupported dtype {t['dtype']} for {name}")
        if a.size != math.prod(t["shape"]):
            raise SystemExit(f"{path}: {name} holds {a.size} values, its shape {t['shape']} {math.prod(t['shape'])}")
        out[name] = torch.from_numpy(a.reshape(t["shape"]))
    return out


def read_model_folder(d):
    """The weights of a Hugging Face folder, found as from_pretrained finds them: model.safetensors,
    else the index's shards (every one it names must exist and hold the tensors it maps to it)."""
    single = os.path.join(d, "model.safetensors")
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(single):
        P = read_safetensors(single)
    elif os.path.exists(index):
        weight_map = json.load(open(index))["weight_map"]
        P = {}
        for shard in sorted(set(weight_map.values())):
            got = read_safetensors(os.path.join(d, shard))
            for name in got:
                if weight_map.get(name) != shard:
                    raise SystemExit(f"{index}: {name} is in {shard}, the weight_map says {weight_map.get(name)}")
            P.update(got)
        missing = sorted(set(weight_map) - set(P))
        if missing:
            raise SystemExit(f"{index}: {missing} mapped but in no shard")
    else:
        raise SystemExit(f"{d}: no model.safetensors and no model.safetensors.index.json")
    return P


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        a = t.detach().to(torch.float64).contiguous().numpy().astype("<f8")
        b = a.tobytes()
        header[name] = {"dtype": "F64", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


BF16_GEMM = False


def rb(x):
    """x rounded to bf16 (round to nearest even, through fp32 as strata's fp32 values are)."""
    return x.float().bfloat16().double() if BF16_GEMM else x


class Gemm(torch.autograd.Function):
    """a @ b ([..., N, K] x [..., K, M]) as strata's GEMMs compute it: operands rounded (rb), and
    in backward the incoming gradient too, for both of its products."""

    @staticmethod
    def forward(ctx, a, b):
        a, b = rb(a), rb(b)
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        g = rb(g)
        return g @ b.transpose(-1, -2), a.transpose(-1, -2) @ g


def mm(x, w):
    """x [..., K] @ w [K, M] through Gemm."""
    return Gemm.apply(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[-1])


def rope_tables(cfg, hd, T):
    theta = cfg.get("rope_theta", 10000.0)
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        inv_l = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wl < hi_wl) * ~(wl > lo_wl)
        inv = torch.where(medium, smoothed, inv_l)
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Bf16Attention(torch.autograd.Function):
    """Causal softmax(q k^T * scale) v with strata's bf16 roundings (--bf16-gemm): forward, q, k, v
    and the probabilities P rounded as the two products' operands; backward (its formula, as
    strata's kernel computes it), dO, v, P and dS = P (dP - rowsum(dO o)) * scale rounded as
    operands, rowsum(dO o) from the unrounded dO and the output o."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mask):
        p = torch.softmax((rb(q) @ rb(k).transpose(-1, -2) * scale).masked_fill(mask, float("-inf")), dim=-1)
        o = rb(p) @ rb(v)
        ctx.save_for_backward(q, k, v, p, o)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, p, o = ctx.saved_tensors
        dob = rb(do)
        dp = dob @ rb(v).transpose(-1, -2)
        ds = rb(p * (dp - (do * o).sum(-1, keepdim=True)) * ctx.scale)
        return ds @ rb(k), ds.transpose(-1, -2) @ rb(q), rb(p).transpose(-1, -2) @ dob, None, None


def attention_mask(pos, T):
    """True where a query (row) must not see a key (column): [B, 1, T, T] (or [T, T] without
    positions). Packed rows: keys of another document (documents start where pos is 0)."""
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    if pos is None:
        return causal
    doc = torch.cumsum((pos == 0).long(), dim=1)  # [B, T]
    other = doc[:, :, None] != doc[:, None, :]
    return (causal[None] | other)[:, None]


def attention(q, k, v, nh, nkv, scale=None, pos=None):
    # q [B, nh, T, hd]; k, v [B, nkv, T, hd] (repeat_kv as Hugging Face does)
    rep = nh // nkv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    T = q.shape[2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = attention_mask(pos, T)
    if BF16_GEMM:
        return Bf16Attention.apply(q, k, v, scale, mask)
    s = q @ k.transpose(-1, -2) * scale
    s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def llama(cfg, P, tok, pos=None):
    B, T = tok.shape
    C = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim", C // nh)
    eps = cfg.get("rms_norm_eps", 1e-6)
    cos, sin = rope_tables(cfg, hd, T)
    if pos is not None:  # [B, 1, T, hd]: each token's row of the tables
        cos, sin = cos[pos][:, None], sin[pos][:, None]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def lin(x, name):
        y = mm(x, P[name + ".weight"].T)
        if name + ".bias" in P:
            y = y + P[name + ".bias"]
        return y

    x = P["model.embed_tokens.weight"][tok]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms(x, P[p + "input_layernorm.weight"])
        q = lin(h, p + "self_attn.q_proj").view(B, T, nh, hd).transpose(1, 2)
        k = lin(h, p + "self_attn.k_proj").view(B, T, nkv, hd).transpose(1, 2)
        v = lin(h, p + "self_attn.v_proj").view(B, T, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = attention(q, k, v, nh, nkv, pos=pos).transpose(1, 2).reshape(B, T, nh * hd)
        x = x + lin(o, p + "self_attn.o_proj")
        h = rms(x, P[p + "post_attention_layernorm.weight"])
        g = lin(h, p + "mlp.gate_proj")
        u = lin(h, p + "mlp.up_proj")
        x = x + lin(torch.nn.functional.silu(g) * u, p + "mlp.down_proj")
    x = rms(x, P["model.norm.weight"])
    head = P["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else P["lm_head.weight"]
    return mm(x, head.T)


def gpt2(cfg, P, tok, pos=None):
    B, T = tok.shape
    C = cfg["n_embd"]
    nh = cfg["n_head"]
    hd = C // nh
    eps = cfg.get("layer_norm_epsilon", 1e-5)

    def ln(x, p):
        return torch.nn.functional.layer_norm(x, (C,), P[p + ".weight"], P[p + ".bias"], eps)

    def conv1d(x, p):  # Conv1D: weight [in, out]
        return mm(x, P[p + ".weight"]) + P[p + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    x = P["transformer.wte.weight"][tok] + P["transformer.wpe.weight"][torch.arange(T) if pos is None else pos]
    for l in range(cfg["n_layer"]):
        p = f"transformer.h.{l}."
        qkv = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn")
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (t.view(B, T, nh, hd).transpose(1, 2) for t in (q, k, v))
        # GPT2Attention: / sqrt(hd) when scale_attn_weights, / (layer_idx + 1) when scale_attn_by_inverse_layer_idx
        scale = 1 / math.sqrt(hd) if cfg.get("scale_attn_weights", True) else 1.0
        if cfg.get("scale_attn_by_inverse_layer_idx", False):
            scale /= l + 1
        o = attention(q, k, v, nh, nh, scale, pos).transpose(1, 2).reshape(B, T, C)
        x = x + conv1d(o, p + "attn.c_proj")
        x = x + conv1d(gelu_new(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    x = ln(x, "transformer.ln_f")
    return mm(x, P["transformer.wte.weight"].T)


def greedy(d, n, prompt):
    cfg = json.load(open(f"{d}/config.json"))
    P = read_model_folder(d)
    if cfg["model_type"] == "gpt2" and "wte.weight" in P:  # the Hub's GPT-2 names: no prefix
        P = {"transformer." + k: v for k, v in P.items()}
    fwd = gpt2 if cfg["model_type"] == "gpt2" else llama
    seq = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = fwd(cfg, P, torch.tensor([seq], dtype=torch.long))
            nxt = int(torch.argmax(logits[0, -1]).item())  # the first maximum, as torch.argmax
            out.append(nxt)
            seq.append(nxt)
    print(" ".join(str(t) for t in out))


def main():
    global BF16_GEMM
    args = sys.argv[1:]
    if args and args[0] == "--greedy":
        n = int(args[1])
        assert args[2] == "--prompt-ids", "usage: --greedy N --prompt-ids IDS DIR"
        greedy(args[4], n, [int(t) for t in args[3].replace(",", " ").split()])
        return
    batch_file = out_file = None
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag == "--bf16-gemm":
            BF16_GEMM = True
        elif flag in ("--batch", "--out") and args:
            if flag == "--batch":
                batch_file = args.pop(0)
            else:
                out_file = args.pop(0)
        else:
            raise SystemExit(f"model_ref.py: unknown or incomplete option {flag}; see the usage at the top")
    if len(args) != 1:
        raise SystemExit("usage: model_ref.py [--bf16-gemm] [--batch FILE] [--out FILE] DIR")
    d = args[0]
    cfg = json.load(open(f"{d}/config.json"))
    P = read_model_folder(d)
    if cfg["model_type"] == "gpt2" and "wte.weight" in P:  # the Hub's GPT-2 names: no prefix
        P = {"transformer." + k: v for k, v in P.items()}
    for t in P.values():
        t.requires_grad_(True)
    batch = read_safetensors(batch_file or f"{d}/batch.safetensors")
    tok = batch["tokens"].long()
    tgt = batch["targets"].long()
    pos = batch["positions"].long() if "positions" in batch else None
    fwd = gpt2 if cfg["model_type"] == "gpt2" else llama
    logits = fwd(cfg, P, tok, pos)
    V = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits.view(-1, V), tgt.view(-1), ignore_index=-100)
    loss.backward()
    out = {"logits": logits.view(-1, V), "loss": loss.view(1)}
    for name, t in P.items():
        out["grad." + name] = t.grad if t.grad is not None else torch.zeros_like(t)
    write_safetensors(out_file or f"{d}/ref.safetensors", out)


if __name__ == "__main__":
    main()
