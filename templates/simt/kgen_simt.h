// kgen SIMT runtime: run CUDA kernels (the subset kgen's templates use) on the CPU.
//
// Force-included (g++ -include kgen_simt.h) in front of a generated kernel source.
// Number formats come from NVIDIA's own cuda_fp16.h / cuda_bf16.h / cuda_fp8.h,
// compiled in host mode, so conversions match the GPU bit for bit.
// Each thread block runs as cooperative fibers on one OS thread; blocks are spread
// over std::thread workers.  See docs/cpu-backend.md.
#pragma once
#ifndef KGEN_SIMT_H
#define KGEN_SIMT_H

#define KGEN_SIMT 1

// NVIDIA's number-format headers (they also pull vector_types.h / vector_functions.h,
// which give dim3, uint3, float2/float4/int4/... and make_* helpers: reused, not redefined).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <vector_types.h>
#include <vector_functions.h>

#include <math.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// ---- CUDA keywords ---------------------------------------------------------
// host_defines.h (host mode) already makes __device__/__global__/__host__/
// __constant__ empty and defines __forceinline__, __align__(n).
#undef __shared__
// Static __shared__ storage: one copy per OS worker thread. Every fiber of a block
// runs on the same OS thread and a worker runs one block at a time, so this is
// exactly "private to each thread block".
#define __shared__ static thread_local
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __maxnreg__
#define __maxnreg__(...)
#endif
#ifndef __grid_constant__
#define __grid_constant__
#endif

namespace kgen_simt {
void* dynamic_smem_ptr();
}
// Dynamic shared memory (the CPU side; the CUDA side is `extern __shared__`).
// 16-byte aligned buffer of the size given at launch, private to the block.
#define KGEN_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::kgen_simt::dynamic_smem_ptr())

#include "kgen_simt_sched.h"
#include "kgen_simt_device.h"
#include "kgen_simt_mma.h"  // mma.sync / ldmatrix (templates/common/mma.cuh)
#include "kgen_simt_hopper.h"  // mbarrier, cp.async.bulk{.tensor} (templates/common/hopper.cuh)
#include "kgen_simt_wgmma.h"   // wgmma.mma_async (templates/common/hopper.cuh)
#include "kgen_simt_launch.h"
#include "kgen_simt_tsan.h"  // only with KGEN_SIMT_RACECHECK

#endif  // KGEN_SIMT_H
