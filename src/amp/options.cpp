#include <apex/amp/options.h>

#include <c10/util/Exception.h>

#include <charconv>
#include <cmath>
#include <sstream>

namespace apex::amp {

namespace {

/// What an opt level casts the model to.
enum class ModelCast { kNone, kFloat, kHalf };

/// One row of apex's opt-level table: the properties a level sets before any override.
struct LevelDefaults {
  OptLevel level;
  const char* name;
  ModelCast cast_model;
  bool patch_torch_functions;  ///< autocast around operations
  bool keep_batchnorm_fp32;
  bool master_weights;
  bool dynamic_loss_scale;  ///< dynamic scaling for fp16 (bf16 keeps a static 1: fp32's range)
};

constexpr LevelDefaults kLevels[] = {
    {.level = OptLevel::O0,
     .name = "O0",
     .cast_model = ModelCast::kFloat,
     .patch_torch_functions = false,
     .keep_batchnorm_fp32 = false,
     .master_weights = false,
     .dynamic_loss_scale = false},
    {.level = OptLevel::O1,
     .name = "O1",
     .cast_model = ModelCast::kNone,
     .patch_torch_functions = true,
     .keep_batchnorm_fp32 = false,
     .master_weights = false,
     .dynamic_loss_scale = true},
    {.level = OptLevel::O2,
     .name = "O2",
     .cast_model = ModelCast::kHalf,
     .patch_torch_functions = false,
     .keep_batchnorm_fp32 = true,
     .master_weights = true,
     .dynamic_loss_scale = true},
    {.level = OptLevel::O3,
     .name = "O3",
     .cast_model = ModelCast::kHalf,
     .patch_torch_functions = false,
     .keep_batchnorm_fp32 = false,
     .master_weights = false,
     .dynamic_loss_scale = false},
};

const LevelDefaults& defaults_of(OptLevel level) {
  for (const auto& row : kLevels) {
    if (row.level == level) return row;
  }
  TORCH_CHECK(false, "invalid OptLevel value ", static_cast<int>(level));
}

}  // namespace

OptLevel parse_opt_level(std::string_view text) {
  for (const auto& row : kLevels) {
    if (text == row.name) return row.level;
  }
  TORCH_CHECK(false, "unknown opt_level '", text,
              "'; expected O0, O1, O2 or O3 (the letter O, not zero)");
}

std::string to_string(OptLevel level) { return defaults_of(level).name; }

LossScale::LossScale(double value) : dynamic_(false), value_(value) {
  TORCH_CHECK(std::isfinite(value) && value > 0, "loss_scale must be finite and > 0, got ", value);
}

LossScale LossScale::dynamic() { return {true, 1.0}; }

LossScale LossScale::parse(std::string_view text) {
  if (text == "dynamic") return dynamic();
  double v = 0;
  const auto* end = text.data() + text.size();
  const auto res = std::from_chars(text.data(), end, v);
  TORCH_CHECK(res.ec == std::errc() && res.ptr == end && !text.empty(), "invalid loss_scale '",
              text, "'; expected \"dynamic\" or a positive number");
  return {v};
}

Options::Options(OptLevel opt_level) : opt_level_(opt_level) {}

namespace {

bool is_float_type(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kHalf || t == c10::kBFloat16;
}

}  // namespace

c10::ScalarType Properties::default_half_dtype(c10::DeviceType device) {
  // CUDA: apex's fp16. CPU: bf16, which LibTorch multiplies fast with AVX512-BF16/AMX and apex's
  // route computes through fp32 elsewhere (cpu_half.h), and which needs no loss scaling.
  return device == c10::kCUDA ? c10::kHalf : c10::kBFloat16;
}

Properties Properties::resolve(const Options& o, c10::DeviceType device) {
  const OptLevel level = o.opt_level();
  const std::string name = to_string(level);
  const c10::ScalarType half = o.half_dtype().value_or(default_half_dtype(device));
  TORCH_CHECK(half == c10::kHalf || half == c10::kBFloat16,
              "amp Options: half_dtype must be Half or BFloat16, got ", half);
  TORCH_CHECK(
      o.cast_model_outputs() == c10::kFloat || o.cast_model_outputs() == c10::kHalf ||
          o.cast_model_outputs() == c10::kBFloat16 || o.cast_model_outputs() == c10::kDouble,
      "amp Options: cast_model_outputs must be a floating dtype, got ", o.cast_model_outputs());
  TORCH_CHECK(o.num_losses() >= 1, "amp Options: num_losses must be >= 1, got ", o.num_losses());
  TORCH_CHECK(o.verbosity() >= 0, "amp Options: verbosity must be >= 0, got ", o.verbosity());

  const LevelDefaults& row = defaults_of(level);
  Properties p;
  p.opt_level = level;
  p.enabled = o.enabled();
  p.half_dtype = half;
  if (row.cast_model != ModelCast::kNone) {
    p.cast_model_type = row.cast_model == ModelCast::kFloat ? c10::kFloat : half;
  }
  p.patch_torch_functions = row.patch_torch_functions;
  p.keep_batchnorm_fp32 = row.keep_batchnorm_fp32;
  p.master_weights = row.master_weights;
  // bf16 needs no dynamic scaling (fp32's exponent range).
  p.loss_scale =
      row.dynamic_loss_scale && half != c10::kBFloat16 ? LossScale::dynamic() : LossScale(1.0);
  p.cast_model_outputs = o.cast_model_outputs();

  // Overrides, checked as apex's Properties.__setattr__ did.
  if (o.cast_model_type()) {
    const auto t = *o.cast_model_type();
    TORCH_CHECK(is_float_type(t),
                "amp Options: cast_model_type must be Float, Half or BFloat16, got ", t);
    TORCH_CHECK(level != OptLevel::O1 || t == c10::kFloat,
                "amp Options: O1 inserts casts around operations rather than casting the model, so "
                "the weights stay fp32; cast_model_type must be unset or Float under O1, got ",
                t, ". Use O2 or O3 to cast the model");
    p.cast_model_type = t;
  }
  if (o.patch_torch_functions()) {
    TORCH_CHECK(level == OptLevel::O1 || !*o.patch_torch_functions(),
                "amp Options: patch_torch_functions=true (autocast) is only valid with O1, got "
                "opt_level ",
                name);
    p.patch_torch_functions = *o.patch_torch_functions();
  }
  if (o.keep_batchnorm_fp32()) {
    TORCH_CHECK(level != OptLevel::O1,
                "amp Options: with O1, batchnorm runs in fp32 through autocast; "
                "keep_batchnorm_fp32 must be unset, got ",
                *o.keep_batchnorm_fp32() ? "true" : "false");
    p.keep_batchnorm_fp32 = *o.keep_batchnorm_fp32();
  }
  if (o.master_weights()) {
    TORCH_CHECK(level != OptLevel::O1,
                "amp Options: O1 keeps the weights fp32, so master_weights makes no sense; it must "
                "be unset under O1, got ",
                *o.master_weights() ? "true" : "false");
    p.master_weights = *o.master_weights();
  }
  if (o.loss_scale()) p.loss_scale = *o.loss_scale();

  TORCH_CHECK(std::isfinite(o.init_loss_scale()) && o.init_loss_scale() > 0,
              "amp Options: init_loss_scale must be finite and > 0, got ", o.init_loss_scale());
  if (o.min_loss_scale()) {
    TORCH_CHECK(*o.min_loss_scale() > 0 && *o.min_loss_scale() <= o.max_loss_scale(),
                "amp Options: min_loss_scale must be in (0, max_loss_scale=", o.max_loss_scale(),
                "], got ", *o.min_loss_scale());
  }
  if (!p.enabled) {
    p.cast_model_type = std::nullopt;
    p.patch_torch_functions = false;
    p.keep_batchnorm_fp32 = false;
    p.master_weights = false;
    p.loss_scale = LossScale(1.0);
  }
  return p;
}

std::string Properties::describe() const {
  std::ostringstream s;
  s << "opt_level             : " << to_string(opt_level) << (enabled ? "" : " (disabled)") << '\n'
    << "half_dtype            : " << half_dtype << '\n'
    << "cast_model_type       : "
    << (cast_model_type ? std::string(c10::toString(*cast_model_type)) : "None") << '\n'
    << "patch_torch_functions : " << (patch_torch_functions ? "True" : "False") << '\n'
    << "keep_batchnorm_fp32   : " << (keep_batchnorm_fp32 ? "True" : "False") << '\n'
    << "master_weights        : " << (master_weights ? "True" : "False") << '\n'
    << "loss_scale            : "
    << (loss_scale.is_dynamic() ? std::string("dynamic") : std::to_string(loss_scale.value()))
    << '\n';
  return s.str();
}

}  // namespace apex::amp
