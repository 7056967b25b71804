// What the generation loop needs from a model: states that can be copied (prefix snapshots) and a
// forward call returning the last token's logits. Qwen36 is adapted to it; tests plug in fakes.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

namespace lily {

class Qwen36;
struct SamplingParams;

// One sequence's state (KV cache + recurrent state for Qwen36).
class LmState {
 public:
  virtual ~LmState() = default;
  virtual int pos() const = 0;        // tokens consumed
  virtual int capacity() const = 0;   // tokens it can hold
};

class LanguageModel {
 public:
  virtual ~LanguageModel() = default;
  virtual int vocab_size() const = 0;   // length of a logits row
  virtual int max_chunk() const = 0;    // tokens per forward call that keep memory bounded
  virtual std::unique_ptr<LmState> new_state(int capacity) = 0;
  virtual void reset(LmState& st) = 0;
  // dst becomes an exact copy of src (dst.capacity() >= src.pos()).
  virtual void copy_state(const LmState& src, LmState& dst) = 0;
  // Consumes tokens; writes the last token's logits [vocab] to logits_last when non-null.
  virtual void forward(LmState& st, std::span<const int32_t> tokens, float* logits_last) = 0;
  virtual int64_t state_bytes(int capacity) const = 0;

  // Optional, for snapshots that share a working state's KV rows (only the recurrent part is
  // copied; a 35B-A3B snapshot is then 62.8 MiB whatever its length). copy_recurrent returns
  // nullptr when unsupported.
  virtual std::unique_ptr<LmState> copy_recurrent(const LmState& src) { return nullptr; }
  // dst takes the snapshot's recurrent state and position; dst's KV rows [0, snap.pos()) must
  // already hold the snapshot's tokens.
  virtual void restore_recurrent(const LmState& snap, LmState& dst) {}
  // A self-contained state: recurrent part from snap, KV rows [0, snap.pos()) from kv_src.
  virtual std::unique_ptr<LmState> materialize(const LmState& snap, const LmState& kv_src) {
    return nullptr;
  }
  virtual int64_t recurrent_bytes() const { return 0; }

  // Optional decode loop with sampling inside the model's backend (D2). kNone: not available (or
  // not for these parameters); kAvailable: works but does not pay (cpu); kPreferred: use it.
  enum class DeviceLoop { kNone, kAvailable, kPreferred };
  virtual DeviceLoop device_loop(const SamplingParams& p) const { return DeviceLoop::kNone; }
  // Samples the first token from `logits` ([vocab], the logits after st's last token), then feeds
  // each pick and samples the next, calling on_token(id) for every pick in order until it returns
  // false or max_tokens picks were made. n_valid: ids >= n_valid are never picked; prompt seeds
  // the repetition penalty. Returns c, the number of picks st consumed (picks[0, c), in order):
  // max_tokens - 1 when all were made, else the number accepted (the step feeding the last
  // accepted pick was already queued). On return `logits` holds the logits after st's last token.
  virtual int generate(LmState& st, float* logits, int max_tokens, const SamplingParams& p, int n_valid,
                       std::span<const int32_t> prompt, const std::function<bool(int32_t)>& on_token) {
    return 0;
  }
};

// Adapts a Qwen36 model (which must outlive the adapter).
std::unique_ptr<LanguageModel> make_qwen36_lm(Qwen36& model);

}  // namespace lily
