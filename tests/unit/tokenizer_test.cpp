// Tokenizer unit tests: UTF-8 repair (Unicode §3.9 examples), the streaming decoder, stop ids,
// added-token modes, BPE fast path vs reference, and loader errors. Id parity with Hugging Face is
// covered by tests/tokenizer/test_tokenizer_diff.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/common.h"
#include "tokenizer/bpe_model.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/tokenizer.h"

namespace lily {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kFFFD = "\xEF\xBF\xBD";

// ---- a small synthetic tokenizer written to a temp dir ------------------------------------------

// Vocabulary: the 256 bytes (ids 0..255 in byte order) plus merges that split 😀 (F0 9F 98 80)
// into the tokens [F0 9F] [98] [80] and build "aa", "aaaa", "he", "hel", "hell", "hello".
struct TinyTokenizer {
  fs::path dir;
  TinyTokenizer() {
    dir = fs::temp_directory_path() / ("lily_tok_" + std::to_string(::getpid()) + "_" +
                                       std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(dir);
  }
  ~TinyTokenizer() { fs::remove_all(dir); }

  static std::string sp(std::string_view raw) { return byte_level().encode(raw); }

  json tokenizer_json() const {
    json vocab = json::object();
    for (int b = 0; b < 256; ++b) vocab[sp(std::string(1, char(b)))] = b;
    json merges = json::array();
    int next = 256;
    for (auto [a, b] : std::vector<std::pair<std::string, std::string>>{
             {"\xF0", "\x9F"}, {"a", "a"}, {"aa", "aa"}, {"h", "e"}, {"he", "l"}, {"hel", "l"}, {"hell", "o"}}) {
      merges.push_back(json::array({sp(a), sp(b)}));
      vocab[sp(a + b)] = next++;
    }
    json added = json::array();
    int id = next;
    for (auto [t, special] : std::vector<std::pair<std::string, bool>>{
             {"<|endoftext|>", true}, {"<|im_start|>", true}, {"<|im_end|>", true}, {"<think>", false}}) {
      added.push_back({{"id", id++}, {"content", t}, {"special", special}, {"lstrip", false},
                       {"rstrip", false}, {"single_word", false}, {"normalized", false}});
    }
    return {{"version", "1.0"}, {"added_tokens", added}, {"normalizer", {{"type", "NFC"}}},
            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
            {"decoder", {{"type", "ByteLevel"}}},
            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
  }
  void write(const std::string& name, const json& j) const { std::ofstream(dir / name) << j.dump(); }
  std::shared_ptr<Tokenizer> load() const { return Tokenizer::load(dir.string()); }
};

std::vector<int32_t> ids_of(const Tokenizer& t, std::initializer_list<std::string_view> toks) {
  std::vector<int32_t> out;
  for (auto s : toks) out.push_back(t.token_id(TinyTokenizer::sp(s)));
  return out;
}

// ---- UTF-8 ----------------------------------------------------------------------------------

TEST(Utf8, LossyFollowsMaximalSubparts) {
  // Unicode Standard §3.9, Table 3-8: 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64.
  EXPECT_EQ(utf8_lossy("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a" + kFFFD + kFFFD + kFFFD + "b" + kFFFD + "c" + kFFFD + kFFFD + "d");
  // Non-shortest form, surrogates and > U+10FFFF: every byte is its own maximal subpart.
  EXPECT_EQ(utf8_lossy("\xC0\xAF"), kFFFD + kFFFD);
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), kFFFD + kFFFD + kFFFD);
  EXPECT_EQ(utf8_lossy("\xF4\x90\x80\x80"), kFFFD + kFFFD + kFFFD + kFFFD);
  EXPECT_EQ(utf8_lossy("ok \xE2\x82\xAC \xF0\x9F\x98\x80"), "ok \xE2\x82\xAC \xF0\x9F\x98\x80");
  EXPECT_TRUE(utf8_valid("\xF0\x9F\x98\x80"));
  EXPECT_FALSE(utf8_valid("\xF0\x9F\x98"));
}

TEST(Utf8, StablePrefixHoldsOnlyIncompleteTails) {
  EXPECT_EQ(utf8_stable_prefix("ab\xF0\x9F\x98"), 2u);
  EXPECT_EQ(utf8_stable_prefix("ab\xF0\x9F\x98\x80"), 6u);
  EXPECT_EQ(utf8_stable_prefix("a\xE2\x82"), 1u);
  EXPECT_EQ(utf8_stable_prefix("a\xC0"), 2u);           // never valid: emit (as U+FFFD)
  EXPECT_EQ(utf8_stable_prefix("a\xE0\x80"), 3u);       // E0 80 can never complete
  EXPECT_EQ(utf8_stable_prefix("\x80\x80\x80\x80"), 4u);
  EXPECT_EQ(utf8_stable_prefix(""), 0u);
}

// ---- streaming decoder -------------------------------------------------------------------------

TEST(StreamDecoder, HoldsSplitCharacterUntilComplete) {
  TinyTokenizer tt;
  tt.write("tokenizer.json", tt.tokenizer_json());
  auto tok = tt.load();
  const std::string text = "he\xF0\x9F\x98\x80!";
  const auto ids = tok->encode(text);
  ASSERT_EQ(ids, ids_of(*tok, {"he", "\xF0\x9F", "\x98", "\x80", "!"}));
  StreamDecoder sd(*tok);
  EXPECT_EQ(sd.push(ids[0]), "he");
  EXPECT_EQ(sd.push(ids[1]), "");
  EXPECT_EQ(sd.push(ids[2]), "");
  EXPECT_EQ(sd.push(ids[3]), "\xF0\x9F\x98\x80");
  EXPECT_EQ(sd.push(ids[4]), "!");
  EXPECT_EQ(sd.flush(), "");
}

TEST(StreamDecoder, InvalidBytes) {
  TinyTokenizer tt;
  tt.write("tokenizer.json", tt.tokenizer_json());
  auto tok = tt.load();
  const auto f09f = ids_of(*tok, {"\xF0\x9F"})[0], x80 = ids_of(*tok, {"\x80"})[0];
  const auto a = ids_of(*tok, {"a"})[0];
  {
    StreamDecoder sd(*tok);   // a lone continuation byte can never complete: replaced at once
    EXPECT_EQ(sd.push(x80), kFFFD);
  }
  {
    StreamDecoder sd(*tok);   // a truncated sequence followed by ASCII: one U+FFFD, then the text
    EXPECT_EQ(sd.push(f09f), "");
    EXPECT_EQ(sd.push(a), kFFFD + "a");
  }
  {
    StreamDecoder sd(*tok);   // stream ends inside a sequence: flush replaces the pending bytes
    EXPECT_EQ(sd.push(a), "a");
    EXPECT_EQ(sd.push(f09f), "");
    EXPECT_EQ(sd.flush(), kFFFD);
    EXPECT_EQ(sd.flush(), "");
  }
}

TEST(StreamDecoder, EqualsDecodeOnRandomIdStreams) {
  TinyTokenizer tt;
  tt.write("tokenizer.json", tt.tokenizer_json());
  auto tok = tt.load();
  std::mt19937 rng(5);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<int32_t> ids(rng() % 12 + 1);
    for (auto& id : ids) id = int32_t(rng() % uint32_t(tok->vocab_size()));
    for (bool skip : {false, true}) {
      StreamDecoder sd(*tok, skip);
      std::string s;
      for (int32_t id : ids) {
        const std::string piece = sd.push(id);
        ASSERT_TRUE(utf8_valid(piece));
        s += piece;
      }
      s += sd.flush();
      ASSERT_EQ(s, tok->decode(ids, skip)) << "trial " << trial;
    }
  }
}

TEST(StreamDecoder, SkipsOnlyTrueSpecials) {
  TinyTokenizer tt;
  tt.write("tokenizer.json", tt.tokenizer_json());
  auto tok = tt.load();
  const auto ids = tok->encode("<|im_start|>he<think>a<|im_end|>");
  StreamDecoder sd(*tok, true);
  std::string s;
  for (int32_t id : ids) s += sd.push(id);
  EXPECT_EQ(s + sd.flush(), "he<think>a");
  EXPECT_EQ(tok->decode(ids, false), "<|im_start|>he<think>a<|im_end|>");
}

// ---- added tokens ------------------------------------------------------------------------------

TEST(Tokenizer, SpecialTokensAsTextOnlyWhenAsked) {
  TinyTokenizer tt;
  tt.write("tokenizer.json", tt.tokenizer_json());
  auto tok = tt.load();
  const int32_t im_end = tok->token_id("<|im_end|>"), think = tok->token_id("<think>");
  ASSERT_GE(im_end, 0);
  EXPECT_EQ(tok->encode("a<|im_end|>a"), (std::vector<int32_t>{'a', im_end, 'a'}));
  EXPECT_TRUE(tok->is_special(im_end));
  EXPECT_FALSE(tok->is_special(think));
  // parse_special=false: the special becomes bytes, the non-special <think> is still one token (HF
  // encode_special_tokens and llama.cpp user-defined tokens behave the same way).
  const auto plain = tok->encode("<|im_end|><think>", false);
  EXPECT_EQ(plain.back(), think);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), im_end), 0);
  EXPECT_EQ(tok->decode(plain), "<|im_end|><think>");
  EXPECT_EQ(tok->encode("<|im_end"), tok->encode("<|im_end", false));   // unclosed look-alike
}

TEST(Tokenizer, InvalidUtf8InputIsRepairedAndNfcApplied) {
  TinyTokenizer tt;
  tt.write("tokenizer.json", tt.tokenizer_json());
  auto tok = tt.load();
  EXPECT_EQ(tok->decode(tok->encode("a\xFF" "b")), "a" + kFFFD + "b");
  EXPECT_EQ(tok->decode(tok->encode("e\xCC\x81")), "\xC3\xA9");   // e + U+0301 -> é under NFC
  // Unknown ids (padded embedding rows) decode to nothing, as in HF, in both decoders.
  const std::vector<int32_t> with_unknown = {'a', tok->vocab_size(), -1, 'b'};
  EXPECT_EQ(tok->decode(with_unknown), "ab");
  StreamDecoder sd(*tok);
  std::string s;
  for (int32_t id : with_unknown) s += sd.push(id);
  EXPECT_EQ(s + sd.flush(), "ab");
}

TEST(Tokenizer, ConcurrentEncodersAgreeWithSequential) {
  // encode() is const and shared by server threads: caches and regex scratch are per thread.
  TinyTokenizer tt;
  tt.write("tokenizer.json", tt.tokenizer_json());
  auto tok = tt.load();
  std::mt19937 rng(3);
  const std::vector<std::string> parts = {"a", "aa", "hello", " ", "\xF0\x9F\x98\x80", "he", "<|im_end|>", "\n", "x'"};
  std::vector<std::string> texts(400);
  for (auto& t : texts)
    for (int k = int(rng() % 30); k >= 0; --k) t += parts[rng() % parts.size()];
  std::vector<std::vector<int32_t>> want;
  for (const auto& t : texts) want.push_back(tok->encode(t));
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int th = 0; th < 4; ++th)
    threads.emplace_back([&, th] {
      for (int rep = 0; rep < 5; ++rep)
        for (size_t i = 0; i < texts.size(); ++i) bad[size_t(th)] += tok->encode(texts[i]) != want[i];
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad, std::vector<int>(4, 0));
}

TEST(Tokenizer, WordCacheIsPerModel) {
  // Two models alternating on one thread must not see each other's cached words.
  TinyTokenizer ta, tb;
  ta.write("tokenizer.json", ta.tokenizer_json());
  json jb = tb.tokenizer_json();
  jb["model"]["merges"].erase(2);   // drop aa+aa
  jb["model"]["merges"].erase(1);   // drop a+a
  tb.write("tokenizer.json", jb);
  auto a = ta.load(), b = tb.load();
  const std::vector<int32_t> aaaa_a = ids_of(*a, {"aaaa"}), aaaa_b = ids_of(*b, {"a", "a", "a", "a"});
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(a->encode("aaaa"), aaaa_a);
    EXPECT_EQ(b->encode("aaaa"), aaaa_b);
  }
}

// ---- stop ids ---------------------------------------------------------------------------------

TEST(StopIds, GenerationConfigUnitedWithTokenizerEos) {
  TinyTokenizer tt;
  tt.write("tokenizer.json", tt.tokenizer_json());
  const int32_t eot = tt.load()->token_id("<|endoftext|>"), im_end = tt.load()->token_id("<|im_end|>");
  tt.write("generation_config.json", {{"eos_token_id", eot}});
  tt.write("tokenizer_config.json", {{"eos_token", "<|im_end|>"}});
  EXPECT_EQ(tt.load()->stop_ids(), (std::vector<int32_t>{eot, im_end}));
  tt.write("generation_config.json", {{"eos_token_id", {im_end, eot}}});
  tt.write("tokenizer_config.json", {{"eos_token", {{"content", "<|im_end|>"}}}});
  EXPECT_EQ(tt.load()->stop_ids(), (std::vector<int32_t>{im_end, eot}));   // no duplicates
  tt.write("tokenizer_config.json", {{"eos_token", "<|nope|>"}});
  EXPECT_THROW(tt.load(), Error);
  fs::remove(tt.dir / "tokenizer_config.json");
  fs::remove(tt.dir / "generation_config.json");
  EXPECT_EQ(tt.load()->stop_ids(), (std::vector<int32_t>{im_end, eot}));   // bare file: ChatML ends
}

TEST(StopIds, RealQwen36GenerationConfig) {
  const fs::path gen = fs::path(LILY_SHARED_DIR) / "reference/qwen3.6-35b-a3b/generation_config.json";
  if (!fs::exists(gen)) GTEST_SKIP() << gen << " not found";
  TinyTokenizer tt;
  tt.write("tokenizer.json", tt.tokenizer_json());
  fs::copy_file(gen, tt.dir / "generation_config.json");
  std::ifstream in(gen);
  const json g = json::parse(in);
  const auto want = g["eos_token_id"].get<std::vector<int32_t>>();
  EXPECT_EQ(tt.load()->stop_ids(), want);
}

// ---- BPE core ---------------------------------------------------------------------------------

TEST(BpeModel, FastPathsMatchReference) {
  // Merges over {a, b, c} with overlapping and competing pairs so the order of merging matters.
  std::vector<std::string> vocab = {"a", "b", "c"};
  std::vector<BpeModel::Merge> merges;
  auto add = [&](int l, int r) {
    vocab.push_back(vocab[size_t(l)] + vocab[size_t(r)]);
    merges.push_back({l, r, int32_t(vocab.size() - 1)});
    return int32_t(vocab.size() - 1);
  };
  const int ab = add(0, 1), bc = add(1, 2), aa = add(0, 0), abc = add(ab, 2), aabc = add(aa, bc);
  add(aa, aa);
  add(abc, abc);
  add(aabc, 0);
  add(2, 2);
  BpeModel m(vocab, merges, false);
  std::mt19937 rng(11);
  for (int trial = 0; trial < 3000; ++trial) {
    std::string w(rng() % 200 + 2, 'a');
    for (auto& ch : w) ch = "abc"[rng() % 3];
    std::vector<int32_t> fast, ref;
    m.encode_word(w, fast);
    m.encode_word(w, fast);   // second time from the word cache
    m.encode_word_reference(w, ref);
    m.encode_word_reference(w, ref);
    ASSERT_EQ(fast, ref) << w;
  }
}

// ---- loader errors ----------------------------------------------------------------------------

TEST(TokenizerLoad, ErrorsNameTheProblem) {
  try {
    Tokenizer::load("/nonexistent/dir/tokenizer.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/tokenizer.json"), std::string::npos);
  }
  TinyTokenizer tt;
  json j = tt.tokenizer_json();
  j["normalizer"] = {{"type", "NFKC"}};
  tt.write("tokenizer.json", j);
  EXPECT_THROW(tt.load(), Error);
  j = tt.tokenizer_json();
  j["model"]["merges"].push_back(json::array({"zz", "q"}));
  tt.write("tokenizer.json", j);
  try {
    tt.load();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("zz"), std::string::npos);
  }
}

TEST(TokenizerLoad, Qwen3FixtureBasics) {
  const fs::path dir = fs::path(LILY_SHARED_DIR) / "reference/qwen3-tokenizer";
  if (!fs::exists(dir / "tokenizer.json")) GTEST_SKIP() << dir << " not found";
  auto tok = Tokenizer::load(dir.string());
  EXPECT_EQ(tok->vocab_size(), 151669);   // 151,643 BPE + 26 added (FRONTEND.md §2)
  const int32_t im_end = tok->token_id("<|im_end|>");
  EXPECT_EQ(tok->stop_ids(), std::vector<int32_t>{im_end});   // tokenizer_config eos_token
  // A multi-byte emoji is spread over several tokens: streaming must hold it back.
  const auto ids = tok->encode(" \xF0\x9F\x8E\x89");
  ASSERT_GT(ids.size(), 1u);
  StreamDecoder sd(*tok);
  std::string s;
  int held = 0;
  for (int32_t id : ids) {
    const std::string piece = sd.push(id);
    held += piece.empty();
    s += piece;
  }
  EXPECT_GT(held, 0);
  EXPECT_EQ(s + sd.flush(), " \xF0\x9F\x8E\x89");
}

}  // namespace
}  // namespace lily
