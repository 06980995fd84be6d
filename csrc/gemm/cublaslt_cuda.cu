// cuBLASLt GEMMs (cublaslt.h, cublaslt.cuh): plans cached per shape, the process-wide handle and
// gemm.h's FrameworkGemm on them.
#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gemm/cublaslt.cuh"
#include "util/cuda_common.cuh"

namespace fusedlayers {
namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail(std::string(what) + ": " + cublasLtGetStatusString(status));
}

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    default: fail("cuBLASLt GEMMs take float32, float16 or bfloat16, got " +
                  std::string(dtype_name(dtype)));
  }
}

template <typename T, cublasStatus_t (*Destroy)(T)>
struct Deleter {
  void operator()(T p) const { Destroy(p); }
};
using OpDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                               Deleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using Layout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                               Deleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using Pref = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                             Deleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

Layout layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l;
  check(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld), "cublasLtMatrixLayoutCreate");
  return Layout(l);
}

template <typename V>
void set(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const V& value) {
  check(cublasLtMatmulDescSetAttribute(op, attr, &value, sizeof(value)),
        "cublasLtMatmulDescSetAttribute");
}

template <typename V>
void set(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
         const V& value) {
  check(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)),
        "cublasLtMatmulPreferenceSetAttribute");
}

// The largest power of two up to 256 dividing the address: what cuBLASLt's heuristic must be
// told, or it may pick a kernel whose vector loads need more alignment than a view's offset has.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// What the heuristic's answer depends on. Pointers enter only through their alignment.
using PlanKey = std::array<int64_t, 17>;

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t h = 1469598103934665603ull;  // FNV-1a over the fields
    for (int64_t v : key) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};

struct Plan {
  OpDesc op;
  Layout a, b, d;
  cublasLtMatmulAlgo_t algo;
  bool found;  // false: cuBLASLt has no algorithm for this GEMM and epilogue
};

// What an FP8 GEMM's plan depends on beyond a GEMM's (-1: not FP8).
int64_t fp8_key(const LtFp8* f) {
  if (!f) return -1;
  return int64_t(f->a_type) | int64_t(f->b_type) << 8 | int64_t(f->a_scale_mode) << 16 |
         int64_t(f->b_scale_mode) << 24 | int64_t(f->fast_accum) << 32;
}

// The FP8 attributes of a matmul descriptor; the scale pointers are set again for each call.
void set_fp8(cublasLtMatmulDesc_t op, const LtFp8& f) {
  set(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, f.a_scale_inv);
  set(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, f.b_scale_inv);
  set(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(f.fast_accum));
  if (f.a_scale_mode == 0 && f.b_scale_mode == 0) return;  // scalars: the default mode
#if CUBLAS_VERSION >= 120900
  if (cublasLtGetVersion() < 120900)
    fail("FP8 block scales need cuBLASLt >= 12.9, found " +
         std::to_string(cublasLtGetVersion()));
  set(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, f.a_scale_mode);
  set(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, f.b_scale_mode);
#else
  fail("FP8 block scales need cuBLASLt >= 12.9; this build's headers are older");
#endif
}

// The cached plan of `g`. Per host thread, so the descriptor's pointer attributes can be set for
// each call without a lock (autograd runs backwards on its own threads: each thread pays one
// heuristic query per shape). Bounded: a workload with endlessly new shapes starts over.
Plan& plan(const LtContext& lt, DType dtype, const LtGemm& g) {
  constexpr size_t kMaxPlans = 1024;
  thread_local std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
  int device;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  const PlanKey key{device, g.trans_a, g.trans_b, g.rows, g.cols, g.inner, g.lda, g.ldb,
                    int64_t(dtype), int64_t(g.epilogue), alignment(g.a), alignment(g.b),
                    alignment(g.d), alignment(g.bias), alignment(g.aux),
                    int64_t(lt.workspace_size), fp8_key(g.fp8)};
  if (auto it = plans.find(key); it != plans.end()) return it->second;
  if (plans.size() >= kMaxPlans) plans.clear();

  const cudaDataType_t type = cuda_type(dtype);
  const cudaDataType_t a_type = g.fp8 ? g.fp8->a_type : type, b_type = g.fp8 ? g.fp8->b_type : type;
  cublasLtMatmulDesc_t raw_op;
  check(cublasLtMatmulDescCreate(&raw_op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        "cublasLtMatmulDescCreate");
  Plan p{OpDesc(raw_op), nullptr, nullptr, nullptr, {}, false};
  set(raw_op, CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(raw_op, CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(raw_op, CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
  if (g.bias) set(raw_op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.bias && g.fp8) set(raw_op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(type));
  if (g.fp8) set_fp8(raw_op, *g.fp8);
  if (g.aux) {
    set(raw_op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    set(raw_op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.rows);
  }
  p.a = g.trans_a ? layout(a_type, g.inner, g.rows, g.lda)
                  : layout(a_type, g.rows, g.inner, g.lda);
  p.b = g.trans_b ? layout(b_type, g.cols, g.inner, g.ldb)
                  : layout(b_type, g.inner, g.cols, g.ldb);
  p.d = layout(type, g.rows, g.cols, g.rows);
  cublasLtMatmulPreference_t raw_pref;
  check(cublasLtMatmulPreferenceCreate(&raw_pref), "cublasLtMatmulPreferenceCreate");
  Pref pref(raw_pref);
  set(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, lt.workspace_size);
  set(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(g.a));
  set(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(g.b));
  set(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(g.d));
  set(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(g.d));
  cublasLtMatmulHeuristicResult_t heuristic;
  int found = 0;
  check(cublasLtMatmulAlgoGetHeuristic(lt.handle, raw_op, p.a.get(), p.b.get(), p.d.get(),
                                       p.d.get(), raw_pref, 1, &heuristic, &found),
        "cublasLtMatmulAlgoGetHeuristic");
  p.found = found > 0;
  p.algo = heuristic.algo;
  return plans.emplace(key, std::move(p)).first->second;
}

}  // namespace

// Runs g; false when cuBLASLt has no algorithm for it (the caller may try another epilogue).
bool cublaslt_try_matmul(const LtContext& lt, DType dtype, const LtGemm& g) {
  Plan& p = plan(lt, dtype, g);
  if (!p.found) return false;
  if (g.bias) set(p.op.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux) set(p.op.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
  if (g.fp8) {
    set(p.op.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, g.fp8->a_scale_inv);
    set(p.op.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, g.fp8->b_scale_inv);
  }
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  check(cublasLtMatmul(lt.handle, p.op.get(), &alpha, g.a, p.a.get(), g.b, p.b.get(), &beta, g.d,
                       p.d.get(), g.d, p.d.get(), &p.algo, lt.workspace, lt.workspace_size,
                       lt.stream),
        "cublasLtMatmul");
  return true;
}

void cublaslt_matmul(const LtContext& lt, DType dtype, const LtGemm& g, const char* op) {
  if (!cublaslt_try_matmul(lt, dtype, g))
    fail(std::string(op) + ": cuBLASLt has no algorithm for this GEMM (" +
         std::to_string(g.rows) + " x " + std::to_string(g.cols) + " x " +
         std::to_string(g.inner) + ", " + dtype_name(dtype) + ")");
}

cublasLtHandle_t cublaslt_handle() {
  int device = 0;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  static std::mutex mutex;
  static std::vector<cublasLtHandle_t> handles;  // by device, kept for the process's life
  const std::lock_guard<std::mutex> lock(mutex);
  if (size_t(device) >= handles.size()) handles.resize(size_t(device) + 1, nullptr);
  if (handles[device] == nullptr) check(cublasLtCreate(&handles[device]), "cublasLtCreate");
  return handles[device];
}

FrameworkGemm cublaslt_gemm(const LtContext& lt, const char* op) {
  return [lt, op](const Matrix& a, const Matrix& b, void* c, DType dtype, bool accumulate) {
    const int64_t m = a.rows, k = a.cols, n = b.cols;
    if (m == 0 || n == 0) return;
    if (k == 0) {  // a @ b is all zeros
      if (!accumulate)
        cuda::check(cudaMemsetAsync(c, 0, size_t(m * n) * dtype_size(dtype), lt.stream),
                    "cudaMemsetAsync");
      return;
    }
    // Row-major c (m x n) is column-major c^T = b^T a^T. b, stored row-major k x n, is
    // column-major n x k (ld n); transposed it is stored n x k, column-major k x n (ld k), taken
    // with op T. Likewise a.
    cublaslt_matmul(lt, dtype,
                    {b.transposed, a.transposed, n, m, k, b.data, b.transposed ? k : n, a.data,
                     a.transposed ? m : k, c, CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr,
                     accumulate},
                    op);
  };
}

}  // namespace fusedlayers
