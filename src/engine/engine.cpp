// Generation loop with prefix reuse (see engine.h).
#include "engine/engine.h"

#include <algorithm>
#include <set>

#include "core/common.h"
#include "engine/stop_matcher.h"

namespace lily {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

bool is_prefix(std::span<const int32_t> p, std::span<const int32_t> of) {
  return p.size() <= of.size() && std::equal(p.begin(), p.end(), of.begin());
}

}  // namespace

Engine::Engine(LanguageModel& lm, std::shared_ptr<const Tokenizer> tok, EngineOptions opt)
    : lm_(lm), tok_(std::move(tok)), opt_(opt), cache_(std::max<int64_t>(opt.cache_bytes, 0)) {
  if (opt_.ctx < 2) throw Error("context length must be at least 2 tokens");
  live_ = lm_.new_state(opt_.ctx);
  logits_.assign(lm_.vocab_size(), 0.0f);
  scratch_.assign(lm_.vocab_size(), 0.0f);
  im_end_ = tok_->token_id("<|im_end|>");
  const auto nl = tok_->encode("\n", false);
  newline_ = nl.size() == 1 ? nl[0] : -1;
}

void Engine::reset_sessions() {
  cache_.clear();
  live_tokens_.clear();
  live_kv_.clear();
  live_valid_ = false;
}

EngineStats Engine::stats() const {
  EngineStats s = stats_;
  s.cache = cache_.stats();
  return s;
}

void Engine::overwrite_kv(int q, std::span<const int32_t> incoming, const Snapshot* protect) {
  const size_t end = size_t(q) + incoming.size();
  if (end <= live_kv_.size() && std::equal(incoming.begin(), incoming.end(), live_kv_.begin() + q))
    return;   // the same tokens again: rows and history unchanged
  cache_.before_kv_overwrite(lm_, *live_, live_kv_, q, incoming, protect);
  live_kv_.resize(std::min(live_kv_.size(), size_t(q)));
  live_kv_.insert(live_kv_.end(), incoming.begin(), incoming.end());
}

void Engine::drop_live() {
  // The state may be half-updated: never reuse it, nor snapshots sharing its KV rows.
  live_valid_ = false;
  live_tokens_.clear();
  live_kv_.clear();
  cache_.drop_shared();
}

void Engine::forward_live(std::span<const int32_t> tokens) {
  try {
    overwrite_kv(live_->pos(), tokens);
    lm_.forward(*live_, tokens, logits_.data());
  } catch (...) {
    drop_live();
    throw;
  }
  live_tokens_.insert(live_tokens_.end(), tokens.begin(), tokens.end());
}

void Engine::decode_on_device(const GenerationRequest& req, int max_tokens, int n_valid,
                              const std::function<bool(int32_t)>& take) {
  // The picks that the device will feed back are unknown until they are made, so KV rows from
  // the current position on count as overwritten (shared snapshots past it are promoted or
  // dropped first); the history is then fixed to what was really consumed.
  const int q = live_->pos();
  const int32_t unknown = -1;
  if (max_tokens > 1) overwrite_kv(q, {&unknown, 1});
  std::vector<int32_t> picks;
  int consumed = 0;
  try {
    consumed = lm_.generate(*live_, logits_.data(), max_tokens, req.sampling, n_valid, req.prompt,
                            [&](int32_t id) {
                              picks.push_back(id);
                              return take(id);
                            });
  } catch (...) {
    drop_live();
    throw;
  }
  LILY_CHECK(consumed >= 0 && consumed <= int(picks.size()) && live_->pos() == q + consumed,
             "device decode: inconsistent consumed-token count");
  live_kv_.resize(std::min(live_kv_.size(), size_t(q)));
  live_kv_.insert(live_kv_.end(), picks.begin(), picks.begin() + consumed);
  live_tokens_.insert(live_tokens_.end(), picks.begin(), picks.begin() + consumed);
  stats_.decode_tokens += consumed;
}

int Engine::restore_prefix(const std::vector<int32_t>& prompt) {
  const bool snaps = opt_.prefix_reuse && cache_.budget() > 0;
  const Snapshot* s = snaps ? cache_.find(prompt, live_valid_ ? std::span<const int32_t>(live_kv_)
                                                              : std::span<const int32_t>()) : nullptr;
  // The live sequence, when it prefixes the prompt, costs nothing; a snapshot must be longer.
  if (opt_.prefix_reuse && live_valid_ && !live_tokens_.empty() && is_prefix(live_tokens_, prompt) &&
      (!s || s->tokens.size() <= live_tokens_.size()))
    return int(live_tokens_.size());
  if (s) {
    if (s->shared_kv) {
      lm_.restore_recurrent(*s->state, *live_);   // KV rows [0, n) are already in place
    } else {
      overwrite_kv(0, s->tokens, s);   // s is protected from eviction by this call
      lm_.copy_state(*s->state, *live_);
    }
    live_tokens_ = s->tokens;
    std::copy(s->logits.begin(), s->logits.end(), logits_.begin());
    live_valid_ = true;
    return int(live_tokens_.size());
  }
  lm_.reset(*live_);   // KV rows stay: shared snapshots remain valid until rows are rewritten
  live_tokens_.clear();
  if (!live_valid_) live_kv_.clear();
  live_valid_ = true;
  return 0;
}

bool Engine::prefill(const GenerationRequest& req, int from, const EventSink& sink) {
  const auto& P = req.prompt;
  const int n = int(P.size());
  // Snapshot points: after every "<|im_end|>\n" (turn boundaries), every snapshot_every tokens and
  // the end of the prompt (= the start of the assistant turn, FRONTEND.md §4.7 P1/P2).
  std::set<int> snaps, cuts;
  if (opt_.prefix_reuse && cache_.budget() > 0) {
    for (int b = from + 1; b <= n; ++b) {
      if (b >= 2 && P[b - 2] == im_end_ && P[b - 1] == newline_) snaps.insert(b);
      if (opt_.snapshot_every > 0 && b % opt_.snapshot_every == 0) snaps.insert(b);
    }
    snaps.insert(n);
  }
  cuts = snaps;
  const int chunk = std::max(1, lm_.max_chunk());
  for (int b = from + chunk; b < n; b += chunk) cuts.insert(b);
  cuts.insert(n);
  int a = from;
  for (int b : cuts) {
    if (b <= a) continue;
    if ((req.cancel && req.cancel->load()) || Clock::now() > req.deadline) return false;
    forward_live({P.data() + a, size_t(b - a)});
    stats_.prefill_tokens += b - a;
    if (snaps.count(b) && !cache_.contains({P.data(), size_t(b)})) {
      try {
        cache_.insert(lm_, {P.data(), size_t(b)}, *live_, logits_, opt_.shared_kv_snapshots);
      } catch (const std::exception&) {
        // Out of backend memory for a snapshot: serving goes on without it (the cache never holds
        // a half-built snapshot; insert makes it visible only when complete).
      }
    }
    a = b;
    if (sink && b < n) {
      GenerationEvent ev;
      ev.ping = true;
      ev.prefill_done = b;
      ev.prefill_total = n;
      sink(ev);
    }
  }
  return true;
}

GenerationResult Engine::generate(const GenerationRequest& req, const EventSink& sink) {
  const int n = int(req.prompt.size());
  if (n == 0) throw Error("the prompt is empty");
  if (n >= opt_.ctx)
    throw Error("the prompt has " + std::to_string(n) + " tokens but the context length is " +
                std::to_string(opt_.ctx) + " (prompt plus at least one output token must fit)");
  const int n_valid = std::min(tok_->vocab_size(), lm_.vocab_size());
  for (int32_t t : req.prompt)
    if (t < 0 || t >= n_valid)
      throw Error("prompt token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                  std::to_string(n_valid) + ")");
  if (req.logprobs > 20) throw Error("'top_logprobs' must be at most 20");
  Sampler sampler(req.sampling, n_valid, req.prompt);   // validates the sampling values

  GenerationResult r;
  r.prompt_tokens = n;
  ++stats_.requests;
  stats_.prompt_tokens += n;

  // ---- prefill: resume from the longest reusable prefix --------------------------------------
  auto t0 = Clock::now();
  const int reuse = restore_prefix(req.prompt);
  r.cached_tokens = reuse;
  stats_.cached_tokens += reuse;
  const bool prefilled = reuse == n || prefill(req, reuse, sink);
  r.prefill_seconds = since(t0);
  stats_.prefill_seconds += r.prefill_seconds;
  if (!prefilled) {
    r.finish_reason = (req.cancel && req.cancel->load()) ? "cancelled" : "timeout";
    return r;
  }

  // ---- decode ----------------------------------------------------------------------------------
  std::set<int32_t> stop_ids(req.stop_ids.begin(), req.stop_ids.end());
  if (!req.ignore_eos) stop_ids.insert(tok_->stop_ids().begin(), tok_->stop_ids().end());
  const int room = opt_.ctx - n;   // output tokens that fit (the last one is never fed back)
  const int max_tokens = req.max_tokens < 0 ? room : std::min(req.max_tokens, room);
  StreamDecoder dec(*tok_);
  StopMatcher stops(req.stop);
  std::unique_ptr<OutputParser> parser;
  if (req.parse_output)
    parser = std::make_unique<OutputParser>(req.starts_in_reasoning, req.tools, req.tool_id_seed);

  auto emit = [&](GenerationEvent& ev, const std::string& text) {
    ev.text = text;
    r.text += text;
    if (parser && !text.empty()) ev.parsed = parser->push(text);
    else if (!parser) ev.parsed.content = text;
    if (sink && (!ev.text.empty() || !ev.parsed.empty() || !ev.tokens.empty())) sink(ev);
  };

  auto t1 = Clock::now();
  // One pick: record it, stream what became final, and say whether generation goes on.
  auto take = [&](int32_t id, const TokenLogprob* lp) {
    GenerationEvent ev;
    r.tokens.push_back(id);
    ev.tokens.push_back(id);
    if (lp) {
      r.logprobs.push_back(*lp);
      ev.logprobs.push_back(*lp);
    }
    if (parser && parser->in_reasoning()) ++r.reasoning_tokens;
    if (stop_ids.count(id)) {
      r.finish_reason = "stop";
      emit(ev, "");
      return false;
    }
    emit(ev, stops.push(dec.push(id)));
    if (stops.stopped()) {
      r.finish_reason = "stop";
      r.stop_reason = stops.matched();
      return false;
    }
    if (int(r.tokens.size()) >= max_tokens) {
      r.finish_reason = "length";
      return false;
    }
    if (req.cancel && req.cancel->load()) {
      r.finish_reason = "cancelled";
      return false;
    }
    if (Clock::now() > req.deadline) {
      r.finish_reason = "timeout";
      return false;
    }
    return true;
  };
  const auto loop = lm_.device_loop(req.sampling);
  const bool on_device = req.logprobs < 0 && loop != LanguageModel::DeviceLoop::kNone &&
                         (opt_.device_sampling > 0 ||
                          (opt_.device_sampling < 0 && loop == LanguageModel::DeviceLoop::kPreferred));
  if (on_device) {
    decode_on_device(req, max_tokens, n_valid, [&](int32_t id) { return take(id, nullptr); });
  } else {
    const int V = lm_.vocab_size();
    while (true) {
      std::copy(logits_.begin(), logits_.end(), scratch_.begin());
      TokenLogprob lp;
      const int32_t id = sampler.sample(scratch_.data(), V, req.logprobs >= 0 ? &lp : nullptr,
                                        std::max(0, req.logprobs));
      sampler.accept(id);
      if (!take(id, req.logprobs >= 0 ? &lp : nullptr)) break;
      forward_live({&id, 1});
      ++stats_.decode_tokens;
    }
  }
  if (!stops.stopped()) {
    GenerationEvent ev;
    std::string tail = stops.push(dec.flush());
    tail += stops.flush();
    emit(ev, tail);
  }
  if (parser) {
    GenerationEvent ev;
    ev.parsed = parser->finish();
    if (sink && !ev.parsed.empty()) sink(ev);
    r.reasoning = parser->reasoning();
    r.content = parser->content();
    r.tool_calls = parser->tool_calls();
    if (!r.tool_calls.empty() && r.finish_reason == "stop") r.finish_reason = "tool_calls";
  } else {
    r.content = r.text;
  }
  r.completion_tokens = int(r.tokens.size());
  r.decode_seconds = since(t1);
  stats_.decode_seconds += r.decode_seconds;
  return r;
}

}  // namespace lily
