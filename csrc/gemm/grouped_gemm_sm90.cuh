// The grouped GEMM's Hopper kernel for one operand layout (grouped_gemm_sm90.h): CUTLASS's sm90
// ptr-array grouped GEMM, cooperative warp-specialized mainloop (two consumer warpgroups on a
// 128 x 256 x 64 tile, TMA loads multicast across a 2 x 1 cluster), D = A B (beta 0: the source
// operand is never read), problem sizes read on the device only. Included by one grouped_gemm_sm90_<layout>.cu
// each, which nvcc compiles for sm_90a alone.
#pragma once

#include <mutex>
#include <string>
#include <unordered_map>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "util/cuda_common.cuh"
#include "gemm/grouped_gemm_sm90.h"

namespace fusedlayers {
namespace sm90 {

using namespace cute;

using Element = cutlass::bfloat16_t;
constexpr int kAlignment = 8;  // elements: TMA's 16 bytes
using LayoutD = cutlass::layout::RowMajor;
using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_2, _1, _1>;
using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutD*, kAlignment,
    Element, LayoutD*, kAlignment, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<Element, float, Element, float>>::CollectiveOp;
// Outside the template below: GCC (nvcc's host compiler) misparses CUTLASS's builders where this
// sizeof is a dependent expression.
constexpr int kEpilogueSmem = static_cast<int>(sizeof(Epilogue::SharedStorage));

template <Sm90Layout L>
struct Kernel {
  using Element = sm90::Element;
  using LayoutA = std::conditional_t<L == Sm90Layout::kWgrad, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<L == Sm90Layout::kRowsNK, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment, Element,
      LayoutB*, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Problem = typename ProblemShape::UnderlyingProblemShape;
};

constexpr size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The per-group arrays CUTLASS reads, laid out at the start of the workspace.
template <Sm90Layout L>
struct Arrays {
  using K = Kernel<L>;
  using E = typename K::Element;
  typename K::Problem* sizes;
  const E** a;
  const E** b;
  E** d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
  void* cutlass_workspace;

  static size_t bytes(int64_t g) {
    return align256(g * sizeof(typename K::Problem)) + 3 * align256(g * sizeof(void*)) +
           align256(g * sizeof(typename K::StrideA)) + align256(g * sizeof(typename K::StrideB)) +
           align256(g * sizeof(typename K::StrideD));
  }

  Arrays(void* workspace, int64_t g) {
    char* p = static_cast<char*>(workspace);
    auto take = [&](size_t n) {
      char* q = p;
      p += align256(n);
      return q;
    };
    sizes = reinterpret_cast<typename K::Problem*>(take(g * sizeof(typename K::Problem)));
    a = reinterpret_cast<const E**>(take(g * sizeof(void*)));
    b = reinterpret_cast<const E**>(take(g * sizeof(void*)));
    d = reinterpret_cast<E**>(take(g * sizeof(void*)));
    stride_a = reinterpret_cast<typename K::StrideA*>(take(g * sizeof(typename K::StrideA)));
    stride_b = reinterpret_cast<typename K::StrideB*>(take(g * sizeof(typename K::StrideB)));
    stride_d = reinterpret_cast<typename K::StrideD*>(take(g * sizeof(typename K::StrideD)));
    cutlass_workspace = p;
  }
};

// One thread per group: its problem size, pointers and strides from the offsets.
template <Sm90Layout L>
__global__ void setup_kernel(Sm90GroupedGemm args, Arrays<L> out) {
  using K = Kernel<L>;
  using E = typename K::Element;
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= args.groups) return;
  auto clamp = [&](int64_t v, int64_t lo) { return v < lo ? lo : v > args.rows ? args.rows : v; };
  const int64_t start = g ? clamp(args.offsets[g - 1], 0) : 0;
  const int64_t rows = clamp(args.offsets[g], start) - start;
  const E* a = static_cast<const E*>(args.a);
  const E* b = static_cast<const E*>(args.b);
  E* d = static_cast<E*>(args.d);
  const int m = static_cast<int>(L == Sm90Layout::kWgrad ? args.m : rows);
  const int k = static_cast<int>(L == Sm90Layout::kWgrad ? rows : args.k);
  const int n = static_cast<int>(args.n);
  if constexpr (L == Sm90Layout::kWgrad) {
    out.sizes[g] = make_shape(rows ? m : 0, n, k);  // no rows: no tiles
    out.a[g] = a + start * args.m;
    out.b[g] = b + start * args.n;
    out.d[g] = d + g * args.m * args.n;
  } else {
    out.sizes[g] = make_shape(m, n, k);
    out.a[g] = a + start * args.k;
    out.b[g] = b + g * args.n * args.k;
    out.d[g] = d + start * args.n;
  }
  // Packed strides depend only on the fixed dimensions (a column-major A's on m, which is
  // fixed for kWgrad), so an empty group's are as valid as any.
  out.stride_a[g] = cutlass::make_cute_packed_stride(typename K::StrideA{}, make_shape(m, k, 1));
  out.stride_b[g] = cutlass::make_cute_packed_stride(typename K::StrideB{}, make_shape(n, k, 1));
  out.stride_d[g] = cutlass::make_cute_packed_stride(typename K::StrideD{}, make_shape(m, n, 1));
}

// CUTLASS's view of the device (SM count, clusters that fit), queried once per device.
template <Sm90Layout L>
cutlass::KernelHardwareInfo hardware_info() {
  static std::mutex mutex;
  static std::unordered_map<int, cutlass::KernelHardwareInfo> known;
  int device;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(device);
  if (it == known.end())
    it = known.emplace(device, cutlass::KernelHardwareInfo::make_kernel_hardware_info<
                                   typename Kernel<L>::GemmKernel>(device)).first;
  return it->second;
}

template <Sm90Layout L>
typename Kernel<L>::Gemm::Arguments arguments(const Arrays<L>& arrays, int64_t groups) {
  using K = Kernel<L>;
  typename K::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(groups), arrays.sizes, nullptr};  // device sizes only
  args.mainloop = {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = arrays.d;
  args.epilogue.dD = arrays.stride_d;
  args.hw_info = hardware_info<L>();
  return args;
}

inline void check_status(cutlass::Status status, const char* what) {
  if (status != cutlass::Status::kSuccess)
    fail(std::string("grouped GEMM (CUTLASS sm90): ") + what + " failed: " +
         cutlassGetStatusString(status));
}

}  // namespace sm90

template <Sm90Layout L>
size_t grouped_gemm_sm90_workspace_size(int64_t groups) {
  sm90::Arrays<L> arrays(nullptr, groups);
  return sm90::Arrays<L>::bytes(groups) +
         sm90::align256(sm90::Kernel<L>::Gemm::get_workspace_size(
             sm90::arguments<L>(arrays, groups)));
}

template <Sm90Layout L>
void grouped_gemm_sm90(const Sm90GroupedGemm& a, cudaStream_t stream) {
  sm90::Arrays<L> arrays(a.workspace, a.groups);
  const int threads = 128;
  sm90::setup_kernel<L><<<static_cast<unsigned>((a.groups + threads - 1) / threads), threads, 0,
                          stream>>>(a, arrays);
  cuda::check_launch("grouped_gemm_sm90 setup");
  auto args = sm90::arguments<L>(arrays, a.groups);
  typename sm90::Kernel<L>::Gemm gemm;
  sm90::check_status(gemm.can_implement(args), "can_implement");
  sm90::check_status(gemm.initialize(args, arrays.cutlass_workspace, stream), "initialize");
  sm90::check_status(gemm.run(stream), "run");
}

}  // namespace fusedlayers

// The explicit instantiations of one layout (in its own .cu file).
#define FUSEDLAYERS_GROUPED_GEMM_SM90(layout)                                                 \
  template size_t fusedlayers::grouped_gemm_sm90_workspace_size<layout>(int64_t);             \
  template void fusedlayers::grouped_gemm_sm90<layout>(const fusedlayers::Sm90GroupedGemm&,   \
                                                       cudaStream_t)
