// An Amp handle's state dict (apex/amp/initialize.h): the loss scalers and the fp32 masters,
// saved and loaded atomically; a failed load changes nothing.
#include <apex/amp/initialize.h>
#include <apex/io.h>
#include <apex/serialize.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <string_view>

#include "amp/amp_state.h"
#include "common/io.h"

namespace apex::amp {

StateDict Amp::state_dict() {
  auto& st = *state_;
  st.rethrow_deferred();
  st.sync_all();
  st.resolve([](const detail::PendingCheck&) { return true; });
  StateDict d = make_state_dict();
  d.insert("opt_level", to_string(st.props.opt_level));
  for (size_t i = 0; i < st.scalers.size(); ++i) {
    d.insert("loss_scaler" + std::to_string(i), st.scalers[i].state_dict());
  }
  c10::impl::GenericList masters(c10::ListType::ofTensors());
  for (const auto& e : st.entries) {
    c10::List<at::Tensor> list;
    for (const auto& s : e.slots) {
      if (s.copy)
        list.push_back(s.master.detach().to(c10::kCPU, /*non_blocking=*/false,
                                            /*copy=*/true));
    }
    masters.push_back(list);
  }
  d.insert("master_params", masters);
  return d;
}

void Amp::load_state_dict(const StateDict& state) {
  auto& st = *state_;
  st.rethrow_deferred();
  st.sync_all();
  st.resolve([](const detail::PendingCheck&) { return true; });
  // Validate everything into copies; commit only when all of it is good.
  std::vector<LossScaler> scalers = st.scalers;
  std::vector<bool> seen(scalers.size(), false);
  std::vector<std::vector<at::Tensor>> masters;
  bool have_masters = false;
  for (const auto& entry : state) {
    TORCH_CHECK(entry.key().isString(), "Amp::load_state_dict: keys must be strings");
    const std::string key = entry.key().toStringRef();
    const c10::IValue& v = entry.value();
    if (key == "opt_level") {
      TORCH_CHECK(v.isString() && v.toStringRef() == to_string(st.props.opt_level),
                  "Amp::load_state_dict: the state was written at opt_level ",
                  v.isString() ? v.toStringRef() : std::string("?"), ", this handle is ",
                  to_string(st.props.opt_level));
    } else if (key.rfind("loss_scaler", 0) == 0) {
      const std::string num = key.substr(11);
      size_t i = 0;
      try {
        i = std::stoul(num);
      } catch (const std::exception&) {
        TORCH_CHECK(false, "Amp::load_state_dict: unexpected key '", key, "'");
      }
      TORCH_CHECK(i < scalers.size(), "Amp::load_state_dict: '", key, "' but this handle has ",
                  scalers.size(), " loss scaler(s) (num_losses)");
      TORCH_CHECK(v.isGenericDict(), "Amp::load_state_dict: '", key, "' must be a dict");
      StateDict sd = make_state_dict();
      for (const auto& e : v.toGenericDict()) sd.insert(e.key().toStringRef(), e.value());
      scalers[i].load_state_dict(sd);
      seen[i] = true;
    } else if (key == "master_params") {
      TORCH_CHECK(v.isList(), "Amp::load_state_dict: 'master_params' must be a list");
      const auto outer = v.toList();
      TORCH_CHECK(outer.size() == st.entries.size(), "Amp::load_state_dict: 'master_params' has ",
                  outer.size(), " optimizer list(s), this handle has ", st.entries.size());
      for (size_t i = 0; i < outer.size(); ++i) {
        const c10::IValue inner_v = outer.get(i);
        TORCH_CHECK(inner_v.isList(), "Amp::load_state_dict: master_params[", i,
                    "] must be a list of tensors");
        std::vector<at::Tensor> inner;
        for (const auto& t : inner_v.toListRef()) {
          TORCH_CHECK(t.isTensor(), "Amp::load_state_dict: master_params[", i, "] holds a ",
                      t.tagKind(), ", expected tensors");
          inner.push_back(t.toTensor());
        }
        std::vector<const detail::Slot*> copies;
        for (const auto& s : st.entries[i].slots) {
          if (s.copy) copies.push_back(&s);
        }
        TORCH_CHECK(inner.size() == copies.size(), "Amp::load_state_dict: master_params[", i,
                    "] has ", inner.size(), " tensors, optimizer ", i, " has ", copies.size(),
                    " master weights");
        for (size_t k = 0; k < inner.size(); ++k) {
          TORCH_CHECK(inner[k].sizes() == copies[k]->master.sizes() && inner[k].is_floating_point(),
                      "Amp::load_state_dict: master_params[", i, "][", k, "] has shape ",
                      inner[k].sizes(), " and dtype ", inner[k].scalar_type(),
                      ", expected a floating tensor of shape ", copies[k]->master.sizes());
        }
        masters.push_back(std::move(inner));
      }
      have_masters = true;
    } else {
      TORCH_CHECK(false, "Amp::load_state_dict: unexpected key '", key, "'");
    }
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    TORCH_CHECK(seen[i], "Amp::load_state_dict: missing 'loss_scaler", i, "'");
  }
  bool need_masters = false;
  for (const auto& e : st.entries) {
    for (const auto& s : e.slots) need_masters = need_masters || s.copy;
  }
  TORCH_CHECK(have_masters || !need_masters,
              "Amp::load_state_dict: missing 'master_params' (this handle keeps fp32 master "
              "weights; resuming without them would lose precision)");

  st.scalers = std::move(scalers);
  if (have_masters) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < masters.size(); ++i) {
      size_t k = 0;
      for (auto& s : st.entries[i].slots) {
        if (!s.copy) continue;
        s.master.copy_(masters[i][k++]);
      }
      st.copy_masters_to_model(st.entries[i]);
    }
  }
}

void Amp::save(const std::string& path) {
  const auto bytes = apex::detail::pickle_save(state_dict(), "amp");
  apex::write_file_atomic(path, std::string_view(bytes.data(), bytes.size()));
}

void Amp::load(const std::string& path) {
  const c10::IValue v = apex::detail::load_state_file(
      path, "amp", "Amp::load",
      "an Amp state (Amp::save, or Python's amp.state_dict() saved by torch.save)");
  TORCH_CHECK(v.isGenericDict(), "Amp::load: '", path, "' holds a ", v.tagKind(),
              ", expected an Amp state dict");
  StateDict d = make_state_dict();
  for (const auto& e : v.toGenericDict()) {
    TORCH_CHECK(e.key().isString(), "Amp::load: '", path, "' has a non-string key");
    d.insert(e.key().toStringRef(), e.value());
  }
  // A dict of another kind (no kind record: e.g. written from Python) says what it looks like.
  TORCH_CHECK(!d.contains("scale") || d.contains("loss_scaler0"), "Amp::load: '", path,
              "' holds a GradScaler state (keys scale, growth_factor, ...), expected an Amp state "
              "(keys loss_scaler0, ...)");
  TORCH_CHECK(!d.contains("param_groups"), "Amp::load: '", path,
              "' holds an optimizer state (keys state, param_groups), expected an Amp state "
              "(keys loss_scaler0, ...)");
  load_state_dict(d);
}

}  // namespace apex::amp
