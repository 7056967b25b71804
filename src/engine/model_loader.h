// Loads everything a serving process needs from a checkpoint directory: weights, backend, the
// Qwen36 model, its LanguageModel adapter and the tokenizer. Shared by `lily serve` and `lily chat`.
#pragma once
#include <memory>
#include <string>

#include "engine/language_model.h"
#include "tokenizer/tokenizer.h"

namespace lily {

struct ModelLoadOptions {
  std::string dir;
  std::string backend = "cpu";
  int threads = 0;
  int chunk = 0;              // prefill chunk (P5); 0 = default_prefill_chunk(backend), at most max_context
  int max_context = 0;        // the context the caller will use, when known (> 0): no default chunk beyond it
  bool progress = true;
  std::string ablate;         // comma-separated optimization ids to switch off
};

// Owns the model objects; lm() stays valid as long as this object.
class LoadedModel {
 public:
  virtual ~LoadedModel() = default;
  virtual LanguageModel& lm() = 0;
  virtual std::shared_ptr<const Tokenizer> tokenizer() const = 0;
  virtual int max_position_embeddings() const = 0;
  virtual std::string backend_name() const = 0;
};

// Throws lily::Error naming the file on any problem.
std::shared_ptr<LoadedModel> load_model(const ModelLoadOptions& opt);

}  // namespace lily
