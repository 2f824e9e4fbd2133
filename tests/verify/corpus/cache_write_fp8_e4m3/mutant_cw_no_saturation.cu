// Hand-written cache write for spec cache_write_fp8_e4m3, from `kgen abi`: stores the new
// fp16 K/V rows of each token into an fp8 (e4m3) NHD cache [num_blocks, 16, 8, 128] with one
// scale per KV head (stored = real / scale, round-to-nearest-even, saturated to +-448).
//
// Launch (kgen's): grid (num_tokens, ceil(2 * 8 / 4)), 128 threads = 4 warps. Block x owns
// token x; each warp writes one row (K or V of one KV head) at a time, its lanes striding
// over head_dim.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

struct Cfg {
  typedef __half in_t;
  typedef __nv_fp8_e4m3 kv_t;
};

constexpr int NUM_KV_HEADS = 8;
constexpr int HEAD_DIM = 128;
constexpr int BLOCK_SIZE = 16;
constexpr int NUM_WARPS = 128 / 32;

extern "C" __global__ void __launch_bounds__(128) cache_write_fp8_e4m3(
    const Cfg::in_t* __restrict__ key, const Cfg::in_t* __restrict__ value, Cfg::kv_t* __restrict__ k_cache,
    Cfg::kv_t* __restrict__ v_cache, float* __restrict__ k_scale, float* __restrict__ v_scale,
    const int* __restrict__ slot_mapping, long long num_slots, long long key_s_tok, long long key_s_head,
    long long val_s_tok, long long val_s_head, long long k_s_block, long long k_s_head, long long k_s_token,
    long long k_s_run, long long v_s_block, long long v_s_head, long long v_s_token, long long v_s_run,
    long long ks_s_block, long long ks_s_head, long long ks_s_token, long long vs_s_block, long long vs_s_head,
    long long vs_s_token) {
  // Unused here: NHD rows are contiguous (no run stride); per-head scales are a plain [8] array
  // that this kernel only reads.
  (void)k_s_run, (void)v_s_run, (void)ks_s_block, (void)ks_s_head, (void)ks_s_token;
  (void)vs_s_block, (void)vs_s_head, (void)vs_s_token;

  const long long token = blockIdx.x;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;  // -1: a padding token, nothing to store
  const long long block = slot / BLOCK_SIZE;
  const int offset = slot % BLOCK_SIZE;

  for (int row = blockIdx.y * NUM_WARPS + warp; row < 2 * NUM_KV_HEADS; row += gridDim.y * NUM_WARPS) {
    const bool is_v = row >= NUM_KV_HEADS;
    const int head = is_v ? row - NUM_KV_HEADS : row;
    const __half* src = is_v ? value + token * val_s_tok + head * val_s_head
                             : key + token * key_s_tok + head * key_s_head;
    __nv_fp8_e4m3* dst = is_v ? v_cache + block * v_s_block + offset * v_s_token + head * v_s_head
                              : k_cache + block * k_s_block + offset * k_s_token + head * k_s_head;
    const float scale = is_v ? v_scale[head] : k_scale[head];
    for (int d = lane; d < HEAD_DIM; d += 32) {
      const float x = __half2float(src[d]) / scale;
      dst[d].__x = __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E4M3);
    }
  }
}
