// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status and absl::StatusOr.
// The installed abseil ships no such macros.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KARAT_CONCAT_INNER(a, b) a##b
#define KARAT_CONCAT(a, b) KARAT_CONCAT_INNER(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function
// when it is not OK.
#define RETURN_IF_ERROR(expr)                                  \
  do {                                                         \
    ::absl::Status karat_status_ = (expr);                     \
    if (!karat_status_.ok()) return karat_status_;             \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, F());` declares/assigns the value of an
// absl::StatusOr<T>, or returns its status from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(KARAT_CONCAT(karat_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
