"""Probe w4 schemes fast: fake-quantize SmolLM2 layer by layer in HF eager, score perplexity like `octavo eval`.

    python scripts/quant_probe.py --method {fp32,rtn,awq,gptq,awqgptq} --gs 64 --tokens 4096 --threads 1 \
        [--act-order] [--damp-mode mean|median|diag] [--sink keep|drop|cap] [--float-stats] [--only REGEX]
        [--scale-forms act|duo|both|rms] [--alpha-cuts STEPS,MAX] [--block-loss N] [--awq-vo]
        [--awq-range-error block|diag] [--range-search] [--gptq-range ends|mid] [--refit ROUNDS]

A measuring tool for choosing what to build, not the compiler's path: the float HF model (the
dequantized GGUF), calibrated on the same runs as the compiler (the built-in calibration text, up to
32 runs of 512 tokens), each layer's linears replaced by their dequantized w4 values in order
(q, k, v; o; gate, up; down), sequential statistics unless --float-stats. AWQ and GPTQ call
octavo's own searches and solver (awq_search, gptq_solver); folds are applied to the HF modules.
The embedding and lm_head stay float (the artifacts store them int8) and activations are
float32, so its perplexities sit near, not on, the artifacts'. Windows as octavo.eval.perplexity
(512, stride 256). --sink cap weighs each calibration row in the Hessian by
min(1, 16 median|x|^2 / |x|^2) (rows far larger than the rest, the attention sink's, count as
16 typical rows); drop leaves position 0 out. --only REGEX: RTN of the matching linears
(names under model.layers, e.g. "down_proj" or "^(27|28|29)\\.") and nothing else.
AWQ scale-search variants (measured worse than the library's search, so kept here only):
--scale-forms duo|both adds AutoAWQ's duo candidates ``m ** a / (w ** (1 - a) + 1e-4)`` (w: the
per-channel mean of group-normalized |W|); --alpha-cuts STEPS,MAX scores every candidate with each
group's range searched over grid_cuts(STEPS, MAX) instead of plain RTN; --scale-forms rms takes rms(x) for mean|x|;
--block-loss N scores each alpha on the whole attention / MLP block's output over N runs (the reference
code's loss) instead of each linear's own; --awq-vo also folds o_proj's scales into v_proj's rows (one per
kv channel); --awq-range-error diag scores the range cuts by the Gram block's diagonal only.
--refit N refits each group's levels after the range search (N rounds of awq_search.refine_group_params, what
w4-awq does with 4; 0 stores the searched range's own levels).
GPTQ: --gptq-range mid searches its group ranges among symmetric cuts (w4-awq-gptq's) instead of each end
cut on its own (w4-gptq's).
"""
import argparse
import copy
import json
import math
import sys
import time

import torch

from octavo.eval.corpus import calibration_text, read_text
from octavo.eval.perplexity import plan_windows, tokenize_text
from octavo.frontend.sources import load_model
from octavo.passes.awq_search import (
    DEFAULT_ALPHA_GRID,
    clamp_groups,
    gram_blocks,
    output_error,
    refine_group_params,
    scales_for,
    search_range,
    search_scales,
)
from octavo.passes.gptq_solver import gptq_quantize
from octavo.passes.quant_schemes import Calibration
from octavo.passes.quantize_rtn import (
    DEFAULT_RANGE_CUTS,
    SYMMETRIC_RANGE_CUTS,
    fake_quantize_w4,
    grid_cuts,
    grouped_columns,
    quantize_w4_on_params,
    w4_scale_dtype,
)

p = argparse.ArgumentParser()
p.add_argument("--method", default="fp32")  # fp32 rtn awq gptq awqgptq
p.add_argument("--gs", type=int, default=64)
p.add_argument("--tokens", type=int, default=4096)
p.add_argument("--damp", type=float, default=0.01)
p.add_argument("--damp-mode", default="mean")  # mean | diag | median
p.add_argument("--act-order", action="store_true")
p.add_argument("--sink", default="keep")  # keep | drop | cap
p.add_argument("--clip", action="store_true", help="awq range search before gptq")
p.add_argument("--range-search", action="store_true", help="gptq: each group's range searched (shrinks)")
p.add_argument("--awq-range", default="grid", help="awq range search: grid (each end cut on its own) | mid")
p.add_argument("--range-steps", type=int, default=6, help="cuts per end: 0 .. --range-max in this many steps")
p.add_argument("--range-max", type=float, default=0.25, help="largest cut, a fraction of the group's range")
p.add_argument("--alpha-cuts", default=None,
               help="awq scale search: score each candidate with ranges searched on STEPS,MAX cuts per end")
p.add_argument("--scale-forms", default="act",
               help="awq scale candidates: act (m^a) | duo | both | rms (rms(x)^a); s=1 always")
p.add_argument("--gptq-range", default="ends", help="gptq range search: ends (each cut on its own) | mid (shrunk)")
p.add_argument("--block-loss", type=int, default=0,
               help="awq: score each alpha on the whole attention / MLP output over this many runs (0: each linear's)")
p.add_argument("--awq-vo", action="store_true",
               help="awq (with --float-stats): also fold o_proj's scales into v_proj's rows, one per kv channel")
p.add_argument("--awq-range-error", default="block", help="awq range search error: block (d^T G_g d) | diag")
p.add_argument("--refit", type=int, default=0, help="awq: rounds of the level refit after the range search")
p.add_argument("--only", default=None, help="rtn of the weights whose name matches this regex, nothing else")
p.add_argument("--runs", type=int, default=32)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--float-stats", action="store_true", help="stats from the float model (not sequential)")
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)

src = load_model("smollm2-135m")
model = src.load_module("float32")
tok = src.tokenizer
layers = model.model.layers


class Stats:
    def __init__(self, k):
        self.gram = torch.zeros(k, k)
        self.abs_sum = torch.zeros(k)
        self.rows = 0

    def add(self, x):  # x [B, T, K]
        x = x.detach().float()
        w = torch.ones(x.shape[:2])
        if args.sink == "drop":
            w[:, 0] = 0
        elif args.sink == "cap":
            norms = x.pow(2).sum(-1)
            med = norms[:, 1:].median()
            w = torch.clamp(med * 16 / norms, max=1.0)
        xr = x.reshape(-1, x.shape[-1])
        wr = w.reshape(-1, 1)
        self.gram.addmm_((xr * wr).T, xr)
        self.abs_sum += (xr.abs() * wr).sum(0)
        self.rows += int(wr.sum())

    def hessian(self):
        return self.gram * 2 / self.rows


def damped_hessian(h):
    if args.damp_mode == "mean":
        return h, args.damp
    d = torch.diagonal(h)
    if args.damp_mode == "diag":
        h = h + torch.diag(args.damp * d)
        return h, 1e-6
    if args.damp_mode == "median":
        h = h + torch.eye(h.shape[0]) * args.damp * d.median()
        return h, 1e-6
    raise ValueError


def quant(weight, stats, scales=None):
    """fake quantized weight (float) for `weight` whose input had `stats` (already in scaled space)."""
    if args.method == "rtn":
        return fake_quantize_w4(weight, args.gs)
    gram = stats.gram / stats.rows
    if scales is not None:
        inv = 1.0 / scales
        gram = gram * inv[None] * inv[:, None]
    if args.method == "awq" or args.clip:
        if args.awq_range == "mid":
            steps = [args.range_max * i / (args.range_steps - 1) for i in range(args.range_steps)]
            cuts = tuple((t, t) for t in steps)
        else:
            cuts = grid_cuts(args.range_steps, args.range_max)
        range_gram = torch.diag(torch.diagonal(gram)) if args.awq_range_error == "diag" else gram
        low, high = search_range(weight, gram_blocks(range_gram, args.gs), args.gs, cuts)
        if args.method == "awq" and args.refit:
            scales, offsets = refine_group_params(weight, gram_blocks(range_gram, args.gs), args.gs, low, high,
                                                  args.refit)
            return quantize_w4_on_params(weight, args.gs, scales, offsets).dequantize().float()
        weight = clamp_groups(weight, low, high, args.gs)
        if args.method == "awq":
            return fake_quantize_w4(weight, args.gs)
    h, damp = damped_hessian(2 * gram)
    cuts = SYMMETRIC_RANGE_CUTS if args.gptq_range == "mid" else DEFAULT_RANGE_CUTS
    q, _ = gptq_quantize(weight, h, args.gs, damping=damp, act_order=args.act_order, range_search=args.range_search,
                         range_cuts=cuts)
    return q.dequantize().float()


block_inputs = {}


def block_scales(ws, m, run_block):
    """AWQ's scale search scored on a whole block's output: run_block(weights) against the float weights."""
    with torch.no_grad():
        reference = run_block(ws)
        best = None
        for a in DEFAULT_ALPHA_GRID:
            sc = scales_for(m, a) if a else torch.ones_like(m)
            out = run_block([fake_quantize_w4(w.float() * sc, args.gs) / sc for w in ws])
            loss = float((out - reference).pow(2).mean())
            if best is None or loss < best[0]:
                best = (loss, a, sc)
    picks.append(("block", best[1]))
    return best[2]


def vo_fold(at, stats):
    """AWQ's scales for o_proj's input, one per v channel (each shared by the query heads of its kv head), folded
    into v_proj's rows; returns them expanded to o_proj's input channels."""
    kv_heads, head_dim = model.config.num_key_value_heads, at.head_dim
    wo = at.o_proj.weight.data
    repeats = wo.shape[1] // head_dim // kv_heads
    gram, m = stats.gram / stats.rows, stats.abs_sum / stats.rows
    mv = m.view(kv_heads, repeats, head_dim).mean(1).reshape(-1)
    best = None
    for a in DEFAULT_ALPHA_GRID:
        sv = scales_for(mv, a)
        se = sv.view(kv_heads, 1, head_dim).expand(kv_heads, repeats, head_dim).reshape(-1)
        loss = output_error(wo, fake_quantize_w4(wo.float() * se, args.gs) / se, gram)
        if best is None or loss < best[0]:
            best = (loss, a, sv, se)
    picks.append(("vo", best[1]))
    at.v_proj.weight.data = at.v_proj.weight.data / best[2].unsqueeze(1)
    at.o_proj.weight.data = wo * best[3]
    return best[3]


def alpha_cuts():
    steps, largest = args.alpha_cuts.split(",")
    return int(steps), float(largest)


picks = []


def weight_magnitude(ws):
    """AutoAWQ's duo term: per input channel, the mean over all rows of |w| / (max |w| of its row's group + 1e-6)."""
    grouped = grouped_columns(torch.cat([w.float() for w in ws]), args.gs).abs()
    rel = grouped / (grouped.amax(-1, keepdim=True) + 1e-6)
    return rel.reshape(rel.shape[0], -1)[:, :ws[0].shape[1]].mean(0)


def duo_scales(m, wm, alpha):
    """m ** alpha / (wm ** (1 - alpha) + 1e-4), clamped at 1e-4, normalized by sqrt(max * min)."""
    sc = (m.pow(alpha) / (wm.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    return sc / (sc.max() * sc.min()).sqrt()


def rounded(w, gram, cuts):
    if cuts is None:
        return fake_quantize_w4(w, args.gs)
    low, high = search_range(w, gram_blocks(gram, args.gs), args.gs, cuts)
    return fake_quantize_w4(clamp_groups(w, low, high, args.gs), args.gs, w4_scale_dtype(w))


def probe_scales(ws, gram, m):
    """Candidates s = 1, m ** a (--scale-forms act|both), duo (duo|both); loss with RTN or --alpha-cuts ranges."""
    cuts = grid_cuts(*alpha_cuts()) if args.alpha_cuts else None
    cands = [("act", 0.0, torch.ones_like(m))]
    if args.scale_forms in ("act", "both"):
        cands += [("act", a, scales_for(m, a)) for a in DEFAULT_ALPHA_GRID if a]
    if args.scale_forms == "rms":  # root mean square of x instead of mean |x|
        cands += [("rms", a, scales_for(torch.diagonal(gram).clamp(min=0).sqrt(), a)) for a in DEFAULT_ALPHA_GRID if a]
    if args.scale_forms in ("duo", "both"):
        wm = weight_magnitude(ws)
        cands += [("duo", a, duo_scales(m, wm, a)) for a in DEFAULT_ALPHA_GRID]
    best = None
    for form, a, sc in cands:
        g = None if cuts is None else gram / sc[None] / sc[:, None]
        loss = sum(output_error(w, rounded(w.float() * sc, g, cuts) / sc, gram) for w in ws)
        if best is None or loss < best[0]:
            best = (loss, form, a, sc)
    picks.append(best[1:3])
    return best[3]


def awq_fold(linears, stats, upstream, run_block=None):
    if args.method not in ("awq", "awqgptq"):
        return None
    ws = [linear.weight.data for linear in linears]
    gram, m = stats.gram / stats.rows, stats.abs_sum / stats.rows
    if args.block_loss and run_block is not None:
        s = block_scales(ws, m, run_block)
    elif args.alpha_cuts or args.scale_forms != "act":
        s = probe_scales(ws, gram, m)
    else:
        s, alpha, _ = search_scales(ws, gram, m, args.gs)
        picks.append(("act", alpha))
    for linear in linears:
        linear.weight.data = linear.weight.data * s
    upstream(s)
    return s


def stats_of(x):
    stats = Stats(x.shape[-1])
    stats.add(x)
    return stats


def float_stats(layer, hidden, pe):
    at, mlp = layer.self_attn, layer.mlp
    out = []
    a = layer.input_layernorm(hidden)
    out.append(stats_of(a))
    cap = {}
    hk = at.o_proj.register_forward_pre_hook(lambda m, a: cap.__setitem__("x", a[0]))
    at(hidden_states=a, position_embeddings=pe, attention_mask=None)
    hk.remove()
    out.append(stats_of(cap["x"]))
    h = hidden + at.o_proj(cap["x"])
    block_inputs["attn"], block_inputs["mlp"] = hidden, h
    m = layer.post_attention_layernorm(h)
    out.append(stats_of(m))
    dx = mlp.act_fn(mlp.gate_proj(m)) * mlp.up_proj(m)
    out.append(stats_of(dx))
    return out, h + mlp.down_proj(dx)


def calibrate():
    cal = Calibration("default", "", list(tok.encode(calibration_text("default"), add_special_tokens=False)))
    runs = cal.samples(512, args.runs)
    ids = torch.tensor(runs)
    pos = torch.arange(512).unsqueeze(0).expand(len(runs), -1)
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
        pe = model.model.rotary_emb(hidden, pos)
        hidden_f = hidden
        for i, layer in enumerate(layers):
            t0 = time.time()
            if args.float_stats:
                fst, hidden_f = float_stats(copy.deepcopy(layer), hidden_f, pe)
            at = layer.self_attn
            mlp = layer.mlp
            # qkv
            st = Stats(hidden.shape[-1])
            st.add(layer.input_layernorm(hidden))
            if args.float_stats:
                st = fst[0]
            qkv = [at.q_proj, at.k_proj, at.v_proj]

            def up_norm(s, norm=layer.input_layernorm):
                norm.weight.data = norm.weight.data / s
            n = args.block_loss
            x_attn = block_inputs["attn"][:n] if args.float_stats else hidden[:n]
            pe_n = (pe[0][:n], pe[1][:n])

            def run_attn(ws, at=at, norm=layer.input_layernorm, x=x_attn, pe_n=pe_n, linears=qkv):
                kept = [linear.weight.data for linear in linears]
                for linear, w in zip(linears, ws, strict=True):
                    linear.weight.data = w
                out = at(hidden_states=norm(x), position_embeddings=pe_n, attention_mask=None)[0]
                for linear, w in zip(linears, kept, strict=True):
                    linear.weight.data = w
                return out
            s = awq_fold(qkv, st, up_norm, run_attn)
            vo = vo_fold(at, fst[1]) if args.awq_vo and args.method in ("awq", "awqgptq") else None
            for linear in qkv:
                linear.weight.data = quant(linear.weight.data, st, s)
            # o_proj
            cap = {}
            hk = at.o_proj.register_forward_pre_hook(lambda m, a, cap=cap: cap.__setitem__("x", a[0]))
            at(hidden_states=layer.input_layernorm(hidden), position_embeddings=pe, attention_mask=None)
            hk.remove()
            st = Stats(cap["x"].shape[-1])
            st.add(cap["x"])
            if args.float_stats:
                st = fst[1]
            at.o_proj.weight.data = quant(at.o_proj.weight.data, st, vo)
            h = hidden + at.o_proj(cap["x"])
            # gate/up
            st = Stats(h.shape[-1])
            st.add(layer.post_attention_layernorm(h))
            if args.float_stats:
                st = fst[2]
            gu = [mlp.gate_proj, mlp.up_proj]

            def up_norm2(s, norm=layer.post_attention_layernorm):
                norm.weight.data = norm.weight.data / s
            x_mlp = block_inputs["mlp"][:n] if args.float_stats else h[:n]

            def run_mlp(ws, mlp=mlp, norm=layer.post_attention_layernorm, x=x_mlp, linears=gu):
                kept = [linear.weight.data for linear in linears]
                for linear, w in zip(linears, ws, strict=True):
                    linear.weight.data = w
                out = mlp(norm(x))
                for linear, w in zip(linears, kept, strict=True):
                    linear.weight.data = w
                return out
            s = awq_fold(gu, st, up_norm2, run_mlp)
            for linear in gu:
                linear.weight.data = quant(linear.weight.data, st, s)
            m = layer.post_attention_layernorm(h)
            dx = mlp.act_fn(mlp.gate_proj(m)) * mlp.up_proj(m)
            st = Stats(dx.shape[-1])
            st.add(dx)
            if args.float_stats:
                st = fst[3]

            def up_up(s, up=mlp.up_proj):
                up.weight.data = up.weight.data / s.unsqueeze(1)
            s = awq_fold([mlp.down_proj], st, up_up)
            if s is not None:
                dx = dx / s
            mlp.down_proj.weight.data = quant(mlp.down_proj.weight.data, st, s)
            hidden = h + mlp.down_proj(dx)
            print(f"layer {i} {time.time() - t0:.1f}s", file=sys.stderr, flush=True)


def evaluate():
    ids = tokenize_text(tok, read_text("default"), args.tokens)
    total, n = 0.0, 0
    with torch.no_grad():
        for w in plan_windows(len(ids)):
            x = torch.tensor(ids[w.start:w.end]).unsqueeze(0)
            logits = model(input_ids=x, use_cache=False).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1)
            tgt = x[0, 1:]
            lp = lp.gather(1, tgt.unsqueeze(1))[:, 0]
            total += float(lp[-w.scored:].sum())
            n += w.scored
    return math.exp(-total / n), n


if args.only:
    import re
    with torch.no_grad():
        for n, mod in model.model.layers.named_modules():
            if isinstance(mod, torch.nn.Linear) and re.search(args.only, n):
                mod.weight.data = fake_quantize_w4(mod.weight.data, args.gs)
elif args.method != "fp32":
    t0 = time.time()
    calibrate()
    print(f"calibrated in {time.time() - t0:.0f}s", file=sys.stderr)
t0 = time.time()
ppl, n = evaluate()
if picks:
    forms = sorted({form for form, _ in picks})
    print("picks: " + ", ".join(f"{form} {sum(f == form for f, _ in picks)} mean alpha "
                                f"{sum(a for f, a in picks if f == form) / sum(f == form for f, _ in picks):.3f}"
                                for form in forms), file=sys.stderr)
print(json.dumps({**vars(args), "ppl": round(ppl, 4), "scored": n, "eval_s": round(time.time() - t0)}), flush=True)
