// The transformer's forward and backward, unit by unit, over a UnitProvider.
//
// Owns: the rotary tables, the current micro-batch's ids, each layer's saved activations
// (or only its input, with checkpointing), the gradient flowing down the residual stream,
// and scratch. It never owns weights or weight gradients: those are the provider's, and
// are touched only between acquire and release.
//
// Invariants:
//  - Every device buffer is allocated on the model's stream, so it is freed in stream order:
//    dropping a Buffer on the host while queued work still reads it is safe.
//  - Activations are fp32; in bf16 compute every GEMM input is bf16 (weights already are),
//    accumulation and outputs stay fp32. An activation read only by GEMMs (the norms' outputs,
//    SwiGLU/GELU's output, SwiGLU's dgu, the logits' gradient) is written in bf16 by its
//    kernel; one read also elsewhere (o, the residual gradient) gets a bf16 copy from the
//    kernel that writes it, or (dqkv, GPT-2's gradients) from one cast shared by its GEMMs.
//  - A layer's recomputation (checkpointing) runs exactly the forward code on exactly the
//    same inputs, and every kernel is deterministic, so gradients are bit-identical.
//  - Packed rows (Batch::positions) run each document as a sequence of its own wherever positions
//    matter (rotary embedding, GPT-2's learned positions, attention): the kernels get the
//    document's rows, at its first row, as a batch of one row of its length (a run of rows that
//    are each one whole document goes as one call of that many rows). Everything else works on
//    all N rows as unpacked. Without positions the calls are exactly the unpacked ones.
#include "strata/model.h"

#include <cmath>
#include <numbers>

#include "model/ops.h"
#include "strata/comm.h"
#include "strata/error.h"

namespace strata {

using model_ops::Weight;
static_assert(kIgnoreTarget == model_ops::kIgnoreTarget);
using i64 = std::int64_t;

namespace {

TensorRef dev_tensor(const Device& dev, const void* p, DType t, std::size_t numel) {
  return TensorRef{MemRef{const_cast<void*>(p), numel * dtype_size(t), MemSpace::kDevice, &dev}, t,
                   numel};
}

float* fptr(const Buffer& b) { return static_cast<float*>(b.data()); }

// One layer's activations kept for backward, on the device: fp32, except those read only as
// GEMM operands (h1, h2, act), which are in the compute dtype (bf16 in bf16 compute).
struct Acts {
  Buffer x;             // the layer's input [N, C] (empty while checkpointed to host)
  Buffer h1, n1a, n1b;  // first norm: output, rstd (RMSNorm) or mean and rstd (LayerNorm)
  Buffer qkv, o, lse;   // fused projections after rotary, attention output, logsumexp
  Buffer xm;            // residual after attention
  Buffer h2, n2a, n2b;  // second norm
  Buffer fc, act;       // MLP: gate|up (Llama) or pre-GELU (GPT-2), and its activation
  Buffer ob;            // bf16 compute: o rounded to bf16 (the output projection's operand)
  void drop_all_but_input() {
    for (Buffer* b : {&h1, &n1a, &n1b, &qkv, &o, &lse, &xm, &h2, &n2a, &n2b, &fc, &act, &ob})
      b->reset();
  }
};

}  // namespace

struct Model::Impl {
  ModelConfig cfg;
  ModelOptions opt;
  Device& dev;
  Stream& s;
  std::vector<UnitSpec> units;
  DType wdt;
  // Under tensor parallelism I, V, nh, nkv (and qd, kvd, qkvd) are this rank's shares; Vfull the
  // whole vocabulary, Vp a rank's share of it (the last rank may hold fewer, V), v0 its first row.
  i64 B, T, N, C, I, V, L, nh, nkv, hd, qd, kvd, qkvd;
  i64 Vfull, Vp, v0 = 0;
  Communicator* tp = nullptr;  // null: TP 1
  TensorParallel tpl;
  Model::TpTraffic traffic;
  // Sequence parallelism (Megatron-SP, under TP): the residual stream, the norms and the
  // replicated biases' work hold this rank's Nl = N / TP rows ([rank * Nl, (rank + 1) * Nl) of the
  // B x T token rows); the column-parallel layers get all N rows by an all-gather and the
  // row-parallel ones give back this rank's rows by a reduce-scatter. Without it Nl = N.
  bool seqp = false;
  i64 Nl = 0;
  // The replicated parameters' gradients of this backward, summed over TP before they are added
  // to the provider's (SP: each rank's rows give a part): the provider's pointer and the part.
  std::vector<std::pair<float*, Buffer>> rep_parts;
  bool gpt2;
  Buffer rope_cos, rope_sin;                            // [T, hd/2]
  Buffer tokens, targets;                               // int32 [N]
  std::vector<std::int32_t> tokens_host, targets_host;  // what was copied into them
  std::vector<Acts> acts;
  // Layer inputs checkpointed to host memory; kept across steps so that no copy from or
  // into them can outlive them (the stream orders this step's copies after the last one's).
  std::vector<std::vector<float>> host_ckpt;
  // Device checkpoints: every layer's input in one block taken at the start of the forward,
  // instead of L small blocks that outlive everything allocated around them and cut a tight
  // device memory into pieces (DeepSpeed's contiguous_memory_optimization, for the same reason).
  Buffer ckpt_store;
  Buffer dres;       // gradient of the residual stream, flowing down in backward
  Buffer dres_b;     // bf16 compute, Llama: dres rounded to bf16 by the RMSNorm backward that last
                     // wrote it
  Buffer tied_grad;  // LM-head gradient of the tied embedding, until the embedding's backward
  std::vector<float> host_losses;
  bool have_grad = false;

  // The batch's documents, from Batch::positions (set_positions): r0 the first row (token index
  // into [0, N)), `rows` rows of t positions each. Empty: unpacked (every row one document).
  struct Seg {
    i64 r0, rows, t;
  };
  std::vector<Seg> segs;

  Impl(const ModelConfig& c, Device& d, Stream& st, const ModelOptions& o)
      : cfg(c), opt(o), dev(d), s(st), units(units_for(c, o)), wdt(o.compute) {
    STRATA_REQUIRE(&st.device() == &d, "Model: the stream belongs to another device");
    if (o.tensor_parallel && o.tensor_parallel->world_size() > 1) {
      tp = o.tensor_parallel;
      tpl = {tp->world_size(), tp->rank()};
      STRATA_REQUIRE(&tp->device() == &d,
                     "Model: the tensor-parallel communicator is on device {}, the model on {}",
                     tp->device().name(), d.name());
    }
    STRATA_REQUIRE(wdt == DType::kF32 || wdt == DType::kBF16,
                   "Model: compute dtype must be fp32 or bf16, got {}", dtype_name(wdt));
    gpt2 = c.arch == ModelArch::kGpt2;
    B = o.micro_batch;
    T = o.seq_len > 0 ? o.seq_len : (gpt2 ? c.max_positions : 1024);
    opt.seq_len = T;
    STRATA_REQUIRE(B > 0, "Model: micro_batch must be > 0, got {}", B);
    STRATA_REQUIRE(!gpt2 || T <= c.max_positions,
                   "Model: seq_len {} exceeds GPT-2's n_positions {} (its learned position table)",
                   T, c.max_positions);
    const i64 window = binding_sliding_window(c);
    STRATA_REQUIRE(
        window == 0 || T <= window,
        "Model: seq_len {} exceeds the config's sliding_window {}; strata's attention is "
        "full causal, so use seq_len <= sliding_window",
        T, window);
    N = B * T;
    seqp = o.sequence_parallel;
    STRATA_REQUIRE(
        !seqp || tp,
        "Model: sequence parallelism shards the token rows over a tensor-parallel group: "
        "give ModelOptions::tensor_parallel a communicator of 2 or more ranks");
    STRATA_REQUIRE(
        !seqp || N % tpl.size == 0,
        "Model: sequence parallelism cuts the micro-batch's {} x {} = {} token rows over "
        "{} TP ranks: use a micro_batch x seq_len that {} divides",
        B, T, N, tpl.size, tpl.size);
    Nl = seqp ? N / tpl.size : N;
    C = c.hidden_size;
    I = c.intermediate_size / tpl.size;
    Vfull = c.vocab_size;
    const ParamSpec& wte = units[0].params[0];  // the vocabulary's rows this rank holds
    V = wte.shape[0];
    v0 = wte.split_begin;
    Vp = (Vfull + tpl.size - 1) / tpl.size;
    L = c.num_layers;
    nh = c.num_heads / tpl.size;
    nkv = c.num_kv_heads / tpl.size;
    hd = c.head_dim;
    qd = nh * hd;
    kvd = nkv * hd;
    qkvd = qd + 2 * kvd;
    acts.resize(static_cast<std::size_t>(L));
    if (opt.checkpoint && opt.checkpoint_on_host) host_ckpt.resize(static_cast<std::size_t>(L));
    if (!gpt2) build_rope();
    tokens = dev.alloc(N * 4, &s);
    targets = dev.alloc(N * 4, &s);
  }

  static std::vector<UnitSpec> units_for(const ModelConfig& c, const ModelOptions& o) {
    const Communicator* g = o.tensor_parallel;
    return model_units(c, g && g->world_size() > 1 ? TensorParallel{g->world_size(), g->rank()}
                                                   : TensorParallel{});
  }

  // In place: the sum of `x` over the tensor-parallel group (a row-parallel layer's output, a
  // column-parallel layer's input gradient), queued on the stream. Nothing under TP 1.
  void tp_sum(float* x, i64 numel) {
    if (!tp) return;
    tp->all_reduce(dev_tensor(dev, x, DType::kF32, numel), ReduceOp::kSum, s);
    ++traffic.all_reduces;
    traffic.all_reduce_bytes += std::uint64_t(numel) * 4;
  }
  // SP: every TP rank's Nl rows of `cols` values (dtype t) at `local`, in rank order: all N rows.
  Buffer gather_rows(const void* local, DType t, i64 cols) {
    const std::size_t es = dtype_size(t);
    Buffer full = dev.alloc(std::size_t(N * cols) * es, &s);
    tp->all_gather(dev_tensor(dev, local, t, Nl * cols), tensor(full, t, std::size_t(N * cols)), s);
    ++traffic.all_gathers;
    traffic.all_gather_bytes += std::uint64_t(Nl * cols) * es;
    return full;
  }
  // SP: the sum over TP of all N rows of `full` (fp32, `cols` values a row), this rank's Nl rows of
  // it into `local`.
  void scatter_rows(const float* full, float* local, i64 cols) {
    tp->reduce_scatter(dev_tensor(dev, full, DType::kF32, N * cols),
                       dev_tensor(dev, local, DType::kF32, Nl * cols), ReduceOp::kSum, s);
    ++traffic.reduce_scatters;
    traffic.reduce_scatter_bytes += std::uint64_t(N * cols) * 4;
  }
  // Where a replicated parameter's gradient goes in this backward: the provider's `g` itself, or
  // under SP a zeroed part of its own, summed over TP and added to `g` by flush_rep_grads().
  float* rep_grad(float* g, i64 n) {
    if (!seqp) return g;
    Buffer part = falloc(n);
    s.fill(tensor(part, DType::kF32), 0.0f);
    rep_parts.emplace_back(g, std::move(part));
    return fptr(rep_parts.back().second);
  }
  void flush_rep_grads() {
    for (auto& [g, part] : rep_parts) {
      const i64 n = i64(part.size() / 4);
      tp_sum(fptr(part), n);
      s.axpy(1.0f, tensor(part, DType::kF32), dev_tensor(dev, g, DType::kF32, n));
    }
    rep_parts.clear();
  }
  // A norm's output (compute dtype, `rows` rows) as the next GEMM's operand: under SP (`seq`) all
  // N rows gathered into `full`.
  TensorRef gathered(const Buffer& local, bool seq, Buffer& full, i64 rows) {
    if (!seq) return otensor(local, rows * C);
    full = gather_rows(local.data(), wdt, C);
    return otensor(full, N * C);
  }
  // Every TP rank's `numel` floats of `in` side by side in `out`.
  void tp_gather(const Buffer& in, Buffer& out, i64 numel) {
    tp->all_gather(tensor(in, DType::kF32, std::size_t(numel)),
                   tensor(out, DType::kF32, std::size_t(tpl.size * numel)), s);
    ++traffic.all_gathers;
    traffic.all_gather_bytes += std::uint64_t(numel) * 4;
  }
  // y = resid + in @ op(W) of a row-parallel layer (the attention output and MLP down
  // projections): under TP each rank's partial product summed over the group, then the residual.
  // Under SP (`seq`) y and resid are this rank's Nl rows: the partial product's rows summed over
  // TP by a reduce-scatter.
  void row_parallel(const TensorRef& in, Weight w, bool out_in, float* y, const float* resid, i64 n,
                    i64 k, i64 out, bool seq = false) {
    if (!tp) {
      copy_f(y, resid, n * out);
      linear(in, w, out_in, y, n, k, out, 1.0f);
      return;
    }
    i64 rows = n;
    if (seq) {
      Buffer partial = falloc(n * out);
      linear(in, w, out_in, fptr(partial), n, k, out, 0.0f);
      scatter_rows(fptr(partial), y, out);
      rows = Nl;
    } else {
      linear(in, w, out_in, y, n, k, out, 0.0f);
      tp_sum(y, n * out);
    }
    s.axpy(1.0f, dev_tensor(dev, resid, DType::kF32, rows * out),
           dev_tensor(dev, y, DType::kF32, rows * out));
  }
  // Ids as this rank's vocabulary rows (TP): id - v0 for its own, -1 for another rank's (the
  // embedding's zero row, the cross-entropy's "elsewhere"); kIgnoreTarget stays.
  void localize(std::vector<std::int32_t>& ids) const {
    if (!tp) return;
    for (auto& id : ids)
      if (id != kIgnoreTarget) id = id >= v0 && id < v0 + V ? std::int32_t(id - v0) : -1;
  }
  // Rows of the LM head's loss chunks: the same on every TP rank (their collectives must match).
  i64 loss_chunk() const {
    return opt.loss_chunk_rows > 0 ? opt.loss_chunk_rows
                                   : std::max<i64>(1, std::min<i64>(N, (i64(4) << 20) / Vp));
  }
  // Every rank's columns of `rows` rows of logits ([rows, V], this rank's) as [rows, Vfull] on the
  // host: an all-gather over TP (each rank's block padded to rows x Vp). Synchronizes.
  std::vector<float> full_logits(const Buffer& local, i64 rows) {
    std::vector<float> host(static_cast<std::size_t>(rows * Vfull));
    if (!tp) {
      s.copy(host_ref(host.data(), host.size() * 4), local.ref(0, host.size() * 4));
      s.synchronize();
      return host;
    }
    Buffer mine = falloc(rows * Vp), all = falloc(tpl.size * rows * Vp);
    copy_f(fptr(mine), fptr(local), rows * V);
    tp_gather(mine, all, rows * Vp);
    std::vector<float> blocks(static_cast<std::size_t>(tpl.size * rows * Vp));
    s.copy(host_ref(blocks.data(), blocks.size() * 4), all.ref());
    s.synchronize();
    for (i64 p = 0; p < tpl.size; ++p) {
      const i64 first = p * Vp, cols = std::min(Vp, Vfull - first);
      for (i64 r = 0; r < rows; ++r)
        std::copy_n(blocks.begin() + (p * rows * Vp + r * cols), cols,
                    host.begin() + (r * Vfull + first));
    }
    return host;
  }

  // Hugging Face's rotary tables, in double then rounded once: inv_freq[i] = theta^(-2i/hd),
  // with the llama3 rescaling of long wavelengths when configured.
  void build_rope() {
    const i64 half = hd / 2;
    std::vector<double> inv(half);
    for (i64 i = 0; i < half; ++i)
      inv[i] = 1.0 / std::pow(cfg.rope_theta, double(2 * i) / double(hd));
    if (cfg.rope_llama3_factor > 0) {
      const double f = cfg.rope_llama3_factor, lo = cfg.rope_llama3_low_freq_factor,
                   hi = cfg.rope_llama3_high_freq_factor,
                   old = cfg.rope_llama3_original_max_positions;
      const double lo_wl = old / lo, hi_wl = old / hi;
      for (auto& fr : inv) {
        const double wl = 2 * std::numbers::pi / fr;
        if (wl > lo_wl) {
          fr = fr / f;
        } else if (wl >= hi_wl) {
          const double smooth = (old / wl - lo) / (hi - lo);
          fr = (1 - smooth) * fr / f + smooth * fr;
        }
      }
    }
    std::vector<float> cs(T * half), sn(T * half);
    for (i64 t = 0; t < T; ++t)
      for (i64 i = 0; i < half; ++i) {
        cs[t * half + i] = static_cast<float>(std::cos(double(t) * inv[i]));
        sn[t * half + i] = static_cast<float>(std::sin(double(t) * inv[i]));
      }
    rope_cos = dev.alloc(cs.size() * 4, &s);
    rope_sin = dev.alloc(sn.size() * 4, &s);
    s.copy(rope_cos.ref(), host_ref(cs.data(), cs.size() * 4));
    s.copy(rope_sin.ref(), host_ref(sn.data(), sn.size() * 4));
    s.synchronize();  // the host vectors die here
  }

  Buffer falloc(i64 numel) { return dev.alloc(static_cast<std::size_t>(numel) * 4, &s); }

  // Parameter `idx` of unit `unit` inside the acquired weights `w`.
  Weight param(const TensorRef& w, std::size_t unit, std::size_t idx) const {
    const ParamSpec& p = units[unit].params[idx];
    return Weight{static_cast<const char*>(w.mem.ptr) + p.offset * dtype_size(wdt), wdt};
  }
  float* gparam(const TensorRef& g, std::size_t unit, std::size_t idx) const {
    return static_cast<float*>(g.mem.ptr) + units[unit].params[idx].offset;
  }

  void require_unit(const TensorRef& t, std::size_t unit, DType dt, const char* what) const {
    STRATA_REQUIRE(
        t.mem.ptr && t.numel == units[unit].numel && t.dtype == dt &&
            t.mem.space == MemSpace::kDevice && t.mem.device == &dev,
        "Model: the provider's {} for unit {} ('{}') must be {} {} elements on {}; got {} {} "
        "elements",
        what, unit, units[unit].name, dtype_name(dt), units[unit].numel, dev.name(),
        dtype_name(t.dtype), t.numel);
  }
  TensorRef acquire_w(UnitProvider& p, std::size_t unit) {
    TensorRef t = p.acquire_weights(unit);
    require_unit(t, unit, wdt, "weights");
    return t;
  }
  TensorRef acquire_g(UnitProvider& p, std::size_t unit) {
    TensorRef t = p.acquire_grads(unit);
    require_unit(t, unit, DType::kF32, "gradients");
    return t;
  }

  // fp32 activations `x` (numel elements) as a GEMM operand: x itself in fp32 compute; in bf16
  // compute a bf16 copy, made once into `copy` and shared by every GEMM that reads x (the
  // forward's, and the dx and dW GEMMs of the backward).
  TensorRef operand(const float* x, i64 numel, Buffer& copy) {
    if (wdt == DType::kF32) return dev_tensor(dev, x, DType::kF32, numel);
    copy = dev.alloc(static_cast<std::size_t>(numel) * 2, &s);
    TensorRef t = tensor(copy, DType::kBF16, numel);
    s.cast(dev_tensor(dev, x, DType::kF32, numel), t);
    return t;
  }
  // The residual gradient g (= dres) as a GEMM operand in the Llama backward: its bf16 copy,
  // kept current by the RMSNorm backwards that write g, or g itself in fp32 compute.
  TensorRef g_operand(float* g) const {
    return dres_b ? tensor(dres_b, DType::kBF16, std::size_t(N * C))
                  : dev_tensor(dev, g, DType::kF32, N * C);
  }
  // The output projection's operand: o's bf16 copy (bf16 compute) or o itself.
  TensorRef o_operand(const Acts& a) const { return o_operand(a, N); }
  TensorRef o_operand(const Acts& a, i64 n) const {
    return a.ob ? tensor(a.ob, DType::kBF16, std::size_t(n * qd))
                : tensor(a.o, DType::kF32, std::size_t(n * qd));
  }
  // Activations read only as GEMM operands are kept in the compute dtype: kernels write them
  // so (model_ops::Out) and no cast pass is needed.
  Buffer oalloc(i64 numel) {
    return dev.alloc(static_cast<std::size_t>(numel) * dtype_size(wdt), &s);
  }
  model_ops::Out oout(const Buffer& b) const { return model_ops::Out{b.data(), wdt}; }
  TensorRef otensor(const Buffer& b, i64 numel) const {
    return tensor(b, wdt, static_cast<std::size_t>(numel));
  }
  // Rows [r0, r0 + rows) of a row-major operand of `cols` columns.
  static TensorRef rows_of(TensorRef t, i64 r0, i64 rows, i64 cols) {
    const std::size_t es = dtype_size(t.dtype);
    t.mem.ptr = static_cast<char*>(t.mem.ptr) + std::size_t(r0 * cols) * es;
    t.mem.bytes = std::size_t(rows * cols) * es;
    t.numel = std::size_t(rows * cols);
    return t;
  }

  // y[n, out] = beta * y + x[n, in] @ op(W); W stored [out, in] (out_in) or [in, out] (Conv1D).
  void linear(const TensorRef& x, Weight w, bool out_in, float* y, i64 n, i64 in, i64 out,
              float beta) {
    MatmulDesc d;
    d.m = n;
    d.n = out;
    d.k = in;
    d.trans_b = out_in;
    d.beta = beta;
    d.a = x;
    d.b = dev_tensor(dev, w.ptr, wdt, out * in);
    d.c = dev_tensor(dev, y, DType::kF32, n * out);
    s.matmul(d);
  }
  // dx[n, in] = beta * dx + dy[n, out] @ op(W)^T.
  void linear_dx(const TensorRef& dy, Weight w, bool out_in, float* dx, i64 n, i64 in, i64 out,
                 float beta) {
    MatmulDesc d;
    d.m = n;
    d.n = in;
    d.k = out;
    d.trans_b = !out_in;
    d.beta = beta;
    d.a = dy;
    d.b = dev_tensor(dev, w.ptr, wdt, out * in);
    d.c = dev_tensor(dev, dx, DType::kF32, n * in);
    s.matmul(d);
  }
  // dW += op(x^T dy): [out, in] = dy^T x, or [in, out] = x^T dy.
  void linear_dw(const TensorRef& tx, const TensorRef& tdy, float* dw, bool out_in, i64 n, i64 in,
                 i64 out) {
    MatmulDesc d;
    d.k = n;
    d.trans_a = true;
    d.beta = 1.0f;
    if (out_in) {
      d.m = out;
      d.n = in;
      d.a = tdy;
      d.b = tx;
    } else {
      d.m = in;
      d.n = out;
      d.a = tx;
      d.b = tdy;
    }
    d.c = dev_tensor(dev, dw, DType::kF32, out * in);
    s.matmul(d);
  }
  void copy_f(float* dst, const float* src, i64 numel) {
    s.copy(MemRef{dst, std::size_t(numel) * 4, MemSpace::kDevice, &dev},
           MemRef{const_cast<float*>(src), std::size_t(numel) * 4, MemSpace::kDevice, &dev});
  }

  // The rows a layer_forward runs: b x t of them (n), the first at position p0; with a key/value
  // cache (decode), the new rows' keys and values go into it and the queries attend over it.
  struct Span {
    i64 b, t, n, p0;
    float* k_cache;
    float* v_cache;
  };
  void attend(Acts& a, const Span& sp, double scale) {
    if (sp.k_cache) {
      model_ops::attention_cached(s, fptr(a.qkv), sp.k_cache, sp.v_cache, fptr(a.o), a.ob.data(),
                                  sp.n, sp.p0, nh, nkv, hd, scale, wdt);
    } else if (segs.empty()) {
      model_ops::attention_forward(s, fptr(a.qkv), fptr(a.o), a.ob.data(), fptr(a.lse), sp.b, sp.t,
                                   nh, nkv, hd, scale, wdt);
    } else {
      // Each document's lse rows sit at nh * r0: the segments tile [0, N nh) as the unpacked
      // [B, nh, T] layout tiles it, and the backward reads them from the same place.
      for (const Seg& g : segs)
        model_ops::attention_forward(
            s, fptr(a.qkv) + g.r0 * qkvd, fptr(a.o) + g.r0 * qd,
            a.ob ? static_cast<char*>(a.ob.data()) + std::size_t(g.r0 * qd) * 2 : nullptr,
            fptr(a.lse) + g.r0 * nh, g.rows, g.t, nh, nkv, hd, scale, wdt);
    }
  }
  void attend_backward(Acts& a, float* d_o, float* dqkv, double scale) {
    if (segs.empty()) {
      model_ops::attention_backward(s, fptr(a.qkv), fptr(a.o), d_o, fptr(a.lse), dqkv, B, T, nh,
                                    nkv, hd, scale, wdt);
      return;
    }
    for (const Seg& g : segs)
      model_ops::attention_backward(s, fptr(a.qkv) + g.r0 * qkvd, fptr(a.o) + g.r0 * qd,
                                    d_o + g.r0 * qd, fptr(a.lse) + g.r0 * nh, dqkv + g.r0 * qkvd,
                                    g.rows, g.t, nh, nkv, hd, scale, wdt);
  }
  // Rotary embedding of q's and k's heads of `x` (rows of qkvd), at the rows' positions: the
  // span's (from p0 on, row % t), or each packed document's from 0.
  void rotate(float* x, const Span& sp, bool inverse) {
    const i64 half = hd / 2;
    if (sp.k_cache || segs.empty()) {
      model_ops::rope(s, x, sp.n, sp.t, qkvd, 0, nh + nkv, hd, fptr(rope_cos) + sp.p0 * half,
                      fptr(rope_sin) + sp.p0 * half, inverse);
      return;
    }
    for (const Seg& g : segs)
      model_ops::rope(s, x + g.r0 * qkvd, g.rows * g.t, g.t, qkvd, 0, nh + nkv, hd, fptr(rope_cos),
                      fptr(rope_sin), inverse);
  }
  Span batch_span() const { return Span{B, T, N, 0, nullptr, nullptr}; }

  // ---- one decoder layer ----
  // Fills a (whose x is set) from the layer's weights w; returns the output when need_out.
  // `sp`: the rows it runs (the batch's, or decode()'s new rows with their key/value cache).
  Buffer layer_forward(Acts& a, const TensorRef& w, std::size_t unit, bool need_out) {
    return layer_forward(a, w, unit, need_out, batch_span());
  }
  Buffer layer_forward(Acts& a, const TensorRef& w, std::size_t unit, bool need_out,
                       const Span& sp) {
    const i64 B = sp.b, T = sp.t, N = sp.n;  // NOLINT: the rows of this call
    // SP (training, not decoding): the residual stream and the norms on this rank's Nr rows.
    const bool seq = seqp && !sp.k_cache;
    const i64 Nr = seq ? Nl : N;
    const float* x = fptr(a.x);
    const double scale = attn_scale(unit);
    a.h1 = oalloc(Nr * C);
    a.qkv = falloc(N * qkvd);
    a.o = falloc(N * qd);
    if (!sp.k_cache) a.lse = falloc(B * nh * T);
    a.xm = falloc(Nr * C);
    a.h2 = oalloc(Nr * C);
    if (wdt == DType::kBF16) a.ob = dev.alloc(static_cast<std::size_t>(N * qd) * 2, &s);
    a.n1b = falloc(Nr);
    a.n2b = falloc(Nr);
    Buffer y, h1g, h2g;  // SP: the norms' outputs, all N rows (for this call's GEMMs only)
    if (gpt2) {
      // ln_1.w ln_1.b c_attn.w c_attn.b attn.c_proj.w attn.c_proj.b ln_2.w ln_2.b c_fc.w c_fc.b
      // c_proj.w c_proj.b
      auto P = [&](std::size_t i) { return param(w, unit, i); };
      a.n1a = falloc(Nr);
      a.n2a = falloc(Nr);
      a.fc = falloc(N * I);
      a.act = oalloc(N * I);
      model_ops::layernorm_forward(s, x, P(0), P(1), oout(a.h1), fptr(a.n1a), fptr(a.n1b), Nr, C,
                                   cfg.norm_eps);
      linear(gathered(a.h1, seq, h1g, N), P(2), false, fptr(a.qkv), N, C, qkvd, 0.0f);
      model_ops::bias_add(s, fptr(a.qkv), P(3), N, qkvd);
      attend(a, sp, scale);
      row_parallel(o_operand(a, N), P(4), false, fptr(a.xm), x, N, qd, C, seq);
      model_ops::bias_add(s, fptr(a.xm), P(5), Nr, C);
      model_ops::layernorm_forward(s, fptr(a.xm), P(6), P(7), oout(a.h2), fptr(a.n2a), fptr(a.n2b),
                                   Nr, C, cfg.norm_eps);
      linear(gathered(a.h2, seq, h2g, N), P(8), false, fptr(a.fc), N, C, I, 0.0f);
      model_ops::bias_add(s, fptr(a.fc), P(9), N, I);
      model_ops::gelu_forward(s, fptr(a.fc), oout(a.act), N * I);
      const TensorRef act = otensor(a.act, N * I);
      if (need_out) {
        y = falloc(Nr * C);
        row_parallel(act, P(10), false, fptr(y), fptr(a.xm), N, I, C, seq);
        model_ops::bias_add(s, fptr(y), P(11), Nr, C);
      }
    } else {
      const LlamaIdx ix = llama_idx();
      auto P = [&](std::size_t i) { return param(w, unit, i); };
      a.fc = falloc(N * 2 * I);
      a.act = oalloc(N * I);
      model_ops::rmsnorm_forward(s, x, P(ix.in_norm), oout(a.h1), fptr(a.n1b), Nr, C, cfg.norm_eps);
      linear(gathered(a.h1, seq, h1g, N), P(ix.q), true, fptr(a.qkv), N, C, qkvd, 0.0f);
      if (cfg.qkv_bias) model_ops::bias_add(s, fptr(a.qkv), P(ix.qb), N, qkvd);
      // q's heads and then k's are consecutive columns: one pass rotates both.
      rotate(fptr(a.qkv), sp, false);
      attend(a, sp, scale);
      row_parallel(o_operand(a, N), P(ix.o), true, fptr(a.xm), x, N, qd, C, seq);
      if (cfg.o_bias) model_ops::bias_add(s, fptr(a.xm), P(ix.ob), Nr, C);
      model_ops::rmsnorm_forward(s, fptr(a.xm), P(ix.post_norm), oout(a.h2), fptr(a.n2b), Nr, C,
                                 cfg.norm_eps);
      linear(gathered(a.h2, seq, h2g, N), P(ix.gate), true, fptr(a.fc), N, C, 2 * I, 0.0f);
      model_ops::swiglu_forward(s, fptr(a.fc), oout(a.act), N, I);
      const TensorRef act = otensor(a.act, N * I);
      if (need_out) {
        y = falloc(Nr * C);
        row_parallel(act, P(ix.down), true, fptr(y), fptr(a.xm), N, I, C, seq);
      }
    }
    return y;
  }

  // g (grad of the layer's output) becomes the grad of its input, in place. Under SP g, the
  // residual stream and the norms are this rank's Nl rows: g is all-gathered for the row-parallel
  // layers' backward, the column-parallel layers' input gradients reduce-scattered back to Nl rows
  // (instead of all-reduced), the norms' outputs gathered again for the weight gradients, and the
  // replicated parameters' gradients (parts from each rank's rows) summed over TP.
  void layer_backward(Acts& a, const TensorRef& w, const TensorRef& gw, std::size_t unit,
                      float* g) {
    const float* x = fptr(a.x);
    const double scale = attn_scale(unit);
    const i64 Nr = Nl;  // the rows of g and the norms (N without SP)
    auto P = [&](std::size_t i) { return param(w, unit, i); };
    auto G = [&](std::size_t i) { return gparam(gw, unit, i); };
    Buffer dact = falloc(N * I);
    Buffer dh = falloc(N * C);
    Buffer dh_rows = seqp ? falloc(Nr * C) : Buffer{};  // SP: this rank's rows of dh, summed
    float* dhr = seqp ? fptr(dh_rows) : fptr(dh);
    Buffer dqkv = falloc(N * qkvd);
    Buffer d_o = falloc(N * qd);
    // The column-parallel layer's input gradient in dh, summed over TP into dhr.
    auto sum_dh = [&] {
      if (seqp)
        scatter_rows(fptr(dh), dhr, C);
      else
        tp_sum(fptr(dh), N * C);
    };
    // g, all N rows, as a GEMM operand (SP: gathered; its bf16 copy where the norm kept one).
    auto g_rows = [&](Buffer& full, Buffer& copy) -> TensorRef {
      if (!seqp) return gpt2 ? operand(g, N * C, copy) : g_operand(g);
      if (!gpt2 && dres_b) {
        full = gather_rows(dres_b.data(), DType::kBF16, C);
        return tensor(full, DType::kBF16, std::size_t(N * C));
      }
      full = gather_rows(g, DType::kF32, C);
      return operand(fptr(full), N * C, copy);
    };
    Buffer h1g, h2g;
    if (gpt2) {
      Buffer dfc = falloc(N * I);
      {
        Buffer full, copy;
        const TensorRef gop = g_rows(full, copy);
        linear_dx(gop, P(10), false, fptr(dact), N, I, C, 0.0f);
        linear_dw(otensor(a.act, N * I), gop, G(10), false, N, I, C);
      }
      model_ops::bias_backward(s, g, rep_grad(G(11), C), Nr, C);
      model_ops::gelu_backward(s, fptr(dact), fptr(a.fc), fptr(dfc), N * I);
      {
        Buffer copy;
        const TensorRef dfcop = operand(fptr(dfc), N * I, copy);
        linear_dx(dfcop, P(8), false, fptr(dh), N, C, I, 0.0f);
        sum_dh();
        linear_dw(gathered(a.h2, seqp, h2g, N), dfcop, G(8), false, N, C, I);
      }
      model_ops::bias_backward(s, fptr(dfc), G(9), N, I);
      model_ops::layernorm_backward(s, dhr, fptr(a.xm), P(6), fptr(a.n2a), fptr(a.n2b), g,
                                    rep_grad(G(6), C), rep_grad(G(7), C), Nr, C);
      {
        Buffer full, copy;
        const TensorRef gop = g_rows(full, copy);
        linear_dx(gop, P(4), false, fptr(d_o), N, qd, C, 0.0f);
        linear_dw(o_operand(a), gop, G(4), false, N, qd, C);
      }
      model_ops::bias_backward(s, g, rep_grad(G(5), C), Nr, C);
      attend_backward(a, fptr(d_o), fptr(dqkv), scale);
      model_ops::bias_backward(s, fptr(dqkv), G(3), N, qkvd);
      {
        Buffer copy;
        const TensorRef dqkvop = operand(fptr(dqkv), N * qkvd, copy);
        linear_dx(dqkvop, P(2), false, fptr(dh), N, C, qkvd, 0.0f);
        sum_dh();
        linear_dw(gathered(a.h1, seqp, h1g, N), dqkvop, G(2), false, N, C, qkvd);
      }
      model_ops::layernorm_backward(s, dhr, x, P(0), fptr(a.n1a), fptr(a.n1b), g, rep_grad(G(0), C),
                                    rep_grad(G(1), C), Nr, C);
    } else {
      const LlamaIdx ix = llama_idx();
      Buffer dgu = oalloc(N * 2 * I);
      {
        Buffer full, copy;
        const TensorRef gop = g_rows(full, copy);
        linear_dx(gop, P(ix.down), true, fptr(dact), N, I, C, 0.0f);
        linear_dw(otensor(a.act, N * I), gop, G(ix.down), true, N, I, C);
      }
      // dgu is read only by the two GEMMs: written in the compute dtype.
      model_ops::swiglu_backward(s, fptr(dact), fptr(a.fc), oout(dgu), N, I);
      linear_dx(otensor(dgu, N * 2 * I), P(ix.gate), true, fptr(dh), N, C, 2 * I, 0.0f);
      sum_dh();
      linear_dw(gathered(a.h2, seqp, h2g, N), otensor(dgu, N * 2 * I), G(ix.gate), true, N, C,
                2 * I);
      h2g.reset();
      model_ops::rmsnorm_backward(s, dhr, fptr(a.xm), P(ix.post_norm), fptr(a.n2b), g,
                                  rep_grad(G(ix.post_norm), C), Nr, C, dres_b.data());
      if (cfg.o_bias) model_ops::bias_backward(s, g, rep_grad(G(ix.ob), C), Nr, C);
      {
        Buffer full, copy;
        const TensorRef gop = g_rows(full, copy);
        linear_dx(gop, P(ix.o), true, fptr(d_o), N, qd, C, 0.0f);
        linear_dw(o_operand(a), gop, G(ix.o), true, N, qd, C);
      }
      attend_backward(a, fptr(d_o), fptr(dqkv), scale);
      rotate(fptr(dqkv), batch_span(), true);
      if (cfg.qkv_bias) model_ops::bias_backward(s, fptr(dqkv), G(ix.qb), N, qkvd);
      {
        Buffer copy;
        const TensorRef dqkvop = operand(fptr(dqkv), N * qkvd, copy);
        linear_dx(dqkvop, P(ix.q), true, fptr(dh), N, C, qkvd, 0.0f);
        sum_dh();
        linear_dw(gathered(a.h1, seqp, h1g, N), dqkvop, G(ix.q), true, N, C, qkvd);
      }
      model_ops::rmsnorm_backward(s, dhr, x, P(ix.in_norm), fptr(a.n1b), g,
                                  rep_grad(G(ix.in_norm), C), Nr, C, dres_b.data());
    }
    flush_rep_grads();
  }

  // Indices of a Llama layer's parameters in its UnitSpec (q/k/v and o biases shift the rest).
  struct LlamaIdx {
    std::size_t in_norm = 0, q = 1, qb = 0, o, ob = 0, post_norm, gate, down;
  };
  LlamaIdx llama_idx() const {
    LlamaIdx ix;
    std::size_t next = 4;  // after in_norm, q, k, v
    if (cfg.qkv_bias) {
      ix.qb = next;
      next += 3;
    }
    ix.o = next++;
    if (cfg.o_bias) ix.ob = next++;
    ix.post_norm = next;
    ix.gate = next + 1;
    ix.down = next + 3;  // after gate, up
    return ix;
  }

  // The attention score scale of decoder layer `unit` (1..L), as Hugging Face computes it.
  double attn_scale(std::size_t unit) const {
    double sc = !gpt2 || cfg.scale_attn_weights ? 1.0 / std::sqrt(double(hd)) : 1.0;
    if (gpt2 && cfg.scale_attn_by_inverse_layer_idx)
      sc /= double(unit);  // layer index unit - 1, plus 1
    return sc;
  }

  // `ignore_ok`: kIgnoreTarget is allowed too (targets).
  void check_ids(const std::vector<std::int32_t>& ids, const char* what,
                 bool ignore_ok = false) const {
    STRATA_REQUIRE(
        static_cast<i64>(ids.size()) == N,
        "Model: batch.{} has {} ids; the model was built for micro_batch {} x seq_len {} = {}",
        what, ids.size(), B, T, N);
    for (std::size_t i = 0; i < ids.size(); ++i)
      STRATA_REQUIRE((ids[i] >= 0 && ids[i] < Vfull) || (ignore_ok && ids[i] == kIgnoreTarget),
                     "Model: batch.{}[{}] = {} is outside the vocabulary [0, {}){}", what, i,
                     ids[i], Vfull,
                     ignore_ok ? " (a target that must not count is kIgnoreTarget, -100)" : "");
  }

  // Batch::positions checked and cut into documents (segs); empty positions: unpacked.
  // Positions stay below T (each row starts at 0 and steps by 1), so within the rotary tables and,
  // for GPT-2, within n_positions (T <= n_positions is checked at construction).
  void set_positions(const std::vector<std::int32_t>& pos) {
    segs.clear();
    if (pos.empty()) return;
    STRATA_REQUIRE(static_cast<i64>(pos.size()) == N,
                   "Model: batch.positions has {} entries; give none (each row one document) or "
                   "one per token: micro_batch {} x seq_len {} = {}",
                   pos.size(), B, T, N);
    std::vector<Seg> out;
    auto add = [&](i64 r0, i64 len) {
      if (len == T && !out.empty() && out.back().t == T &&
          out.back().r0 + out.back().rows * T == r0)
        ++out.back().rows;
      else
        out.push_back(Seg{r0, 1, len});
    };
    for (i64 b = 0; b < B; ++b) {
      const std::int32_t* p = pos.data() + b * T;
      STRATA_REQUIRE(p[0] == 0,
                     "Model: batch.positions[{}] = {}: row {} must start a document (position 0); "
                     "a document cut at a row's end goes on at 0 in the next row",
                     b * T, p[0], b);
      i64 start = 0;
      for (i64 t = 1; t <= T; ++t) {
        if (t < T)
          STRATA_REQUIRE(p[t] == 0 || p[t] == p[t - 1] + 1,
                         "Model: batch.positions[{}] = {} after {}: a position is 0 (a document "
                         "starts) or the previous one + 1",
                         b * T + t, p[t], p[t - 1]);
        if (t == T || p[t] == 0) {
          add(b * T + start, t - start);
          start = t;
        }
      }
    }
    segs = std::move(out);
  }

  // Copies from model-owned host memory: a copy still queued when the caller's batch goes
  // away (an exception later in forward) must not read freed memory. Every forward ends
  // synchronized, so the staging is free again by the next call.
  void upload_ids(const std::vector<std::int32_t>& ids, Buffer& dst, const char* what) {
    check_ids(ids, what, &dst == &targets);
    std::vector<std::int32_t>& staging = &dst == &tokens ? tokens_host : targets_host;
    staging = ids;
    localize(staging);
    s.copy(dst.ref(), host_ref(staging.data(), staging.size() * 4));
  }

  MemRef ckpt_slice(i64 l) const {
    const std::size_t bytes = static_cast<std::size_t>(Nl * C) * 4;  // a layer's input rows
    return ckpt_store.ref(static_cast<std::size_t>(l) * bytes, bytes);
  }

  // Embeddings and decoder layers; returns the last layer's output. Keeps activations when grad.
  Buffer run_trunk(UnitProvider& p, bool grad) {
    const bool device_ckpt = grad && opt.checkpoint && !opt.checkpoint_on_host;
    ckpt_store.reset();
    if (device_ckpt) ckpt_store = falloc(L * Nl * C);
    Buffer x = falloc(N * C);
    {
      const TensorRef w0 = acquire_w(p, 0);
      // Under TP the rows are summed over the group: the position rows come from TP rank 0 only.
      const Weight wpe = gpt2 && tpl.rank == 0 ? param(w0, 0, 1) : Weight{};
      const auto* ids = static_cast<const std::int32_t*>(tokens.data());
      if (wpe && !segs.empty()) {  // each document's rows from wpe's row 0
        for (const Seg& g : segs)
          model_ops::embedding_forward(s, ids + g.r0, param(w0, 0, 0), wpe, fptr(x) + g.r0 * C,
                                       g.rows * g.t, g.t, C);
      } else {
        model_ops::embedding_forward(s, ids, param(w0, 0, 0), wpe, fptr(x), N, T, C);
      }
      if (seqp) {  // summed over the vocabulary's shards, this rank's rows kept
        Buffer rows = falloc(Nl * C);
        scatter_rows(fptr(x), fptr(rows), C);
        x = std::move(rows);
      } else {
        tp_sum(fptr(x), N * C);
      }
      p.release_weights(0);
    }
    for (i64 l = 0; l < L; ++l) {
      const std::size_t unit = static_cast<std::size_t>(l + 1);
      Acts& a = acts[l];
      a = Acts{};
      a.x = std::move(x);
      const TensorRef w = acquire_w(p, unit);
      x = layer_forward(a, w, unit, true);
      p.release_weights(unit);
      if (!grad) {
        a = Acts{};
      } else if (opt.checkpoint) {
        a.drop_all_but_input();
        if (device_ckpt) {
          s.copy(ckpt_slice(l), a.x.ref());
          a.x.reset();
        } else if (opt.checkpoint_on_host) {
          auto& h = host_ckpt[static_cast<std::size_t>(l)];
          h.resize(static_cast<std::size_t>(Nl * C));
          s.copy(host_ref(h.data(), h.size() * 4), a.x.ref());
          a.x.reset();
        }
      }
    }
    return x;
  }

  // The final norm of the head unit: out, and its saved statistics.
  void final_norm(const TensorRef& wh, const float* x, model_ops::Out out, float* st_a, float* st_b,
                  i64 rows = -1) {
    const i64 n = rows < 0 ? N : rows;
    if (gpt2)
      model_ops::layernorm_forward(s, x, param(wh, L + 1, 0), param(wh, L + 1, 1), out, st_a, st_b,
                                   n, C, cfg.norm_eps);
    else
      model_ops::rmsnorm_forward(s, x, param(wh, L + 1, 0), out, st_b, n, C, cfg.norm_eps);
  }

  Weight head_weight(const TensorRef& wh, const TensorRef& w0) const {
    return cfg.tie_word_embeddings ? param(w0, 0, 0) : param(wh, L + 1, 1);
  }

  float forward(const Batch& batch, UnitProvider& p, bool grad, double loss_denominator) {
    check_ids(batch.tokens, "tokens");
    check_ids(batch.targets, "targets", true);
    STRATA_REQUIRE(std::isfinite(loss_denominator) && loss_denominator >= 0,
                   "Model::forward: loss_denominator {} must be > 0 (the step's counted targets "
                   "over its micro-batches), or 0 for this batch's own",
                   loss_denominator);
    const double den = loss_denominator > 0 ? loss_denominator : double(counted_targets(batch));
    STRATA_REQUIRE(den > 0,
                   "Model::forward: every target of the batch is kIgnoreTarget (-100), so its mean "
                   "loss has no token to average over: give the batch a target that counts, or, "
                   "for one micro-batch of a step, pass loss_denominator (the step's counted "
                   "targets)");
    set_positions(batch.positions);
    upload_ids(batch.tokens, tokens, "tokens");
    upload_ids(batch.targets, targets, "targets");
    Buffer x = run_trunk(p, grad);
    const std::size_t hu = static_cast<std::size_t>(L + 1);
    const TensorRef wh = acquire_w(p, hu);
    const TensorRef w0 = cfg.tie_word_embeddings ? acquire_w(p, 0) : TensorRef{};
    // hf: the head's operand (SP: the final norm on this rank's rows, then all N rows gathered)
    Buffer hf = oalloc(Nl * C), st_a = falloc(Nl), st_b = falloc(Nl), hfg;
    final_norm(wh, fptr(x), oout(hf), fptr(st_a), fptr(st_b), Nl);
    const Weight whead = head_weight(wh, w0);
    Buffer losses = falloc(N);
    Buffer dhf;
    TensorRef gh;
    float* dwh = nullptr;
    if (grad) {
      dhf = falloc(N * C);
      gh = acquire_g(p, hu);
      if (cfg.tie_word_embeddings) {
        tied_grad = falloc(V * C);
        s.fill(tensor(tied_grad, DType::kF32), 0.0f);
        dwh = fptr(tied_grad);
      } else {
        dwh = gparam(gh, hu, 1);
      }
    }
    const i64 chunk = loss_chunk();
    Buffer logits = falloc(std::min(chunk, N) * V);
    // TP: each chunk row's (log-sum-exp, target logit) here, then every rank's.
    Buffer stats = tp ? falloc(std::min(chunk, N) * 2) : Buffer{};
    Buffer stats_all = tp ? falloc(tpl.size * std::min(chunk, N) * 2) : Buffer{};
    // bf16 compute: the loss kernel writes the logits' gradient straight as the GEMMs' operand.
    Buffer dlogits_b = grad && wdt == DType::kBF16
                           ? dev.alloc(std::size_t(std::min(chunk, N) * V) * 2, &s)
                           : Buffer{};
    const TensorRef hfop = gathered(hf, seqp, hfg, N);
    for (i64 r0 = 0; r0 < N; r0 += chunk) {
      const i64 rows = std::min(chunk, N - r0);
      const TensorRef hrows = rows_of(hfop, r0, rows, C);
      linear(hrows, whead, true, fptr(logits), rows, C, V, 0.0f);
      const auto* trows = static_cast<const std::int32_t*>(targets.data()) + r0;
      const model_ops::Out gout =
          dlogits_b ? model_ops::Out{dlogits_b.data(), DType::kBF16} : model_ops::Out{fptr(logits)};
      if (tp) {
        model_ops::cross_entropy_stats(s, fptr(logits), trows, fptr(stats), rows, V);
        tp_gather(stats, stats_all, rows * 2);
        model_ops::cross_entropy_finish(s, fptr(logits), trows, fptr(stats_all), tpl.size,
                                        fptr(losses) + r0, rows, V, grad ? 1.0 / den : 0.0, gout);
      } else {
        model_ops::cross_entropy(s, fptr(logits), trows, fptr(losses) + r0, rows, V,
                                 grad ? 1.0 / den : 0.0, gout);
      }
      if (grad) {
        const TensorRef dlogits = dlogits_b ? tensor(dlogits_b, DType::kBF16, std::size_t(rows * V))
                                            : tensor(logits, DType::kF32, std::size_t(rows * V));
        linear_dx(dlogits, whead, true, fptr(dhf) + r0 * C, rows, C, V, 0.0f);
        linear_dw(hrows, dlogits, dwh, true, rows, C, V);
      }
    }
    if (grad) {
      // The head is column-parallel: its input gradient summed over TP (SP: this rank's rows).
      if (seqp) {
        Buffer rows = falloc(Nl * C);
        scatter_rows(fptr(dhf), fptr(rows), C);
        dhf = std::move(rows);
      } else {
        tp_sum(fptr(dhf), N * C);
      }
      dres = falloc(Nl * C);
      if (wdt == DType::kBF16 && !gpt2)
        dres_b = dev.alloc(static_cast<std::size_t>(Nl * C) * 2, &s);
      s.fill(tensor(dres, DType::kF32), 0.0f);
      if (gpt2)
        model_ops::layernorm_backward(s, fptr(dhf), fptr(x), param(wh, hu, 0), fptr(st_a),
                                      fptr(st_b), fptr(dres), rep_grad(gparam(gh, hu, 0), C),
                                      rep_grad(gparam(gh, hu, 1), C), Nl, C);
      else
        model_ops::rmsnorm_backward(s, fptr(dhf), fptr(x), param(wh, hu, 0), fptr(st_b), fptr(dres),
                                    rep_grad(gparam(gh, hu, 0), C), Nl, C, dres_b.data());
      flush_rep_grads();
      p.release_grads(hu);
    }
    if (cfg.tie_word_embeddings) p.release_weights(0);
    p.release_weights(hu);
    host_losses.resize(static_cast<std::size_t>(N));
    s.copy(host_ref(host_losses.data(), host_losses.size() * 4), losses.ref());
    s.synchronize();
    have_grad = grad;
    double sum = 0;
    for (float l : host_losses) sum += l;  // an ignored target's is 0
    return static_cast<float>(sum / den);
  }

  void backward(UnitProvider& p) {
    STRATA_REQUIRE(have_grad, "Model::backward: call forward(batch, weights, /*grad=*/true) first");
    have_grad = false;
    for (i64 l = L - 1; l >= 0; --l) {
      const std::size_t unit = static_cast<std::size_t>(l + 1);
      Acts& a = acts[l];
      const TensorRef w = acquire_w(p, unit);
      if (opt.checkpoint) {
        if (opt.checkpoint_on_host) {
          const auto& h = host_ckpt[static_cast<std::size_t>(l)];
          a.x = falloc(Nl * C);
          s.copy(a.x.ref(), host_ref(h.data(), h.size() * 4));
        } else {
          a.x = falloc(Nl * C);
          s.copy(a.x.ref(), ckpt_slice(l));
        }
        layer_forward(a, w, unit, false);
      }
      const TensorRef gw = acquire_g(p, unit);
      layer_backward(a, w, gw, unit, fptr(dres));
      p.release_grads(unit);
      p.release_weights(unit);
      a = Acts{};
    }
    const TensorRef g0 = acquire_g(p, 0);
    const auto* ids = static_cast<const std::int32_t*>(tokens.data());
    if (seqp) dres = gather_rows(fptr(dres), DType::kF32, C);  // the embedding's: all N rows
    if (gpt2 && !segs.empty()) {
      for (const Seg& g : segs)
        model_ops::embedding_backward(s, ids + g.r0, fptr(dres) + g.r0 * C, gparam(g0, 0, 0),
                                      gparam(g0, 0, 1), g.rows * g.t, g.t, C);
    } else {
      model_ops::embedding_backward(s, ids, fptr(dres), gparam(g0, 0, 0),
                                    gpt2 ? gparam(g0, 0, 1) : nullptr, N, T, C);
    }
    if (cfg.tie_word_embeddings)
      s.axpy(1.0f, tensor(tied_grad, DType::kF32),
             dev_tensor(dev, gparam(g0, 0, 0), DType::kF32, V * C));
    p.release_grads(0);
    tied_grad.reset();
    dres.reset();
    dres_b.reset();
    ckpt_store.reset();
  }

  // ---- decoding with a key/value cache (one sequence) ----
  std::vector<Buffer> k_cache, v_cache;  // per layer [T, kvd], fp32
  i64 dec_len = 0;                       // positions in the cache
  Buffer dec_tokens;
  std::vector<std::int32_t> dec_tokens_host;

  std::vector<float> decode(const std::vector<std::int32_t>& ids, UnitProvider& p) {
    const i64 n = static_cast<i64>(ids.size());
    STRATA_REQUIRE(n > 0, "Model::decode: no tokens given");
    STRATA_REQUIRE(dec_len + n <= T,
                   "Model::decode: {} more positions after {} exceed the model's context of {} "
                   "(ModelOptions::seq_len): reset_decode(), or build the model with a longer "
                   "seq_len",
                   n, dec_len, T);
    for (std::size_t i = 0; i < ids.size(); ++i)
      STRATA_REQUIRE(ids[i] >= 0 && ids[i] < Vfull,
                     "Model::decode: token {} = {} is outside the vocabulary [0, {})", i, ids[i],
                     Vfull);
    if (k_cache.empty())
      for (i64 l = 0; l < L; ++l) {
        k_cache.push_back(falloc(T * kvd));
        v_cache.push_back(falloc(T * kvd));
      }
    s.synchronize();  // the staging below may still be read by the last call's copy
    dec_tokens_host = ids;
    localize(dec_tokens_host);
    dec_tokens = dev.alloc(std::size_t(n) * 4, &s);
    s.copy(dec_tokens.ref(), host_ref(dec_tokens_host.data(), std::size_t(n) * 4));
    Buffer x = falloc(n * C);
    {
      const TensorRef w0 = acquire_w(p, 0);
      Weight wpe{};
      if (gpt2 && tpl.rank == 0) {  // the rows' positions: dec_len on (TP: rank 0's rows only)
        wpe = param(w0, 0, 1);
        wpe.ptr = static_cast<const char*>(wpe.ptr) + std::size_t(dec_len * C) * dtype_size(wdt);
      }
      model_ops::embedding_forward(s, static_cast<const std::int32_t*>(dec_tokens.data()),
                                   param(w0, 0, 0), wpe, fptr(x), n, n, C);
      tp_sum(fptr(x), n * C);
      p.release_weights(0);
    }
    for (i64 l = 0; l < L; ++l) {
      const std::size_t unit = static_cast<std::size_t>(l + 1);
      Acts a;
      a.x = std::move(x);
      const TensorRef w = acquire_w(p, unit);
      x = layer_forward(
          a, w, unit, true,
          Span{1, n, n, dec_len, fptr(k_cache[std::size_t(l)]), fptr(v_cache[std::size_t(l)])});
      p.release_weights(unit);
    }
    // The head on the last row only.
    const std::size_t hu = static_cast<std::size_t>(L + 1);
    const TensorRef wh = acquire_w(p, hu);
    const TensorRef w0 = cfg.tie_word_embeddings ? acquire_w(p, 0) : TensorRef{};
    Buffer hf = oalloc(C), st_a = falloc(1), st_b = falloc(1), out = falloc(V);
    final_norm(wh, fptr(x) + (n - 1) * C, oout(hf), fptr(st_a), fptr(st_b), 1);
    linear(otensor(hf, C), head_weight(wh, w0), true, fptr(out), 1, C, V, 0.0f);
    if (cfg.tie_word_embeddings) p.release_weights(0);
    p.release_weights(hu);
    std::vector<float> host = full_logits(out, 1);
    dec_len += n;
    return host;
  }

  void reset_decode() {
    s.synchronize();
    k_cache.clear();
    v_cache.clear();
    dec_tokens.reset();
    dec_len = 0;
  }

  std::vector<float> logits(const std::vector<std::int32_t>& ids, UnitProvider& p) {
    segs.clear();  // unpacked rows
    upload_ids(ids, tokens, "tokens");
    Buffer x = run_trunk(p, false);
    const std::size_t hu = static_cast<std::size_t>(L + 1);
    const TensorRef wh = acquire_w(p, hu);
    const TensorRef w0 = cfg.tie_word_embeddings ? acquire_w(p, 0) : TensorRef{};
    Buffer hf = oalloc(Nl * C), st_a = falloc(Nl), st_b = falloc(Nl), out = falloc(N * V), hfg;
    final_norm(wh, fptr(x), oout(hf), fptr(st_a), fptr(st_b), Nl);
    linear(gathered(hf, seqp, hfg, N), head_weight(wh, w0), true, fptr(out), N, C, V, 0.0f);
    if (cfg.tie_word_embeddings) p.release_weights(0);
    p.release_weights(hu);
    return full_logits(out, N);
  }
};

Model::Model(const ModelConfig& cfg, Device& device, Stream& stream, const ModelOptions& options)
    : impl_(std::make_unique<Impl>(cfg, device, stream, options)) {}
Model::~Model() {
  // Queued work may still read buffers the host-side members own (host checkpoints). A
  // failure inside that work was the caller's to see at their synchronize; not rethrown here.
  try {
    impl_->s.synchronize();
  } catch (const Error&) {
  }
}

const ModelConfig& Model::config() const { return impl_->cfg; }
const ModelOptions& Model::options() const { return impl_->opt; }
const std::vector<UnitSpec>& Model::units() const { return impl_->units; }
TensorParallel Model::tensor_parallel() const { return impl_->tpl; }
Model::TpTraffic Model::tp_traffic() const { return impl_->traffic; }

std::uint64_t host_checkpoint_bytes(const ModelConfig& cfg, std::int64_t micro_batch,
                                    std::int64_t seq_len, int sequence_parallel_ranks) {
  const std::uint64_t rows = std::uint64_t(micro_batch) * std::uint64_t(seq_len) /
                             std::uint64_t(std::max(1, sequence_parallel_ranks));
  return std::uint64_t(cfg.num_layers) * rows * std::uint64_t(cfg.hidden_size) * 4;
}

std::size_t num_params(const std::vector<UnitSpec>& units) {
  std::size_t n = 0;
  for (const auto& u : units)
    for (const auto& p : u.params) n += p.numel;
  return n;
}

std::size_t Model::num_params() const { return strata::num_params(impl_->units); }

double Model::flops_per_step() const {
  const Impl& m = *impl_;
  // Matmul weights every token passes through (the head once, even when tied).
  const double per_layer =
      double(m.C) * m.qkvd + double(m.qd) * m.C + double(m.C) * m.I * (m.gpt2 ? 2 : 3);
  const double matmul_params = per_layer * m.L + double(m.C) * m.V;
  const double attn =
      2.0 * 2.0 * m.L * double(m.T) * m.T / 2 * m.qd * m.B;  // QK^T and PV, causal half
  return 6.0 * matmul_params * double(m.N) + 3.0 * attn;
}

// The shapes linear(), linear_dx() and linear_dw() give Stream::matmul (keep in step with them
// and with the layers and the head above).
std::vector<Model::GemmShape> Model::gemm_shapes() const {
  const Impl& m = *impl_;
  std::vector<GemmShape> out;
  auto add = [&](const std::string& name, i64 n, i64 in, i64 out_dim, bool out_in, i64 count,
                 bool fwd_again) {
    out.push_back({name + " forward", n, out_dim, in, false, out_in, count, false});
    if (fwd_again)
      out.push_back({name + " forward (recompute)", n, out_dim, in, false, out_in, count, true});
    out.push_back({name + " dx", n, in, out_dim, false, !out_in, count, false});
    if (out_in)
      out.push_back({name + " dw", out_dim, in, n, true, false, count, false});
    else
      out.push_back({name + " dw", in, out_dim, n, true, false, count, false});
  };
  const bool ckpt = m.opt.checkpoint;
  const bool out_in = !m.gpt2;
  // A recomputed layer runs every linear but the last (its output is not needed).
  add(m.gpt2 ? "attn c_attn" : "q|k|v", m.N, m.C, m.qkvd, out_in, m.L, ckpt);
  add(m.gpt2 ? "attn c_proj" : "o", m.N, m.qd, m.C, out_in, m.L, ckpt);
  add(m.gpt2 ? "mlp c_fc" : "mlp gate|up", m.N, m.C, m.gpt2 ? m.I : 2 * m.I, out_in, m.L, ckpt);
  add(m.gpt2 ? "mlp c_proj" : "mlp down", m.N, m.I, m.C, out_in, m.L, false);
  const i64 chunk = m.loss_chunk();
  if (m.N / chunk > 0) add("lm head", chunk, m.C, m.V, true, m.N / chunk, false);
  if (m.N % chunk > 0) add("lm head (last chunk)", m.N % chunk, m.C, m.V, true, 1, false);
  return out;
}

float Model::forward(const Batch& batch, UnitProvider& weights, bool grad,
                     double loss_denominator) {
  return impl_->forward(batch, weights, grad, loss_denominator);
}

std::int64_t counted_targets(const Batch& batch) {
  std::int64_t n = 0;
  for (std::int32_t t : batch.targets) n += t != kIgnoreTarget;
  return n;
}
void Model::backward(UnitProvider& weights) { impl_->backward(weights); }
std::vector<float> Model::logits(const std::vector<std::int32_t>& tokens, UnitProvider& weights) {
  return impl_->logits(tokens, weights);
}
std::vector<float> Model::decode(const std::vector<std::int32_t>& tokens, UnitProvider& weights) {
  return impl_->decode(tokens, weights);
}
void Model::reset_decode() { impl_->reset_decode(); }
std::int64_t Model::decode_length() const { return impl_->dec_len; }

}  // namespace strata
