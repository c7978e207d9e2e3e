// RMSNorm / gated RMSNorm as a C++ autograd node that launches the Triton kernels of k3_kernels/norm/fused.py.
//
// Why: at a few thousand rows the Python side of a Triton op (torch.autograd.Function, argument binding, three
// launches, allocations) costs more host time than the kernels take on the GPU; torch's own rms_norm is a C++
// node. Here forward and backward are C++; a kernel's first launch for a given specialisation goes through
// Python (Triton compiles it: `_compile_and_launch` in fused.py, which returns the compiled function and its
// parameter list), later launches go straight to cuLaunchKernel with the same parameter layout as Triton's own
// launcher (triton/backends/nvidia/driver.py, 3.6: the non-constexpr arguments in order, then the global and
// profile scratch pointers). Under the CPU interpreter every launch goes through Python. Triton launch hooks
// (profilers) see a specialisation's launches only until it is cached.
#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// One argument of a launch: an absent operand (Triton specialises None as a constant), a tensor, an int, a float.
struct Arg {
  enum Kind { kNone, kTensor, kInt, kFloat } kind = kNone;
  Tensor tensor;
  int64_t i = 0;
  double f = 0;
};

Arg arg(const std::optional<Tensor>& t) {
  Arg a;
  if (t.has_value() && t->defined()) {
    a.kind = Arg::kTensor;
    a.tensor = *t;
  }
  return a;
}
Arg arg(int64_t v) {
  Arg a;
  a.kind = Arg::kInt;
  a.i = v;
  return a;
}
Arg arg(double v) {
  Arg a;
  a.kind = Arg::kFloat;
  a.f = v;
  return a;
}

// A compiled kernel as cuLaunchKernel needs it; `params` lists (argument index, kind) of the runtime parameters:
// 'p' pointer, 'i' i32, 'l' i64 / u64, 'f' fp32.
struct Compiled {
  void* function = nullptr;
  unsigned threads = 0;
  unsigned shared = 0;
  std::vector<std::pair<int, char>> params;
};

std::mutex cache_mutex;
std::unordered_map<std::string, std::shared_ptr<Compiled>> cache;
py::object* compile_and_launch = nullptr;  // set by set_compiler()

// The compile key: at least as fine as Triton's specialisation (as k3_kernels.launch._spec): tensor dtype and
// 16-byte alignment, int == 1 / % 16 / i32 range, None, float; plus the constexprs and the device.
std::string key_of(const char* kernel, int device, const std::vector<Arg>& args,
                   const std::vector<std::pair<const char*, int64_t>>& constexprs) {
  std::string key(kernel);
  key += '|';
  key += std::to_string(device);
  for (const Arg& a : args) {
    key += '|';
    switch (a.kind) {
      case Arg::kNone: key += 'n'; break;
      case Arg::kTensor:
        key += 't' + std::to_string(static_cast<int>(a.tensor.scalar_type()));
        key += (reinterpret_cast<uintptr_t>(a.tensor.data_ptr()) % 16 == 0) ? 'a' : 'u';
        break;
      case Arg::kInt:
        key += 'i';
        key += a.i == 1 ? '1' : (a.i % 16 == 0 ? 'd' : 'x');
        key += (a.i >= INT32_MIN && a.i <= INT32_MAX) ? '4' : '8';
        break;
      case Arg::kFloat: key += 'f'; break;
    }
  }
  for (const auto& c : constexprs) {
    key += '|';
    key += c.first;
    key += '=' + std::to_string(c.second);
  }
  return key;
}

typedef int (*LaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                            void**, void**);

LaunchKernel cu_launch_kernel() {
  static LaunchKernel fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "k3 rms_norm: cannot load libcuda.so.1");
    auto f = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
    TORCH_CHECK(f != nullptr, "k3 rms_norm: libcuda.so.1 has no cuLaunchKernel");
    return f;
  }();
  return fn;
}

void launch_compiled(const Compiled& k, const std::vector<Arg>& args, int64_t grid, const c10::Device& device) {
  std::vector<uint64_t> slots(k.params.size() + 2, 0);  // + global scratch, profile scratch (null: size 0)
  std::vector<void*> params(slots.size());
  for (size_t j = 0; j < k.params.size(); ++j) {
    const Arg& a = args[k.params[j].first];
    switch (k.params[j].second) {
      case 'p': slots[j] = reinterpret_cast<uint64_t>(a.tensor.data_ptr()); break;
      case 'i': *reinterpret_cast<int32_t*>(&slots[j]) = static_cast<int32_t>(a.i); break;
      case 'l': *reinterpret_cast<int64_t*>(&slots[j]) = a.i; break;
      case 'f': *reinterpret_cast<float*>(&slots[j]) = static_cast<float>(a.f); break;
      default: TORCH_CHECK(false, "k3 rms_norm: unknown parameter kind ", k.params[j].second);
    }
  }
  for (size_t j = 0; j < slots.size(); ++j) params[j] = &slots[j];
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
  int err = cu_launch_kernel()(k.function, static_cast<unsigned>(grid), 1, 1, k.threads, 1, 1, k.shared, stream,
                               params.data(), nullptr);
  TORCH_CHECK(err == 0, "k3 rms_norm: cuLaunchKernel failed with CUresult ", err);
}

// Launch `kernel` (a name fused.py knows) on a 1-D grid: from the cache when compiled for this specialisation,
// else through Python (which compiles, launches and describes the compiled kernel, or returns None).
void launch(const char* kernel, int64_t grid, const std::vector<Arg>& args,
            const std::vector<std::pair<const char*, int64_t>>& constexprs, const c10::Device& device) {
  std::string key;
  if (device.is_cuda()) {
    key = key_of(kernel, device.index(), args, constexprs);
    std::shared_ptr<Compiled> hit;
    {
      std::lock_guard<std::mutex> lock(cache_mutex);
      auto it = cache.find(key);
      if (it != cache.end()) hit = it->second;
    }
    if (hit) {
      launch_compiled(*hit, args, grid, device);
      return;
    }
  }
  TORCH_CHECK(compile_and_launch != nullptr, "k3 rms_norm: set_compiler() was not called");
  py::gil_scoped_acquire gil;
  py::list py_args;
  for (const Arg& a : args) {
    switch (a.kind) {
      case Arg::kNone: py_args.append(py::none()); break;
      case Arg::kTensor: py_args.append(py::cast(a.tensor)); break;
      case Arg::kInt: py_args.append(py::int_(a.i)); break;
      case Arg::kFloat: py_args.append(py::float_(a.f)); break;
    }
  }
  py::dict py_constexprs;
  for (const auto& c : constexprs) py_constexprs[c.first] = py::int_(c.second);
  py::object info = (*compile_and_launch)(kernel, grid, py_args, py_constexprs);
  if (info.is_none() || !device.is_cuda()) return;
  auto c = std::make_shared<Compiled>();
  auto t = info.cast<py::tuple>();
  c->function = reinterpret_cast<void*>(t[0].cast<uint64_t>());
  c->threads = t[1].cast<unsigned>();
  c->shared = t[2].cast<unsigned>();
  for (auto p : t[3].cast<py::list>()) {
    auto pair = p.cast<py::tuple>();
    c->params.emplace_back(pair[0].cast<int>(), pair[1].cast<std::string>().at(0));
  }
  std::lock_guard<std::mutex> lock(cache_mutex);
  cache.emplace(key, std::move(c));
}

// Launch configuration, a function of D alone (batch invariance): (rows per program, padded width, warps).
struct Config {
  int64_t block_m, block_d, warps;
};

Config config_of(int64_t D) {
  int64_t block_d = 1;
  while (block_d < D) block_d <<= 1;
  int64_t block_m = std::max<int64_t>(1, std::min<int64_t>(16, 2048 / block_d));
  int64_t warps = block_d * block_m <= 2048 ? 4 : (block_d <= 4096 ? 8 : 16);
  return {block_m, block_d, warps};
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Forward: y (and 1/rms when it will be needed by a backward).
std::pair<Tensor, Tensor> forward_impl(const Tensor& x2, const std::optional<Tensor>& g2,
                                       const std::optional<Tensor>& weight, double eps, bool store_rstd) {
  const int64_t M = x2.size(0), D = x2.size(1);
  Tensor y = at::empty({M, D}, x2.options());
  Tensor rstd = store_rstd ? at::empty({M}, x2.options().dtype(at::kFloat)) : Tensor();
  if (M > 0) {
    Config c = config_of(D);
    const bool gated = g2.has_value() && g2->defined();
    const bool has_w = weight.has_value() && weight->defined();
    launch("rms_fwd", cdiv(M, c.block_m),
           {arg(x2), arg(g2), arg(weight), arg(y), arg(store_rstd ? std::optional<Tensor>(rstd) : std::nullopt),
            arg(M), arg(D), arg(x2.stride(0)), arg(gated ? g2->stride(0) : int64_t(0)), arg(eps)},
           {{"HAS_W", has_w}, {"GATED", gated}, {"STORE_RSTD", store_rstd}, {"BLOCK_M", c.block_m},
            {"BLOCK_D", c.block_d}, {"num_warps", c.warps}},
           x2.device());
  }
  return {y, rstd};
}

class RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x2, const std::optional<Tensor>& g2,
                        const std::optional<Tensor>& weight, double eps, int64_t programs_per_sm, int64_t sms) {
    c10::DeviceGuard guard(x2.device());
    auto [y, rstd] = forward_impl(x2, g2, weight, eps, true);
    ctx->save_for_backward({x2, g2.value_or(Tensor()), weight.value_or(Tensor()), rstd});
    ctx->saved_data["programs"] = std::max<int64_t>(1, std::min<int64_t>(
        cdiv(x2.size(0), config_of(x2.size(1)).block_m), sms * programs_per_sm));
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &x2 = saved[0], &g2 = saved[1], &weight = saved[2], &rstd = saved[3];
    const int64_t M = x2.size(0), D = x2.size(1);
    c10::DeviceGuard guard(x2.device());
    Tensor dy = grads[0].reshape({M, D}).contiguous();
    Tensor dx = at::empty({M, D}, x2.options());
    Tensor dg = g2.defined() ? at::empty({M, D}, g2.options()) : Tensor();
    const int64_t P = ctx->saved_data["programs"].toInt();
    Tensor dw_part = weight.defined() ? at::empty({P, D}, x2.options().dtype(at::kFloat)) : Tensor();
    Config c = config_of(D);
    auto opt = [](const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; };
    if (M > 0) {
      launch("rms_bwd", P,
             {arg(x2), arg(opt(g2)), arg(opt(weight)), arg(dy), arg(rstd), arg(dx), arg(opt(dg)), arg(opt(dw_part)),
              arg(M), arg(D), arg(x2.stride(0)), arg(g2.defined() ? g2.stride(0) : int64_t(0))},
             {{"HAS_W", weight.defined()}, {"GATED", g2.defined()}, {"BLOCK_M", c.block_m}, {"BLOCK_D", c.block_d},
              {"num_warps", c.warps}},
             x2.device());
    } else if (dw_part.defined()) {
      dw_part.zero_();
    }
    Tensor dw;
    if (weight.defined() && ctx->needs_input_grad(g2.defined() ? 2 : 1)) {  // edges: the defined tensor inputs
      dw = at::empty({D}, weight.options());
      const int64_t block = 256;
      launch("colsum", cdiv(D, block), {arg(dw_part), arg(dw), arg(P), arg(D)},
             {{"BLOCK_P", 32}, {"BLOCK", block}, {"num_warps", 4}}, x2.device());
    }
    variable_list out = {dx, dg, dw};
    if (torch::autograd::GradMode::is_enabled()) {  // create_graph=True: a second derivative raises (as Python's
      // once_differentiable): the gradients are returned through an error node
      auto err = std::make_shared<torch::autograd::DelayedError>(
          "k3 rms_norm: no second derivative through the fused kernels", static_cast<int64_t>(out.size()));
      for (Tensor& t : out) {
        if (t.defined()) t = t.detach().requires_grad_(true);
      }
      out = (*err)(std::move(out));
    }
    out.resize(6);  // eps, programs_per_sm, sms: no gradient
    return out;
  }
};

Tensor rms_norm_node(const Tensor& x2, const std::optional<Tensor>& g2, const std::optional<Tensor>& weight,
                     double eps, int64_t programs_per_sm, int64_t sms) {
  return RMSNormFunction::apply(x2, g2, weight, eps, programs_per_sm, sms);
}

Tensor rms_norm_forward(const Tensor& x2, const std::optional<Tensor>& g2, const std::optional<Tensor>& weight,
                        double eps) {
  c10::DeviceGuard guard(x2.device());
  return forward_impl(x2, g2, weight, eps, false).first;
}

// For tests: the compile key of a launch's arguments, and how many kernels the direct-launch cache holds.
std::string specialisation_key(const py::list& values) {
  std::vector<Arg> args;
  for (auto v : values) {
    TORCH_CHECK(!py::isinstance<py::bool_>(v), "k3 rms_norm: bool launch arguments are not used");
    if (v.is_none()) {
      args.push_back(arg(std::optional<Tensor>()));
    } else if (py::isinstance<py::int_>(v)) {
      args.push_back(arg(v.cast<int64_t>()));
    } else if (py::isinstance<py::float_>(v)) {
      args.push_back(arg(v.cast<double>()));
    } else {
      args.push_back(arg(std::optional<Tensor>(v.cast<Tensor>())));
    }
  }
  return key_of("k", 0, args, {});
}

size_t cached_kernels() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  return cache.size();
}

void set_compiler(py::object fn) {
  // Deliberately never freed: a static py::object would be released after the interpreter has shut down.
  compile_and_launch = new py::object(std::move(fn));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_node", &rms_norm_node, "RMSNorm(x) [* weight] [* sigmoid(gate)] with a C++ autograd node",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_forward", &rms_norm_forward, "forward only (no autograd, 1/rms not stored)",
        py::call_guard<py::gil_scoped_release>());
  m.def("set_compiler", &set_compiler, "the Python callback that compiles and launches a kernel's first call");
  m.def("specialisation_key", &specialisation_key, "compile key of launch arguments (tests)");
  m.def("cached_kernels", &cached_kernels, "kernels the direct-launch cache holds (tests)");
}
