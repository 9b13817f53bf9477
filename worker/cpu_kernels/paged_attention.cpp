// Decode attention over the paged KV pool on the CPU: one query token per sequence attends its whole context, read
// in place from the pool's blocks (no gathered copy), grouped-query heads sharing each K/V row as it is read.
//
//   q            [S, H, D] float32            (D a multiple of 8; H a multiple of KVH)
//   k/v pools    [B, KVH, BS, D] float32 or bfloat16, one layer's
//   block_tables [S, max_blocks] int32        token t of sequence s is at block_tables[s, t / BS], offset t % BS
//   context_lens [S] int32 (>= 1; the new token's K/V already written)
//   out          [S, H, D] float32
//
// Per (sequence, KV head), the scores of its H / KVH query heads over every context token (scale * q . k, fp32),
// then an exact two-pass softmax (max, then exp(score - max) with a vectorised expf) and sum_t p_t v_t / sum_t p_t.
// Every output depends on its own sequence only, computed in a fixed order: batch invariant; threads split the
// (sequence, KV head) pairs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using sluice::exp256;
using sluice::hsum;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

constexpr int kMaxGroup = 16;  // query heads per KV head handled together

template <typename T>
void attend_one(const float* q, const T* k_pool, const T* v_pool, const int32_t* table, int64_t len,
                int64_t kvh, int64_t KVH, int64_t BS, int64_t D, int64_t group, float scale, float* scores,
                float* out) {
  // q: the group's query heads [group, D]; scores: [group, len] scratch; out: [group, D]
  const int64_t vecs = D / 8;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t row = (static_cast<int64_t>(table[t / BS]) * KVH + kvh) * BS + t % BS;
    const T* k = k_pool + row * D;
    __m256 acc[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t j = 0; j < vecs; ++j) {
      const __m256 kv = load8(k + 8 * j);
      for (int64_t g = 0; g < group; ++g) acc[g] = _mm256_fmadd_ps(load8(q + g * D + 8 * j), kv, acc[g]);
    }
    for (int64_t g = 0; g < group; ++g) scores[g * len + t] = hsum(acc[g]) * scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) max_score = std::max(max_score, sg[t]);
    const __m256 vmax = _mm256_set1_ps(max_score);
    __m256 vsum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
      const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vmax));
      _mm256_storeu_ps(sg + t, p);
      vsum = _mm256_add_ps(vsum, p);
    }
    float sum = hsum(vsum);
    if (t < len) {  // the tail through the same vector exp, padded with -inf (exp -> 0)
      alignas(32) float tail[8];
      for (int i = 0; i < 8; ++i) tail[i] = t + i < len ? sg[t + i] - max_score : -std::numeric_limits<float>::infinity();
      _mm256_store_ps(tail, exp256(_mm256_load_ps(tail)));
      for (int64_t i = 0; t + i < len; ++i) {
        sg[t + i] = tail[i];
        sum += tail[i];
      }
    }
    const float inv = 1.0f / sum;
    float* og = out + g * D;
    for (int64_t j0 = 0; j0 < vecs; j0 += 8) {  // at most 8 output vectors (64 floats) in registers at once
      const int64_t nj = std::min<int64_t>(8, vecs - j0);
      __m256 o[8];
      for (int64_t j = 0; j < nj; ++j) o[j] = _mm256_setzero_ps();
      for (int64_t u = 0; u < len; ++u) {
        const int64_t row = (static_cast<int64_t>(table[u / BS]) * KVH + kvh) * BS + u % BS;
        const T* v = v_pool + row * D + 8 * j0;
        const __m256 p = _mm256_set1_ps(sg[u]);
        for (int64_t j = 0; j < nj; ++j) o[j] = _mm256_fmadd_ps(p, load8(v + 8 * j), o[j]);
      }
      const __m256 vinv = _mm256_set1_ps(inv);
      for (int64_t j = 0; j < nj; ++j) _mm256_storeu_ps(og + 8 * (j0 + j), _mm256_mul_ps(o[j], vinv));
    }
  }
}

template <typename T>
void attend_all(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                const torch::Tensor& block_tables, const int32_t* lens, float scale, torch::Tensor& out) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_pool.size(1), BS = k_pool.size(2), group = H / KVH;
  const int64_t max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(k_pool.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_pool.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / KVH, kvh = item % KVH;
      const int64_t len = lens[s];
      scores.resize(group * len);
      const int64_t head = s * H + kvh * group;
      attend_one<T>(qp + head * D, kp, vp, tables + s * max_blocks, len, kvh, KVH, BS, D, group, scale,
                    scores.data(), op + head * D);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be a contiguous [S, H, D] float32 tensor");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
              v_pool.is_contiguous() && k_pool.scalar_type() == v_pool.scalar_type(),
              "k and v pools must be contiguous [B, KVH, BS, D] tensors of one dtype");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(1), BS = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == D && D % 8 == 0, "head_dim ", D, " must match the pool and be a multiple of 8");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxGroup, "heads ", H, " must be a multiple of KV heads ", KVH,
              " (at most ", kMaxGroup, " per KV head)");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S && block_tables.scalar_type() == torch::kInt32 &&
              block_tables.is_contiguous(), "block_tables must be a contiguous [S, max_blocks] int32 tensor");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == S && context_lens.scalar_type() == torch::kInt32 &&
              context_lens.is_contiguous(), "context_lens must be a contiguous [S] int32 tensor");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t num_blocks = k_pool.size(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lens[s] >= 1 && (lens[s] + BS - 1) / BS <= block_tables.size(1),
                "context length ", lens[s], " of sequence ", s, " does not fit its block table");
    for (int64_t b = 0; b < (lens[s] + BS - 1) / BS; ++b) {
      const int32_t block = tables[s * block_tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the pool of ", num_blocks);
    }
  }
  auto out = torch::empty({S, H, D}, q.options());
  if (k_pool.scalar_type() == torch::kFloat32) {
    attend_all<float>(q, k_pool, v_pool, block_tables, lens, static_cast<float>(scale), out);
  } else {
    TORCH_CHECK(k_pool.scalar_type() == torch::kBFloat16, "the pool must be float32 or bfloat16");
    attend_all<c10::BFloat16>(q, k_pool, v_pool, block_tables, lens, static_cast<float>(scale), out);
  }
  return out;
}
