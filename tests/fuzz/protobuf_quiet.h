// For the fuzz targets that parse protobuf messages: protobuf logs an error
// line for every string field that is not UTF-8, which would bury
// libFuzzer's output. Included by exactly one source of a target, it
// defines the target's LLVMFuzzerInitialize, which drops protobuf's logs.
#pragma once

#include "google/protobuf/stubs/logging.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}
