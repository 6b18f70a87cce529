#pragma once

// apex-train's model families: classifiers from inputs to logits [N, classes].
//   mlp          flattened input (token ids through an embedding) -> ReLU MLP
//   resnet       a small ResNet with BatchNorm (so keep_batchnorm_fp32 matters), 32x32-ish images
//   transformer  a BERT-style encoder: token + position embeddings, post-LN blocks of multi-head
//                attention and a GELU MLP with apex::normalization::FusedLayerNorm, mean pooling
//   wav2vec2     a wav2vec 2.0-style model: a strided convolutional feature encoder over the raw
//                waveform (GroupNorm after the first layer, GELU), a projection, a convolutional
//                relative position embedding, then the transformer encoder blocks, mean pooling
// tools/bench/train_peer.py defines the same architectures in Python for apex-bench train.

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace apex::train {

struct Dataset;

/// Sizes of a model; 0 means the family's default.
struct ModelConfig {
  std::string family = "transformer";
  int64_t width = 0;     ///< mlp hidden units, resnet base channels, transformer/wav2vec2 model dim
  int64_t depth = 0;     ///< mlp hidden layers, resnet blocks per stage, encoder layers
  int64_t heads = 0;     ///< attention heads
  bool sync_bn = false;  ///< resnet: apex::parallel::SyncBatchNorm (needs a process group)
};

class Classifier : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& inputs) = 0;
};

/// One model family: everything apex-train, its help, its tests and apex-bench know of it. A new
/// family is one row of model_families() (and its class in models.cpp).
struct ModelFamily {
  std::string name;
  std::string accepts;       ///< the data kind it takes ("image", "tokens", "audio"); "" = any
  std::string default_data;  ///< the built-in data set when --data is not given
  int64_t width = 0;         ///< defaults of ModelConfig's sizes; heads 0: no attention
  int64_t depth = 0;
  int64_t heads = 0;
  std::string width_means;  ///< what --width and --depth count, for --help
  std::string depth_means;
  int64_t default_steps = 0;  ///< steps when neither --steps nor --epochs: ~1 min per level
  /// A lower bound of the parameter count for these sizes (the dominant terms), in double so that
  /// absurd sizes cannot overflow: checked against the machine's memory before anything is built.
  double (*min_parameters)(const ModelConfig&) = nullptr;
  std::shared_ptr<Classifier> (*make)(const ModelConfig&, const Dataset&) = nullptr;
};

/// The model families, in --help's order.
const std::vector<ModelFamily>& model_families();
std::vector<std::string> model_family_names();
/// The family called `name`; an error listing the families otherwise.
const ModelFamily& model_family(const std::string& name);
/// Whether `family` takes data of `kind` ("image", "tokens", "audio").
bool family_accepts(const std::string& family, const std::string& kind);
/// The config with the family's defaults filled in.
ModelConfig resolved(ModelConfig config);

/// Builds the model for `data` (input shape, classes, vocabulary) with weights drawn from
/// `seed`: the same seed gives the same initial weights at every opt level.
std::shared_ptr<Classifier> make_model(const ModelConfig& config, const Dataset& data,
                                       uint64_t seed);

/// A one-line description, e.g. "transformer d=128 layers=2 heads=4 (0.41M parameters)".
std::string describe(const ModelConfig& config, const torch::nn::Module& model);

}  // namespace apex::train
