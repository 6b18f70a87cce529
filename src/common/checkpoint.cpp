// apex::save_module / load_module / save_optimizer / load_optimizer: LibTorch's archives, written
// atomically and read only after their CRC-32 checks, with nothing changed on a failed load.
#include <apex/io.h>
#include <apex/serialize.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/archive.h"
#include "common/half_models.h"
#include "common/io.h"

namespace apex {
namespace detail {
namespace {
std::mutex& half_models_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<const torch::nn::Module*, int>& half_models() {
  static std::unordered_map<const torch::nn::Module*, int> m;
  return m;
}
}  // namespace

void register_half_model(const torch::nn::Module* module) {
  const std::lock_guard<std::mutex> lock(half_models_mutex());
  ++half_models()[module];
}

void unregister_half_model(const torch::nn::Module* module) {
  const std::lock_guard<std::mutex> lock(half_models_mutex());
  auto it = half_models().find(module);
  if (it != half_models().end() && --it->second == 0) half_models().erase(it);
}

bool is_half_model(const torch::nn::Module* module) {
  const std::lock_guard<std::mutex> lock(half_models_mutex());
  return half_models().count(module) > 0;
}
}  // namespace detail

namespace {

// Module::save's layout (parameters, buffers, then each child's archive), half tensors widened.
void save_widened(const torch::nn::Module& module, torch::serialize::OutputArchive& archive) {
  const auto widen = [](const at::Tensor& t) {
    return detail::is_half(t.scalar_type()) ? t.to(at::kFloat) : t;
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    archive.write(p.key(), widen(p.value()));
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    archive.write(b.key(), widen(b.value()), /*is_buffer=*/true);
  }
  for (const auto& c : module.named_children()) {
    if (!c.value()->is_serializable()) continue;
    torch::serialize::OutputArchive child(archive.compilation_unit());
    save_widened(*c.value(), child);
    archive.write(c.key(), child);
  }
}

/// The bytes of `path`, checked: a zip archive in LibTorch's (TorchScript) format whose records
/// all pass their CRC-32.
std::string read_torch_archive(const std::string& path, const std::string& who,
                               const std::string& expected) {
  const std::vector<char> bytes = detail::read_file(path);
  const std::string_view view(bytes.data(), bytes.size());
  const std::string what = who + ": '" + path + "'";
  const bool zip = view.size() >= 4 && view.substr(0, 4) == std::string_view("PK\x03\x04", 4);
  TORCH_CHECK(zip, what, " is ", detail::describe_file(view), ", expected ", expected);
  const auto records = detail::verify_zip(view, what);
  bool script = false;
  for (const auto& r : records) {
    script = script || r.name.find("/constants.pkl") != std::string::npos ||
             r.name.find("/code/") != std::string::npos;
  }
  TORCH_CHECK(script, what, " is ", detail::describe_file(view), ", expected ", expected);
  return std::string(view);
}

std::string what_of(const std::exception& e) {
  const auto* c = dynamic_cast<const c10::Error*>(&e);
  return c != nullptr ? c->what_without_backtrace() : e.what();
}

// Module::load's walk (parameters, buffers, each child's archive), but every archive tensor is
// read first and checked against the module's (shape, dtype; fp32 into a half tensor only for an
// amp O2/O3 model, whose save_module widened it), and written later with copy_. LibTorch's
// loader set_()s each tensor onto the archive's storage, which for another dtype reinterprets
// the bytes: an fp32 archive "loaded" into a bf16 model without an error.
void read_checked(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                  const std::string& prefix, bool narrow,
                  std::vector<std::pair<at::Tensor, at::Tensor>>& reads) {
  const auto take = [&](const std::string& key, const at::Tensor& dst, bool is_buffer) {
    if (!dst.defined()) return;
    at::Tensor src;
    archive.read(key, src, is_buffer);
    TORCH_CHECK(src.sizes() == dst.sizes(), "'", prefix, key, "' has shape ", src.sizes(),
                " in the file, the module's has ", dst.sizes());
    TORCH_CHECK(
        src.scalar_type() == dst.scalar_type() ||
            (narrow && detail::is_half(dst.scalar_type()) && src.scalar_type() == at::kFloat),
        "'", prefix, key, "' is ", src.scalar_type(), " in the file, the module's is ",
        dst.scalar_type());
    reads.emplace_back(dst, std::move(src));
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) take(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(/*recurse=*/false)) take(b.key(), b.value(), true);
  for (const auto& c : module.named_children()) {
    if (!c.value()->is_serializable()) continue;
    torch::serialize::InputArchive child;
    archive.read(c.key(), child);
    read_checked(*c.value(), child, prefix + c.key() + ".", narrow, reads);
  }
}

}  // namespace

void save_module(const torch::nn::Module& module, const std::string& path) {
  torch::serialize::OutputArchive archive;
  if (detail::is_half_model(&module)) {
    save_widened(module, archive);
  } else {
    module.save(archive);
  }
  std::ostringstream out;
  archive.save_to(out);
  write_file_atomic(path, out.str());
}

void load_module(torch::nn::Module& module, const std::string& path) {
  const std::string who = "load_module";
  std::istringstream in(
      read_torch_archive(path, who, "a module archive (torch::save, save_module)"));
  std::vector<at::Tensor> tensors;
  for (const auto& p : module.parameters()) tensors.push_back(p);
  for (const auto& b : module.buffers()) tensors.push_back(b);
  const at::NoGradGuard no_grad;
  // Read onto the module's device where it has one, so that the copies stay on it.
  std::optional<c10::Device> device;
  for (const auto& t : tensors) {
    if (!device) device = t.device();
    if (t.device() != *device) device.reset();
    if (!device) break;
  }
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(in, device);
    // Everything read and checked (shape, dtype) before anything is written: a failure leaves
    // the module as it was, with no copy of it kept aside. copy_ keeps each tensor's shape,
    // dtype and device.
    std::vector<std::pair<at::Tensor, at::Tensor>> reads;
    read_checked(module, archive, "", detail::is_half_model(&module), reads);
    for (auto& [dst, src] : reads) dst.copy_(src);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who, ": '", path, "' does not hold this module's parameters and buffers (",
                what_of(e), "); the module is unchanged");
  }
}

void save_optimizer(const torch::optim::Optimizer& optimizer, const std::string& path) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  write_file_atomic(path, out.str());
}

void load_optimizer(torch::optim::Optimizer& optimizer, const std::string& path) {
  const std::string who = "load_optimizer";
  std::istringstream in(
      read_torch_archive(path, who, "an optimizer archive (torch::save, save_optimizer)"));
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options;
  for (const auto& g : optimizer.param_groups()) options.push_back(g.options().clone());
  ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>> state;
  for (const auto& [key, value] : optimizer.state()) state[key] = value->clone();
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    optimizer.load(archive);
  } catch (const std::exception& e) {
    for (size_t gi = 0; gi < options.size(); ++gi) {
      optimizer.param_groups()[gi].set_options(std::move(options[gi]));
    }
    optimizer.state() = std::move(state);
    TORCH_CHECK(false, who, ": '", path, "' could not be loaded into this optimizer (", what_of(e),
                "); the optimizer is unchanged");
  }
}

}  // namespace apex
