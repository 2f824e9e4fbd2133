// kgen SIMT runtime, part 4: the warp-level matrix instructions the tensor-core templates use
// (templates/common/mma.cuh calls these on the CPU, inline PTX on the GPU).
//
// Each one is a collective of the 32 lanes of a warp, with the fragment layouts of the PTX ISA
// (9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type", 9.7.14.5.15 "ldmatrix";
// tests/runtime/ptx_layouts.py holds the tests' own transcription):
//   groupID = laneid >> 2, threadID_in_group = laneid % 4;
//   A (16x16, row):  a0,a1: (groupID,   2*tig + 0/1)   a2,a3: (groupID+8, 2*tig + 0/1)
//                    a4,a5: (groupID,   2*tig+8 + 0/1) a6,a7: (groupID+8, 2*tig+8 + 0/1)
//   B (16x8, col):   b0,b1: (k = 2*tig + 0/1, n = groupID)   b2,b3: (k = 2*tig+8 + 0/1, n = groupID)
//   C/D (16x8):      c0,c1: (groupID, 2*tig + 0/1)   c2,c3: (groupID+8, 2*tig + 0/1)
// Two 16-bit elements share one .b32 register, the lower-indexed one in the low half.
//   ldmatrix .m8n8 .b16: lanes 8i..8i+7 give the row addresses of matrix i (x1: i = 0; x2: 0, 1;
//   x4: 0..3); register i of lane l holds row l/4, columns 2*(l%4) + 0/1 of matrix i
//   (.trans: rows 2*(l%4) + 0/1, column l/4, i.e. the transposed matrix). Each row address must
//   be 16-byte aligned (the ISA: "naturally aligned" to the 16 bytes four threads load); a
//   misaligned one is an error naming the lane.
//
// The lanes exchange operands through a per-warp staging area (the block's, like __shared__:
// one copy per worker thread) between two __syncwarp()s: every lane deposits, every lane reads
// what it needs, and nobody deposits again before everybody has read.
// mma accumulates in fp32 in k order, one rounding per step: the products of two fp16 or two
// bf16 values are exact in fp32, so each step is a correctly rounded fp32 add. (Tensor cores
// may group the additions differently; the result is within fp32 rounding of this.)
#pragma once

namespace kgen_simt {

struct MmaStage {
  alignas(16) unsigned a[32][4];
  unsigned b[32][2];
  const unsigned char* row[32];
};
inline thread_local MmaStage mma_stage[32];  // one per warp of the running block

inline unsigned lane_id() { return tls_w->cur->lane; }
inline MmaStage& warp_stage() { return mma_stage[tls_w->cur->warp]; }

template <class T>
inline float bits_to_float(unsigned short bits) {
  T x;
  std::memcpy(&x, &bits, 2);
  return (float)x;
}
inline unsigned short lo16(unsigned r) { return (unsigned short)(r & 0xffffu); }
inline unsigned short hi16(unsigned r) { return (unsigned short)(r >> 16); }

// Element (row, k) of A and (k, n) of B as held by the depositing lanes (layouts above).
inline unsigned short a_elem(const MmaStage& s, int row, int k) {
  const int lane = (row & 7) * 4 + (k & 7) / 2;
  const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
  return (k & 1) ? hi16(s.a[lane][reg]) : lo16(s.a[lane][reg]);
}
inline unsigned short b_elem(const MmaStage& s, int k, int n) {
  const int lane = n * 4 + (k & 7) / 2;
  const int reg = k >= 8 ? 1 : 0;
  return (k & 1) ? hi16(s.b[lane][reg]) : lo16(s.b[lane][reg]);
}

// D = A * B + C for one m16n8k16 tile; T is __half or __nv_bfloat16.
template <class T>
inline void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
  MmaStage& s = warp_stage();
  const unsigned lane = lane_id();
  for (int i = 0; i < 4; ++i) s.a[lane][i] = a[i];
  s.b[lane][0] = b[0];
  s.b[lane][1] = b[1];
  __syncwarp();
  const int g = (int)lane >> 2, t = (int)lane & 3;
  float res[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float acc = c[i];
    for (int k = 0; k < 16; ++k) acc += bits_to_float<T>(a_elem(s, row, k)) * bits_to_float<T>(b_elem(s, k, col));
    res[i] = acc;
  }
  __syncwarp();  // every lane has read the stage
  for (int i = 0; i < 4; ++i) d[i] = res[i];
}

// ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16: N matrices of 8x8 16-bit elements.
template <int N, bool TRANS>
inline void ldmatrix(unsigned (&r)[N], const void* row_ptr) {
  MmaStage& s = warp_stage();
  const unsigned lane = lane_id();
  // Lanes 0 .. 8N-1 give the rows of the N matrices; each row (16 bytes) must be 16-byte aligned.
  if (lane < 8u * N && (uintptr_t)row_ptr % 16)
    fail("ldmatrix.m8n8.x%d%s: lane %u gives the row address %p, which is not 16-byte aligned (each row of "
         "eight 16-bit elements must start on a 16-byte boundary)", N, TRANS ? ".trans" : "", lane, row_ptr);
  s.row[lane] = static_cast<const unsigned char*>(row_ptr);
  __syncwarp();
  unsigned out[N];
  for (int i = 0; i < N; ++i) {
    unsigned short e[2];
    for (int j = 0; j < 2; ++j) {
      const int row = TRANS ? 2 * (int)(lane & 3) + j : (int)(lane >> 2);
      const int col = TRANS ? (int)(lane >> 2) : 2 * (int)(lane & 3) + j;
      std::memcpy(&e[j], s.row[8 * i + row] + 2 * col, 2);
    }
    out[i] = (unsigned)e[0] | ((unsigned)e[1] << 16);
  }
  __syncwarp();
  for (int i = 0; i < N; ++i) r[i] = out[i];
}

}  // namespace kgen_simt
