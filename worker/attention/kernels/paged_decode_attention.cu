// Paged decode attention: one query token per sequence against its paged K/V, grouped-query aware,
// split along the context (flash-decoding) for long sequences.
//
// ── Math ────────────────────────────────────────────────────────────────────────────────────────────────────
// For sequence s, query head h (KV head kvh = h / G, G = num_heads / num_kv_heads) and context positions
// t in [0, L_s):
//     x_t  = (q[s,h] · K[s,kvh,t]) * scale                        (the score)
//     out  = Σ_t softmax(x)_t V[s,kvh,t] = Σ_t e^(x_t - M) V_t / Σ_t e^(x_t - M),  M = max_t x_t
// Scores are kept in the log2 domain: q is pre-multiplied by scale * log2(e), so e^(x - M) = 2^(y - m) with
// y = x * log2(e), and the exponential is one ex2.approx instruction. All sums and products are fp32.
//
// Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022): a running (m, l, o) over the
// tiles of tokens that one warp visits, for each tile T:
//     m' = max(m, max_{t∈T} y_t);  α = 2^(m - m');  l' = α l + Σ_{t∈T} 2^(y_t - m');  o' = α o + Σ_{t∈T} 2^(y_t - m') V_t
// Two partial states (m_a, l_a, o_a), (m_b, l_b, o_b) over disjoint token sets merge the same way:
//     m = max(m_a, m_b);  l = l_a 2^(m_a - m) + l_b 2^(m_b - m);  o = o_a 2^(m_a - m) + o_b 2^(m_b - m)
// This merge combines the 4 warps of a CTA (through shared memory) and, in the split path, the partitions
// (flash-decoding, Dao et al. 2023; vLLM's paged_attention_v2): each partition stores its normalised output
// o/l with its m and l, and the reduce kernel computes w_p = l_p 2^(m_p - M), out = Σ_p w_p (o_p/l_p) / Σ_p w_p.
// worker/attention/partitioned_ref.py runs this exact schedule in NumPy and is tested against plain softmax.
//
// ── Grid → work ─────────────────────────────────────────────────────────────────────────────────────────────
// decode kernels (paged_decode_* and paged_decode_split_*), 128 threads = 4 warps per CTA:
//     blockIdx.x = kv_head * num_head_chunks + chunk   the CTA serves query heads
//                                                       [kv_head*G + chunk*H, kv_head*G + chunk*H + H) ∩ group,
//                                                       H = kHeadsPerCta ∈ {1,2,4,8} (template), chunks = ceil(G/H)
//     blockIdx.y = sequence
//     blockIdx.z = partition p: tokens [p*P, min((p+1)*P, L_s)), P = partition_tokens (a multiple of block_size);
//                  a CTA whose partition starts at or past L_s exits at once (shorter sequences of the batch).
// Every K/V tile a CTA loads is used by all H query heads it serves: with G <= 8 each K/V block is read from
// memory once per KV head (G > 8 reloads it once per chunk of 8 heads).
// Warp w of the CTA takes the partition's blocks w, w+4, w+8, ... (its id fetched 32 at a time: lane j holds
// the block id of the warp's j-th next block, broadcast by shuffle). A block is visited in tiles of
// kTileTokens tokens. Inside a warp, a K or V row of head_dim elements is read by kLanesPerToken = head_dim/8
// lanes, 16 bytes (8 elements) each, so one warp-wide load covers kTokensPerIter = 32 / kLanesPerToken rows
// of one block, which are contiguous in memory: every load is a 16-byte vector and a warp reads 512
// consecutive bytes. Lane = token_slot * kLanesPerToken + dim_slot owns dims [8*dim_slot, 8*dim_slot + 8) of
// tokens tile_start + i*kTokensPerIter + token_slot, i < kItersPerTile. A score is the fp32 dot product of
// the lane's 8 dims, summed over the kLanesPerToken lanes by xor-shuffles; the running max is warp-uniform,
// l and o stay per lane and are summed over token slots once at the end of the warp's work.
// reduce kernel (paged_decode_reduce_*), blockDim.x = 128: blockIdx.x = query head, blockIdx.y = sequence.
//
// ── Tensors (all row-major; element strides are int64) ─────────────────────────────────────────────────────
//   KV pool   [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]; the kernel gets one layer's
//             K view and V view, each [num_blocks, num_kv_heads, block_size, head_dim] with strides
//             (kv_block_stride, kv_head_stride, head_dim, 1): a (block, kv head) tile of block_size*head_dim
//             elements is contiguous. Offsets into the pool are 64-bit (block_id * kv_block_stride).
//   q              [num_seqs, num_heads, head_dim], strides (q_seq_stride, q_head_stride, 1)
//   block_tables   [num_seqs, block_table_stride] int32; entry b = pool block of tokens [b*bs, (b+1)*bs)
//   context_lens   [num_seqs] int32, tokens of context (the new token's K/V already written), >= 1
//   out            [num_seqs, num_heads, head_dim] contiguous, q's dtype
//   partial_out    [num_seqs, num_heads, num_partitions, head_dim] fp32 (split path): o_p / l_p
//   partial_max    [num_seqs, num_heads, num_partitions] fp32 (split path): m_p, log2 domain
//   partial_sum    [num_seqs, num_heads, num_partitions] fp32 (split path): l_p
// Assumptions (checked by worker/attention/cupy_paged.py before launch): every pointer 16-byte aligned and every
// stride a multiple of 8 elements; block ids < num_blocks; num_heads % num_kv_heads == 0; num_partitions <=
// kMaxPartitions. A context length of 0 gives an all-zero output row.
//
// ── Resources ───────────────────────────────────────────────────────────────────────────────────────────────
// Shared memory (static): decode CTA 4 warps × H heads × (head_dim + 2) floats for the warp merge:
// 4.2 KB (H=2, d=128) … 16.6 KB (H=8, d=128); reduce CTA kMaxPartitions floats of weights + 8 floats = 2 KB.
// Registers: per lane H*8 fp32 of q, H*8 of o, kItersPerTile*H scores, 2*kItersPerTile 16-byte K/V vectors in
// flight (kItersPerTile = 8 for H <= 4, 4 for H = 8). __launch_bounds__(128, 2) caps them at 255 and no instance
// spills (tests/worker/test_kernel_compile.py checks ptxas' report); sm_90, H=4, d=128, bs=16 uses 221 registers:
// 2 CTAs = 8 warps per SM, each warp with up to 16 16-byte loads (8 KB) in flight. Batch 1 or a few sequences get
// their parallelism from the split (cupy_paged.py plans it from the SM count and this occupancy).
//
// ── Build ───────────────────────────────────────────────────────────────────────────────────────────────────
// Self-contained: no #include, so it builds the same with nvcc and NVRTC (CuPy RawModule). With
// SLUICE_HOST_EMULATION defined, the five inline-PTX helpers take plain C++ forms so that a host C++ compiler can
// run the kernels, lane by lane, on the CPU (tests/worker/test_kernel_emulation.py supplies the CUDA built-ins). bf16/fp16 are
// handled as 16-bit storage (bf16: shift into the high half of an fp32; fp16: cvt.f32.f16) with fp32 math.
// Every instantiation has an extern "C" entry point named
//     paged_decode_<dtype>_d<head_dim>_b<block_size>_g<H>          single pass, writes out
//     paged_decode_split_<dtype>_d<head_dim>_b<block_size>_g<H>    one partition, writes partial_*
//     paged_decode_reduce_<dtype>_d<head_dim>                      combines partitions into out
// with dtype ∈ {bf16, f16}. All are compiled unless SLUICE_SELECT is defined; then only the groups named by
// SLUICE_SELECT_<dtype>_d<head_dim>_b<block_size> and SLUICE_SELECT_REDUCE_<dtype>_d<head_dim> are.

namespace sluice {

constexpr int kWarpSize = 32;
constexpr int kNumWarps = 4;
constexpr int kThreads = kWarpSize * kNumWarps;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxPartitions = 512;
constexpr int kMinCtasPerSm = 2;  // __launch_bounds__ of the decode kernels: at most 255 registers, no spills
constexpr int kVecElems = 8;  // 16-byte vectors of 16-bit elements

__host__ __device__ constexpr int const_min(int a, int b) { return a < b ? a : b; }

// 16-bit storage types: the kernel never does 16-bit arithmetic, it only converts.
struct __align__(2) bf16_t {
  unsigned short bits;
};
struct __align__(2) f16_t {
  unsigned short bits;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; 2^-inf = +0
#ifdef SLUICE_HOST_EMULATION
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

struct Bf16 {
  using storage = bf16_t;
  // Two packed bf16 (element 0 in the low half) to fp32: bf16 is the high half of an fp32.
  static __device__ __forceinline__ void unpack2(unsigned int x, float& lo, float& hi) {
    lo = __uint_as_float(x << 16);
    hi = __uint_as_float(x & 0xffff0000u);
  }
  // fp32 to bf16, round to nearest even; NaN stays NaN.
  static __device__ __forceinline__ unsigned short pack(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      return static_cast<unsigned short>((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<unsigned short>(u >> 16);
  }
};

struct F16 {
  using storage = f16_t;
  static __device__ __forceinline__ void unpack2(unsigned int x, float& lo, float& hi) {
    const unsigned short a = static_cast<unsigned short>(x & 0xffffu);
    const unsigned short b = static_cast<unsigned short>(x >> 16);
#ifdef SLUICE_HOST_EMULATION
    lo = host_f16_to_float(a);
    hi = host_f16_to_float(b);
#else
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(a));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(b));
#endif
  }
  static __device__ __forceinline__ unsigned short pack(float f) {  // round to nearest even
#ifdef SLUICE_HOST_EMULATION
    return host_float_to_f16(f);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
  }
};

template <class Traits>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[kVecElems]) {
  Traits::unpack2(v.x, f[0], f[1]);
  Traits::unpack2(v.y, f[2], f[3]);
  Traits::unpack2(v.z, f[4], f[5]);
  Traits::unpack2(v.w, f[6], f[7]);
}

// 16-byte read-only load that bypasses L1: K/V are streamed once.
__device__ __forceinline__ uint4 load_stream_16b(const void* ptr) {
#ifdef SLUICE_HOST_EMULATION
  return *static_cast<const uint4*>(ptr);
#else
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
#endif
}

__device__ __forceinline__ uint4 load_16b(const void* ptr) {
#ifdef SLUICE_HOST_EMULATION
  return *static_cast<const uint4*>(ptr);
#else
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
#endif
}

// Tile geometry of one (head_dim, block_size, heads per CTA) instance; mirrored by partitioned_ref.py.
template <int kHeadDim, int kBlockSize, int kHeadsPerCta>
struct Geometry {
  static constexpr int kLanesPerToken = kHeadDim / kVecElems;            // 16 (d=128) or 8 (d=64)
  static constexpr int kTokensPerIter = kWarpSize / kLanesPerToken;      // 2 or 4 rows per warp-wide load
  static constexpr int kMaxItersPerTile = kHeadsPerCta <= 4 ? 8 : 4;     // bounds registers
  static constexpr int kItersPerTile = const_min(kMaxItersPerTile, kBlockSize / kTokensPerIter);
  static constexpr int kTileTokens = kItersPerTile * kTokensPerIter;
  static constexpr int kTilesPerBlock = kBlockSize / kTileTokens;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim must be 64, 128 or 256");
  static_assert(kWarpSize % kLanesPerToken == 0, "a warp must hold whole rows");
  static_assert(kBlockSize % kTileTokens == 0, "tiles must divide a block");
};

// The decode body: see the header comment. kSplit = false writes `out` (single pass, one partition covering the
// whole context); kSplit = true writes this partition's (o/l, m, l) to partial_*.
template <class Traits, int kHeadDim, int kBlockSize, int kHeadsPerCta, bool kSplit>
__device__ __forceinline__ void paged_decode_body(
    typename Traits::storage* __restrict__ out,                // [num_seqs, num_heads, head_dim]
    float* __restrict__ partial_out,                           // [num_seqs, num_heads, num_partitions, head_dim]
    float* __restrict__ partial_max,                           // [num_seqs, num_heads, num_partitions]
    float* __restrict__ partial_sum,                           // [num_seqs, num_heads, num_partitions]
    const typename Traits::storage* __restrict__ q,            // [num_seqs, num_heads, head_dim] (strided)
    const typename Traits::storage* __restrict__ k_cache,      // [num_blocks, num_kv_heads, block_size, head_dim]
    const typename Traits::storage* __restrict__ v_cache,      // [num_blocks, num_kv_heads, block_size, head_dim]
    const int* __restrict__ block_tables,                      // [num_seqs, block_table_stride]
    const int* __restrict__ context_lens,                      // [num_seqs]
    float scale, int num_heads, int num_kv_heads, long long q_seq_stride, long long q_head_stride,
    long long kv_block_stride, long long kv_head_stride, int block_table_stride, int partition_tokens) {
  using T = typename Traits::storage;
  using G = Geometry<kHeadDim, kBlockSize, kHeadsPerCta>;
  constexpr int kLanesPerToken = G::kLanesPerToken;
  constexpr int kTokensPerIter = G::kTokensPerIter;
  constexpr int kIters = G::kItersPerTile;
  constexpr int H = kHeadsPerCta;

  __shared__ float s_max[kNumWarps][H];
  __shared__ float s_sum[kNumWarps][H];
  __shared__ __align__(16) float s_out[kNumWarps][H][kHeadDim];

  const int seq = blockIdx.y;
  const int partition = blockIdx.z;
  const int num_partitions = gridDim.z;
  const int group_size = num_heads / num_kv_heads;
  const int num_head_chunks = (group_size + H - 1) / H;
  const int kv_head = blockIdx.x / num_head_chunks;
  const int head0 = kv_head * group_size + (blockIdx.x % num_head_chunks) * H;
  const int num_heads_here = const_min(H, kv_head * group_size + group_size - head0);

  const int context_len = context_lens[seq];
  const int token_begin = partition * partition_tokens;
  if (context_len <= 0) {  // empty context: zero output (single pass; the reduce kernel does the split path)
    if (!kSplit) {
      for (int idx = threadIdx.x; idx < num_heads_here * kHeadDim; idx += kThreads) {
        const long long row = static_cast<long long>(seq) * num_heads + head0 + idx / kHeadDim;
        out[row * kHeadDim + idx % kHeadDim].bits = 0;
      }
    }
    return;
  }
  if (token_begin >= context_len) {
    return;  // CTA-uniform, before any barrier: this sequence is shorter than the launched partitions
  }
  const int token_end = const_min(context_len, token_begin + partition_tokens);
  const int block_begin = token_begin / kBlockSize;
  const int block_end = (token_end + kBlockSize - 1) / kBlockSize;

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int dim_slot = lane % kLanesPerToken;
  const int token_slot = lane / kLanesPerToken;

  // q[h][8 dims of this lane], pre-scaled into the log2 domain.
  float q_reg[H][kVecElems];
  const float q_scale = scale * kLog2e;
#pragma unroll
  for (int h = 0; h < H; ++h) {
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if (h < num_heads_here) {
      raw = load_16b(q + seq * q_seq_stride + (head0 + h) * q_head_stride + dim_slot * kVecElems);
    }
    unpack8<Traits>(raw, q_reg[h]);
#pragma unroll
    for (int e = 0; e < kVecElems; ++e) q_reg[h][e] *= q_scale;
  }

  float m[H], l[H], o[H][kVecElems];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    m[h] = neg_inf();
    l[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < kVecElems; ++e) o[h][e] = 0.0f;
  }

  const int* __restrict__ table = block_tables + static_cast<long long>(seq) * block_table_stride;
  const long long head_offset = kv_head * kv_head_stride + dim_slot * kVecElems;
  int prefetched_ids = 0;
  int j = 0;
#pragma unroll 1
  for (int blk = block_begin + warp; blk < block_end; blk += kNumWarps, ++j) {
    if ((j % kWarpSize) == 0) {  // fetch the ids of this warp's next 32 blocks, one per lane
      const int ahead = blk + lane * kNumWarps;
      prefetched_ids = ahead < block_end ? table[ahead] : 0;
    }
    const long long block_id = __shfl_sync(kFullMask, prefetched_ids, j % kWarpSize);
    const T* __restrict__ k_block = k_cache + block_id * kv_block_stride + head_offset;
    const T* __restrict__ v_block = v_cache + block_id * kv_block_stride + head_offset;

#pragma unroll 1
    for (int tile = 0; tile < G::kTilesPerBlock; ++tile) {
      const int tile_start = blk * kBlockSize + tile * G::kTileTokens;  // absolute position
      if (tile_start >= token_end) {
        break;  // warp-uniform
      }
      uint4 k_raw[kIters], v_raw[kIters];
      bool valid[kIters];
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        const int row = tile * G::kTileTokens + i * kTokensPerIter + token_slot;  // row within the block
        valid[i] = blk * kBlockSize + row < token_end;
        k_raw[i] = make_uint4(0u, 0u, 0u, 0u);
        v_raw[i] = make_uint4(0u, 0u, 0u, 0u);
        if (valid[i]) {
          k_raw[i] = load_stream_16b(k_block + row * kHeadDim);
          v_raw[i] = load_stream_16b(v_block + row * kHeadDim);
        }
      }

      // Scores of this lane's rows for every head: partial dot over 8 dims, then summed over the row's lanes.
      float score[kIters][H];
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        float kf[kVecElems];
        unpack8<Traits>(k_raw[i], kf);
#pragma unroll
        for (int h = 0; h < H; ++h) {
          float dot = 0.0f;
#pragma unroll
          for (int e = 0; e < kVecElems; ++e) dot = fmaf(q_reg[h][e], kf[e], dot);
          score[i][h] = dot;
        }
      }
#pragma unroll
      for (int mask = kLanesPerToken / 2; mask >= 1; mask /= 2) {
#pragma unroll
        for (int i = 0; i < kIters; ++i) {
#pragma unroll
          for (int h = 0; h < H; ++h) score[i][h] += __shfl_xor_sync(kFullMask, score[i][h], mask);
        }
      }

      // Online softmax update; the running max is the same in every lane of the warp.
#pragma unroll
      for (int h = 0; h < H; ++h) {
        float tile_max = neg_inf();
#pragma unroll
        for (int i = 0; i < kIters; ++i) {
          if (!valid[i]) score[i][h] = neg_inf();
          tile_max = fmaxf(tile_max, score[i][h]);
        }
#pragma unroll
        for (int mask = kLanesPerToken; mask < kWarpSize; mask *= 2) {
          tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, mask));
        }
        const float m_new = fmaxf(m[h], tile_max);
        const float alpha = fast_exp2(m[h] - m_new);  // 0 on the first tile (m = -inf)
        m[h] = m_new;
        l[h] *= alpha;
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) o[h][e] *= alpha;
      }
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        float vf[kVecElems];
        unpack8<Traits>(v_raw[i], vf);  // zero for masked rows, whose p is 0 too
#pragma unroll
        for (int h = 0; h < H; ++h) {
          const float p = fast_exp2(score[i][h] - m[h]);
          l[h] += p;
#pragma unroll
          for (int e = 0; e < kVecElems; ++e) o[h][e] = fmaf(p, vf[e], o[h][e]);
        }
      }
    }
  }

  // Sum l and o over the warp's token slots: lanes with the same dim_slot.
#pragma unroll
  for (int mask = kLanesPerToken; mask < kWarpSize; mask *= 2) {
#pragma unroll
    for (int h = 0; h < H; ++h) {
      l[h] += __shfl_xor_sync(kFullMask, l[h], mask);
#pragma unroll
      for (int e = 0; e < kVecElems; ++e) o[h][e] += __shfl_xor_sync(kFullMask, o[h][e], mask);
    }
  }
  if (token_slot == 0) {
#pragma unroll
    for (int h = 0; h < H; ++h) {
      float4* dst = reinterpret_cast<float4*>(&s_out[warp][h][dim_slot * kVecElems]);
      dst[0] = make_float4(o[h][0], o[h][1], o[h][2], o[h][3]);
      dst[1] = make_float4(o[h][4], o[h][5], o[h][6], o[h][7]);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < H; ++h) {
      s_max[warp][h] = m[h];
      s_sum[warp][h] = l[h];
    }
  }
  __syncthreads();

  // Merge the 4 warps (a warp with no tokens has m = -inf and weight 0), then write.
  for (int idx = threadIdx.x; idx < num_heads_here * kHeadDim; idx += kThreads) {
    const int h = idx / kHeadDim;
    const int d = idx % kHeadDim;
    float m_all = neg_inf();
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) m_all = fmaxf(m_all, s_max[w][h]);
    float l_all = 0.0f;
    float o_all = 0.0f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      const float weight = s_max[w][h] == neg_inf() ? 0.0f : fast_exp2(s_max[w][h] - m_all);
      l_all = fmaf(s_sum[w][h], weight, l_all);
      o_all = fmaf(s_out[w][h][d], weight, o_all);
    }
    const long long row = static_cast<long long>(seq) * num_heads + head0 + h;  // [seq, head]
    if (kSplit) {
      const long long part_row = row * num_partitions + partition;
      partial_out[part_row * kHeadDim + d] = o_all / l_all;
      if (d == 0) {
        partial_max[part_row] = m_all;
        partial_sum[part_row] = l_all;
      }
    } else {
      out[row * kHeadDim + d].bits = Traits::pack(o_all / l_all);
    }
  }
}

// Combine the partitions of each (sequence, head): out = Σ_p w_p o_p / Σ_p w_p, w_p = l_p 2^(m_p - M).
template <class Traits, int kHeadDim>
__device__ __forceinline__ void paged_decode_reduce_body(
    typename Traits::storage* __restrict__ out,    // [num_seqs, num_heads, head_dim]
    const float* __restrict__ partial_out,         // [num_seqs, num_heads, num_partitions, head_dim]
    const float* __restrict__ partial_max,         // [num_seqs, num_heads, num_partitions]
    const float* __restrict__ partial_sum,         // [num_seqs, num_heads, num_partitions]
    const int* __restrict__ context_lens,          // [num_seqs]
    int num_heads, int num_partitions, int partition_tokens) {
  __shared__ float s_weight[kMaxPartitions];
  __shared__ float s_scratch[kNumWarps];
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const long long row = static_cast<long long>(seq) * num_heads + head;
  const int context_len = context_lens[seq];
  const int used =
      context_len <= 0 ? 0 : const_min(num_partitions, (context_len + partition_tokens - 1) / partition_tokens);
  const float* __restrict__ maxes = partial_max + row * num_partitions;
  const float* __restrict__ sums = partial_sum + row * num_partitions;

  float local = neg_inf();
  for (int p = threadIdx.x; p < used; p += kThreads) local = fmaxf(local, maxes[p]);
#pragma unroll
  for (int mask = kWarpSize / 2; mask >= 1; mask /= 2) local = fmaxf(local, __shfl_xor_sync(kFullMask, local, mask));
  if (lane == 0) s_scratch[warp] = local;
  __syncthreads();
  float m_all = neg_inf();
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) m_all = fmaxf(m_all, s_scratch[w]);
  __syncthreads();

  float local_sum = 0.0f;
  for (int p = threadIdx.x; p < used; p += kThreads) {
    const float weight = sums[p] * fast_exp2(maxes[p] - m_all);
    s_weight[p] = weight;
    local_sum += weight;
  }
#pragma unroll
  for (int mask = kWarpSize / 2; mask >= 1; mask /= 2) local_sum += __shfl_xor_sync(kFullMask, local_sum, mask);
  if (lane == 0) s_scratch[warp] = local_sum;
  __syncthreads();
  float l_all = 0.0f;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) l_all += s_scratch[w];
  const float inv_l = used == 0 ? 0.0f : 1.0f / l_all;

  const float* __restrict__ outs = partial_out + row * num_partitions * kHeadDim;
  for (int d = threadIdx.x; d < kHeadDim; d += kThreads) {
    float acc = 0.0f;
#pragma unroll 8
    for (int p = 0; p < used; ++p) acc = fmaf(s_weight[p], outs[static_cast<long long>(p) * kHeadDim + d], acc);
    out[row * kHeadDim + d].bits = Traits::pack(acc * inv_l);
  }
}

}  // namespace sluice

// ── extern "C" entry points ─────────────────────────────────────────────────────────────────────────────────

#define SLUICE_DECODE_PARAMS(T)                                                                              \
  T *__restrict__ out, float *__restrict__ partial_out, float *__restrict__ partial_max,                     \
      float *__restrict__ partial_sum, const T *__restrict__ q, const T *__restrict__ k_cache,               \
      const T *__restrict__ v_cache, const int *__restrict__ block_tables, const int *__restrict__ context_lens, \
      float scale, int num_heads, int num_kv_heads, long long q_seq_stride, long long q_head_stride,         \
      long long kv_block_stride, long long kv_head_stride, int block_table_stride, int partition_tokens

#define SLUICE_DECODE_ARGS                                                                                   \
  out, partial_out, partial_max, partial_sum, q, k_cache, v_cache, block_tables, context_lens, scale,        \
      num_heads, num_kv_heads, q_seq_stride, q_head_stride, kv_block_stride, kv_head_stride,                 \
      block_table_stride, partition_tokens

#define SLUICE_DECODE_ENTRY(NAME, TRAITS, D, B, H)                                                           \
  extern "C" __global__ void __launch_bounds__(sluice::kThreads, sluice::kMinCtasPerSm)                       \
      paged_decode_##NAME##_d##D##_b##B##_g##H(SLUICE_DECODE_PARAMS(sluice::TRAITS::storage)) {              \
    sluice::paged_decode_body<sluice::TRAITS, D, B, H, false>(SLUICE_DECODE_ARGS);                           \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(sluice::kThreads, sluice::kMinCtasPerSm)                       \
      paged_decode_split_##NAME##_d##D##_b##B##_g##H(SLUICE_DECODE_PARAMS(sluice::TRAITS::storage)) {        \
    sluice::paged_decode_body<sluice::TRAITS, D, B, H, true>(SLUICE_DECODE_ARGS);                            \
  }

#define SLUICE_DECODE_GROUP(NAME, TRAITS, D, B) \
  SLUICE_DECODE_ENTRY(NAME, TRAITS, D, B, 1)    \
  SLUICE_DECODE_ENTRY(NAME, TRAITS, D, B, 2)    \
  SLUICE_DECODE_ENTRY(NAME, TRAITS, D, B, 4)    \
  SLUICE_DECODE_ENTRY(NAME, TRAITS, D, B, 8)

#define SLUICE_REDUCE_ENTRY(NAME, TRAITS, D)                                                                 \
  extern "C" __global__ void __launch_bounds__(sluice::kThreads) paged_decode_reduce_##NAME##_d##D(          \
      sluice::TRAITS::storage *__restrict__ out, const float *__restrict__ partial_out,                     \
      const float *__restrict__ partial_max, const float *__restrict__ partial_sum,                         \
      const int *__restrict__ context_lens, int num_heads, int num_partitions, int partition_tokens) {       \
    sluice::paged_decode_reduce_body<sluice::TRAITS, D>(out, partial_out, partial_max, partial_sum,          \
                                                        context_lens, num_heads, num_partitions,             \
                                                        partition_tokens);                                   \
  }

#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_bf16_d64_b16)
SLUICE_DECODE_GROUP(bf16, Bf16, 64, 16)
#endif
#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_bf16_d64_b32)
SLUICE_DECODE_GROUP(bf16, Bf16, 64, 32)
#endif
#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_bf16_d128_b16)
SLUICE_DECODE_GROUP(bf16, Bf16, 128, 16)
#endif
#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_bf16_d128_b32)
SLUICE_DECODE_GROUP(bf16, Bf16, 128, 32)
#endif
#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_f16_d64_b16)
SLUICE_DECODE_GROUP(f16, F16, 64, 16)
#endif
#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_f16_d64_b32)
SLUICE_DECODE_GROUP(f16, F16, 64, 32)
#endif
#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_f16_d128_b16)
SLUICE_DECODE_GROUP(f16, F16, 128, 16)
#endif
#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_f16_d128_b32)
SLUICE_DECODE_GROUP(f16, F16, 128, 32)
#endif

#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_REDUCE_bf16_d64)
SLUICE_REDUCE_ENTRY(bf16, Bf16, 64)
#endif
#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_REDUCE_bf16_d128)
SLUICE_REDUCE_ENTRY(bf16, Bf16, 128)
#endif
#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_REDUCE_f16_d64)
SLUICE_REDUCE_ENTRY(f16, F16, 64)
#endif
#if !defined(SLUICE_SELECT) || defined(SLUICE_SELECT_REDUCE_f16_d128)
SLUICE_REDUCE_ENTRY(f16, F16, 128)
#endif
