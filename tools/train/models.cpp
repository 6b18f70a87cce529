#include "train/models.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <apex/normalization/fused_layer_norm.h>
#include <apex/parallel/sync_batch_norm.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdio>

#include "train/data.h"

namespace apex::train {
namespace {

namespace nn = torch::nn;
using apex::normalization::FusedLayerNorm;
using apex::normalization::FusedNormOptions;

// ---- transformer encoder block (BERT: post-LN) ------------------------------------------------

class EncoderLayerImpl : public nn::Module {
 public:
  EncoderLayerImpl(int64_t d, int64_t heads)
      : heads_(heads),
        qkv_(register_module("qkv", nn::Linear(d, 3 * d))),
        proj_(register_module("proj", nn::Linear(d, d))),
        ln1_(register_module("ln1", FusedLayerNorm(FusedNormOptions({d})))),
        fc1_(register_module("fc1", nn::Linear(d, 4 * d))),
        fc2_(register_module("fc2", nn::Linear(4 * d, d))),
        ln2_(register_module("ln2", FusedLayerNorm(FusedNormOptions({d})))) {
    TORCH_CHECK(d % heads == 0, "apex-train: the model width ", d,
                " must be a multiple of the number of heads ", heads);
  }

  at::Tensor forward(const at::Tensor& x) {
    const int64_t b = x.size(0);
    const int64_t t = x.size(1);
    const int64_t d = x.size(2);
    // [B, T, 3, H, Dh] -> [3, B, H, T, Dh]
    const at::Tensor qkv =
        qkv_->forward(x).view({b, t, 3, heads_, d / heads_}).permute({2, 0, 3, 1, 4});
    const at::Tensor a =
        at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape({b, t, d});
    at::Tensor h = ln1_->forward(x + proj_->forward(a));
    return ln2_->forward(h + fc2_->forward(at::gelu(fc1_->forward(h))));
  }

 private:
  int64_t heads_;
  nn::Linear qkv_, proj_;
  FusedLayerNorm ln1_;
  nn::Linear fc1_, fc2_;
  FusedLayerNorm ln2_;
};
TORCH_MODULE(EncoderLayer);

// Encoder layers over [B, T, d], mean-pooled, then the classifier.
class EncoderHead : public nn::Module {
 public:
  EncoderHead(int64_t d, int64_t depth, int64_t heads, int64_t classes)
      : layers_(register_module("layers", nn::ModuleList())),
        fc_(register_module("classifier", nn::Linear(d, classes))) {
    for (int64_t i = 0; i < depth; ++i) layers_->push_back(EncoderLayer(d, heads));
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& layer : *layers_) x = layer->as<EncoderLayer>()->forward(x);
    return fc_->forward(x.mean(1));
  }

 private:
  nn::ModuleList layers_;
  nn::Linear fc_;
};

// ---- the families ------------------------------------------------------------------------------

class Mlp : public Classifier {
 public:
  Mlp(const ModelConfig& c, const Dataset& data) {
    int64_t in = 1;
    if (data.kind == "tokens") {
      embed_ = register_module("embed", nn::Embedding(data.vocab_size, kTokenDim));
      in = data.inputs.size(1) * kTokenDim;
    } else {
      for (int64_t i = 1; i < data.inputs.dim(); ++i) in *= data.inputs.size(i);
    }
    layers_ = register_module("layers", nn::ModuleList());
    for (int64_t i = 0; i < c.depth; ++i) {
      layers_->push_back(nn::Linear(i == 0 ? in : c.width, c.width));
    }
    out_ = register_module("out", nn::Linear(c.depth > 0 ? c.width : in, data.num_classes));
  }
  at::Tensor forward(const at::Tensor& inputs) override {
    at::Tensor x = embed_ ? embed_->forward(inputs) : inputs;
    x = x.flatten(1);
    for (const auto& l : *layers_) x = at::relu(l->as<nn::Linear>()->forward(x));
    return out_->forward(x);
  }

 private:
  static constexpr int64_t kTokenDim = 16;
  nn::Embedding embed_{nullptr};
  nn::ModuleList layers_{nullptr};
  nn::Linear out_{nullptr};
};

// A BatchNorm2d, or with --sync-bn a SyncBatchNorm over every rank's batch (same parameter and
// buffer names, so checkpoints of either load into the other).
nn::AnyModule batch_norm(nn::Module& parent, const std::string& name, int64_t channels, bool sync) {
  if (sync) {
    return nn::AnyModule(parent.register_module(
        name, apex::parallel::SyncBatchNorm(nn::BatchNormOptions(channels))));
  }
  return nn::AnyModule(parent.register_module(name, nn::BatchNorm2d(channels)));
}

class BasicBlockImpl : public nn::Module {
 public:
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride, bool sync)
      : conv1_(register_module(
            "conv1",
            nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)))),
        bn1_(batch_norm(*this, "bn1", out, sync)),
        conv2_(register_module("conv2",
                               nn::Conv2d(nn::Conv2dOptions(out, out, 3).padding(1).bias(false)))),
        bn2_(batch_norm(*this, "bn2", out, sync)) {
    if (stride != 1 || in != out) {
      down_ = register_module("down",
                              nn::Conv2d(nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)));
      down_bn_ = batch_norm(*this, "down_bn", out, sync);
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::relu(bn1_.forward<at::Tensor>(conv1_->forward(x)));
    h = bn2_.forward<at::Tensor>(conv2_->forward(h));
    return at::relu(h + (down_ ? down_bn_.forward<at::Tensor>(down_->forward(x)) : x));
  }

 private:
  nn::Conv2d conv1_;
  nn::AnyModule bn1_;
  nn::Conv2d conv2_;
  nn::AnyModule bn2_;
  nn::Conv2d down_{nullptr};
  nn::AnyModule down_bn_;
};
TORCH_MODULE(BasicBlock);

class ResNet : public Classifier {
 public:
  ResNet(const ModelConfig& c, const Dataset& data) {
    const int64_t w = c.width;
    stem_ = register_module(
        "stem", nn::Conv2d(nn::Conv2dOptions(data.inputs.size(1), w, 3).padding(1).bias(false)));
    stem_bn_ = batch_norm(*this, "stem_bn", w, c.sync_bn);
    blocks_ = register_module("blocks", nn::ModuleList());
    int64_t in = w;
    for (int64_t stage = 0; stage < 3; ++stage) {
      const int64_t out = w << stage;
      for (int64_t b = 0; b < c.depth; ++b) {
        blocks_->push_back(BasicBlock(in, out, stage > 0 && b == 0 ? 2 : 1, c.sync_bn));
        in = out;
      }
    }
    fc_ = register_module("classifier", nn::Linear(in, data.num_classes));
  }
  at::Tensor forward(const at::Tensor& inputs) override {
    at::Tensor x = at::relu(stem_bn_.forward<at::Tensor>(stem_->forward(inputs)));
    for (const auto& b : *blocks_) x = b->as<BasicBlock>()->forward(x);
    return fc_->forward(x.mean({2, 3}));
  }

 private:
  nn::Conv2d stem_{nullptr};
  nn::AnyModule stem_bn_;
  nn::ModuleList blocks_{nullptr};
  nn::Linear fc_{nullptr};
};

class Transformer : public Classifier {
 public:
  Transformer(const ModelConfig& c, const Dataset& data)
      : tok_(register_module("tok", nn::Embedding(data.vocab_size, c.width))),
        pos_(register_module("pos", nn::Embedding(data.inputs.size(1), c.width))),
        ln_(register_module("ln", FusedLayerNorm(FusedNormOptions({c.width})))),
        encoder_(register_module("encoder", std::make_shared<EncoderHead>(c.width, c.depth, c.heads,
                                                                          data.num_classes))) {}
  at::Tensor forward(const at::Tensor& inputs) override {
    const at::Tensor positions = at::arange(inputs.size(1), inputs.options());
    return encoder_->forward(ln_->forward(tok_->forward(inputs) + pos_->forward(positions)));
  }

 private:
  nn::Embedding tok_, pos_;
  FusedLayerNorm ln_;
  std::shared_ptr<EncoderHead> encoder_;
};

class Wav2Vec2 : public Classifier {
 public:
  Wav2Vec2(const ModelConfig& c, const Dataset& data) {
    const int64_t ch = kChannels;
    features_ = register_module("features", nn::ModuleList());
    // 10/5 then four 3/2 convolutions: 4000 samples (0.25 s at 16 kHz) -> 49 frames.
    features_->push_back(nn::Conv1d(nn::Conv1dOptions(1, ch, 10).stride(5).bias(false)));
    for (int i = 0; i < 4; ++i) {
      features_->push_back(nn::Conv1d(nn::Conv1dOptions(ch, ch, 3).stride(2).bias(false)));
    }
    group_norm_ = register_module("group_norm", nn::GroupNorm(nn::GroupNormOptions(ch, ch)));
    feature_ln_ = register_module("feature_ln", FusedLayerNorm(FusedNormOptions({ch})));
    project_ = register_module("project", nn::Linear(ch, c.width));
    pos_conv_ = register_module(
        "pos_conv",
        nn::Conv1d(nn::Conv1dOptions(c.width, c.width, 15).padding(7).groups(kPosGroups)));
    ln_ = register_module("ln", FusedLayerNorm(FusedNormOptions({c.width})));
    encoder_ = register_module(
        "encoder", std::make_shared<EncoderHead>(c.width, c.depth, c.heads, data.num_classes));
    TORCH_CHECK(data.inputs.size(-1) >= 400, "apex-train: wav2vec2 needs clips of at least 400 ",
                "samples, got ", data.inputs.size(-1));
  }
  at::Tensor forward(const at::Tensor& inputs) override {
    at::Tensor x = inputs;  // [B, 1, L]
    for (size_t i = 0; i < features_->size(); ++i) {
      x = features_[i]->as<nn::Conv1d>()->forward(x);
      if (i == 0) x = group_norm_->forward(x);
      x = at::gelu(x);
    }
    x = project_->forward(feature_ln_->forward(x.transpose(1, 2)));  // [B, T, d]
    x = x + at::gelu(pos_conv_->forward(x.transpose(1, 2))).transpose(1, 2);
    return encoder_->forward(ln_->forward(x));
  }

 private:
  static constexpr int64_t kChannels = 64;
  static constexpr int64_t kPosGroups = 4;
  nn::ModuleList features_{nullptr};
  nn::GroupNorm group_norm_{nullptr};
  FusedLayerNorm feature_ln_{nullptr};
  nn::Linear project_{nullptr};
  nn::Conv1d pos_conv_{nullptr};
  FusedLayerNorm ln_{nullptr};
  std::shared_ptr<EncoderHead> encoder_;
};

template <class Model>
std::shared_ptr<Classifier> make(const ModelConfig& c, const Dataset& data) {
  return std::make_shared<Model>(c, data);
}

// Dominant parameter counts: hidden layers; 3x3 convolutions over three stages of w, 2w, 4w
// channels; attention and MLP blocks (4 d^2 + 8 d^2 per layer).
double width2(const ModelConfig& c) { return static_cast<double>(c.width) * c.width; }
double mlp_parameters(const ModelConfig& c) {
  return width2(c) * static_cast<double>(std::max<int64_t>(c.depth - 1, 0)) + c.width;
}
double resnet_parameters(const ModelConfig& c) { return 378.0 * width2(c) * c.depth; }
double encoder_parameters(const ModelConfig& c) { return 12.0 * width2(c) * c.depth; }

}  // namespace

const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> families = {
      {.name = "mlp",
       .accepts = "",
       .default_data = "shapes",
       .width = 512,
       .depth = 2,
       .heads = 0,
       .width_means = "hidden units",
       .depth_means = "hidden layers",
       .default_steps = 300,
       .min_parameters = mlp_parameters,
       .make = make<Mlp>},
      {.name = "resnet",
       .accepts = "image",
       .default_data = "shapes",
       .width = 16,
       .depth = 1,
       .heads = 0,
       .width_means = "base channels",
       .depth_means = "blocks per stage",
       .default_steps = 150,
       .min_parameters = resnet_parameters,
       .make = make<ResNet>},
      {.name = "transformer",
       .accepts = "tokens",
       .default_data = "tokens",
       .width = 256,
       .depth = 2,
       .heads = 4,
       .width_means = "model dim",
       .depth_means = "encoder layers",
       .default_steps = 160,
       .min_parameters = encoder_parameters,
       .make = make<Transformer>},
      {.name = "wav2vec2",
       .accepts = "audio",
       .default_data = "tones",
       .width = 256,
       .depth = 2,
       .heads = 4,
       .width_means = "model dim",
       .depth_means = "encoder layers",
       .default_steps = 150,
       .min_parameters = encoder_parameters,
       .make = make<Wav2Vec2>},
  };
  return families;
}

std::vector<std::string> model_family_names() {
  std::vector<std::string> names;
  for (const auto& f : model_families()) names.push_back(f.name);
  return names;
}

const ModelFamily& model_family(const std::string& name) {
  for (const auto& f : model_families()) {
    if (f.name == name) return f;
  }
  std::string names;
  for (const auto& f : model_families()) names.append(names.empty() ? "" : ", ").append(f.name);
  TORCH_CHECK(false, "apex-train: unknown model family '", name, "' (expected one of ", names, ")");
}

bool family_accepts(const std::string& family, const std::string& kind) {
  const ModelFamily& f = model_family(family);
  return f.accepts.empty() || f.accepts == kind;
}

ModelConfig resolved(ModelConfig c) {
  const ModelFamily& f = model_family(c.family);
  if (c.width == 0) c.width = f.width;
  if (c.depth == 0) c.depth = f.depth;
  if (c.heads == 0) c.heads = f.heads;
  return c;
}

std::shared_ptr<Classifier> make_model(const ModelConfig& config, const Dataset& data,
                                       uint64_t seed) {
  const ModelConfig c = resolved(config);
  const ModelFamily& f = model_family(c.family);
  if (!family_accepts(c.family, data.kind)) {
    std::string takes;
    for (const auto& g : model_families()) {
      if (!takes.empty()) takes.append(", ");
      takes.append(g.name).append(": ").append(g.accepts.empty() ? "any" : g.accepts);
    }
    TORCH_CHECK(false, "apex-train: --model ", c.family, " does not take ", data.kind, " data (",
                takes, ")");
  }
  torch::manual_seed(seed);
  return f.make(c, data);
}

std::string describe(const ModelConfig& config, const torch::nn::Module& model) {
  const ModelConfig c = resolved(config);
  int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.numel();
  char buf[160];
  if (model_family(c.family).heads == 0) {
    std::snprintf(buf, sizeof(buf), "%s width=%lld depth=%lld (%.2fM parameters)", c.family.c_str(),
                  static_cast<long long>(c.width), static_cast<long long>(c.depth),
                  static_cast<double>(n) / 1e6);
  } else {
    std::snprintf(buf, sizeof(buf), "%s d=%lld layers=%lld heads=%lld (%.2fM parameters)",
                  c.family.c_str(), static_cast<long long>(c.width),
                  static_cast<long long>(c.depth), static_cast<long long>(c.heads),
                  static_cast<double>(n) / 1e6);
  }
  return buf;
}

}  // namespace apex::train
