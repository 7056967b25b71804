// What the generation loop needs from a model: states that can be copied (prefix snapshots) and a
// forward call returning the last token's logits. Qwen36 is adapted to it; tests plug in fakes.
#pragma once
#include <cstdint>
#include <memory>
#include <span>

namespace lily {

class Qwen36;

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
};

// Adapts a Qwen36 model (which must outlive the adapter).
std::unique_ptr<LanguageModel> make_qwen36_lm(Qwen36& model);

}  // namespace lily
