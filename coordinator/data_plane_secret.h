// The cluster's data-plane secret (docs/security.md "Data plane"): random
// bytes the coordinator hands to every node it registers
// (RegisterNodeResponse.data_plane_secret), under which the nodes' data-plane
// hellos carry their proofs (common/hello_proof.h).
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "cluster.pb.h"

namespace karat::coordinator {

inline constexpr size_t kDataPlaneSecretBytes = 32;
// The secret's file in the coordinator's state dir.
inline constexpr const char* kDataPlaneSecretFile = "data_plane_secret";

// The secret kept in `state_dir` (its file kDataPlaneSecretFile, mode 0600),
// made from the operating system's random generator and written there
// (through a temporary file and a rename) when the file is missing, so that
// a coordinator restarted on the same directory hands out the same secret;
// with an empty `state_dir` a fresh secret that is kept nowhere. The
// directory is created when missing. FAILED_PRECONDITION naming the file
// when it cannot be read or written, is not a regular file, holds other
// than kDataPlaneSecretBytes bytes, or may be read or written by others
// than its owner (mode beyond 0600: `chmod 600 FILE`).
absl::StatusOr<std::string> LoadOrCreateDataPlaneSecret(
    const std::string& state_dir);

// The secret a coordinator with `security` and `state_dir` hands out: none
// (empty) in plaintext mode, where the data plane takes every hello as it
// is; else LoadOrCreateDataPlaneSecret(state_dir).
absl::StatusOr<std::string> DataPlaneSecretFor(
    const cluster::SecurityConfig& security, const std::string& state_dir);

}  // namespace karat::coordinator
