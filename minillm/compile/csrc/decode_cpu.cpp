// The whole batch-1 decode step of a GPT-2 model in one C++ call, for the CPU: what llama.cpp does, written plainly.
// One version. Per token, in order, with no call back into PyTorch:
//   x = wte[token] + wpe[pos]                                      (C)
//   for each block:
//     h = layernorm(x)                                              (C)
//     q, k, v = h W_attn^T + b                                      (3 x A), GEMV of gemv_cpu.cpp (float or int8)
//     k, v written at slot `start` of this layer's cache            (1, nh, max_len, hs), in place
//     per head: softmax(q . K[0..start] / sqrt(hs)) . V[0..start]   (A), two passes over the kept slots
//     x += y W_proj^T + b                                           (C)
//     x += gelu_tanh(layernorm(x) W_fc^T + b) W_mproj^T + b         (H -> C)
//   logits = layernorm(x) W_head^T                                  (V), the tied embedding
// Why it exists: chapter 13's profile shows a batch-1 step of `base` spending more time between the matrix products
// (about 150 PyTorch operator calls, each a few microseconds of dispatch and allocation) than in them. Here the step
// is one call from Python; the products run the same GEMV as FastLinear and the rest is a few plain loops over
// buffers allocated once. What it leaves out: batches (the engine keeps FastLinear), several threads, other dtypes.
// int8 and int4: each of a block's four linears may instead hold chapter 09's weight-only int8 codes (N, K) with one
// float scale per output row, or its symmetric group-wise int4 codes packed two per byte (N, K/2) uint8 with one
// scale per row and group (N, groups) (`scales`, one entry per linear, empty for a float32 one). That linear then
// runs the int8 GEMV (small_gemm_q8), a quarter of the bytes, or the int4 one (small_gemm_q4), an eighth; everything
// else, the embeddings and the tied head included, stays float32. Its twin is then the quantized model's own
// forward (QuantLinear).
// Reference twin: GPT.hidden + GPT.logits over a ContiguousKVCache (tests compare logits and greedy tokens).
//
// `verify` is the same step for n tokens at once (1..kMaxRows), what speculative decoding's target needs: the γ
// drafts and the token before them scored in ONE call (minillm/compile/fused_speculative.py). Row i is token i at
// position pos0 + i, written to slot start + i:
//   X (n, C) = wte[tokens] + wpe[pos0..]                             each row as above
//   for each block: the same sequence, every product a small_gemm with M = n rows, so each weight matrix is walked
//     once for all n rows (4 weight rows loaded, then multiplied by every row of x): a verify of n rows streams the
//     weights once, as one step does, and adds only arithmetic (16 lanes wide with AVX-512, two rows per pass: each
//     extra row measured at 0.05-0.15 of a step on `base`). int8 and int4 linears take the same M-row loops.
//     attention: the K/V of all n rows written at slots start..start+n-1 first, then row i attends over slots
//     0..start+i: the cache and the new rows up to itself (causal among the new rows, as the model's mask).
//   logits (n, V)                                                   the head, M = n too
// Rolling back rejected rows is the caller's: slots past the kept ones are simply overwritten later.
// The same attention loop also serves the engine: `paged_decode_attention` (end of file) reads chapter 05's paged
// pool through the block tables in place, one query per sequence; its twin is PagedKVCache._attend_decode. And
// `paged_verify_attention` takes several queries per sequence (a verify step's last token and drafts).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace minillm {
namespace {

constexpr int64_t kMaxRows = 16;  // tokens one `verify` call takes: γ + 1 <= 16 (its scratch holds this many rows)
constexpr int kLayerTensors = 12;  // ln_1 w b, c_attn w b, attn c_proj w b, ln_2 w b, c_fc w b, mlp c_proj w b
// A block's four linears, as `linear` names them, and where each one's weight sits among the block's 12 tensors
// (its bias follows it). Each may be float32 or int8 codes with a per-row scale (`scales`: kLinears per block).
constexpr int kLinears = 4;
enum Linear { kQKV = 0, kAttnProj = 1, kFc = 2, kMlpProj = 3 };
constexpr int kLinearWeight[kLinears] = {2, 4, 8, 10};
constexpr const char* kLinearName[kLinears] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};

// a . b over n floats
float dot(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    s = hsum(acc);
#endif
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

// y += p * x over n floats
void axpy(float* y, float p, const float* x, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 pv = _mm256_set1_ps(p);
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    }
#endif
    for (; i < n; ++i) y[i] += p * x[i];
}

// y = (x - mean) / sqrt(var + eps) * w + b over n floats (biased variance, as nn.LayerNorm)
void layernorm(const float* x, const float* w, const float* b, float* y, int64_t n, float eps) {
    float mean = 0.f;
    for (int64_t i = 0; i < n; ++i) mean += x[i];
    mean /= static_cast<float>(n);
    float var = 0.f;
    for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
    const float rstd = 1.f / std::sqrt(var / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd * w[i] + b[i];
}

#if defined(__AVX2__) && defined(__FMA__)
// e^x for 8 floats at once (std::exp takes one): e^x = 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by
// the degree-6 polynomial of the Cephes library's expf (about 1 ulp), 2^n built directly in the exponent bits.
// x is clamped to [-87.3, 88.3], where 2^n stays a normal float.
__m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: r = x - n ln 2, exactly
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));  // 1 + r + r^2 p(r)
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

// GPT-2's gelu_new, the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in place.
// With AVX2, 8 at a time through tanh(u) = 1 - 2 / (e^(2u) + 1); the tail (and every float without AVX2) std::tanh.
void gelu_tanh(float* x, int64_t n) {
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
        const __m256 u = _mm256_mul_ps(_mm256_set1_ps(c), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, v));
        const __m256 e = exp8(_mm256_mul_ps(two, u));
        const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));  // tanh(u)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, t)));
    }
#endif
    for (; i < n; ++i) x[i] = 0.5f * x[i] * (1.f + std::tanh(c * (x[i] + 0.044715f * x[i] * x[i] * x[i])));
}

// s[j] = e^(s[j] - top) for j < n; returns their sum (the softmax's denominator)
float exp_shifted(float* s, int64_t n, float top) {
    int64_t j = 0;
    float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = hsum(acc);
#endif
    for (; j < n; ++j) {
        s[j] = std::exp(s[j] - top);
        total += s[j];
    }
    return total;
}

// One new token's attention, every head, over n cached tokens: for each head h,
//   out[h] (hs) = softmax_j(q[h] . K_j[h] / sqrt(hs)) . V_j[h]   over j < n.
// Token j's head h starts at k + where[j] + h * head_stride (and likewise in v), so one loop serves both caches:
// the fused step's contiguous (1, nh, max_len, hs) tensors (called per head: nh = 1, where[j] = j hs) and the
// engine's paged pools (nb, bs, nh, hs) (where[j] from the block table, head_stride = hs). The loops run token
// by token with the heads inside, so a paged token's K (or V) row of nh * hs floats is read once, front to back.
// scores: nh * n floats of scratch; q and out: nh * hs.
void attend_heads(const float* q, const float* k, const float* v, const int64_t* where, int64_t n, int64_t nh,
                  int64_t hs, int64_t head_stride, float* scores, float* out) {
    const float scale = 1.f / std::sqrt(static_cast<float>(hs));
    for (int64_t j = 0; j < n; ++j) {
        for (int64_t h = 0; h < nh; ++h) {
            scores[h * n + j] = dot(q + h * hs, k + where[j] + h * head_stride, hs) * scale;
        }
    }
    for (int64_t h = 0; h < nh; ++h) {  // each head's softmax over its n scores, in place
        float* s = scores + h * n;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
        const float inv = 1.f / exp_shifted(s, n, top);
        for (int64_t j = 0; j < n; ++j) s[j] *= inv;
    }
    std::fill_n(out, nh * hs, 0.f);
    for (int64_t j = 0; j < n; ++j) {
        for (int64_t h = 0; h < nh; ++h) axpy(out + h * hs, scores[h * n + j], v + where[j] + h * head_stride, hs);
    }
}

const float* ptr(const at::Tensor& t) { return t.data_ptr<float>(); }

void check_float(const at::Tensor& t, const char* what, std::vector<int64_t> shape) {
    check_plain_memory(t, "FusedDecoder", what);
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "FusedDecoder: ", what,
                " must be a contiguous float32 CPU tensor");
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "FusedDecoder: ", what, " must have shape ",
                at::IntArrayRef(shape),
                ", got ", t.sizes());
}

// An int8 linear's codes: a contiguous int8 CPU tensor of `shape` (block `layer`'s `what`, for the message).
void check_codes(const at::Tensor& t, int64_t layer, const char* what, std::vector<int64_t> shape) {
    check_plain_memory(t, "FusedDecoder", ("block " + std::to_string(layer) + "'s " + what + " codes").c_str());
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kChar && t.is_contiguous(), "FusedDecoder: block ",
                layer, "'s ", what, ".weight has a scale, so it must hold int8 codes (a contiguous int8 CPU tensor) "
                "or packed int4 ones (uint8), got ", t.scalar_type(), t.is_contiguous() ? "" : " (not contiguous)");
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "FusedDecoder: block ", layer, "'s ", what, " codes must have "
                "shape ", at::IntArrayRef(shape), ", got ", t.sizes());
}

// An int4 linear (N outputs, K inputs): packed codes p, a contiguous uint8 CPU tensor (N, K/2), and scales s, a
// contiguous float32 CPU tensor (N, groups) whose groups split K into equal even groups (block `layer`'s `what`).
void check_int4(const at::Tensor& p, const at::Tensor& s, int64_t layer, const char* what, int64_t N, int64_t K) {
    const std::string where = "block " + std::to_string(layer) + "'s " + what;
    check_plain_memory(p, "FusedDecoder", (where + " int4 codes").c_str());
    check_plain_memory(s, "FusedDecoder", (where + " int4 scale").c_str());
    TORCH_CHECK(p.device().is_cpu() && p.is_contiguous() && p.dim() == 2 && p.size(0) == N && 2 * p.size(1) == K,
                "FusedDecoder: block ", layer, "'s ", what, " int4 codes must be a contiguous uint8 CPU tensor of "
                "shape (", N, ", ", K / 2, "), two codes per byte, got ", p.sizes());
    TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 &&
                    s.size(0) == N && s.size(1) >= 1 && K % s.size(1) == 0 && (K / s.size(1)) % 2 == 0,
                "FusedDecoder: block ", layer, "'s ", what, " int4 scale must be a contiguous float32 CPU tensor of "
                "shape (", N, ", groups) with groups dividing ", K, " into even groups, got ", s.scalar_type(), " ",
                s.sizes());
}

// The metadata of a paged step, checked before any pool is read: block_tables (S, max_nb), context_lens (S,) and
// query_lens (S,) (null: one query per sequence) contiguous int64 CPU tensors; each context length in
// [1, max_nb * bs], each query length in [1, its context length], every block id a sequence reads inside the pool
// [0, nb), and the query lengths adding up to the step's N rows. `who` names the entry point in the message.
void check_paged_batch(const char* who, const at::Tensor& block_tables, const at::Tensor& context_lens,
                       const at::Tensor* query_lens, int64_t nb, int64_t bs, int64_t N) {
    check_plain_memory(block_tables, who, "block_tables");
    check_plain_memory(context_lens, who, "context_lens");
    if (query_lens) check_plain_memory(*query_lens, who, "query_lens");
    std::vector<const at::Tensor*> ints = {&block_tables, &context_lens};
    if (query_lens) ints.push_back(query_lens);
    for (const auto* t : ints) {
        TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(), who,
                    ": block_tables, context_lens and query_lens must be contiguous int64 CPU tensors");
    }
    const int64_t S = block_tables.dim() == 2 ? block_tables.size(0) : -1;
    TORCH_CHECK(S >= 0 && context_lens.dim() == 1 && context_lens.size(0) == S &&
                    (!query_lens || (query_lens->dim() == 1 && query_lens->size(0) == S)),
                who, ": block_tables must be (S, max_nb), context_lens and query_lens (S,), got ", block_tables.sizes(),
                " and ", context_lens.sizes());
    const int64_t max_nb = block_tables.size(1);
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    const int64_t* qls = query_lens ? query_lens->data_ptr<int64_t>() : nullptr;
    int64_t rows = 0;
    for (int64_t s = 0; s < S; ++s) {
        const int64_t ql = qls ? qls[s] : 1;
        TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_nb * bs, who, ": context length ", lens[s], " of sequence ", s,
                    " is outside [1, ", max_nb * bs, "]");
        TORCH_CHECK(ql >= 1 && ql <= lens[s], who, ": query length ", ql, " of sequence ", s, " is outside [1, ",
                    lens[s], "] (its context length)");
        for (int64_t b = 0; b < (lens[s] + bs - 1) / bs; ++b) {
            const int64_t id = tables[s * max_nb + b];
            TORCH_CHECK(id >= 0 && id < nb, who, ": block id ", id, " of sequence ", s, " is outside the pool [0, ", nb,
                        ")");
        }
        rows += ql;
    }
    TORCH_CHECK(rows == N, who, ": the step has ", N, " rows but the query lengths add up to ", rows);
}

// Holds the model's tensors (not copies: the same storage as the parameters) and its cache's K/V tensors, plus the
// scratch buffers of one step (kMaxRows rows each, for `verify`; `step` uses the first), all allocated at
// construction; `step` and `verify` allocate only the returned logits.
class FusedDecoder {
  public:
    // globals: wte (V, C), wpe (P, C), ln_f weight (C), ln_f bias (C), head (V, C);
    // layers: kLayerTensors per block in the order above; k, v: per block (1, nh, max_len, hs);
    // eps: each LayerNorm's own, ln_1 and ln_2 of every block, then ln_f (2 n_layer + 1);
    // scales: empty (every linear float32), or kLinears per block in `Linear`'s order: an empty tensor for a float32
    // linear, the per-row scales (N,) float32 of an int8 one, whose weight in `layers` is then its int8 codes (N, K),
    // or the group scales (N, groups) of an int4 one, whose weight is then its packed codes (N, K/2) uint8.
    FusedDecoder(std::vector<at::Tensor> globals, std::vector<at::Tensor> layers, std::vector<at::Tensor> k,
                 std::vector<at::Tensor> v, int64_t n_head, int64_t head_size, std::vector<double> eps,
                 std::vector<at::Tensor> scales)
        : globals_(std::move(globals)), layers_(std::move(layers)), k_(std::move(k)), v_(std::move(v)),
          scales_(std::move(scales)), nh_(n_head), hs_(head_size), eps_(eps.begin(), eps.end()) {
        TORCH_CHECK(globals_.size() == 5, "FusedDecoder: globals must be wte, wpe, ln_f weight, ln_f bias, head");
        TORCH_CHECK(n_head > 0 && head_size > 0, "FusedDecoder: n_head and head_size must be positive");
        TORCH_CHECK(!layers_.empty() && layers_.size() % kLayerTensors == 0,
                    "FusedDecoder: layers must hold ", kLayerTensors, " tensors per block, got ", layers_.size());
        n_layer_ = static_cast<int64_t>(layers_.size()) / kLayerTensors;
        TORCH_CHECK((k_.empty() && v_.empty()) ||
                        (static_cast<int64_t>(k_.size()) == n_layer_ && static_cast<int64_t>(v_.size()) == n_layer_),
                    "FusedDecoder: one K and one V tensor per block, or none (an engine's decoder: `paged` only)");
        TORCH_CHECK(static_cast<int64_t>(eps_.size()) == 2 * n_layer_ + 1,
                    "FusedDecoder: eps must hold ln_1 and ln_2 of every block, then ln_f");
        TORCH_CHECK(scales_.empty() || static_cast<int64_t>(scales_.size()) == kLinears * n_layer_,
                    "FusedDecoder: scales must be empty or hold ", kLinears, " tensors per block (",
                    kLinears * n_layer_, "), got ", scales_.size());
        scales_.resize(kLinears * n_layer_);  // empty: every linear float32 (an undefined tensor)
        for (auto& s : scales_) {
            if (s.defined() && s.numel() == 0) s = at::Tensor();  // "no scale": this linear is float32
        }
        TORCH_CHECK(globals_[0].dim() == 2 && globals_[1].dim() == 2, "FusedDecoder: wte and wpe must be 2-D");
        V_ = globals_[0].size(0);
        C_ = globals_[0].size(1);
        P_ = globals_[1].size(0);
        A_ = nh_ * hs_;
        check_float(globals_[0], "wte", {V_, C_});
        check_float(globals_[1], "wpe", {P_, C_});
        check_float(globals_[2], "ln_f.weight", {C_});
        check_float(globals_[3], "ln_f.bias", {C_});
        check_float(globals_[4], "lm_head.weight", {V_, C_});
        TORCH_CHECK(k_.empty() || k_[0].dim() == 4, "FusedDecoder: K must be (1, nh, max_len, hs)");
        max_len_ = k_.empty() ? 0 : k_[0].size(2);  // 0: no cache of its own, `step` and `verify` refuse every slot
        int64_t widest = 0;
        for (int64_t l = 0; l < n_layer_; ++l) {
            const at::Tensor* t = &layers_[l * kLayerTensors];
            TORCH_CHECK(t[8].dim() == 2, "FusedDecoder: mlp.c_fc.weight must be 2-D");
            const int64_t H = t[8].size(0);  // the MLP width (chapter 10 may have pruned it, block by block)
            widest = std::max(widest, H);
            check_float(t[0], "ln_1.weight", {C_});
            check_float(t[1], "ln_1.bias", {C_});
            check_float(t[3], "attn.c_attn.bias", {3 * A_});
            check_float(t[5], "attn.c_proj.bias", {C_});
            check_float(t[6], "ln_2.weight", {C_});
            check_float(t[7], "ln_2.bias", {C_});
            check_float(t[9], "mlp.c_fc.bias", {H});
            check_float(t[11], "mlp.c_proj.bias", {C_});
            const int64_t outs[kLinears] = {3 * A_, C_, H, C_}, ins[kLinears] = {C_, A_, C_, H};
            for (int j = 0; j < kLinears; ++j) {  // each weight: float32 (N, K), or int8 codes (N, K) + scales (N,)
                const at::Tensor& w = t[kLinearWeight[j]];
                const at::Tensor& s = scales_[l * kLinears + j];
                if (!s.defined()) {
                    check_float(w, (std::string(kLinearName[j]) + ".weight").c_str(), {outs[j], ins[j]});
                    continue;
                }
                if (w.scalar_type() == at::kByte) {  // int4: packed codes (N, K/2), scales (N, groups)
                    check_int4(w, s, l, kLinearName[j], outs[j], ins[j]);
                    continue;
                }
                check_codes(w, l, kLinearName[j], {outs[j], ins[j]});
                check_plain_memory(s, "FusedDecoder", (std::string(kLinearName[j]) + " scale").c_str());
                TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.is_contiguous() &&
                                s.sizes() == at::IntArrayRef({outs[j]}),
                            "FusedDecoder: block ", l, "'s ", kLinearName[j], " scale must be a contiguous float32 "
                            "CPU tensor of shape (", outs[j], ",), one per output row, got ", s.scalar_type(), " ",
                            s.sizes());
            }
            if (k_.empty()) continue;
            check_float(k_[l], "K cache", {1, nh_, max_len_, hs_});
            check_float(v_[l], "V cache", {1, nh_, max_len_, hs_});
        }
        x_.resize(kMaxRows * C_);  // row i of a verify at i * C_, and likewise below
        h_.resize(kMaxRows * C_);
        qkv_.resize(kMaxRows * 3 * A_);
        y_.resize(kMaxRows * A_);
        f_.resize(kMaxRows * widest);  // a verify's rows are (n, H) for this block's H: contiguous rows of width H
        scores_.resize(max_len_);
        logits_.resize(V_);
        where_.resize(max_len_);
        for (int64_t j = 0; j < max_len_; ++j) where_[j] = j * hs_;  // slot j of a head's (max_len, hs) rows
    }

    // Logits (1, V) of `token` at position `pos`, whose K/V go to slot `start` (the same number: checked); it
    // attends over slots 0..start.
    at::Tensor step(int64_t token, int64_t pos, int64_t start) {
        TORCH_CHECK(token >= 0 && token < V_, "FusedDecoder: token id ", token, " is outside the vocabulary [0, ", V_,
                    ")");
        TORCH_CHECK(pos >= 0 && pos < P_, "FusedDecoder: position ", pos, " is outside the context window [0, ", P_,
                    ")");
        TORCH_CHECK(start >= 0 && start < max_len_, "FusedDecoder: slot ", start, " is outside the cache [0, ",
                    max_len_, ")");
        // One sequence, no padding: the token written to slot `start` sits at position `start`. Any other position
        // would embed it as if tokens were missing (or repeated) before it, next to keys that say otherwise.
        TORCH_CHECK(pos == start, "FusedDecoder: position ", pos, " is not the cache length ", start,
                    " (one sequence without padding: the token at slot ", start, " is at position ", start, ")");
        // BEGIN INCLUDE decode_step
        float* x = x_.data();
        float* h = h_.data();
        const float* te = ptr(globals_[0]) + token * C_;
        const float* pe = ptr(globals_[1]) + pos * C_;
        for (int64_t i = 0; i < C_; ++i) x[i] = te[i] + pe[i];
        for (int64_t l = 0; l < n_layer_; ++l) {
            const at::Tensor* t = &layers_[l * kLayerTensors];
            const int64_t H = t[8].size(0);
            layernorm(x, ptr(t[0]), ptr(t[1]), h, C_, eps_[2 * l]);
            linear(l, kQKV, h, qkv_.data());  // the GEMV of the linear's dtype: float32 or int8 codes
            attend(l, start);
            linear(l, kAttnProj, y_.data(), h);
            for (int64_t i = 0; i < C_; ++i) x[i] += h[i];
            layernorm(x, ptr(t[6]), ptr(t[7]), h, C_, eps_[2 * l + 1]);
            linear(l, kFc, h, f_.data());
            gelu_tanh(f_.data(), H);
            linear(l, kMlpProj, f_.data(), h);
            for (int64_t i = 0; i < C_; ++i) x[i] += h[i];
        }
        layernorm(x, ptr(globals_[2]), ptr(globals_[3]), h, C_, eps_.back());
        auto logits = at::empty({1, V_}, globals_[0].options());
        small_gemm(h, ptr(globals_[4]), nullptr, logits.data_ptr<float>(), 1, C_, V_);
        return logits;
        // END INCLUDE decode_step
    }

    // Speculative decoding's verify: logits (n, V) of n = len(tokens) tokens (1..kMaxRows) at positions
    // pos0..pos0+n-1, their K/V written to slots start..start+n-1 (pos0 == start: checked, as in `step`), in ONE call.
    // Row i attends over slots 0..start+i. Equal to n calls of `step` to float rounding (tested), but every weight
    // matrix is walked once for all n rows (small_gemm / small_gemm_q8 with M = n), not n times.
    at::Tensor verify(const std::vector<int64_t>& tokens, int64_t pos0, int64_t start) {
        const int64_t n = static_cast<int64_t>(tokens.size());
        TORCH_CHECK(n >= 1 && n <= kMaxRows, "FusedDecoder.verify: takes 1 to ", kMaxRows, " tokens, got ", n);
        for (int64_t i = 0; i < n; ++i) {
            TORCH_CHECK(tokens[i] >= 0 && tokens[i] < V_, "FusedDecoder: token id ", tokens[i], " (tokens[", i,
                        "]) is outside the vocabulary [0, ", V_, ")");
        }
        TORCH_CHECK(pos0 >= 0 && pos0 + n <= P_, "FusedDecoder: positions ", pos0, "..", pos0 + n - 1,
                    " are outside the context window [0, ", P_, ")");
        TORCH_CHECK(start >= 0 && start + n <= max_len_, "FusedDecoder: slots ", start, "..", start + n - 1,
                    " are outside the cache [0, ", max_len_, ")");
        TORCH_CHECK(pos0 == start, "FusedDecoder: position ", pos0, " is not the cache length ", start,
                    " (one sequence without padding: the token at slot ", start, " is at position ", start, ")");
        float* X = x_.data();  // (n, C) residual rows
        float* H = h_.data();  // (n, C) normed rows, then each sublayer's output rows
        for (int64_t i = 0; i < n; ++i) {
            const float* te = ptr(globals_[0]) + tokens[i] * C_;
            const float* pe = ptr(globals_[1]) + (pos0 + i) * C_;
            for (int64_t c = 0; c < C_; ++c) X[i * C_ + c] = te[c] + pe[c];
        }
        for (int64_t l = 0; l < n_layer_; ++l) {
            const at::Tensor* t = &layers_[l * kLayerTensors];
            const int64_t Hw = t[8].size(0);  // this block's MLP width
            for (int64_t i = 0; i < n; ++i) layernorm(X + i * C_, ptr(t[0]), ptr(t[1]), H + i * C_, C_, eps_[2 * l]);
            linear(l, kQKV, H, qkv_.data(), n);  // (n, 3A): one walk over W_attn for all n rows
            attend_rows(l, start, n);            // (n, A) into y_
            linear(l, kAttnProj, y_.data(), H, n);
            for (int64_t i = 0; i < n * C_; ++i) X[i] += H[i];
            for (int64_t i = 0; i < n; ++i) {
                layernorm(X + i * C_, ptr(t[6]), ptr(t[7]), H + i * C_, C_, eps_[2 * l + 1]);
            }
            linear(l, kFc, H, f_.data(), n);  // (n, Hw)
            gelu_tanh(f_.data(), n * Hw);
            linear(l, kMlpProj, f_.data(), H, n);
            for (int64_t i = 0; i < n * C_; ++i) X[i] += H[i];
        }
        for (int64_t i = 0; i < n; ++i) layernorm(X + i * C_, ptr(globals_[2]), ptr(globals_[3]), H + i * C_, C_,
                                                  eps_.back());
        auto logits = at::empty({n, V_}, globals_[0].options());
        small_gemm(H, ptr(globals_[4]), nullptr, logits.data_ptr<float>(), n, C_, V_);  // (n, V), one walk
        return logits;
    }

    // The engine's step over chapter 05's paged pools (fused_engine.py): hidden states (N, C), after ln_f, of the N
    // rows of a continuous-batching step, sequence after sequence (query_lens[s] consecutive rows for sequence s, the
    // last new tokens of its context_lens[s]), each token at its position and its K/V written at its slot of every
    // layer's pools (nb, bs, nh, hs). Row j of sequence s attends over the sequence's first
    // context_lens[s] - query_lens[s] + j + 1 tokens, read in place through its block table: a decode step (one row
    // per sequence), a speculative verify (a last token and its drafts) and a short prompt chunk alike. The rows run
    // in chunks of kMaxRows through the whole model, each weight matrix walked once per chunk for all its rows.
    // subtle: chunking rows across the whole model is exact because a row only attends to tokens before it in its
    // own sequence, and those are either in the pools already or rows of an earlier chunk (every layer's K/V of
    // which is written before the next chunk starts) or of this chunk (written in this layer before it attends).
    at::Tensor paged(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& query_lens,
                     const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools) {
        const char* who = "FusedDecoder.paged";
        TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == n_layer_ && static_cast<int64_t>(v_pools.size()) == n_layer_,
                    who, ": k_pools and v_pools must hold one pool per block (", n_layer_, "), got ", k_pools.size(),
                    " and ", v_pools.size());
        for (const auto* pools : {&k_pools, &v_pools}) {
            for (const auto& pool : *pools) {
                check_plain_memory(pool, who, "a pool");
                TORCH_CHECK(pool.device().is_cpu() && pool.scalar_type() == at::kFloat && pool.is_contiguous() &&
                                pool.dim() == 4 && pool.sizes() == k_pools[0].sizes() && pool.size(1) >= 1 &&
                                pool.size(2) == nh_ && pool.size(3) == hs_,
                            who, ": every pool must be a contiguous float32 CPU tensor (nb, bs >= 1, ", nh_, ", ",
                            hs_, "), all of one shape, got ", pool.scalar_type(), " ", pool.sizes());
            }
        }
        for (const auto* t : {&tokens, &positions, &slot_mapping}) {
            check_plain_memory(*t, who, "tokens, positions and slot_mapping");
            TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 &&
                            t->size(0) == tokens.size(0),
                        who, ": tokens, positions and slot_mapping must be contiguous int64 CPU tensors (N,) of one "
                        "length, got ", tokens.sizes(), ", ", positions.sizes(), " and ", slot_mapping.sizes());
        }
        const int64_t N = tokens.size(0), nb = k_pools[0].size(0), bs = k_pools[0].size(1);
        TORCH_CHECK(N >= 1, who, ": a step needs at least one row");
        check_paged_batch(who, block_tables, context_lens, &query_lens, nb, bs, N);
        const int64_t S = block_tables.size(0), max_nb = block_tables.size(1);
        const int64_t* tables = block_tables.data_ptr<int64_t>();
        const int64_t* lens = context_lens.data_ptr<int64_t>();
        const int64_t* qls = query_lens.data_ptr<int64_t>();
        const int64_t* tok = tokens.data_ptr<int64_t>();
        const int64_t* pos = positions.data_ptr<int64_t>();
        const int64_t* slots = slot_mapping.data_ptr<int64_t>();
        // Per row: its sequence, the tokens it attends to; per sequence: where each of its tokens lies in a pool.
        std::vector<int64_t> row_seq(N), row_len(N), seq_where(S + 1, 0);
        for (int64_t s = 0; s < S; ++s) seq_where[s + 1] = seq_where[s] + lens[s];
        std::vector<int64_t> where(seq_where[S]);
        int64_t longest = 0;
        for (int64_t s = 0, r = 0; s < S; ++s) {
            const int64_t* table = tables + s * max_nb;
            for (int64_t j = 0; j < lens[s]; ++j) where[seq_where[s] + j] = (table[j / bs] * bs + j % bs) * A_;
            longest = std::max(longest, lens[s]);
            for (int64_t j = 0; j < qls[s]; ++j, ++r) {
                const int64_t at = lens[s] - qls[s] + j;  // the row's token: index `at` of its sequence's context
                TORCH_CHECK(tok[r] >= 0 && tok[r] < V_, who, ": token id ", tok[r], " of row ", r,
                            " is outside the vocabulary [0, ", V_, ")");
                TORCH_CHECK(pos[r] >= 0 && pos[r] < P_, who, ": position ", pos[r], " of row ", r,
                            " is outside the context window [0, ", P_, ")");
                TORCH_CHECK(slots[r] * A_ == where[seq_where[s] + at], who, ": slot ", slots[r], " of row ", r,
                            " is not where its block table puts token ", at, " of sequence ", s, " (slot ",
                            where[seq_where[s] + at] / A_, ")");
                row_seq[r] = s;
                row_len[r] = at + 1;
            }
        }
        std::vector<float> scores(nh_ * longest);
        auto out = at::empty({N, C_}, globals_[0].options());
        float* X = x_.data();
        float* H = h_.data();
        for (int64_t r0 = 0; r0 < N; r0 += kMaxRows) {
            const int64_t n = std::min(kMaxRows, N - r0);  // rows r0 .. r0 + n - 1, as `verify`'s n rows
            for (int64_t i = 0; i < n; ++i) {
                const float* te = ptr(globals_[0]) + tok[r0 + i] * C_;
                const float* pe = ptr(globals_[1]) + pos[r0 + i] * C_;
                for (int64_t c = 0; c < C_; ++c) X[i * C_ + c] = te[c] + pe[c];
            }
            for (int64_t l = 0; l < n_layer_; ++l) {
                const at::Tensor* t = &layers_[l * kLayerTensors];
                const int64_t Hw = t[8].size(0);
                float* kp = k_pools[l].data_ptr<float>();
                float* vp = v_pools[l].data_ptr<float>();
                for (int64_t i = 0; i < n; ++i) layernorm(X + i * C_, ptr(t[0]), ptr(t[1]), H + i * C_, C_, eps_[2 * l]);
                linear(l, kQKV, H, qkv_.data(), n);  // (n, 3A)
                for (int64_t i = 0; i < n; ++i) {  // k, v (A each: nh heads of hs) to the row's slot, all heads
                    std::copy_n(qkv_.data() + i * 3 * A_ + A_, A_, kp + slots[r0 + i] * A_);
                    std::copy_n(qkv_.data() + i * 3 * A_ + 2 * A_, A_, vp + slots[r0 + i] * A_);
                }
                for (int64_t i = 0; i < n; ++i) {
                    const int64_t r = r0 + i;
                    attend_heads(qkv_.data() + i * 3 * A_, kp, vp, where.data() + seq_where[row_seq[r]], row_len[r],
                                 nh_, hs_, hs_, scores.data(), y_.data() + i * A_);
                }
                linear(l, kAttnProj, y_.data(), H, n);
                for (int64_t i = 0; i < n * C_; ++i) X[i] += H[i];
                for (int64_t i = 0; i < n; ++i) {
                    layernorm(X + i * C_, ptr(t[6]), ptr(t[7]), H + i * C_, C_, eps_[2 * l + 1]);
                }
                linear(l, kFc, H, f_.data(), n);
                gelu_tanh(f_.data(), n * Hw);
                linear(l, kMlpProj, f_.data(), H, n);
                for (int64_t i = 0; i < n * C_; ++i) X[i] += H[i];
            }
            float* o = out.data_ptr<float>() + r0 * C_;
            for (int64_t i = 0; i < n; ++i) layernorm(X + i * C_, ptr(globals_[2]), ptr(globals_[3]), o + i * C_, C_,
                                                      eps_.back());
        }
        return out;
    }

    // The tied head on rows the caller picked: h (R, C) -> logits (R, V), the weight walked once for all rows.
    at::Tensor head(const at::Tensor& h) {
        check_plain_memory(h, "FusedDecoder.head", "h");
        TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2 &&
                        h.size(1) == C_,
                    "FusedDecoder.head: h must be a contiguous float32 CPU tensor (R, ", C_, "), got ", h.scalar_type(),
                    " ", h.sizes());
        auto logits = at::empty({h.size(0), V_}, globals_[0].options());
        small_gemm(h.data_ptr<float>(), ptr(globals_[4]), nullptr, logits.data_ptr<float>(), h.size(0), C_, V_);
        return logits;
    }

    // The step's matrix-vector products alone, in the step's order, `times` over: every weight matrix streamed once
    // per pass with nothing else in the loop (on whatever the scratch buffers hold). Chapter 13's benchmark times it
    // as the weight-streaming bound of the step above, free of any per-call cost a loop from Python would add.
    void products(int64_t times) {
        TORCH_CHECK(times >= 0, "FusedDecoder.products: times must be non-negative, got ", times);
        for (int64_t r = 0; r < times; ++r) {
            for (int64_t l = 0; l < n_layer_; ++l) {
                linear(l, kQKV, h_.data(), qkv_.data());
                linear(l, kAttnProj, y_.data(), h_.data());
                linear(l, kFc, h_.data(), f_.data());
                linear(l, kMlpProj, f_.data(), h_.data());
            }
            small_gemm(h_.data(), ptr(globals_[4]), nullptr, logits_.data(), 1, C_, V_);
        }
    }

    int64_t max_len() const { return max_len_; }

  private:
    // y = x W^T + b for linear j of block l: the float32 GEMV, or where the linear has a scale the int8 one (codes
    // (N, K), per-row scales) or the int4 one (packed codes (N, K/2) uint8, per-group scales (N, groups)). x is
    // (rows, K), y (rows, N): one walk over the weight for all rows.
    void linear(int64_t l, int j, const float* x, float* y, int64_t rows = 1) {
        const at::Tensor& w = layers_[l * kLayerTensors + kLinearWeight[j]];
        const float* b = ptr(layers_[l * kLayerTensors + kLinearWeight[j] + 1]);
        const at::Tensor& scale = scales_[l * kLinears + j];
        if (scale.defined() && w.scalar_type() == at::kByte) {  // int4: (N, K/2) packed codes, (N, groups) scales
            const int64_t K = 2 * w.size(1);
            small_gemm_q4(x, w.data_ptr<uint8_t>(), ptr(scale), b, y, rows, K, w.size(0), K / scale.size(1));
        } else if (scale.defined()) {
            small_gemm_q8(x, w.data_ptr<int8_t>(), ptr(scale), b, y, rows, w.size(1), w.size(0));
        } else {
            small_gemm(x, ptr(w), b, y, rows, w.size(1), w.size(0));
        }
    }

    // This block's attention for the new token: store its k, v at `start`, then each head's softmax-weighted sum
    // of the values at slots 0..start (the new token sees every kept slot, itself included) into y_.
    void attend(int64_t layer, int64_t start) {
        float* kc = k_[layer].data_ptr<float>();
        float* vc = v_[layer].data_ptr<float>();
        const int64_t head_stride = max_len_ * hs_;  // (1, nh, max_len, hs): a head's slots are contiguous
        for (int64_t head = 0; head < nh_; ++head) {
            std::copy_n(qkv_.data() + A_ + head * hs_, hs_, kc + head * head_stride + start * hs_);
            std::copy_n(qkv_.data() + 2 * A_ + head * hs_, hs_, vc + head * head_stride + start * hs_);
        }
        // One head at a time: each head's slots are contiguous here, so this reads two streams front to back.
        // subtle: all heads at once would read 2 nh streams max_len * hs floats apart, which collide in the same
        // L1 cache sets (measured: up to twice as slow at 128 cached tokens).
        for (int64_t head = 0; head < nh_; ++head) {
            attend_heads(qkv_.data() + head * hs_, kc + head * head_stride, vc + head * head_stride, where_.data(),
                         start + 1, 1, hs_, 0, scores_.data(), y_.data() + head * hs_);
        }
    }

    // `attend` for the n rows of a verify: store all n rows' k, v at slots start..start+n-1, then row i's heads
    // attend over slots 0..start+i (itself included, its later rows not: the causal mask) into row i of y_.
    void attend_rows(int64_t layer, int64_t start, int64_t n) {
        float* kc = k_[layer].data_ptr<float>();
        float* vc = v_[layer].data_ptr<float>();
        const int64_t head_stride = max_len_ * hs_;
        for (int64_t i = 0; i < n; ++i) {
            const float* qkv = qkv_.data() + i * 3 * A_;  // row i: q (A), k (A), v (A)
            for (int64_t head = 0; head < nh_; ++head) {
                std::copy_n(qkv + A_ + head * hs_, hs_, kc + head * head_stride + (start + i) * hs_);
                std::copy_n(qkv + 2 * A_ + head * hs_, hs_, vc + head * head_stride + (start + i) * hs_);
            }
        }
        for (int64_t head = 0; head < nh_; ++head) {  // one head at a time, as `attend` (its slots stay in cache)
            for (int64_t i = 0; i < n; ++i) {
                attend_heads(qkv_.data() + i * 3 * A_ + head * hs_, kc + head * head_stride, vc + head * head_stride,
                             where_.data(), start + i + 1, 1, hs_, 0, scores_.data(), y_.data() + i * A_ + head * hs_);
            }
        }
    }

    std::vector<at::Tensor> globals_, layers_, k_, v_;
    std::vector<at::Tensor> scales_;  // kLinears per block: undefined (float32), (N,) (int8) or (N, groups) (int4)
    int64_t nh_, hs_, n_layer_ = 0, V_ = 0, C_ = 0, P_ = 0, A_ = 0, max_len_ = 0;
    std::vector<float> eps_;  // ln_1, ln_2 of block 0, of block 1, ..., ln_f
    std::vector<float> x_, h_, qkv_, y_, f_, scores_;  // the step's scratch: residual, normed/out, q k v, heads, MLP
    std::vector<float> logits_;                          // products() only: step() returns a fresh logits tensor
    std::vector<int64_t> where_;                         // where slot j starts in a head's rows: j * hs
};

// The engine's attention over chapter 06's paged pool, read through the block tables in place: no gather of each
// sequence's blocks into a contiguous copy first, which is what the PyTorch path (`PagedKVCache._attend_decode`:
// index_select, then SDPA) spends most of its time on at these sizes.
// q (N, nh, hs): the step's query rows, sequence after sequence, query_lens[s] of them for sequence s (all 1: a decode
// step); pools (nb, bs, nh, hs); block_tables (S, max_nb) int64, -1 past a sequence's blocks; context_lens (S,) int64,
// the tokens each sequence attends to, its new ones included -> (N, nh, hs). Query j of sequence s (its new tokens are
// the last query_lens[s] of context_lens[s]) attends over the first context_lens[s] - query_lens[s] + j + 1 tokens:
// causal among the new ones, as speculative decoding's verify needs.
at::Tensor paged_attention_rows(const char* who, const at::Tensor& q, const at::Tensor& k_pool,
                                const at::Tensor& v_pool, const at::Tensor& block_tables,
                                const at::Tensor& context_lens, const at::Tensor* query_lens) {
    check_plain_memory(q, who, "q");
    check_plain_memory(k_pool, who, "k_pool");
    check_plain_memory(v_pool, who, "v_pool");
    for (const auto* t : {&q, &k_pool, &v_pool}) {
        TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(), who,
                    ": q and the pools must be contiguous float32 CPU tensors");
    }
    TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() &&
                    k_pool.size(2) == q.size(1) && k_pool.size(3) == q.size(2),
                who, ": q must be (N, nh, hs) and the pools (nb, bs, nh, hs), got ", q.sizes(), " and ",
                k_pool.sizes());
    const int64_t N = q.size(0), nh = q.size(1), hs = q.size(2), nb = k_pool.size(0), bs = k_pool.size(1);
    check_paged_batch(who, block_tables, context_lens, query_lens, nb, bs, N);
    const int64_t S = block_tables.size(0), max_nb = block_tables.size(1);
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    const int64_t* qls = query_lens ? query_lens->data_ptr<int64_t>() : nullptr;
    const int64_t longest = S ? *std::max_element(lens, lens + S) : 0;
    auto out = at::empty({N, nh, hs}, q.options());
    std::vector<float> scores(nh * longest);
    std::vector<int64_t> where(longest);  // where[j]: token j's first float in a pool (its head 0)
    const int64_t row = nh * hs;  // floats between consecutive tokens of one block
    for (int64_t s = 0, r = 0; s < S; ++s) {
        const int64_t* table = tables + s * max_nb;
        // Token j sits at offset j % bs of block table[j / bs]: resolved once per sequence, walking the blocks.
        for (int64_t b = 0, j = 0; j < lens[s]; ++b) {
            for (int64_t o = 0; o < bs && j < lens[s]; ++o, ++j) where[j] = (table[b] * bs + o) * row;
        }
        const int64_t ql = qls ? qls[s] : 1;
        for (int64_t j = 0; j < ql; ++j, ++r) {  // query j sees the tokens before the new ones and new ones 0..j
            attend_heads(q.data_ptr<float>() + r * row, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                         where.data(), lens[s] - ql + j + 1, nh, hs, hs, scores.data(), out.data_ptr<float>() + r * row);
        }
    }
    return out;
}

// One query per sequence (a decode step): q (S, nh, hs) -> (S, nh, hs). Its twin is PagedKVCache._attend_decode.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens) {
    return paged_attention_rows("paged_decode_attention", q, k_pool, v_pool, block_tables, context_lens, nullptr);
}

// query_lens[s] queries per sequence (a verify step: a last token and its drafts): q (N, nh, hs) -> (N, nh, hs).
// Its twin is chapter 08's VerifyKVCache.attend.
at::Tensor paged_verify_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  const at::Tensor& query_lens) {
    return paged_attention_rows("paged_verify_attention", q, k_pool, v_pool, block_tables, context_lens, &query_lens);
}

// What the Python side asks before every fused step (minillm/compile/fused_step.py, WatchedModel): is every tensor
// the step reads through a raw pointer still what it was built on? `watched` holds the model's own tensors (the very
// TensorImpl of each Parameter and buffer: `p.data = x` rewrites that object in place, and this handle sees it);
// `reads` what the step reads for each: the same memory, or a copy (`as_cpp_reads` of a non-contiguous tensor or a
// negative view). A watched tensor has changed when its view of memory did (address, sizes, strides, dtype, device,
// negative or conjugate bit) or, for a copy, its values did (an in-place update the copy cannot see). Cost: a few
// comparisons per tensor, and one pass over the values of each copied one.
class TensorWatch {
public:
    TensorWatch(std::vector<at::Tensor> watched, std::vector<at::Tensor> reads)
        : watched_(std::move(watched)), reads_(std::move(reads)) {
        TORCH_CHECK(watched_.size() == reads_.size(), "TensorWatch: watched and reads must pair up, got ",
                    watched_.size(), " and ", reads_.size());
        for (size_t i = 0; i < watched_.size(); ++i) {
            views_.push_back(View::of(watched_[i]));
            copied_.push_back(reads_[i].data_ptr() != watched_[i].data_ptr() || watched_[i].is_neg());
        }
    }

    // The index of the first watched tensor that changed, or -1 when none did.
    int64_t changed() const {
        for (size_t i = 0; i < watched_.size(); ++i) {
            if (!(View::of(watched_[i]) == views_[i])) return static_cast<int64_t>(i);
            if (copied_[i] && !watched_[i].resolve_neg().equal(reads_[i])) return static_cast<int64_t>(i);
        }
        return -1;
    }

private:
    struct View {
        const void* data;
        std::vector<int64_t> sizes, strides;
        at::ScalarType dtype;
        at::Device device;
        bool neg, conj;
        static View of(const at::Tensor& t) {
            return {t.data_ptr(), t.sizes().vec(), t.strides().vec(), t.scalar_type(), t.device(), t.is_neg(),
                    t.is_conj()};
        }
        bool operator==(const View& o) const {
            return data == o.data && sizes == o.sizes && strides == o.strides && dtype == o.dtype &&
                   device == o.device && neg == o.neg && conj == o.conj;
        }
    };
    std::vector<at::Tensor> watched_, reads_;
    std::vector<View> views_;
    std::vector<bool> copied_;
};

// The other half of that question, for what is not a tensor: the model's Python objects, compared by identity
// without calling back into Python (the same look in Python cost tens of microseconds a step). `held`: (dict, key,
// object) triples, each an object the dict held under the key when the watch was built (a module's parameters,
// buffers, children and public attributes, from the dicts the module keeps them in, and those dicts from its
// instance dict); `sized`: (dict, size) pairs (those dicts and each module's instance dict: a block appended or a
// `forward` assigned is a new key; its hook dicts and torch's global ones, at 0); `ordered`: (dict, keys) pairs, the
// keys in order (a ModuleList runs its blocks in its dict's order); `owned`: (object, type, instance dict) triples
// (a module's or tensor's class swapped, or its whole `__dict__`); `class_held` / `class_sized`: every attribute of
// every Python class along each module's MRO, and each class dict's size (a method, property or attribute patched
// on a class changes what every module of it computes). Any difference is "maybe changed": the Python side then says
// what changed, or that nothing did (an attribute written again with an equal value, a private cache a module
// keeps) and builds a new watch.
class ObjectWatch {
public:
    using Held = std::tuple<pybind11::dict, pybind11::object, pybind11::object>;
    using Owned = std::tuple<pybind11::object, pybind11::object, pybind11::object>;

    using ClassHeld = std::tuple<pybind11::type, pybind11::object, pybind11::object>;

    ObjectWatch(std::vector<Held> held, std::vector<std::pair<pybind11::dict, int64_t>> sized,
                std::vector<std::pair<pybind11::dict, std::vector<pybind11::object>>> ordered, std::vector<Owned> owned,
                std::vector<ClassHeld> class_held, std::vector<std::pair<pybind11::type, int64_t>> class_sized)
        : held_(std::move(held)), sized_(std::move(sized)), ordered_(std::move(ordered)), owned_(std::move(owned)),
          class_held_(std::move(class_held)), class_sized_(std::move(class_sized)) {
        for (const auto& [type, size] : class_sized_) {  // a class's own dict, read directly: Python classes only
            TORCH_CHECK(PyType_HasFeature(reinterpret_cast<PyTypeObject*>(type.ptr()), Py_TPFLAGS_HEAPTYPE) &&
                            reinterpret_cast<PyTypeObject*>(type.ptr())->tp_dict != nullptr,
                        "ObjectWatch: class_sized must name classes defined in Python");
        }
    }

    bool changed() const {
        for (const auto& [dict, key, object] : held_) {
            PyObject* now = PyDict_GetItemWithError(dict.ptr(), key.ptr());  // borrowed; nullptr when missing
            if (now == nullptr && PyErr_Occurred()) throw pybind11::error_already_set();
            if (now != object.ptr()) return true;
        }
        for (const auto& [dict, size] : sized_) {
            if (PyDict_Size(dict.ptr()) != size) return true;
        }
        for (const auto& [dict, keys] : ordered_) {
            Py_ssize_t pos = 0;
            PyObject *key = nullptr, *value = nullptr;
            for (const auto& want : keys) {
                if (!PyDict_Next(dict.ptr(), &pos, &key, &value) || key != want.ptr()) return true;
            }
        }
        for (const auto& [object, type, instance_dict] : owned_) {
            if (reinterpret_cast<PyObject*>(Py_TYPE(object.ptr())) != type.ptr()) return true;
            PyObject* now = PyObject_GetAttr(object.ptr(), dict_name_.ptr());  // a new reference
            if (now == nullptr) throw pybind11::error_already_set();
            const bool same = now == instance_dict.ptr();
            Py_DECREF(now);
            if (!same) return true;
        }
        for (const auto& [type, size] : class_sized_) {  // an attribute added to or removed from a class
            if (PyDict_Size(reinterpret_cast<PyTypeObject*>(type.ptr())->tp_dict) != size) return true;
        }
        for (const auto& [type, key, object] : class_held_) {  // one replaced on a class (a method, a property)
            PyObject* now = PyDict_GetItemWithError(reinterpret_cast<PyTypeObject*>(type.ptr())->tp_dict, key.ptr());
            if (now == nullptr && PyErr_Occurred()) throw pybind11::error_already_set();
            if (now != object.ptr()) return true;
        }
        return false;
    }

private:
    std::vector<Held> held_;
    std::vector<std::pair<pybind11::dict, int64_t>> sized_;
    std::vector<std::pair<pybind11::dict, std::vector<pybind11::object>>> ordered_;
    std::vector<Owned> owned_;
    std::vector<ClassHeld> class_held_;
    std::vector<std::pair<pybind11::type, int64_t>> class_sized_;
    pybind11::str dict_name_{"__dict__"};  // made once: a name built at every lookup cost more than the lookup
};

}  // namespace

void register_decoder(pybind11::module& m) {
    m.def("paged_decode_attention", &paged_decode_attention,
          "one query per sequence over its paged K/V, read through the block table (float32, CPU)");
    m.def("paged_verify_attention", &paged_verify_attention,
          "query_lens[s] queries per sequence, causal among its new tokens, over its paged K/V (float32, CPU)");
    pybind11::class_<FusedDecoder>(m, "FusedDecoder")
        .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                            std::vector<at::Tensor>, int64_t, int64_t, std::vector<double>, std::vector<at::Tensor>>(),
             pybind11::arg("globals"), pybind11::arg("layers"), pybind11::arg("k"), pybind11::arg("v"),
             pybind11::arg("n_head"), pybind11::arg("head_size"), pybind11::arg("eps"),
             pybind11::arg("scales") = std::vector<at::Tensor>())  // empty: every linear float32
        .def("step", &FusedDecoder::step, "logits (1, V) of one token at one position, its K/V written at a slot",
             pybind11::call_guard<pybind11::gil_scoped_release>())
        .def("verify", &FusedDecoder::verify, "logits (n, V) of n tokens at positions pos0.., their K/V written at "
             "slots start.., in one call (speculative decoding's verify)", pybind11::arg("tokens"), pybind11::arg("pos0"),
             pybind11::arg("start"), pybind11::call_guard<pybind11::gil_scoped_release>())
        .def("paged", &FusedDecoder::paged, "hidden states (N, C) after ln_f of an engine step's N rows over the "
             "paged pools (their K/V written at their slots), in chunks of kMaxRows rows",
             pybind11::arg("tokens"), pybind11::arg("positions"), pybind11::arg("slot_mapping"),
             pybind11::arg("block_tables"), pybind11::arg("context_lens"), pybind11::arg("query_lens"),
             pybind11::arg("k_pools"), pybind11::arg("v_pools"), pybind11::call_guard<pybind11::gil_scoped_release>())
        .def("head", &FusedDecoder::head, "logits (R, V) of hidden rows h (R, C): the tied head",
             pybind11::call_guard<pybind11::gil_scoped_release>())
        .def("products", &FusedDecoder::products, "the step's matrix-vector products alone, `times` over",
             pybind11::call_guard<pybind11::gil_scoped_release>())
        .def_property_readonly("max_len", &FusedDecoder::max_len);
    pybind11::class_<TensorWatch>(m, "TensorWatch")
        .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>>(), pybind11::arg("watched"),
             pybind11::arg("reads"))
        .def("changed", &TensorWatch::changed, "the index of the first watched tensor whose view of memory or (where "
             "the step reads a copy) values changed since the watch was built; -1 if none");
    pybind11::class_<ObjectWatch>(m, "ObjectWatch")
        .def(pybind11::init<std::vector<ObjectWatch::Held>, std::vector<std::pair<pybind11::dict, int64_t>>,
                            std::vector<std::pair<pybind11::dict, std::vector<pybind11::object>>>,
                            std::vector<ObjectWatch::Owned>, std::vector<ObjectWatch::ClassHeld>,
                            std::vector<std::pair<pybind11::type, int64_t>>>(),
             pybind11::arg("held"), pybind11::arg("sized"), pybind11::arg("ordered"), pybind11::arg("owned"),
             pybind11::arg("class_held"), pybind11::arg("class_sized"))
        .def("changed", &ObjectWatch::changed, "whether any dict holds another object under a key, has another size "
             "or key order, or any object another type or instance dict, than when the watch was built");
}

}  // namespace minillm
