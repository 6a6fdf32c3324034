// torch.ops.cudal2.linear(x, weight, bias=None) and torch.ops.cudal2.mm(a, b), registered with
// TORCH_LIBRARY: the whole call path is here, so nothing in Python runs between a model's
// forward and the kernel launch.
//
// cudal2::_serve hands this library the dispatch table once (cudal2/torch.py reads index.json):
// each kernel's shared object is opened with dlopen and its cudal2_gemm resolved to a function
// pointer. A call's (M, N, K, dtype, layout) is looked up in a map filled on first sight of the
// shape by the table's rule (cudal2/runtime.py, DispatchTable.choose). The kernel runs on the
// current stream with a workspace cached per stream; any call it does not cover (another device
// or dtype, strides, a misaligned pointer, an untuned shape, a kernel that declines) runs
// at::linear / at::mm, the library call the kernel was measured against.
//
// Built without CUDA (CUDAL2_CUDA undefined: the CPU build of torch), the same ops register
// with the fallback alone, so registration, autograd, meta and fallback are exercised anywhere.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#ifdef CUDAL2_PYTHON
#include <torch/extension.h>
#endif

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#ifdef CUDAL2_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace {

// The kernel ABI (docs/method.md); the stream is a cudaStream_t.
using Gemm = int (*)(const void*, const void*, void*, int, int, int, void*, size_t, void*);
using WorkspaceBytes = size_t (*)(int, int, int);

enum Layout : int64_t { NN = 0, NT = 1 };  // b is [K, N] (mm) or [N, K] (linear's weight)

// Codes shared with cudal2/torch.py (DTYPE_CODES, LAYOUT_CODES).
int64_t dtype_code(at::ScalarType type) {
  return type == at::kHalf ? 0 : type == at::kBFloat16 ? 1 : -1;
}

struct Kernel {
  std::string path;
  Gemm gemm;
  WorkspaceBytes workspace;  // null: the kernel needs none
};

struct Tuned {  // one table entry: the kernel tuned for M, verified at Ms in [low, high]
  int64_t m, low, high;
  int kernel;
};

using Family = std::tuple<int64_t, int64_t, int64_t, int64_t>;          // n, k, dtype, layout
using Shape = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;  // m, n, k, dtype, layout

struct ShapeHash {
  size_t operator()(const Shape& s) const {
    size_t h = 0;
    auto mix = [&h](int64_t v) { h = h * 1000003u ^ std::hash<int64_t>()(v); };
    mix(std::get<0>(s)), mix(std::get<1>(s)), mix(std::get<2>(s)), mix(std::get<3>(s)), mix(std::get<4>(s));
    return h;
  }
};

struct Choice {
  std::shared_ptr<const Kernel> kernel;  // null: the library call; shared: outlives a table replaced meanwhile
  size_t workspace;
};

struct Table {
  std::vector<std::shared_ptr<const Kernel>> kernels;
  std::map<Family, std::vector<Tuned>> families;
  std::set<Shape> library_call;  // measured faster by the library call: no kernel, not even a neighbour's

  // DispatchTable.choose: the exact M's kernel, else the nearest tuned M's (ties: the smaller)
  // where M lies within the Ms that kernel was verified at, else none.
  const Tuned* choose(const Shape& shape) const {
    if (library_call.count(shape)) return nullptr;
    auto [m, n, k, dtype, layout] = shape;
    auto family = families.find({n, k, dtype, layout});
    if (family == families.end()) return nullptr;
    std::vector<const Tuned*> order;
    for (const Tuned& t : family->second) order.push_back(&t);
    std::sort(order.begin(), order.end(), [m = m](const Tuned* a, const Tuned* b) {
      return std::make_pair(std::abs(a->m - m), a->m) < std::make_pair(std::abs(b->m - m), b->m);
    });
    for (const Tuned* t : order)
      if (t->m == m || (t->low <= m && m <= t->high)) return t;
    return nullptr;
  }
};

std::mutex lock;
std::shared_ptr<const Table> table = std::make_shared<Table>();
std::unordered_map<Shape, Choice, ShapeHash> chosen;  // the table's answer per call shape
std::vector<void*> opened;  // never closed: a captured CUDA graph may still launch their code

// The choice for a call shape: computed once per shape, then one hash lookup.
Choice choice(const Shape& shape) {
  std::lock_guard<std::mutex> guard(lock);
  auto hit = chosen.find(shape);
  if (hit != chosen.end()) return hit->second;
  Choice c{nullptr, 0};
  if (const Tuned* t = table->choose(shape)) {
    c.kernel = table->kernels[t->kernel];
    auto [m, n, k, dtype, layout] = shape;
    c.workspace = c.kernel->workspace ? c.kernel->workspace(int(m), int(n), int(k)) : 0;
  }
  chosen.emplace(shape, c);
  return c;
}

// cudal2::_serve(kernels, entries, library_call): kernels are shared-object paths; entries are
// (m, n, k, dtype, layout, kernel index, lowest verified M, highest verified M) flattened;
// library_call is (m, n, k, dtype, layout) flattened. Replaces the table; empty lists: none.
void serve(std::vector<std::string> paths, std::vector<int64_t> entries, std::vector<int64_t> library_call) {
  TORCH_CHECK(entries.size() % 8 == 0 && library_call.size() % 5 == 0, "cudal2::_serve: malformed table");
  auto next = std::make_shared<Table>();
  std::vector<void*> handles;
  for (const std::string& path : paths) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(handle != nullptr, "cudal2: cannot load kernel ", path, ": ", dlerror());
    auto gemm = reinterpret_cast<Gemm>(dlsym(handle, "cudal2_gemm"));
    TORCH_CHECK(gemm != nullptr, "cudal2: ", path, " has no cudal2_gemm");
    auto workspace = reinterpret_cast<WorkspaceBytes>(dlsym(handle, "cudal2_workspace_bytes"));
    next->kernels.push_back(std::make_shared<const Kernel>(Kernel{path, gemm, workspace}));
    handles.push_back(handle);
  }
  for (size_t i = 0; i < entries.size(); i += 8) {
    const int64_t* e = &entries[i];
    TORCH_CHECK(e[5] >= 0 && e[5] < int64_t(paths.size()), "cudal2::_serve: no kernel ", e[5]);
    next->families[{e[1], e[2], e[3], e[4]}].push_back({e[0], e[6], e[7], int(e[5])});
  }
  for (size_t i = 0; i < library_call.size(); i += 5) {
    const int64_t* s = &library_call[i];
    next->library_call.insert({s[0], s[1], s[2], s[3], s[4]});
  }
  std::lock_guard<std::mutex> guard(lock);
  opened.insert(opened.end(), handles.begin(), handles.end());
  table = std::move(next);
  chosen.clear();
}

// cudal2::_kernel(m, n, k, dtype, layout): the path of the kernel a call of that shape runs, or
// "" (the library call): what the map above holds, for a reader and the tests.
std::string kernel_for(int64_t m, int64_t n, int64_t k, int64_t dtype, int64_t layout) {
  Choice c = choice({m, n, k, dtype, layout});
  return c.kernel ? c.kernel->path : std::string();
}

#ifdef CUDAL2_CUDA
// One workspace per stream (calls on one stream are ordered, so they may share it), grown on
// demand; a call being captured into a CUDA graph that needs more than the cached one gets its
// own from the graph's pool instead of growing the cache with graph-owned memory.
struct Workspaces {
  std::mutex lock;
  std::unordered_map<cudaStream_t, at::Tensor> by_stream;
};
Workspaces workspaces;

at::Tensor workspace(const at::Tensor& like, cudaStream_t stream, size_t bytes) {
  size_t size = std::max<size_t>(bytes, 256);  // kernels that need none still get a valid pointer
  std::lock_guard<std::mutex> guard(workspaces.lock);
  at::Tensor& cached = workspaces.by_stream[stream];
  if (cached.defined() && size_t(cached.numel()) >= size) return cached;
  at::Tensor fresh = at::empty({int64_t(size)}, like.options().dtype(at::kByte));
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) cached = fresh;
  return fresh;
}

bool aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// C = a @ b (layout NN) or a @ b^T (NT) from the table's kernel, with a's leading dimensions
// flattened into M; nullopt where the table does not cover the call.
std::optional<at::Tensor> tuned(const at::Tensor& a, const at::Tensor& b, Layout layout) {
  if (!a.is_cuda() || a.device() != b.device() || a.dim() < 2 || b.dim() != 2 || b.scalar_type() != a.scalar_type()
      || !a.is_contiguous() || !b.is_contiguous())
    return std::nullopt;
  int64_t dtype = dtype_code(a.scalar_type());
  int64_t k = a.size(-1);
  int64_t n = layout == NN ? b.size(1) : b.size(0);
  int64_t m = k ? a.numel() / k : 0;
  if (dtype < 0 || (layout == NN ? b.size(0) : b.size(1)) != k || m == 0 || n == 0 || k == 0
      || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || !aligned(a) || !aligned(b))
    return std::nullopt;
  Choice c = choice({m, n, k, dtype, layout});
  if (c.kernel == nullptr) return std::nullopt;
  c10::cuda::CUDAGuard device(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
  std::vector<int64_t> sizes = a.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, a.options());
  at::Tensor space = workspace(a, stream, c.workspace);
  int code = c.kernel->gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), int(m), int(n), int(k), space.data_ptr(),
                            c.workspace, stream);
  if (code != 0) return std::nullopt;  // the kernel declines the shape: the library call runs
  return out;
}

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (auto out = tuned(x, weight, NT)) return bias ? out->add_(*bias) : *out;
  return at::linear(x, weight, bias);
}

at::Tensor mm_cuda(const at::Tensor& a, const at::Tensor& b) {
  if (a.dim() == 2)
    if (auto out = tuned(a, b, NN)) return *out;
  return at::mm(a, b);
}
#endif

at::Tensor linear_fallback(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return at::linear(x, weight, bias);
}

at::Tensor mm_fallback(const at::Tensor& a, const at::Tensor& b) { return at::mm(a, b); }

// Shapes and dtypes alone (meta tensors, FakeTensor, torch.compile's tracing; symbolic sizes too).
at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2, "cudal2::linear: x [..., K] and weight [N, K]");
  TORCH_CHECK(x.sym_size(-1) == weight.sym_size(1), "cudal2::linear: x and weight disagree on K");
  std::vector<c10::SymInt> sizes = x.sym_sizes().vec();
  sizes.back() = weight.sym_size(0);
  return at::empty_symint(sizes, x.options());
}

at::Tensor mm_meta(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "cudal2::mm: a [M, K] and b [K, N]");
  TORCH_CHECK(a.sym_size(1) == b.sym_size(0), "cudal2::mm: a and b disagree on K");
  return at::empty_symint({a.sym_size(0), b.sym_size(1)}, a.options());
}

const c10::TypedOperatorHandle<decltype(linear_fallback)>& linear_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("cudal2::linear", "").typed<decltype(linear_fallback)>();
  return op;
}

const c10::TypedOperatorHandle<decltype(mm_fallback)>& mm_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("cudal2::mm", "").typed<decltype(mm_fallback)>();
  return op;
}

// Autograd: differentiable as the library call it stands for; the backward runs library calls.
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias"] = bias.has_value();
    at::AutoDispatchBelowADInplaceOrView below;
    return linear_op().call(x, weight, bias);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &grad = grads[0];
    at::Tensor rows = grad.reshape({-1, grad.size(-1)});  // [M, N]
    return {ctx->needs_input_grad(0) ? at::matmul(grad, weight) : at::Tensor(),
            ctx->needs_input_grad(1) ? at::mm(rows.t(), x.reshape({-1, x.size(-1)})) : at::Tensor(),
            ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2) ? rows.sum(0) : at::Tensor()};
  }
};

struct MmFunction : torch::autograd::Function<MmFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    ctx->save_for_backward({a, b});
    at::AutoDispatchBelowADInplaceOrView below;
    return mm_op().call(a, b);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    return {ctx->needs_input_grad(0) ? at::mm(grads[0], saved[1].t()) : at::Tensor(),
            ctx->needs_input_grad(1) ? at::mm(saved[0].t(), grads[0]) : at::Tensor()};
  }
};

bool records(const at::Tensor& t) { return t.requires_grad(); }

// With nothing to record (inference, or no input requiring a gradient) the call goes straight
// below autograd, without the autograd node that Function::apply allocates on every call.
// The keys below autograd are this call's own, so the dispatcher redispatches without computing
// them again.
at::Tensor linear_autograd(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  if (at::GradMode::is_enabled() && (records(x) || records(weight) || (bias && records(*bias))))
    return LinearFunction::apply(x, weight, bias);
  at::AutoDispatchBelowADInplaceOrView below;
  return linear_op().redispatch(keys & c10::after_ADInplaceOrView_keyset, x, weight, bias);
}

at::Tensor mm_autograd(c10::DispatchKeySet keys, const at::Tensor& a, const at::Tensor& b) {
  if (at::GradMode::is_enabled() && (records(a) || records(b))) return MmFunction::apply(a, b);
  at::AutoDispatchBelowADInplaceOrView below;
  return mm_op().redispatch(keys & c10::after_ADInplaceOrView_keyset, a, b);
}

// cudal2::layer, a patched nn.Linear's forward (cudal2.torch.patch): linear with the layer's own
// tensors first, bound once, so that a call passes x positionally (torch.ops parses keyword
// arguments at a microsecond a call). Each dispatch key's kernel is linear's, arguments reordered
// (a composite calling linear would cost a second trip through the dispatcher).
template <at::Tensor (*Linear)(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>
at::Tensor layer(const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& x) {
  return Linear(x, weight, bias);
}

const c10::TypedOperatorHandle<decltype(layer<linear_fallback>)>& layer_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("cudal2::layer", "").typed<decltype(layer<linear_fallback>)>();
  return op;
}

at::Tensor layer_autograd(c10::DispatchKeySet keys, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& x) {
  if (at::GradMode::is_enabled() && (records(x) || records(weight) || (bias && records(*bias))))
    return LinearFunction::apply(x, weight, bias);
  at::AutoDispatchBelowADInplaceOrView below;
  return layer_op().redispatch(keys & c10::after_ADInplaceOrView_keyset, weight, bias, x);
}

#ifdef CUDAL2_PYTHON
// cudal2::layer called from Python through pybind11 (the module's `layer`, a patched layer's
// forward): its arguments are bound in a fraction of the time torch.ops' schema-driven binding
// takes (1x64x64 on a CPU tensor here: 2.0 us a call, against 3.3 through torch.ops and 2.4 for
// F.linear); the call then goes through the dispatcher as any call of the op (autograd, meta,
// the CUDA kernel or the library call). cudal2/torch.py tells torch.compile to trace it as the op.
at::Tensor layer_call(const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& x) {
  return layer_op().call(weight, bias, x);
}
#endif

}  // namespace

TORCH_LIBRARY(cudal2, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("mm(Tensor a, Tensor b) -> Tensor");
  m.def("layer(Tensor weight, Tensor? bias, Tensor x) -> Tensor");
  m.def("_serve(str[] kernels, int[] entries, int[] library_call) -> ()", &serve);
  m.def("_kernel(int m, int n, int k, int dtype, int layout) -> str", &kernel_for);
}

TORCH_LIBRARY_IMPL(cudal2, CompositeExplicitAutograd, m) {  // every device: the library call
  m.impl("linear", &linear_fallback);
  m.impl("layer", &layer<linear_fallback>);
  m.impl("mm", &mm_fallback);
}

#ifdef CUDAL2_CUDA
TORCH_LIBRARY_IMPL(cudal2, CUDA, m) {
  m.impl("linear", &linear_cuda);
  m.impl("layer", &layer<linear_cuda>);
  m.impl("mm", &mm_cuda);
}
#endif

TORCH_LIBRARY_IMPL(cudal2, Meta, m) {
  m.impl("linear", &linear_meta);
  m.impl("layer", &layer<linear_meta>);
  m.impl("mm", &mm_meta);
}

TORCH_LIBRARY_IMPL(cudal2, Autograd, m) {
  m.impl("linear", &linear_autograd);
  m.impl("layer", &layer_autograd);
  m.impl("mm", &mm_autograd);
}

#ifdef CUDAL2_PYTHON  // built as a Python module (cudal2/torch.py, where Python's headers are installed)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer", &layer_call, "cudal2::layer(weight, bias, x): linear(x, weight, bias) through the dispatcher",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
#endif
