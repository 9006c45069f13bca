// karat-reference: the single-process reference engine from the command line.
//   karat-reference --model DIR --prompt TEXT [--prompt TEXT ...]
//                   [--max-new-tokens N] [--temperature T] [--seed S]
//                   [--prefill-chunk N]
// Each --prompt is one turn of the same session. Prints, per turn, the
// generated token ids and their text.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "common/reference_engine.h"
#include "common/tokenizer.h"
#include "common/weights.h"

namespace {

struct Options {
  std::string model_dir;
  std::vector<std::string> prompts;
  int max_new_tokens = 32;
  float temperature = 0.0f;
  uint64_t seed = 0;
  int prefill_chunk = 0;
};

void Usage(FILE* f) {
  std::fprintf(f,
               "usage: karat-reference --model DIR --prompt TEXT [--prompt "
               "TEXT ...]\n"
               "         [--max-new-tokens N] [--temperature T] [--seed S] "
               "[--prefill-chunk N]\n");
}

int Fail(const std::string& msg) {
  std::fprintf(stderr, "karat-reference: %s\n", msg.c_str());
  return 2;
}

std::string Printable(const std::string& s) {
  std::string out;
  for (unsigned char ch : s) {
    if (ch == '\\') {
      out += "\\\\";
    } else if (ch >= 32 && ch < 127) {
      out += static_cast<char>(ch);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", ch);
      out += buf;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](std::string* out) {
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    std::string v;
    if (a == "--help" || a == "-h") {
      Usage(stdout);
      return 0;
    } else if (a == "--model") {
      if (!value(&o.model_dir)) return Fail("--model needs a directory");
    } else if (a == "--prompt") {
      if (!value(&v)) return Fail("--prompt needs text");
      o.prompts.push_back(v);
    } else if (a == "--max-new-tokens") {
      if (!value(&v) || !absl::SimpleAtoi(v, &o.max_new_tokens) ||
          o.max_new_tokens <= 0)
        return Fail("--max-new-tokens needs a positive integer");
    } else if (a == "--temperature") {
      if (!value(&v) || !absl::SimpleAtof(v, &o.temperature) ||
          o.temperature < 0)
        return Fail("--temperature needs a number >= 0");
    } else if (a == "--seed") {
      if (!value(&v) || !absl::SimpleAtoi(v, &o.seed))
        return Fail("--seed needs an unsigned integer");
    } else if (a == "--prefill-chunk") {
      if (!value(&v) || !absl::SimpleAtoi(v, &o.prefill_chunk) ||
          o.prefill_chunk < 0)
        return Fail("--prefill-chunk needs an integer >= 0");
    } else {
      Usage(stderr);
      return Fail("unknown argument '" + a + "'");
    }
  }
  if (o.model_dir.empty()) return Fail("--model is required");
  if (o.prompts.empty()) return Fail("at least one --prompt is required");

  auto files = karat::LoadModel(o.model_dir);
  if (!files.ok()) return Fail(std::string(files.status().message()));
  karat::ReferenceOptions ropts;
  ropts.prefill_chunk = o.prefill_chunk;
  auto engine = karat::ReferenceEngine::Create(*files, ropts);
  if (!engine.ok()) return Fail(std::string(engine.status().message()));
  karat::ReferenceSession session;
  session.seed = o.seed;
  for (size_t t = 0; t < o.prompts.size(); ++t) {
    auto ids = (*engine)->RunTurn(&session, karat::EncodeText(o.prompts[t]),
                                  o.max_new_tokens, o.temperature);
    if (!ids.ok()) return Fail(std::string(ids.status().message()));
    std::printf("turn %zu ids:", t + 1);
    for (int32_t id : *ids) std::printf(" %d", id);
    std::printf("\nturn %zu text: %s\n", t + 1,
                Printable(karat::DecodeTokens(*ids)).c_str());
  }
  return 0;
}
