// LanguageModel adapter over the Qwen36 forward pass.
#include "engine/language_model.h"

#include "core/common.h"
#include "model/qwen36.h"

namespace lily {
namespace {

class Qwen36LmState : public LmState {
 public:
  explicit Qwen36LmState(std::unique_ptr<Qwen36State> s) : s_(std::move(s)) {}
  int pos() const override { return s_->pos; }
  int capacity() const override { return s_->capacity; }
  Qwen36State& get() { return *s_; }
  const Qwen36State& get() const { return *s_; }

 private:
  std::unique_ptr<Qwen36State> s_;
};

class Qwen36Lm : public LanguageModel {
 public:
  explicit Qwen36Lm(Qwen36& m) : m_(m) {}
  int vocab_size() const override { return m_.config().vocab_size; }
  int max_chunk() const override { return m_.max_chunk(); }
  std::unique_ptr<LmState> new_state(int capacity) override {
    return std::make_unique<Qwen36LmState>(m_.new_state(capacity));
  }
  void reset(LmState& st) override { m_.reset(cast(st)); }
  void copy_state(const LmState& src, LmState& dst) override {
    LILY_CHECK(dst.capacity() >= src.pos(), "copy_state: destination state too small");
    m_.copy_state(static_cast<const Qwen36LmState&>(src).get(), cast(dst));
  }
  void forward(LmState& st, std::span<const int32_t> tokens, float* logits_last) override {
    m_.forward(cast(st), tokens, logits_last, false);
  }
  int64_t state_bytes(int capacity) const override { return m_.state_bytes(capacity); }

 private:
  static Qwen36State& cast(LmState& s) { return static_cast<Qwen36LmState&>(s).get(); }
  Qwen36& m_;
};

}  // namespace

std::unique_ptr<LanguageModel> make_qwen36_lm(Qwen36& model) {
  return std::make_unique<Qwen36Lm>(model);
}

}  // namespace lily
