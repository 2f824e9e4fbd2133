// Copy blocks: for every (src, dst) pair and every plane, copy the bytes of block src
// over block dst. A plane is one pool array of one layer (K, V, a fused KV pool, a
// per_token_head scale pool), described by a row of `planes`:
//   { base address, bytes between consecutive blocks, bytes of one block }.
// Every layer's pools go through one launch this way. The host guarantees that no
// block is both written and read (or written twice) in one call, so blocks copy
// independently.
//
// Work decomposition: one thread block per (pair, plane); threads stride over the
// block's bytes in 16-byte words when both addresses and the size allow, else in
// 4-byte words, else bytes.
#pragma once

namespace kgen {

template <class W>
__device__ __forceinline__ void copy_words(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                           long long nbytes) {
  const W* s = reinterpret_cast<const W*>(src);
  W* d = reinterpret_cast<W*>(dst);
  const long long n = nbytes / (long long)sizeof(W);
  for (long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

__device__ __forceinline__ void copy_blocks_body(const long long* __restrict__ planes,
                                                 const int* __restrict__ pairs) {
  const long long* plane = planes + 3 * (long long)blockIdx.y;
  unsigned char* base = reinterpret_cast<unsigned char*>(plane[0]);
  const long long stride = plane[1], nbytes = plane[2];
  const int src_block = pairs[2 * (long long)blockIdx.x], dst_block = pairs[2 * (long long)blockIdx.x + 1];
  const unsigned char* src = base + src_block * stride;
  unsigned char* dst = base + dst_block * stride;
  const unsigned long long bits = (unsigned long long)src | (unsigned long long)dst | (unsigned long long)nbytes;
  if (bits % 16 == 0) {
    copy_words<uint4>(src, dst, nbytes);
  } else if (bits % 4 == 0) {
    copy_words<unsigned int>(src, dst, nbytes);
  } else {
    copy_words<unsigned char>(src, dst, nbytes);
  }
}

}  // namespace kgen
