// `lily tokenize`: encode/decode text with a tokenizer.json, one string or a JSONL batch (tests),
// plus a single-threaded encode throughput benchmark.
#ifdef LILY_HAVE_FRONTEND
#include <chrono>
#include <ctime>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "command.h"
#include "core/common.h"
#include "core/options.h"
#include "tokenizer/tokenizer.h"

namespace lily {
namespace {

using json = nlohmann::json;

// One batch line: {"text": ..., "parse_special"?: bool} -> ids, decodes and the streamed decode;
// {"ids": [...]} -> the decodes only (checks decoding of arbitrary, possibly broken, sequences).
json process_line(const Tokenizer& tok, const json& req, bool parse_special) {
  if (!req.is_object()) throw Error("each input line must be a JSON object");
  std::vector<int32_t> ids;
  json out = json::object();
  if (req.contains("text")) {
    const bool ps = req.value("parse_special", parse_special);
    ids = tok.encode(req["text"].get<std::string>(), ps);
    out["ids"] = ids;
  } else if (req.contains("ids")) {
    ids = req["ids"].get<std::vector<int32_t>>();
  } else {
    throw Error("input line needs \"text\" or \"ids\"");
  }
  out["decoded"] = tok.decode(ids, false);
  out["decoded_skip_special"] = tok.decode(ids, true);
  StreamDecoder sd(tok);
  std::string streamed;
  for (int32_t id : ids) streamed += sd.push(id);
  streamed += sd.flush();
  out["streamed"] = streamed;
  return out;
}

int run_batch(const Tokenizer& tok, const Options& o) {
  std::ifstream fin(o.str("input"), std::ios::binary);
  if (!fin) throw Error("cannot open input file " + o.str("input"));
  std::ofstream fout;
  std::ostream* out = &std::cout;
  if (o.str("output") != "-") {
    fout.open(o.str("output"), std::ios::binary);
    if (!fout) throw Error("cannot create output file " + o.str("output"));
    out = &fout;
  }
  std::string line;
  size_t n = 0;
  while (std::getline(fin, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json res;
    try {
      res = process_line(tok, json::parse(line), !o.flag("no-special"));
    } catch (const json::exception& e) {
      throw Error(o.str("input") + ":" + std::to_string(n) + ": " + e.what());
    }
    *out << res.dump() << '\n';
  }
  out->flush();
  if (!*out) throw Error("failed writing " + o.str("output"));
  return 0;
}

// Encodes the whole file as one string, `repeat` times, on this thread; prints MB/s as JSON.
int run_bench(const Tokenizer& tok, const Options& o) {
  std::ifstream f(o.str("bench"), std::ios::binary);
  if (!f) throw Error("cannot open benchmark text " + o.str("bench"));
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  const int repeat = std::max(1, o.num("repeat"));
  double best = 1e30, first = 0, best_cpu = 1e30;
  size_t n_tokens = 0;
  for (int r = 0; r < repeat; ++r) {
    // CPU time as well as wall time: on a shared machine the former is the stable number.
    const std::clock_t c0 = std::clock();
    const auto t0 = std::chrono::steady_clock::now();
    const auto ids = tok.encode(text, !o.flag("no-special"));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best_cpu = std::min(best_cpu, double(std::clock() - c0) / CLOCKS_PER_SEC);
    if (r == 0) first = s;
    best = std::min(best, s);
    n_tokens = ids.size();
  }
  const double mb = double(text.size()) / 1e6;
  json res = {{"bytes", text.size()}, {"tokens", n_tokens}, {"repeat", repeat},
              {"first_s", first}, {"best_s", best}, {"best_cpu_s", best_cpu},
              {"first_mb_per_s", mb / first}, {"best_mb_per_s", mb / best},
              {"best_cpu_mb_per_s", mb / best_cpu}};
  std::cout << res.dump() << '\n';
  return 0;
}

int tokenize_main(int argc, char** argv) {
  Options o("tokenize",
            "Tokenize text with a Hugging Face tokenizer.json.\n"
            "  --text STR                 print {\"ids\", \"decoded\", ...} for one string\n"
            "  --input F.jsonl --output F lines {\"text\"} (or {\"ids\"}) -> {\"ids\", \"decoded\", ...}\n"
            "  --bench FILE               single-threaded encode throughput of the whole file\n"
            "  --info                     vocabulary size, stop ids and special ids",
            {{"tokenizer", "", "tokenizer.json or a directory holding it", "LILY_TOKENIZER"},
             {"text", "", "one string to encode", ""},
             {"input", "", "JSONL input file", ""},
             {"output", "-", "JSONL output file (- = stdout)", ""},
             {"no-special", "false", "treat special tokens written in the text as plain text", "", true},
             {"bench", "", "text file to encode as a whole for a throughput measurement", ""},
             {"repeat", "5", "benchmark repetitions (best and first are reported)", ""},
             {"info", "false", "print {\"vocab_size\", \"stop_ids\", \"special_ids\"} and exit", "", true}});
  if (!o.parse(argc, argv)) return 0;
  if (o.str("tokenizer").empty()) throw Error("--tokenizer is required");
  const auto t0 = std::chrono::steady_clock::now();
  auto tok = Tokenizer::load(o.str("tokenizer"));
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (o.given("bench")) {
    std::fprintf(stderr, "tokenizer loaded in %.3f s\n", load_s);
    return run_bench(*tok, o);
  }
  if (o.flag("info")) {
    std::vector<int32_t> special;
    for (int32_t id = 0; id < tok->vocab_size(); ++id)
      if (tok->is_special(id)) special.push_back(id);
    std::cout << json{{"vocab_size", tok->vocab_size()}, {"stop_ids", tok->stop_ids()}, {"special_ids", special},
                      {"load_s", load_s}}.dump() << '\n';
    return 0;
  }
  if (o.given("input")) return run_batch(*tok, o);
  if (!o.given("text")) throw Error("give --text, --input or --bench");
  std::cout << process_line(*tok, json{{"text", o.str("text")}}, !o.flag("no-special")).dump() << '\n';
  return 0;
}

RegisterCommand reg({"tokenize", "encode/decode text with a tokenizer.json (string, JSONL batch, bench)",
                     tokenize_main});

}  // namespace
}  // namespace lily
#endif
