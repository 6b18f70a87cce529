#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace apex::amp::detail {

/// While alive (with a WarningHandlerGuard), drops the dispatcher's "Overriding a previously
/// registered kernel" warning: apex replaces some of LibTorch's kernels on purpose, and the
/// warning is no news to anyone. Every other warning passes on.
struct QuietRegistration : c10::WarningHandler {
  c10::WarningHandler* outer = c10::WarningUtils::get_warning_handler();
  void process(const c10::Warning& w) override {
    if (w.msg().find("Overriding a previously registered kernel") == std::string::npos) {
      outer->process(w);
    }
  }
};

}  // namespace apex::amp::detail
