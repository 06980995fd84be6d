// CPU AdamW: the table's chunks (kAdamWChunk elements of one parameter) as tasks of the thread
// pool; each element updated by adamw.h's adamw_update in a loop the compiler vectorizes, in
// target clones. The norm's partials are per chunk, summed in chunk order.
#include <algorithm>
#include <type_traits>

#include "optimizer/adamw.h"
#include "util/cpu_types.h"

namespace fusedlayers {
namespace {

// Elements [begin, end) of one parameter's tensors.
template <typename P, typename M, bool kMaster, bool kAmsgrad>
FUSEDLAYERS_CPU_CLONES void update_range(const AdamWTensors& t, int64_t begin, int64_t end,
                                         const AdamWCoefficients<typename cpu::Acc<P>::type>& c) {
  using A = typename cpu::Acc<P>::type;
  P* __restrict__ param = static_cast<P*>(t.param.data);
  const P* __restrict__ grad = static_cast<const P*>(t.grad.data);
  M* __restrict__ exp_avg = static_cast<M*>(t.exp_avg.data);
  M* __restrict__ exp_avg_sq = static_cast<M*>(t.exp_avg_sq.data);
  M* __restrict__ max_exp_avg_sq = static_cast<M*>(t.max_exp_avg_sq.data);
  float* __restrict__ master = static_cast<float*>(t.master.data);
  for (int64_t i = begin; i < end; ++i) {
    A w;
    if constexpr (kMaster) w = master[i];
    else w = cpu::to_acc(param[i]);
    A m = cpu::to_acc(exp_avg[i]), v = cpu::to_acc(exp_avg_sq[i]), v_max = 0;
    if constexpr (kAmsgrad) v_max = cpu::to_acc(max_exp_avg_sq[i]);
    adamw_update<kAmsgrad>(w, m, v, v_max, A(cpu::to_acc(grad[i])), c);
    if constexpr (kMaster) master[i] = w;
    param[i] = cpu::from_acc<P>(w);
    exp_avg[i] = cpu::from_acc<M>(m);
    exp_avg_sq[i] = cpu::from_acc<M>(v);
    if constexpr (kAmsgrad) max_exp_avg_sq[i] = cpu::from_acc<M>(v_max);
  }
}

// The members' chunks, numbered in member order: first[j] is member j's first chunk.
std::vector<int64_t> chunk_starts(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> first(sizes.size() + 1, 0);
  for (size_t j = 0; j < sizes.size(); ++j)
    first[j + 1] = first[j] + (sizes[j] + kAdamWChunk - 1) / kAdamWChunk;
  return first;
}

// fn(member, begin, end) for chunks [c0, c1) of the numbering `first`.
template <typename Fn>
void for_chunks(const std::vector<int64_t>& first, const std::vector<int64_t>& sizes, int64_t c0,
                int64_t c1, Fn&& fn) {
  size_t j = std::upper_bound(first.begin(), first.end(), c0) - first.begin() - 1;
  for (int64_t c = c0; c < c1; ++c) {
    while (first[j + 1] <= c) ++j;
    const int64_t begin = (c - first[j]) * kAdamWChunk;
    fn(j, begin, std::min(sizes[j], begin + kAdamWChunk));
  }
}

template <typename P, typename M, bool kMaster, bool kAmsgrad>
void step_members(const AdamWKernelArgs& k, const AdamWOptions& o,
                  const ParallelFor& parallel_for) {
  using A = typename cpu::Acc<P>::type;
  const double lr = o.lr_device ? *o.lr_device : o.lr;
  const double factor = adamw_grad_factor(o, o.grad_scale ? *o.grad_scale : 1.0,
                                          o.grad_sumsq ? *o.grad_sumsq : 0.0);
  std::vector<int64_t> sizes;
  std::vector<AdamWCoefficients<A>> coefs;
  for (int64_t i : k.members) {
    const AdamWTensors& t = (*k.params)[i];
    sizes.push_back(t.param.sizes.numel());
    coefs.push_back(adamw_coefficients<A>(o, lr, *static_cast<const float*>(t.step.data),
                                          factor));
  }
  const std::vector<int64_t> first = chunk_starts(sizes);
  parallel_for(first.back(), 1, [&](int64_t c0, int64_t c1) {
    for_chunks(first, sizes, c0, c1, [&](size_t j, int64_t begin, int64_t end) {
      update_range<P, M, kMaster, kAmsgrad>((*k.params)[k.members[j]], begin, end, coefs[j]);
    });
  });
}

// The DType of a storage type: only the combinations adamw.h's rules allow are instantiated.
template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, double>) return DType::kFloat64;
  else if constexpr (std::is_same_v<T, cpu::Half>) return DType::kFloat16;
  else if constexpr (std::is_same_v<T, cpu::BFloat16>) return DType::kBFloat16;
  else return DType::kFloat32;
}

}  // namespace

void adamw_step_cpu(const AdamWKernelArgs& k, const AdamWOptions& o,
                    const ParallelFor& parallel_for) {
  if (o.found_inf && *o.found_inf != 0) return;  // the skipped step: nothing written
  cpu::dispatch(k.param_dtype, [&](auto p) {
    cpu::dispatch(k.moment_dtype, [&](auto m) {
      using P = decltype(p);
      using M = decltype(m);
      if constexpr (adamw_moment_dtype_ok(dtype_of<P>(), dtype_of<M>())) {
        cpu::with_flags([&](auto master, auto amsgrad) {
          if constexpr (!decltype(master)::value || adamw_half(dtype_of<P>()))
            step_members<P, M, decltype(master)::value, decltype(amsgrad)::value>(k, o,
                                                                                  parallel_for);
        }, k.master, o.amsgrad);
      }
    });
  });
  for (int64_t i : k.members) *static_cast<float*>((*k.params)[i].step.data) += 1;
}

void adamw_grad_sumsq_cpu(const std::vector<TensorRef>& grads, double* sumsq, double* partials,
                          const ParallelFor& parallel_for) {
  std::vector<int64_t> sizes;
  for (const TensorRef& g : grads) sizes.push_back(g.sizes.numel());
  const std::vector<int64_t> first = chunk_starts(sizes);
  parallel_for(first.back(), 1, [&](int64_t c0, int64_t c1) {
    for_chunks(first, sizes, c0, c1, [&](size_t j, int64_t begin, int64_t end) {
      cpu::dispatch(grads[j].dtype, [&](auto t) {
        using T = decltype(t);
        const T* g = static_cast<const T*>(grads[j].data) + begin;
        partials[first[j] + begin / kAdamWChunk] = cpu::lane_sum<double>(
            end - begin, [&](int64_t i) FUSEDLAYERS_LAMBDA_INLINE {
              const double v = cpu::to_acc(g[i]);
              return v * v;
            });
      });
    });
  });
  double total = 0;
  for (int64_t c = 0; c < first.back(); ++c) total += partials[c];
  *sumsq = total;
}

}  // namespace fusedlayers
