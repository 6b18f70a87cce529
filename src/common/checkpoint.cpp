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
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/archive.h"
#include "common/io.h"

namespace apex {
namespace {

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

}  // namespace

void save_module(const torch::nn::Module& module, const std::string& path) {
  torch::serialize::OutputArchive archive;
  module.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  write_file_atomic(path, out.str());
}

void load_module(torch::nn::Module& module, const std::string& path) {
  const std::string who = "load_module";
  std::istringstream in(
      read_torch_archive(path, who, "a module archive (torch::save, save_module)"));
  // Every parameter and buffer as it is now, to put back if anything fails.
  std::vector<at::Tensor> tensors;
  for (const auto& p : module.parameters()) tensors.push_back(p);
  for (const auto& b : module.buffers()) tensors.push_back(b);
  std::vector<at::Tensor> before;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& t : tensors) {
    before.push_back(t.detach().clone());
    shapes.push_back(t.sizes().vec());
  }
  const at::NoGradGuard no_grad;
  // Loaded onto the module's device (LibTorch would otherwise move a parameter to the archive's).
  std::optional<c10::Device> device;
  for (const auto& t : tensors) {
    if (!device) device = t.device();
    if (t.device() != *device) device.reset();
    if (!device) break;
  }
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(in, device);
    module.load(archive);
    for (size_t i = 0; i < tensors.size(); ++i) {
      TORCH_CHECK(tensors[i].sizes() == at::IntArrayRef(shapes[i]) &&
                      tensors[i].scalar_type() == before[i].scalar_type() &&
                      tensors[i].device() == before[i].device(),
                  "tensor ", i, " of the module would change from ", before[i].scalar_type(),
                  at::IntArrayRef(shapes[i]), " on ", before[i].device(), " to ",
                  tensors[i].scalar_type(), tensors[i].sizes(), " on ", tensors[i].device());
    }
  } catch (const std::exception& e) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].sizes() != before[i].sizes() ||
          tensors[i].scalar_type() != before[i].scalar_type() ||
          tensors[i].device() != before[i].device()) {
        tensors[i].set_data(before[i]);  // as LibTorch's loader re-points them
      } else {
        tensors[i].copy_(before[i]);
      }
    }
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
