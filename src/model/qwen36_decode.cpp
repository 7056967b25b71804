// Greedy decode loop of Qwen36 (D2): one decode step = layers → lm_head → on-device argmax writing
// the next id into the input slot → device-side position increment. When the backend can capture,
// the step is recorded once and replayed per token; ids collect in backend memory and reach the
// host with one copy at the end, so there is no host synchronisation per token.
#include <string>

#include "core/common.h"
#include "model/qwen36.h"

namespace lily {

void Qwen36::generate_greedy(Qwen36State& st, int32_t first_token, int n, std::vector<int32_t>& out) {
  if (n <= 0) return;
  const ModelConfig& c = w_.config;
  if (first_token < 0 || first_token >= c.vocab_size)
    throw Error("token id " + std::to_string(first_token) + " out of range [0, " +
                std::to_string(c.vocab_size) + ")");
  if (st.pos + n > st.capacity)
    throw Error("context length exceeded: " + std::to_string(st.pos) + " + " + std::to_string(n) +
                " tokens > capacity " + std::to_string(st.capacity));
  const int32_t pos = st.pos;
  be_.copy_from_host(tok_, &first_token, 4);
  be_.copy_from_host(pos_dev_, &pos, 4);
  int32_t* hist = be_.alloc_i32(n);   // generated ids, in backend memory
  auto step = [&] {
    run_layers(st, 1);
    be_.matmul(w_.lm_head, xn_, 1, logits_);
    be_.argmax(logits_, 1, c.vocab_size, tok_);
    be_.increment(pos_dev_, 1);
  };
  // The first step runs eagerly: it sizes every backend workspace before a capture.
  step();
  be_.copy(hist, tok_, 4);
  st.pos += 1;
  if (n > 1 && be_.begin_capture()) {
    step();
    be_.end_capture();
    for (int i = 1; i < n; ++i) {
      be_.replay();
      be_.copy(hist + i, tok_, 4);
    }
    st.pos += n - 1;
  } else {
    for (int i = 1; i < n; ++i) {
      step();
      be_.copy(hist + i, tok_, 4);
      st.pos += 1;
    }
  }
  const size_t base = out.size();
  out.resize(base + n);
  be_.copy_to_host(out.data() + base, hist, 4LL * n);
  be_.free(hist);
}

}  // namespace lily
