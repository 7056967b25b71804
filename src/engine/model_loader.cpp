// Checkpoint directory -> weights, backend, Qwen36, adapter, tokenizer (see model_loader.h).
#include "engine/model_loader.h"

#include <sstream>

#include "backend/backend.h"
#include "core/common.h"
#include "model/qwen36.h"
#include "model/weights.h"

namespace lily {
namespace {

class LoadedQwen36 : public LoadedModel {
 public:
  explicit LoadedQwen36(const ModelLoadOptions& o) {
    tok_ = Tokenizer::load(o.dir);
    LoadOptions lo;
    lo.progress = o.progress;
    host_ = std::make_shared<ModelWeights>(load_weights(o.dir, lo));
    BackendOptions bo;
    bo.name = o.backend;
    bo.threads = o.threads;
    std::stringstream ss(o.ablate);
    for (std::string id; std::getline(ss, id, ',');)
      if (!id.empty()) bo.ablations.off.push_back(id);
    backend_ = make_backend(bo);
    ModelOptions mo;
    if (o.chunk < 0) throw Error("prefill chunk must be >= 0 (0 = the backend's default), got " + std::to_string(o.chunk));
    mo.max_chunk = o.chunk > 0 ? o.chunk : default_prefill_chunk(backend_->name());
    if (o.chunk == 0 && o.max_context > 0) mo.max_chunk = std::min(mo.max_chunk, o.max_context);   // no unused workspace
    model_ = std::make_unique<Qwen36>(host_, *backend_, mo);
    lm_ = make_qwen36_lm(*model_);
    if (tok_->vocab_size() > model_->config().vocab_size)
      throw Error(o.dir + ": tokenizer has " + std::to_string(tok_->vocab_size()) +
                  " tokens but the model's vocab_size is " + std::to_string(model_->config().vocab_size));
  }
  LanguageModel& lm() override { return *lm_; }
  std::shared_ptr<const Tokenizer> tokenizer() const override { return tok_; }
  int max_position_embeddings() const override { return model_->config().max_position_embeddings; }
  std::string backend_name() const override { return backend_->name(); }

 private:
  // Declaration order = reverse destruction order: the adapter and model go before the backend.
  std::shared_ptr<Tokenizer> tok_;
  std::shared_ptr<ModelWeights> host_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Qwen36> model_;
  std::unique_ptr<LanguageModel> lm_;
};

}  // namespace

std::shared_ptr<LoadedModel> load_model(const ModelLoadOptions& opt) {
  if (opt.dir.empty()) throw Error("--model DIR is required");
  return std::make_shared<LoadedQwen36>(opt);
}

}  // namespace lily
