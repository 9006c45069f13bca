// libFuzzer target for token files (security/tokens.h TokenTable::Parse),
// with and without per-client limits. A file it accepts holds one
// credential per line that names a token and a principal, and each such
// token finds its principal with limits >= 0; refusals are
// INVALID_ARGUMENT naming the file and line.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "security/tokens.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/protobuf_quiet.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  karat::cluster::ClientLimits defaults;
  defaults.set_max_sessions(8);
  for (bool limits : {true, false}) {
    absl::StatusOr<karat::security::TokenTable> table =
        karat::security::TokenTable::Parse(text, "fuzz.tokens", limits,
                                           defaults);
    if (!table.ok()) {
      FUZZ_CHECK(table.status().code() == absl::StatusCode::kInvalidArgument);
      FUZZ_CHECK(table.status().message().rfind("fuzz.tokens:", 0) == 0);
      continue;
    }
    // The lines read independently: comments cut, words split on blanks.
    size_t credentials = 0;
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      line = line.substr(0, line.find('#'));
      std::vector<std::string> words =
          absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
      if (words.empty()) continue;
      ++credentials;
      FUZZ_CHECK(words.size() >= 2 && words[0].size() >= 16);
      const karat::security::Credential* cred = table->Find(words[0]);
      FUZZ_CHECK(cred != nullptr);
      FUZZ_CHECK(cred->principal == words[1]);
      const karat::cluster::ClientLimits& l = cred->limits;
      FUZZ_CHECK(l.max_sessions() >= 0 && l.max_kv_bytes() >= 0 &&
                 l.max_concurrent_turns() >= 0 &&
                 l.sessions_per_second() >= 0 && l.session_burst() >= 0);
      if (!limits) FUZZ_CHECK(words.size() == 2);
    }
    FUZZ_CHECK(table->size() == credentials);
  }
  return 0;
}
